# The two commands README shows: `make demo` and `make test`. Each sets up what it needs
# (virtual env with a CPU torch, build of the C++ core) and is idempotent.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-stamp
BUILD_STAMP := $(VENV)/.build-stamp
CORE_SOURCES := $(wildcard csrc/*.cpp csrc/*.h) setup.py pyproject.toml

.PHONY: all build demo test clean

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

# A CPU torch from this machine's disk (a bare `pip install torch` may pull a multi-GB CUDA build).
$(DEPS_STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "setuptools>=64" wheel "pybind11>=2.11" numpy "pytest>=7" "hypothesis>=6"
	touch $@

# Editable install: builds vattention._C in place. Headers are not tracked by setuptools'
# incremental build, so a change to any core source rebuilds every object (about 20 s on 2 cores).
$(BUILD_STAMP): $(DEPS_STAMP) $(CORE_SOURCES)
	rm -rf build
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(BUILD_STAMP)
	@if [ -f tests/cuda_emulator/Makefile ]; then $(MAKE) -s -C tests/cuda_emulator; fi

demo: build
	$(PY) -m vattention demo

test: build
	$(PY) -m pytest -q

clean:
	rm -rf build $(VENV) vattention/_C*.so *.egg-info
