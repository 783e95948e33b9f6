// EMULATION, TEST-ONLY: streams, in-flight work, synchronisation and stream capture of the strict
// CUDA driver emulation (README.md here lists the rules and how the CUDA docs were read).
//
// Work: the emulated GPU executes nothing by itself. vaemu_launch enqueues a "kernel" unit on a
// stream that reads one address range; held units keep executing until vaemu_complete. A unit is
// complete when it has finished executing and every unit it depends on is complete. Dependencies
// follow CUDA's stream ordering (driver API docs, "Stream synchronization behavior"):
//   - a unit depends on every earlier unit of its own stream;
//   - a unit on the legacy stream also depends on every earlier unit of every blocking stream of
//     its context (created with CU_STREAM_DEFAULT, and per-thread default streams);
//   - a unit on a blocking stream depends on every earlier unit of the legacy stream;
//   - non-blocking streams have no implicit dependency on the legacy stream, nor it on them.
// Copies and memsets write at once; when they had to wait behind earlier work they leave a unit
// (finished executing, touching their ranges) so ordering and the unmap rule still see them. An
// event on the legacy stream that had to wait leaves a unit with no range, so that later work on
// blocking streams waits for it (and hence, transitively, for what it waited for).
//
// Rules: cuMemUnmap of a range a not-complete unit reads, and freeing (cuMemRelease / last
// cuMemUnmap) memory a not-complete unit reads, are violations (the call still acts: a real
// driver would let the kernel fault). Stream capture: see unsafe_call_check.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "emu_state.h"

namespace emu {

namespace {

const char* kind_name(StreamKind k) {
  switch (k) {
    case StreamKind::Legacy: return "legacy";
    case StreamKind::PerThread: return "per-thread default";
    case StreamKind::Created: return "created";
    case StreamKind::Foreign: return "foreign";
  }
  return "?";
}

const char* mode_name(CUstreamCaptureMode m) {
  switch (m) {
    case CU_STREAM_CAPTURE_MODE_GLOBAL: return "GLOBAL";
    case CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: return "THREAD_LOCAL";
    case CU_STREAM_CAPTURE_MODE_RELAXED: return "RELAXED";
  }
  return "?";
}

Stream& new_stream(StreamKind kind, uintptr_t handle, bool blocking) {
  State& s = state();
  uint64_t id = s.next_stream_id++;
  Stream& st = s.streams[id];
  st.info = StreamInfo{id, handle, kind, blocking, stream_context()};
  return st;
}

// `later` (a unit being launched) is ordered after `earlier` (a unit already enqueued).
bool ordered_after(const StreamInfo& later, const StreamInfo& earlier) {
  if (later.id == earlier.id) return true;
  if (later.ctx != earlier.ctx) return false;
  if (later.kind == StreamKind::Legacy) return earlier.blocking;
  if (earlier.kind == StreamKind::Legacy) return later.blocking;
  return false;
}

bool intersects(const Range& r, uintptr_t ptr, size_t bytes) {
  return r.bytes != 0 && bytes != 0 && r.start < ptr + bytes && ptr < r.start + r.bytes;
}

std::vector<uint64_t> handles_backing(const std::vector<Range>& ranges) {
  std::vector<uint64_t> out;
  auto& ms = state().mappings;
  for (const Range& r : ranges) {
    if (r.bytes == 0) continue;
    auto it = ms.upper_bound(r.start);
    if (it != ms.begin()) --it;
    for (; it != ms.end() && it->first < r.start + r.bytes; ++it) {
      if (it->first + it->second.size <= r.start) continue;
      if (std::find(out.begin(), out.end(), it->second.handle) == out.end())
        out.push_back(it->second.handle);
    }
  }
  return out;
}

// Units complete in launch order: a unit's dependencies all have smaller ids, so one pass settles.
void settle() {
  State& s = state();
  for (auto it = s.units.begin(); it != s.units.end();) {
    const Unit& u = it->second;
    if (!u.executing && all_complete(u.deps)) {
      it = s.units.erase(it);
    } else {
      ++it;
    }
  }
  s.work_changed.notify_all();
}

void invalidate(Stream& st) { st.capture.invalidated = true; }

// A capture the legacy stream cannot be used beside: an active capture on a blocking stream of the
// same context (cuStreamIsCapturing's docs: "the legacy stream is in an unusable state").
Stream* blocking_capture_beside(const Stream& legacy) {
  if (state().active_captures == 0) return nullptr;
  for (auto& [id, st] : state().streams) {
    if (st.capture.active && st.info.blocking && st.info.kind != StreamKind::Legacy &&
        st.info.ctx == legacy.info.ctx)
      return &st;
  }
  return nullptr;
}

}  // namespace

CUcontext stream_context() {
  CUcontext ctx = current_context();
  return ctx != nullptr ? ctx : reinterpret_cast<CUcontext>(&state().contexts[0]);
}

std::string describe(const StreamInfo& s) {
  char buf[96];
  const char* flavour =
      s.kind == StreamKind::Legacy ? "" : (s.blocking ? ", blocking" : ", non-blocking");
  snprintf(buf, sizeof buf, "0x%llx (%s%s)", static_cast<unsigned long long>(s.handle),
           kind_name(s.kind), flavour);
  return buf;
}

Stream* resolve_stream(CUstream handle, const char* caller, CUresult* err) {
  State& s = state();
  const auto h = reinterpret_cast<uintptr_t>(handle);
  CUcontext ctx = stream_context();
  if (h == 0 || handle == CU_STREAM_LEGACY) {
    auto it = s.legacy_streams.find(ctx);
    if (it != s.legacy_streams.end()) return &s.streams.at(it->second);
    Stream& st = new_stream(StreamKind::Legacy, 0, true);
    s.legacy_streams[ctx] = st.info.id;
    return &st;
  }
  if (handle == CU_STREAM_PER_THREAD) {
    auto key = std::make_pair(thread_token(), ctx);
    auto it = s.per_thread_streams.find(key);
    if (it != s.per_thread_streams.end()) return &s.streams.at(it->second);
    // The docs: "The per-thread default stream is not a non-blocking stream and will synchronize
    // with the legacy default stream if both are used in a program."
    Stream& st = new_stream(StreamKind::PerThread, h, true);
    s.per_thread_streams[key] = st.info.id;
    return &st;
  }
  auto it = s.stream_handles.find(h);
  if (it != s.stream_handles.end()) return &s.streams.at(it->second);
  if (s.destroyed_streams.count(h)) {
    *err = violation(CUDA_ERROR_INVALID_HANDLE, "%s: stream 0x%llx was destroyed", caller,
                     static_cast<unsigned long long>(h));
    return nullptr;
  }
  if (s.strict_streams) {
    *err = violation(CUDA_ERROR_INVALID_HANDLE,
                     "%s: stream 0x%llx was not created by cuStreamCreate (strict streams)", caller,
                     static_cast<unsigned long long>(h));
    return nullptr;
  }
  Stream& st = new_stream(StreamKind::Foreign, h, false);
  s.stream_handles[h] = st.info.id;
  return &st;
}

std::vector<uint64_t> deps_for(const StreamInfo& s) {
  std::vector<uint64_t> deps;
  for (auto& [id, u] : state().units)
    if (ordered_after(s, u.stream)) deps.push_back(id);
  return deps;
}

bool all_complete(const std::vector<uint64_t>& ids) {
  auto& units = state().units;
  return std::none_of(ids.begin(), ids.end(), [&](uint64_t id) { return units.count(id) != 0; });
}

uint64_t enqueue_behind(const StreamInfo& s, const std::vector<Range>& ranges, const char* what) {
  State& st = state();
  std::vector<uint64_t> deps = deps_for(s);
  if (deps.empty()) return 0;
  uint64_t id = st.next_unit++;
  Unit& u = st.units[id];
  u.stream = s;
  u.ranges = ranges;
  u.handles = handles_backing(ranges);
  u.deps = std::move(deps);
  u.what = what;
  return id;
}

const std::pair<const uint64_t, Unit>* unit_reading(uintptr_t ptr, size_t bytes) {
  for (auto& entry : state().units)
    for (const Range& r : entry.second.ranges)
      if (intersects(r, ptr, bytes)) return &entry;
  return nullptr;
}

const std::pair<const uint64_t, Unit>* unit_using_handle(uint64_t handle) {
  for (auto& entry : state().units) {
    const auto& hs = entry.second.handles;
    if (std::find(hs.begin(), hs.end(), handle) != hs.end()) return &entry;
  }
  return nullptr;
}

// cuThreadExchangeStreamCaptureMode's docs: with the thread's mode GLOBAL, a thread is prohibited
// from potentially unsafe API calls if it has an ongoing capture not begun in RELAXED mode, or if
// any other thread has a concurrent capture begun in GLOBAL mode; THREAD_LOCAL: only the former;
// RELAXED: never. A prohibited call does not act, invalidates the capture(s) it conflicts with, and
// returns CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (a violation: correct code never makes one).
CUresult unsafe_call_check(const char* caller) {
  State& s = state();
  if (s.active_captures == 0) return CUDA_SUCCESS;
  const CUstreamCaptureMode mine = thread_capture_mode();
  if (mine == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
  const uint64_t me = thread_token();
  Stream* first = nullptr;
  int conflicts = 0;
  for (auto& [id, st] : s.streams) {
    const Capture& c = st.capture;
    if (!c.active) continue;
    const bool own = c.owner == me;
    const bool conflict =
        (own && c.mode != CU_STREAM_CAPTURE_MODE_RELAXED) ||
        (!own && mine == CU_STREAM_CAPTURE_MODE_GLOBAL && c.mode == CU_STREAM_CAPTURE_MODE_GLOBAL);
    if (!conflict) continue;
    invalidate(st);
    if (first == nullptr) first = &st;
    conflicts++;
  }
  if (first == nullptr) return CUDA_SUCCESS;
  const bool own = first->capture.owner == me;
  return violation(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                   "%s is a potentially unsafe call, prohibited while %s capture on stream %s "
                   "(begun in %s mode) is ongoing; this thread's mode is %s; %d capture(s) "
                   "invalidated",
                   caller, own ? "this thread's" : "another thread's",
                   describe(first->info).c_str(), mode_name(first->capture.mode), mode_name(mine),
                   conflicts);
}

StreamOp begin_stream_op(CUstream handle, const char* caller) {
  StreamOp op;
  op.stream = resolve_stream(handle, caller, &op.result);
  if (op.stream == nullptr) return op;
  Stream& st = *op.stream;
  if (st.info.kind == StreamKind::Legacy) {
    op.result = unsafe_call_check(caller);
    if (op.result != CUDA_SUCCESS) return op;
    if (Stream* cap = blocking_capture_beside(st)) {
      invalidate(*cap);
      op.result = violation(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                            "%s on the legacy stream while blocking stream %s is capturing (an "
                            "implicit dependency on the capture); capture invalidated",
                            caller, describe(cap->info).c_str());
      return op;
    }
  }
  if (st.capture.active) {
    if (st.capture.invalidated) {
      op.result = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;  // counted when it was invalidated
    } else {
      op.captured = true;
    }
  }
  return op;
}

}  // namespace emu

using emu::state;

namespace {

// Blocks (lock released) until every unit in `waits` is complete and, if `busy_too`, the busy flag
// is clear. False after the synchronisation timeout.
bool wait_for_work(emu::Call& call, const std::vector<uint64_t>& waits, bool busy_too) {
  return state().work_changed.wait_for(call.lock(), state().sync_timeout, [&] {
    return emu::all_complete(waits) && !(busy_too && state().gpu_busy);
  });
}

CUresult timeout_violation(emu::Call& call, const std::vector<uint64_t>& waits) {
  const long long ms = static_cast<long long>(state().sync_timeout.count());
  for (uint64_t id : waits) {
    auto it = state().units.find(id);
    if (it == state().units.end()) continue;
    return call.violation(CUDA_ERROR_LAUNCH_TIMEOUT,
                          "%s waited %lld ms: unit %llu (%s) on stream %s never completed "
                          "(vaemu_complete was not called)",
                          call.name(), ms, static_cast<unsigned long long>(id),
                          it->second.what.c_str(), emu::describe(it->second.stream).c_str());
  }
  return call.violation(CUDA_ERROR_LAUNCH_TIMEOUT,
                        "%s waited %lld ms: the emulated GPU stayed busy", call.name(), ms);
}

CUresult synchronize_context(emu::Call& call, CUcontext ctx) {
  std::vector<uint64_t> waits;
  for (auto& [id, u] : state().units)
    if (u.stream.ctx == ctx) waits.push_back(id);
  if (!wait_for_work(call, waits, true)) return timeout_violation(call, waits);
  return CUDA_SUCCESS;
}

}  // namespace

extern "C" {

CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
  EMU_ENTER("cuStreamCreate", emu::kInit | emu::kContext);
  if (stream == nullptr) return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuStreamCreate: NULL");
  if (flags & ~unsigned(CU_STREAM_NON_BLOCKING))
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuStreamCreate: flags 0x%x", flags);
  emu::State& s = state();
  uintptr_t h = s.next_stream_handle;
  s.next_stream_handle += 0x10;
  emu::Stream& st =
      emu::new_stream(emu::StreamKind::Created, h, (flags & CU_STREAM_NON_BLOCKING) == 0);
  s.stream_handles[h] = st.info.id;
  *stream = reinterpret_cast<CUstream>(h);
  return CUDA_SUCCESS;
}

// Exported as cuStreamDestroy_v2 (cuda.h renames it), base name cuStreamDestroy. Work still queued
// on the stream stays in flight (the driver releases the stream once it completes).
CUresult cuStreamDestroy(CUstream stream) {
  EMU_ENTER("cuStreamDestroy", emu::kInit | emu::kContext);
  emu::State& s = state();
  const auto h = reinterpret_cast<uintptr_t>(stream);
  auto it = s.stream_handles.find(h);
  if (it == s.stream_handles.end() ||
      s.streams.at(it->second).info.kind != emu::StreamKind::Created)
    return call_.violation(CUDA_ERROR_INVALID_HANDLE,
                           "cuStreamDestroy(0x%llx): not a stream from cuStreamCreate%s",
                           static_cast<unsigned long long>(h),
                           s.destroyed_streams.count(h) ? " (destroyed twice)" : "");
  if (s.streams.at(it->second).capture.active) s.active_captures--;
  s.streams.erase(it->second);
  s.stream_handles.erase(it);
  s.destroyed_streams.insert(h);
  return CUDA_SUCCESS;
}

// Waits for the work a unit launched on the stream now would wait for (the legacy stream: also
// every blocking stream's), and for the busy flag to clear.
CUresult cuStreamSynchronize(CUstream stream) {
  EMU_ENTER("cuStreamSynchronize", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  CUresult err = CUDA_SUCCESS;
  emu::Stream* st = emu::resolve_stream(stream, "cuStreamSynchronize", &err);
  if (st == nullptr) return err;
  if (st->capture.active) {
    st->capture.invalidated = true;
    return call_.violation(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                           "cuStreamSynchronize on stream %s, which is capturing; capture "
                           "invalidated",
                           emu::describe(st->info).c_str());
  }
  std::vector<uint64_t> waits = emu::deps_for(st->info);
  if (!wait_for_work(call_, waits, true)) return timeout_violation(call_, waits);
  return CUDA_SUCCESS;
}

// All work of the current context (any stream), and the busy flag.
CUresult cuCtxSynchronize() {
  EMU_ENTER("cuCtxSynchronize", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  return synchronize_context(call_, emu::stream_context());
}

// CUDA 13's ABI of the same base name: the given context (NULL: the current one).
CUresult cuCtxSynchronize_v2(CUcontext ctx) {
  EMU_ENTER("cuCtxSynchronize", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  if (ctx != nullptr && !emu::context_live(ctx))
    return call_.violation(CUDA_ERROR_INVALID_CONTEXT, "cuCtxSynchronize_v2: %p is not live",
                           static_cast<void*>(ctx));
  return synchronize_context(call_, ctx != nullptr ? ctx : emu::stream_context());
}

// Exported as cuStreamBeginCapture_v2 (cuda.h renames it), base name cuStreamBeginCapture.
CUresult cuStreamBeginCapture(CUstream stream, CUstreamCaptureMode mode) {
  EMU_ENTER("cuStreamBeginCapture", emu::kInit | emu::kContext);
  if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      mode != CU_STREAM_CAPTURE_MODE_RELAXED)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuStreamBeginCapture: mode %d", int(mode));
  CUresult err = CUDA_SUCCESS;
  emu::Stream* st = emu::resolve_stream(stream, "cuStreamBeginCapture", &err);
  if (st == nullptr) return err;
  if (st->info.kind == emu::StreamKind::Legacy)
    return call_.violation(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                           "cuStreamBeginCapture: capture may not be initiated on the legacy "
                           "stream");
  if (st->capture.active)
    return call_.violation(CUDA_ERROR_ILLEGAL_STATE,
                           "cuStreamBeginCapture: stream %s is already capturing",
                           emu::describe(st->info).c_str());
  st->capture = emu::Capture{true, false, mode, emu::thread_token()};
  state().active_captures++;
  return CUDA_SUCCESS;
}

CUresult cuStreamEndCapture(CUstream stream, CUgraph* graph) {
  EMU_ENTER("cuStreamEndCapture", emu::kInit | emu::kContext);
  if (graph == nullptr) return call_.violation(CUDA_ERROR_INVALID_VALUE, "phGraph is NULL");
  CUresult err = CUDA_SUCCESS;
  emu::Stream* st = emu::resolve_stream(stream, "cuStreamEndCapture", &err);
  if (st == nullptr) return err;
  emu::Capture& c = st->capture;
  if (!c.active)
    return call_.violation(CUDA_ERROR_ILLEGAL_STATE,
                           "cuStreamEndCapture: stream %s is not capturing",
                           emu::describe(st->info).c_str());
  if (c.mode != CU_STREAM_CAPTURE_MODE_RELAXED && c.owner != emu::thread_token()) {
    c.invalidated = true;
    return call_.violation(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
                           "cuStreamEndCapture on stream %s from a thread other than the one that "
                           "began its %s capture; capture invalidated",
                           emu::describe(st->info).c_str(), emu::mode_name(c.mode));
  }
  const bool invalidated = c.invalidated;
  c = emu::Capture{};
  state().active_captures--;
  if (invalidated) {
    *graph = nullptr;
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;  // the violation was counted when it happened
  }
  uint64_t g = state().next_graph;
  state().next_graph += 0x10;
  state().graphs.insert(g);
  *graph = reinterpret_cast<CUgraph>(g);
  return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status) {
  EMU_ENTER("cuStreamIsCapturing", emu::kInit | emu::kContext);
  if (status == nullptr) return call_.violation(CUDA_ERROR_INVALID_VALUE, "captureStatus is NULL");
  CUresult err = CUDA_SUCCESS;
  emu::Stream* st = emu::resolve_stream(stream, "cuStreamIsCapturing", &err);
  if (st == nullptr) return err;
  // Documented: on the legacy stream while a blocking stream captures, an error (not a misuse, and
  // the capture is not invalidated).
  if (st->info.kind == emu::StreamKind::Legacy && emu::blocking_capture_beside(*st))
    return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (!st->capture.active) {
    *status = CU_STREAM_CAPTURE_STATUS_NONE;
  } else {
    *status = st->capture.invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                      : CU_STREAM_CAPTURE_STATUS_ACTIVE;
  }
  return CUDA_SUCCESS;
}

CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode) {
  EMU_ENTER("cuThreadExchangeStreamCaptureMode", emu::kInit);
  if (mode == nullptr) return call_.violation(CUDA_ERROR_INVALID_VALUE, "mode is NULL");
  if (*mode != CU_STREAM_CAPTURE_MODE_GLOBAL && *mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      *mode != CU_STREAM_CAPTURE_MODE_RELAXED)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuThreadExchangeStreamCaptureMode: mode %d",
                           int(*mode));
  std::swap(emu::thread_capture_mode(), *mode);
  return CUDA_SUCCESS;
}

// A captured graph is a token: the emulation records nothing in it.
CUresult cuGraphDestroy(CUgraph graph) {
  EMU_ENTER("cuGraphDestroy", emu::kInit);
  if (!state().graphs.erase(reinterpret_cast<uint64_t>(graph)))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuGraphDestroy(%p): not a graph from cuStreamEndCapture, or destroyed "
                           "twice",
                           static_cast<void*>(graph));
  return CUDA_SUCCESS;
}

// ---- control API: in-flight work ----------------------------------------------------------------

// Enqueues a "kernel" on `stream` that reads [va, va + bytes) (bytes 0: nothing). The range must be
// mapped with access now (else a violation: an illegal address on a GPU; the unit is enqueued all
// the same). held = 1: it executes until vaemu_complete(id); 0: it finishes at once (complete once
// what it depends on is). On a capturing stream it is captured: nothing is enqueued. Returns the
// unit's id (never 0; also for a captured launch, whose vaemu_complete does nothing).
uint64_t vaemu_launch(CUstream stream, uintptr_t va, size_t bytes, int held) {
  std::lock_guard<std::mutex> lock(state().mu);
  emu::State& s = state();
  s.calls["vaemu_launch"]++;
  const uint64_t id = s.next_unit++;
  CUresult err = CUDA_SUCCESS;
  emu::Stream* st = emu::resolve_stream(stream, "vaemu_launch", &err);
  if (st == nullptr) return id;  // violation counted
  if (st->capture.active) return id;
  if (bytes != 0 && !emu::device_range_accessible(va, bytes))
    emu::violation(CUDA_ERROR_ILLEGAL_ADDRESS,
                   "kernel on stream %s reads unmapped/inaccessible memory [0x%llx, 0x%llx) (an "
                   "illegal address on a GPU)",
                   emu::describe(st->info).c_str(), static_cast<unsigned long long>(va),
                   static_cast<unsigned long long>(va + bytes));
  std::vector<uint64_t> deps = emu::deps_for(st->info);
  if (!held && deps.empty()) return id;  // complete at once
  emu::Unit& u = s.units[id];
  u.stream = st->info;
  if (bytes != 0) u.ranges.push_back(emu::Range{va, bytes});
  u.handles = emu::handles_backing(u.ranges);
  u.deps = std::move(deps);
  u.executing = held != 0;
  u.kernel = true;
  u.what = "kernel";
  return id;
}

// The unit finishes executing (it is complete once everything it depends on is). Unknown or
// already finished ids are ignored.
void vaemu_complete(uint64_t id) {
  std::lock_guard<std::mutex> lock(state().mu);
  auto it = state().units.find(id);
  if (it == state().units.end()) return;
  it->second.executing = false;
  emu::settle();
}

// Kernel units (vaemu_launch) not yet complete.
int64_t vaemu_inflight() {
  std::lock_guard<std::mutex> lock(state().mu);
  int64_t k = 0;
  for (auto& [id, u] : state().units) k += u.kernel ? 1 : 0;
  return k;
}

uintptr_t vaemu_last_memset_stream() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().last_memset_stream;
}

uintptr_t vaemu_last_copy_stream() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().last_copy_stream;
}

}  // extern "C"
