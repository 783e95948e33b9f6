// EMULATION, TEST-ONLY: shared state of the strict CUDA driver emulation (README.md here).
//
// Why it exists: no GPU is available to CI, so the CUDA backend's real code path runs against this
// library, which exports the driver's VMM entry points with the real signatures, backs "device"
// memory with host memory (memfd + mmap), and enforces the driver's documented rules. Passing it is
// evidence, not proof, that the code works on a GPU.
//
// Every entry point starts with an emu::Call, which counts the call, applies injected latency and
// faults, and checks the cuInit / current-context preconditions while holding the one global lock.
#pragma once

#include <cuda.h>

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

namespace emu {

constexpr int kMaxDevices = 8;
constexpr size_t kDefaultGranularity = 2u << 20;  // 2 MiB, as on current GPUs
constexpr size_t kDefaultDeviceMemory = size_t(8) << 30;  // 8 GiB budget (lazily committed)
constexpr int kDriverVersion = 13000;

struct Reservation {
  size_t size = 0;
};

struct Mapping {
  size_t size = 0;
  uint64_t handle = 0;
  bool accessible = false;
};

struct Handle {
  int fd = -1;  // memfd backing the "device" memory; shared by every alias mapping
  size_t size = 0;
  int mappings = 0;  // live mappings of this handle
  bool released = false;  // cuMemRelease called; memory goes when mappings reaches 0
};

struct Event {
  bool recorded = false;
  bool pending = false;  // recorded while the emulated GPU was busy
  uint64_t epoch = 0;  // busy epoch it was recorded in
};

struct PrimaryContext {
  int device = 0;
  int refcount = 0;  // cuDevicePrimaryCtxRetain - Release; live while > 0
};

struct Fault {
  int64_t countdown = 0;  // fires when it reaches 0
  CUresult result = CUDA_SUCCESS;
};

struct State {
  std::mutex mu;
  std::condition_variable gpu_idle;  // signalled when the busy flag clears

  // configuration (vaemu_set_*)
  size_t granularity = kDefaultGranularity;
  size_t device_memory = kDefaultDeviceMemory;
  int device_count = 1;
  int vmm_supported = 1;
  bool strict_context = true;

  bool initialized = false;
  size_t bytes_in_use = 0;
  uint64_t next_handle = 0x7e000001;  // distinctive values; never reused, so double release shows

  std::map<uintptr_t, Reservation> reservations;  // by start address
  std::map<uintptr_t, Mapping> mappings;  // by start address
  std::unordered_map<uint64_t, Handle> handles;  // live (unreleased, or released but mapped)
  std::map<uintptr_t, size_t> host_allocs;  // cuMemHostAlloc'd buffers: start -> bytes
  std::set<Event*> events;
  PrimaryContext contexts[kMaxDevices];

  uintptr_t last_event_stream = 0;  // stream of the latest cuEventRecord, for stream-rule tests
  bool gpu_busy = false;
  uint64_t busy_epoch = 0;

  std::map<std::string, int64_t> calls;  // per entry point (base names)
  std::map<std::string, Fault> faults;
  std::map<std::string, int64_t> latency_ns;  // per-call hold (vaemu_set_latency_ns)
  std::string gate_entry;  // vaemu_gate: entry whose nth call stops
  int64_t gate_countdown = 0;
  bool gate_held = false;  // a call is stopped at the gate now
  bool gate_open = false;
  std::condition_variable gate_changed;
  std::set<std::string> hidden_symbols;  // cuGetProcAddress reports them not found
  int64_t violations = 0;
  std::string last_violation;
};

State& state();

// Entry preconditions.
enum Needs : unsigned { kNone = 0, kInit = 1, kContext = 2 };

// One per entry-point invocation: holds the global lock for the body of the call.
class Call {
 public:
  Call(const char* name, unsigned needs);
  // CUDA_SUCCESS when the body should run; otherwise the entry returns it at once.
  CUresult early() const { return early_; }
  // Records a rule violation (counter + message) and returns code for the entry to return.
  CUresult violation(CUresult code, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
  std::unique_lock<std::mutex>& lock() { return lock_; }
  const char* name() const { return name_; }

 private:
  const char* name_;
  std::unique_lock<std::mutex> lock_;
  CUresult early_ = CUDA_SUCCESS;
};

// Thread's current context (per-thread, as in the driver).
CUcontext& current_context();
bool context_live(CUcontext ctx);
bool device_valid(int ordinal);
// Holds the calling thread for ns nanoseconds (spins when short: see emu_state.cpp).
void hold_for_ns(int64_t ns);

// Frees everything the emulation holds (reservations, handles, events). Caller holds the lock.
void free_all_locked();

}  // namespace emu

#define EMU_ENTER(name, needs)  \
  emu::Call call_(name, needs); \
  if (call_.early() != CUDA_SUCCESS) return call_.early()
