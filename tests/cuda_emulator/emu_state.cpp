// EMULATION, TEST-ONLY: global state, the per-call prologue, and the vaemu_* control API that tests
// reach through ctypes (tests/cuda_emulator/emu.py).
#include "emu_state.h"

#include <sys/mman.h>
#include <unistd.h>

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

CUresult Call::violation(CUresult code, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  State& s = state();
  s.violations++;
  s.last_violation = buf;
  if (getenv("VAEMU_VERBOSE")) fprintf(stderr, "[cuda emulation] rule violation: %s\n", buf);
  return code;
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
  s.initialized = false;
  for (int i = 0; i < emu::kMaxDevices; i++) s.contexts[i] = emu::PrimaryContext{i, 0};
  s.gpu_busy = false;
  s.last_event_stream = 0;
  s.gpu_idle.notify_all();
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
  if (!s.gpu_busy) s.gpu_idle.notify_all();
}

// Calls of an entry point by base name, or one of: live_handles, live_mappings,
// live_reservations, live_events, context_refs, bytes_in_use, violations, accessible_mappings,
// last_event_stream.
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

// 1 when the calling thread's current context is a live primary context.
int vaemu_thread_has_context() {
  std::lock_guard<std::mutex> lock(state().mu);
  CUcontext ctx = emu::current_context();
  return ctx != nullptr && emu::context_live(ctx);
}

}  // extern "C"
