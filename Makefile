# The two commands README shows: `make demo` and `make test`. Each sets up what it needs
# (virtual env with a CPU torch, build of the C++ core) and is idempotent.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-stamp
BUILD_STAMP := $(VENV)/.build-stamp
CORE_SOURCES := $(wildcard csrc/*.cpp csrc/*.h) setup.py pyproject.toml

.PHONY: all build demo test sanitize clean

CXX ?= g++
SAN_DIR := build-sanitize
SAN_SOURCES := csrc/host_backend.cpp csrc/page_pool.cpp csrc/kv_cache.cpp csrc/prefetcher.cpp \
               csrc/kv_cache_reclaim.cpp csrc/kv_cache_prefetch.cpp \
               csrc/kv_cache_sharing.cpp csrc/kv_cache_swap.cpp csrc/swap_store.cpp \
               csrc/kv_cache_window.cpp \
               csrc/tests/core_threads_test.cpp
SAN_FLAGS := -std=c++17 -O1 -g -fno-omit-frame-pointer -Icsrc -pthread

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

# A CPU torch from this machine's disk (a bare `pip install torch` may pull a multi-GB CUDA build).
$(DEPS_STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "setuptools>=64" wheel "pybind11>=2.11" numpy "pytest>=7" "hypothesis>=6"
	$(PY) -m pip install -q "transformers==5.23.0" matplotlib tqdm
	touch $@

# Editable install: builds vattention._C in place. Headers are not tracked by setuptools'
# incremental build, so a change to any core source rebuilds every object (about 20 s on 2 cores).
$(BUILD_STAMP): $(DEPS_STAMP) $(CORE_SOURCES)
	rm -rf build
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(BUILD_STAMP)
	@if [ -f tests/cuda_emulator/Makefile ]; then $(MAKE) -s -C tests/cuda_emulator || \
	  echo "CUDA driver emulation not built (see above): the cuda test parameters will skip"; fi

demo: build
	$(PY) -m vattention demo

# The C++ core's thread and rollback tests under ThreadSanitizer and AddressSanitizer/UBSan.
# Any report fails the run (halt_on_error, non-zero exit codes).
$(SAN_DIR)/core_tsan: $(SAN_SOURCES) $(wildcard csrc/*.h)
	mkdir -p $(SAN_DIR)
	$(CXX) $(SAN_FLAGS) -fsanitize=thread $(SAN_SOURCES) -o $@

$(SAN_DIR)/core_asan: $(SAN_SOURCES) $(wildcard csrc/*.h)
	mkdir -p $(SAN_DIR)
	$(CXX) $(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=all $(SAN_SOURCES) -o $@

# Prefix sharing and swap (issue 7): the same core sources with their own threaded test.
SHARE_SAN_SOURCES := $(filter-out csrc/tests/core_threads_test.cpp,$(SAN_SOURCES)) csrc/tests/sharing_test.cpp

$(SAN_DIR)/sharing_tsan: $(SHARE_SAN_SOURCES) $(wildcard csrc/*.h)
	mkdir -p $(SAN_DIR)
	$(CXX) $(SAN_FLAGS) -fsanitize=thread $(SHARE_SAN_SOURCES) -o $@

$(SAN_DIR)/sharing_asan: $(SHARE_SAN_SOURCES) $(wildcard csrc/*.h)
	mkdir -p $(SAN_DIR)
	$(CXX) $(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=all $(SHARE_SAN_SOURCES) -o $@

sanitize: $(SAN_DIR)/core_tsan $(SAN_DIR)/core_asan $(SAN_DIR)/sharing_tsan $(SAN_DIR)/sharing_asan
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" $(SAN_DIR)/core_tsan
	ASAN_OPTIONS="detect_leaks=1 halt_on_error=1" UBSAN_OPTIONS="halt_on_error=1" $(SAN_DIR)/core_asan
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" $(SAN_DIR)/sharing_tsan
	ASAN_OPTIONS="detect_leaks=1 halt_on_error=1" UBSAN_OPTIONS="halt_on_error=1" $(SAN_DIR)/sharing_asan

# Runs the sanitizer build too when this compiler has the runtimes (gcc on Debian does).
test: build
	@if printf 'int main(){return 0;}' | $(CXX) -fsanitize=thread -x c++ - -o /dev/null 2>/dev/null && \
	    printf 'int main(){return 0;}' | $(CXX) -fsanitize=address,undefined -x c++ - -o /dev/null 2>/dev/null; \
	then $(MAKE) -s sanitize; else echo "sanitizer runtimes not available: skipping make sanitize"; fi
	$(PY) -m pytest -q

clean:
	rm -rf build $(SAN_DIR) $(VENV) vattention/_C*.so *.egg-info
