// EMULATION, TEST-ONLY: shared state of the strict CUDA driver emulation (README.md here).
//
// Why it exists: no GPU is available to CI, so the CUDA backend's real code path runs against this
// library, which exports the driver's VMM entry points with the real signatures, backs "device"
// memory with host memory (memfd + mmap), and enforces the driver's documented rules. Passing it is
// evidence, not proof, that the code works on a GPU.
//
// Every entry point starts with an emu::Call, which counts the call, applies injected latency and
// faults, and checks the cuInit / current-context preconditions while holding the one global lock.
//
// Streams and in-flight work (emu_stream.cpp): the emulated GPU runs nothing by itself. A test
// enqueues "kernel" units with vaemu_launch (each reads one address range) and says when each
// finishes executing; a unit is complete once it has finished and every unit it depends on (by
// CUDA's stream ordering rules) is complete. Events, stream/context synchronisation and the
// unmap/release rules look at the units not yet complete.
#pragma once

#include <cuda.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

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
  std::vector<uint64_t> waits;  // units it waits for (not complete when it was recorded)
  bool captured = false;  // last recorded inside a stream capture (never executes)
};

enum class StreamKind { Legacy, PerThread, Created, Foreign };

// What a unit keeps of its stream (the stream may be destroyed before the unit completes).
struct StreamInfo {
  uint64_t id = 0;  // internal, never reused
  uintptr_t handle = 0;  // the CUstream value callers use (0 for the legacy stream)
  StreamKind kind = StreamKind::Created;
  bool blocking = true;  // synchronizes with the legacy stream (CU_STREAM_DEFAULT, per-thread)
  CUcontext ctx = nullptr;
};

struct Capture {
  bool active = false;  // begun, not yet ended
  bool invalidated = false;
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  uint64_t owner = 0;  // thread_token() of the thread that began it
};

struct Stream {
  StreamInfo info;
  Capture capture;
};

struct Range {
  uintptr_t start = 0;
  size_t bytes = 0;
};

// A unit of work on a stream: a test's "kernel" (vaemu_launch), or a copy/memset/event record that
// had to wait behind earlier work (its data effect already happened; only its ordering remains).
struct Unit {
  StreamInfo stream;
  std::vector<Range> ranges;  // what it reads (kernels) or reads and writes (copies, memsets)
  std::vector<uint64_t> handles;  // allocation handles backing those ranges at launch
  std::vector<uint64_t> deps;  // units it depends on, not complete when it was launched
  bool executing = false;  // held by the test (vaemu_launch held=1) until vaemu_complete
  bool kernel = false;  // from vaemu_launch (vaemu_inflight counts only these)
  std::string what;  // for messages: "kernel", "cuMemcpyAsync", ...
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
  std::condition_variable work_changed;  // busy flag cleared, a unit completed, or reset

  // configuration (vaemu_set_*)
  size_t granularity = kDefaultGranularity;
  size_t device_memory = kDefaultDeviceMemory;
  int device_count = 1;
  int vmm_supported = 1;
  bool strict_context = true;
  bool strict_streams = false;  // unknown stream handles are violations (else adopted as foreign)
  std::chrono::milliseconds sync_timeout{5000};  // synchronize calls fail loudly after this

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
  uintptr_t last_copy_stream = 0;  // stream of the latest accepted cuMemcpy*Async
  uintptr_t last_memset_stream = 0;  // stream of the latest accepted cuMemsetD8Async
  bool gpu_busy = false;
  uint64_t busy_epoch = 0;

  // streams (emu_stream.cpp)
  std::map<uint64_t, Stream> streams;  // every live stream by internal id
  std::map<uintptr_t, uint64_t> stream_handles;  // created and foreign handles -> id
  std::set<uintptr_t> destroyed_streams;  // handles never come back, so a reuse shows
  std::map<CUcontext, uint64_t> legacy_streams;  // one per context
  std::map<std::pair<uint64_t, CUcontext>, uint64_t> per_thread_streams;  // (thread, ctx)
  uint64_t next_stream_id = 1;
  uintptr_t next_stream_handle = 0x5c000010;  // distinctive, never reused
  int active_captures = 0;
  uint64_t capture_generation = 1;  // bumped by reset: threads' capture modes go back to GLOBAL
  std::set<uint64_t> graphs;  // from cuStreamEndCapture, until cuGraphDestroy
  uint64_t next_graph = 0x6a000010;

  // in-flight work
  std::map<uint64_t, Unit> units;  // not yet complete, by id (ascending = launch order)
  uint64_t next_unit = 1;

  std::map<std::string, int64_t> calls;  // per entry point (base names); "held_ns:<entry>" too
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

// Records a rule violation (counter + message) and returns code. Caller holds the lock.
CUresult violation(CUresult code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Thread's current context (per-thread, as in the driver).
CUcontext& current_context();
// A number for the calling thread, unique for the life of the process (thread ids get reused).
uint64_t thread_token();
// The calling thread's stream capture interaction mode (cuThreadExchangeStreamCaptureMode).
CUstreamCaptureMode& thread_capture_mode();
bool context_live(CUcontext ctx);
bool device_valid(int ordinal);
// Holds the calling thread for ns nanoseconds (spins when short: see emu_state.cpp).
void hold_for_ns(int64_t ns);

// [ptr, ptr + bytes) lies in mappings that tile it without holes and all have access.
bool device_range_accessible(uintptr_t ptr, size_t bytes);

// ---- streams and in-flight work (emu_stream.cpp); the caller holds the lock ----

// The context streams and work of the calling thread belong to: its current context, or, on a
// thread with none (a test's thread calling vaemu_launch; non-strict mode), device 0's primary
// context, the one the CUDA runtime would make current.
CUcontext stream_context();

// The stream a handle names for the calling thread: 0 / CU_STREAM_LEGACY the legacy stream of the
// current context, CU_STREAM_PER_THREAD the thread's own default stream, else a created stream. An
// unknown handle is adopted as a foreign non-blocking stream (vaemu_set_strict_streams(0), the
// default) or is a violation; a destroyed one is always a violation. nullptr with *err set if not.
Stream* resolve_stream(CUstream handle, const char* caller, CUresult* err);

// Units a new unit on `s` would depend on (CUDA's stream ordering, see emu_stream.cpp).
std::vector<uint64_t> deps_for(const StreamInfo& s);
// Every unit in `ids` is complete.
bool all_complete(const std::vector<uint64_t>& ids);
// Enqueues a finished-executing unit that waits behind `deps` (only if some are not complete);
// returns its id, or 0 when nothing had to wait.
uint64_t enqueue_behind(const StreamInfo& s, const std::vector<Range>& ranges, const char* what);
// First unit not yet complete whose ranges intersect [ptr, ptr + bytes), or nullptr.
const std::pair<const uint64_t, Unit>* unit_reading(uintptr_t ptr, size_t bytes);
// First unit not yet complete that reads memory of allocation `handle`, or nullptr.
const std::pair<const uint64_t, Unit>* unit_using_handle(uint64_t handle);
// "0x5c000010 (created, non-blocking)" and the like, for messages.
std::string describe(const StreamInfo& s);

// The prohibition of cuThreadExchangeStreamCaptureMode: CUDA_SUCCESS when the calling thread may
// make a potentially unsafe call now; else every capture it conflicts with is invalidated and a
// violation CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED is returned.
CUresult unsafe_call_check(const char* caller);

// How an operation enqueued on a stream (event record, copy, memset) goes: `result` not
// CUDA_SUCCESS means return it; `captured` means the stream is capturing, so the operation is
// recorded into the graph and must not act; else run it on `stream`.
struct StreamOp {
  CUresult result = CUDA_SUCCESS;
  Stream* stream = nullptr;
  bool captured = false;
};
StreamOp begin_stream_op(CUstream handle, const char* caller);

// Frees everything the emulation holds (reservations, handles, events, streams, work). Caller
// holds the lock.
void free_all_locked();

}  // namespace emu

#define EMU_ENTER(name, needs)  \
  emu::Call call_(name, needs); \
  if (call_.early() != CUDA_SUCCESS) return call_.early()

// For the potentially unsafe calls of stream capture (cuThreadExchangeStreamCaptureMode).
#define EMU_UNSAFE_DURING_CAPTURE()                                                     \
  if (CUresult unsafe_ = emu::unsafe_call_check(call_.name()); unsafe_ != CUDA_SUCCESS) \
  return unsafe_
