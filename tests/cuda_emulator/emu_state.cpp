// EMULATION, TEST-ONLY: global state, the per-call prologue, and the vaemu_* control API that tests
// reach through ctypes (tests/cuda_emulator/emu.py).
#include "emu_state.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace emu {

State& state() {
  // Never destroyed: entry points may run during process exit.
  static State* s = [] {
    State* fresh = new State();
    for (int i = 0; i < kMaxDevices; i++) fresh->contexts[i].device = i;
    return fresh;
  }();
  return *s;
}

CUcontext& current_context() {
  thread_local CUcontext current = nullptr;
  return current;
}

uint64_t thread_token() {
  static std::atomic<uint64_t> next{1};
  thread_local const uint64_t token = next++;
  return token;
}

CUstreamCaptureMode& thread_capture_mode() {
  struct Mode {
    uint64_t generation = 0;
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  };
  thread_local Mode m;
  if (m.generation != state().capture_generation) {
    m = Mode{state().capture_generation, CU_STREAM_CAPTURE_MODE_GLOBAL};  // the driver's default
  }
  return m.mode;
}

// Sleeping overshoots by the kernel's timer slack (~50-60 us), far more than a 1.45 us cuMemMap:
// short holds spin (a driver call keeps its thread busy too), long ones sleep all but the last
// 100 us and spin the rest.
void hold_for_ns(int64_t ns) {
  using clock = std::chrono::steady_clock;
  const auto until = clock::now() + std::chrono::nanoseconds(ns);
  constexpr int64_t kSpinNs = 100'000;
  if (ns > 2 * kSpinNs) std::this_thread::sleep_for(std::chrono::nanoseconds(ns - kSpinNs));
  while (clock::now() < until) {
  }
}

bool device_valid(int ordinal) { return ordinal >= 0 && ordinal < state().device_count; }

bool context_live(CUcontext ctx) {
  State& s = state();
  for (auto& c : s.contexts) {
    if (reinterpret_cast<CUcontext>(&c) == ctx) return c.refcount > 0;
  }
  return false;
}

Call::Call(const char* name, unsigned needs) : name_(name), lock_(state().mu) {
  State& s = state();
  s.calls[name]++;
  auto lat = s.latency_ns.find(name);
  if (lat != s.latency_ns.end() && lat->second > 0) {
    // Held open without the lock, so other threads' calls proceed as they would on a real driver.
    int64_t ns = lat->second;
    lock_.unlock();
    hold_for_ns(ns);
    lock_.lock();
    // Counted per entry point: a test checks which calls were held without timing the others.
    s.calls[std::string("held_ns:") + name] += ns;
  }
  if (!s.gate_entry.empty() && s.gate_entry == name && --s.gate_countdown == 0) {
    s.gate_held = true;
    s.gate_changed.notify_all();
    s.gate_changed.wait(lock_, [&s] { return s.gate_open; });  // releases the lock meanwhile
    s.gate_held = false;
  }
  auto fault = s.faults.find(name);
  if (fault != s.faults.end() && --fault->second.countdown == 0) {
    early_ = fault->second.result;  // injected failure: no side effects, not a violation
    s.faults.erase(fault);
    return;
  }
  if ((needs & kInit) && !s.initialized) {
    early_ = violation(CUDA_ERROR_NOT_INITIALIZED, "%s called before cuInit", name);
    return;
  }
  if ((needs & kContext) && s.strict_context) {
    CUcontext ctx = current_context();
    if (ctx == nullptr) {
      early_ = violation(CUDA_ERROR_INVALID_CONTEXT,
                         "%s called from a thread with no current context (strict mode)", name);
    } else if (!context_live(ctx)) {
      early_ =
          violation(CUDA_ERROR_INVALID_CONTEXT,
                    "%s called with a destroyed (fully released) primary context current", name);
    }
  }
}

namespace {

CUresult vviolation(CUresult code, const char* fmt, va_list ap) {
  char buf[512];
  vsnprintf(buf, sizeof buf, fmt, ap);
  State& s = state();
  s.violations++;
  s.last_violation = buf;
  if (getenv("VAEMU_VERBOSE")) fprintf(stderr, "[cuda emulation] rule violation: %s\n", buf);
  return code;
}

}  // namespace

CUresult violation(CUresult code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  CUresult r = vviolation(code, fmt, ap);
  va_end(ap);
  return r;
}

CUresult Call::violation(CUresult code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  CUresult r = vviolation(code, fmt, ap);
  va_end(ap);
  return r;
}

bool device_range_accessible(uintptr_t ptr, size_t bytes) {
  auto& ms = state().mappings;
  uintptr_t at = ptr;
  const uintptr_t end = ptr + bytes;
  auto it = ms.upper_bound(at);
  if (it == ms.begin()) return false;
  --it;
  while (at < end) {
    if (it == ms.end() || it->first > at || it->first + it->second.size <= at) return false;
    if (!it->second.accessible) return false;
    at = it->first + it->second.size;
    ++it;
  }
  return true;
}

void free_all_locked() {
  State& s = state();
  for (auto& [va, r] : s.reservations) munmap(reinterpret_cast<void*>(va), r.size);
  for (auto& [h, handle] : s.handles) close(handle.fd);
  for (Event* e : s.events) delete e;
  for (auto& [p, bytes] : s.host_allocs) std::free(reinterpret_cast<void*>(p));
  s.host_allocs.clear();
  s.reservations.clear();
  s.mappings.clear();  // their address ranges lay inside the reservations just unmapped
  s.handles.clear();
  s.events.clear();
  s.bytes_in_use = 0;
  s.streams.clear();
  s.stream_handles.clear();
  s.destroyed_streams.clear();
  s.legacy_streams.clear();
  s.per_thread_streams.clear();
  s.active_captures = 0;
  s.graphs.clear();
  s.units.clear();
}

}  // namespace emu

// ---- control API (extern "C", prefix vaemu_) ----------------------------------------------------

using emu::state;

extern "C" {

// Back to the defaults: frees everything, forgets cuInit and context retains, clears counters,
// faults, latencies and violations. Only call with no cache/backend alive.
void vaemu_reset() {
  std::lock_guard<std::mutex> lock(state().mu);
  emu::State& s = state();
  emu::free_all_locked();
  s.granularity = emu::kDefaultGranularity;
  s.device_memory = emu::kDefaultDeviceMemory;
  s.device_count = 1;
  s.vmm_supported = 1;
  s.strict_context = true;
  s.strict_streams = false;
  s.sync_timeout = std::chrono::milliseconds(5000);
  s.initialized = false;
  for (int i = 0; i < emu::kMaxDevices; i++) s.contexts[i] = emu::PrimaryContext{i, 0};
  s.gpu_busy = false;
  s.last_event_stream = 0;
  s.last_copy_stream = 0;
  s.last_memset_stream = 0;
  s.capture_generation++;  // every thread's capture mode is GLOBAL again
  s.work_changed.notify_all();
  s.calls.clear();
  s.faults.clear();
  s.latency_ns.clear();
  s.gate_entry.clear();
  s.gate_open = true;  // a call stopped at a gate goes on
  s.gate_held = false;
  s.gate_changed.notify_all();
  s.hidden_symbols.clear();
  s.violations = 0;
  s.last_violation.clear();
}

void vaemu_set_granularity(size_t bytes) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().granularity = bytes;
}

void vaemu_set_device_memory_bytes(size_t bytes) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().device_memory = bytes;
}

void vaemu_set_device_count(int n) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().device_count = n < 0 ? 0 : (n > emu::kMaxDevices ? emu::kMaxDevices : n);
}

void vaemu_set_vmm_supported(int yes) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().vmm_supported = yes ? 1 : 0;
}

void vaemu_set_strict_context(int on) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().strict_context = on != 0;
}

// 1: a stream handle the emulation never created (nor 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD)
// is a violation (CUDA_ERROR_INVALID_HANDLE). 0 (default): it is adopted as a foreign
// non-blocking stream, as tests that pass made-up handles for other libraries' streams need.
void vaemu_set_strict_streams(int on) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().strict_streams = on != 0;
}

// How long cuEventSynchronize / cuStreamSynchronize / cuCtxSynchronize wait before they fail with
// a violation (CUDA_ERROR_LAUNCH_TIMEOUT) instead of hanging (default 5000 ms).
void vaemu_set_sync_timeout_ms(int64_t ms) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().sync_timeout = std::chrono::milliseconds(ms < 0 ? 0 : ms);
}

// The nth call (1 = the next one) of `entry` (base name, e.g. "cuMemMap") returns `result` without
// doing anything. nth <= 0 disarms. One armed fault per entry point.
void vaemu_inject_fault(const char* entry, int64_t nth, int result) {
  std::lock_guard<std::mutex> lock(state().mu);
  if (nth <= 0) {
    state().faults.erase(entry);
  } else {
    state().faults[entry] = emu::Fault{nth, static_cast<CUresult>(result)};
  }
}

// Every call of `entry` is held `ns` nanoseconds (outside the lock) before it acts. 0 clears.
void vaemu_set_latency_ns(const char* entry, int64_t ns) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().latency_ns[entry] = ns;
}

void vaemu_set_latency_us(const char* entry, int64_t us) { vaemu_set_latency_ns(entry, us * 1000); }

// Race tests: the nth call (1 = the next one) of `entry` stops before it acts, without the lock,
// until vaemu_gate_open(); vaemu_gate_held() says whether a call is stopped there now. One gate.
void vaemu_gate(const char* entry, int64_t nth) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().gate_entry = entry;
  state().gate_countdown = nth;
  state().gate_held = false;
  state().gate_open = false;
}

void vaemu_gate_open() {
  std::lock_guard<std::mutex> lock(state().mu);
  state().gate_open = true;
  state().gate_entry.clear();
  state().gate_changed.notify_all();
}

int vaemu_gate_held() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().gate_held ? 1 : 0;
}

// cuGetProcAddress(symbol) reports it as not found, like a driver that lacks the entry point.
void vaemu_hide_symbol(const char* symbol) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().hidden_symbols.insert(symbol);
}

// While busy, recorded events stay not-ready (in-flight GPU work); clearing completes them all.
void vaemu_set_gpu_busy(int busy) {
  std::lock_guard<std::mutex> lock(state().mu);
  emu::State& s = state();
  if (busy && !s.gpu_busy) s.busy_epoch++;
  s.gpu_busy = busy != 0;
  if (!s.gpu_busy) s.work_changed.notify_all();
}

// Calls of an entry point by base name, or one of: live_handles, live_mappings,
// live_reservations, live_events, live_host_allocs, live_streams (created, not destroyed),
// live_graphs, active_captures, inflight (as vaemu_inflight), context_refs, bytes_in_use,
// violations, accessible_mappings, last_event_stream, last_copy_stream, last_memset_stream.
int64_t vaemu_counter(const char* name) {
  std::lock_guard<std::mutex> lock(state().mu);
  emu::State& s = state();
  std::string n = name;
  if (n == "live_handles") return static_cast<int64_t>(s.handles.size());
  if (n == "live_mappings") return static_cast<int64_t>(s.mappings.size());
  if (n == "live_reservations") return static_cast<int64_t>(s.reservations.size());
  if (n == "live_events") return static_cast<int64_t>(s.events.size());
  if (n == "live_host_allocs") return static_cast<int64_t>(s.host_allocs.size());
  if (n == "bytes_in_use") return static_cast<int64_t>(s.bytes_in_use);
  if (n == "violations") return s.violations;
  if (n == "last_event_stream") return static_cast<int64_t>(s.last_event_stream);
  if (n == "last_copy_stream") return static_cast<int64_t>(s.last_copy_stream);
  if (n == "last_memset_stream") return static_cast<int64_t>(s.last_memset_stream);
  if (n == "live_graphs") return static_cast<int64_t>(s.graphs.size());
  if (n == "active_captures") return s.active_captures;
  if (n == "live_streams") {
    int64_t k = 0;
    for (auto& [id, st] : s.streams) k += st.info.kind == emu::StreamKind::Created ? 1 : 0;
    return k;
  }
  if (n == "inflight") {
    int64_t k = 0;
    for (auto& [id, u] : s.units) k += u.kernel ? 1 : 0;
    return k;
  }
  if (n == "context_refs") {
    int64_t refs = 0;
    for (auto& c : s.contexts) refs += c.refcount;
    return refs;
  }
  if (n == "accessible_mappings") {
    int64_t k = 0;
    for (auto& [va, m] : s.mappings) k += m.accessible ? 1 : 0;
    return k;
  }
  auto it = s.calls.find(n);
  return it == s.calls.end() ? 0 : it->second;
}

// Message of the most recent rule violation ("" if none). Valid until the next emulator call.
const char* vaemu_last_violation() {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> lock(state().mu);
  copy = state().last_violation;
  return copy.c_str();
}

// Live reference count of the device's primary context (cuDevicePrimaryCtxRetain - Release);
// -1 for an ordinal that is not an emulated device.
int vaemu_primary_retains(int device) {
  std::lock_guard<std::mutex> lock(state().mu);
  if (device < 0 || device >= emu::kMaxDevices) return -1;
  return state().contexts[device].refcount;
}

// 1 when the calling thread's current context is a live primary context.
int vaemu_thread_has_context() {
  std::lock_guard<std::mutex> lock(state().mu);
  CUcontext ctx = emu::current_context();
  return ctx != nullptr && emu::context_live(ctx);
}

}  // extern "C"
