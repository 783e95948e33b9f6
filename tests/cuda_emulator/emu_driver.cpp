// EMULATION, TEST-ONLY: initialisation, devices, primary contexts, events, error strings and the
// cuGetProcAddress table of the strict CUDA driver emulation.
//
// Events model in-flight GPU work: an event waits for the work units (emu_stream.cpp) a unit
// launched on its stream would wait for, and, while the test holds the emulated GPU busy
// (vaemu_set_gpu_busy), an event recorded then stays not-ready until the test clears the flag, so
// a test can prove that an unmap deferred behind an event really waits for it.
#include <cstring>

#include "emu_state.h"

namespace {

using emu::state;

bool event_ready(const emu::Event& e) {
  const emu::State& s = state();
  return !(e.pending && s.gpu_busy && e.epoch == s.busy_epoch) && emu::all_complete(e.waits);
}

struct ErrorText {
  CUresult code;
  const char* name;
  const char* text;
};

const ErrorText kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error (CUDA emulation)"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument (CUDA emulation)"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory (CUDA emulation)"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED",
     "initialization error (CUDA emulation)"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down (CUDA emulation)"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE",
     "no CUDA-capable device is detected (CUDA emulation)"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE",
     "invalid device ordinal (CUDA emulation)"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT",
     "invalid device context (CUDA emulation)"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE",
     "invalid resource handle (CUDA emulation)"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found (CUDA emulation)"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready (CUDA emulation)"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered (CUDA emulation)"},
    {CUDA_ERROR_LAUNCH_TIMEOUT, "CUDA_ERROR_LAUNCH_TIMEOUT",
     "the launch timed out and was terminated (CUDA emulation)"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state (CUDA emulation)"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing (CUDA emulation)"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture (CUDA emulation)"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking stream (CUDA "
     "emulation)"},
    {CUDA_ERROR_CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT",
     "operation not permitted on an event last recorded in a capturing stream (CUDA emulation)"},
    {CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
     "attempt to terminate a thread-local capture sequence from another thread (CUDA emulation)"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED",
     "operation not permitted (CUDA emulation)"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED",
     "operation not supported (CUDA emulation)"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error (CUDA emulation)"},
};

const ErrorText* find_error(CUresult code) {
  for (const auto& e : kErrors)
    if (e.code == code) return &e;
  return nullptr;
}

}  // namespace

extern "C" {

CUresult cuInit(unsigned int flags) {
  EMU_ENTER("cuInit", emu::kNone);
  if (flags != 0) return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuInit: flags %u != 0", flags);
  if (state().device_count == 0) return CUDA_ERROR_NO_DEVICE;
  state().initialized = true;
  return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int* version) {
  EMU_ENTER("cuDriverGetVersion", emu::kNone);
  if (version == nullptr) return call_.violation(CUDA_ERROR_INVALID_VALUE, "version is NULL");
  *version = emu::kDriverVersion;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int* count) {
  EMU_ENTER("cuDeviceGetCount", emu::kInit);
  if (count == nullptr) return call_.violation(CUDA_ERROR_INVALID_VALUE, "count is NULL");
  *count = state().device_count;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  EMU_ENTER("cuDeviceGet", emu::kInit);
  if (device == nullptr) return call_.violation(CUDA_ERROR_INVALID_VALUE, "device is NULL");
  if (!emu::device_valid(ordinal)) return CUDA_ERROR_INVALID_DEVICE;  // a query, not a misuse
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device) {
  EMU_ENTER("cuDeviceGetAttribute", emu::kInit);
  if (value == nullptr) return call_.violation(CUDA_ERROR_INVALID_VALUE, "value is NULL");
  if (!emu::device_valid(device))
    return call_.violation(CUDA_ERROR_INVALID_DEVICE, "cuDeviceGetAttribute: device %d", device);
  switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
      *value = state().vmm_supported;
      break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 8; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
    default: *value = 0; break;
  }
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice device) {
  EMU_ENTER("cuDevicePrimaryCtxRetain", emu::kInit);
  if (ctx == nullptr) return call_.violation(CUDA_ERROR_INVALID_VALUE, "ctx is NULL");
  if (!emu::device_valid(device))
    return call_.violation(CUDA_ERROR_INVALID_DEVICE, "cuDevicePrimaryCtxRetain: device %d",
                           device);
  state().contexts[device].refcount++;
  *ctx = reinterpret_cast<CUcontext>(&state().contexts[device]);
  return CUDA_SUCCESS;
}

// Exported as cuDevicePrimaryCtxRelease_v2 (cuda.h renames it), base name
// cuDevicePrimaryCtxRelease.
CUresult cuDevicePrimaryCtxRelease(CUdevice device) {
  EMU_ENTER("cuDevicePrimaryCtxRelease", emu::kInit);
  if (!emu::device_valid(device))
    return call_.violation(CUDA_ERROR_INVALID_DEVICE, "cuDevicePrimaryCtxRelease: device %d",
                           device);
  if (state().contexts[device].refcount == 0)
    return call_.violation(CUDA_ERROR_INVALID_CONTEXT,
                           "cuDevicePrimaryCtxRelease(%d) without a matching retain", device);
  state().contexts[device].refcount--;
  return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  EMU_ENTER("cuCtxSetCurrent", emu::kInit);
  if (ctx != nullptr && !emu::context_live(ctx))
    return call_.violation(CUDA_ERROR_INVALID_CONTEXT,
                           "cuCtxSetCurrent: %p is not a live (retained) primary context",
                           static_cast<void*>(ctx));
  emu::current_context() = ctx;
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* ctx) {
  EMU_ENTER("cuCtxGetCurrent", emu::kInit);
  if (ctx == nullptr) return call_.violation(CUDA_ERROR_INVALID_VALUE, "ctx is NULL");
  *ctx = emu::current_context();
  return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  EMU_ENTER("cuEventCreate", emu::kInit | emu::kContext);
  if (event == nullptr) return call_.violation(CUDA_ERROR_INVALID_VALUE, "event is NULL");
  if (flags & ~0x7u)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuEventCreate: flags %u", flags);
  auto* e = new emu::Event();
  state().events.insert(e);
  *event = reinterpret_cast<CUevent>(e);
  return CUDA_SUCCESS;
}

// The event waits for what a unit launched on `stream` now would wait for (emu_stream.cpp), and,
// if the emulated GPU is busy, for the busy flag to clear. On a capturing stream it is captured.
CUresult cuEventRecord(CUevent event, CUstream stream) {
  EMU_ENTER("cuEventRecord", emu::kInit | emu::kContext);
  auto* e = reinterpret_cast<emu::Event*>(event);
  if (!state().events.count(e))
    return call_.violation(CUDA_ERROR_INVALID_HANDLE, "cuEventRecord: unknown event %p",
                           static_cast<void*>(event));
  emu::StreamOp op = emu::begin_stream_op(stream, "cuEventRecord");
  if (op.result != CUDA_SUCCESS) return op.result;
  state().last_event_stream = reinterpret_cast<uintptr_t>(stream);
  e->recorded = true;
  if (op.captured) {
    e->captured = true;  // a node of the graph being captured; it never completes by itself
    return CUDA_SUCCESS;
  }
  e->captured = false;
  e->pending = state().gpu_busy;
  e->epoch = state().busy_epoch;
  // One unit standing for the record keeps later work on blocking streams ordered after what it
  // waited for, when it is on the legacy stream (see emu_stream.cpp).
  const uint64_t marker = emu::enqueue_behind(op.stream->info, {}, "event record");
  e->waits.clear();
  if (marker != 0) e->waits.push_back(marker);
  return CUDA_SUCCESS;
}

CUresult cuEventQuery(CUevent event) {
  EMU_ENTER("cuEventQuery", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  auto* e = reinterpret_cast<emu::Event*>(event);
  if (!state().events.count(e))
    return call_.violation(CUDA_ERROR_INVALID_HANDLE, "cuEventQuery: unknown event %p",
                           static_cast<void*>(event));
  if (e->captured)
    return call_.violation(CUDA_ERROR_CAPTURED_EVENT,
                           "cuEventQuery on an event last recorded inside a stream capture");
  return event_ready(*e) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuEventSynchronize(CUevent event) {
  EMU_ENTER("cuEventSynchronize", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  auto* e = reinterpret_cast<emu::Event*>(event);
  if (!state().events.count(e))
    return call_.violation(CUDA_ERROR_INVALID_HANDLE, "cuEventSynchronize: unknown event %p",
                           static_cast<void*>(event));
  if (e->captured)
    return call_.violation(CUDA_ERROR_CAPTURED_EVENT,
                           "cuEventSynchronize on an event last recorded inside a stream capture");
  // A test that never completes its work would hang a real program forever; fail loudly instead.
  const std::vector<uint64_t> waits = e->waits;
  if (!state().work_changed.wait_for(call_.lock(), state().sync_timeout,
                                     [&] { return !state().events.count(e) || event_ready(*e); })) {
    const long long ms = static_cast<long long>(state().sync_timeout.count());
    if (!emu::all_complete(waits))
      return call_.violation(CUDA_ERROR_LAUNCH_TIMEOUT,
                             "cuEventSynchronize waited %lld ms: work the event waits for never "
                             "completed (vaemu_complete was not called)",
                             ms);
    return call_.violation(CUDA_ERROR_LAUNCH_TIMEOUT,
                           "cuEventSynchronize waited %lld ms: the emulated GPU stayed busy", ms);
  }
  return CUDA_SUCCESS;
}

// Exported as cuEventDestroy_v2 (cuda.h renames it), base name cuEventDestroy.
CUresult cuEventDestroy(CUevent event) {
  EMU_ENTER("cuEventDestroy", emu::kInit | emu::kContext);
  auto* e = reinterpret_cast<emu::Event*>(event);
  if (!state().events.erase(e))
    return call_.violation(CUDA_ERROR_INVALID_HANDLE, "cuEventDestroy: unknown event %p",
                           static_cast<void*>(event));
  delete e;  // legal while pending: the driver frees it once the work completes
  return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char** str) {
  EMU_ENTER("cuGetErrorString", emu::kNone);
  if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorText* e = find_error(error);
  *str =
      e ? e->text : nullptr;  // every text says "(CUDA emulation)": no message can pass for a GPU's
  return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult error, const char** str) {
  EMU_ENTER("cuGetErrorName", emu::kNone);
  if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorText* e = find_error(error);
  *str = e ? e->name : nullptr;
  return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

}  // extern "C"

// ---- cuGetProcAddress ---------------------------------------------------------------------------

#undef cuGetProcAddress  // cuda.h maps it to _v2; we export both the v1 and the v2 symbol

extern "C" CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version,
                                     cuuint64_t flags);

namespace {

struct ProcEntry {
  const char* name;  // base name, as callers pass it
  int since;  // CUDA version that introduced this ABI of the symbol
  void* fn;
};

// Only what the backend and the tests use; anything else is "not found", as for an unsupported
// symbol. A base name with several ABIs has one row per ABI: a lookup gets the newest ABI not newer
// than the version asked for (cuCtxSynchronize: (void) since 2.0, (CUcontext) since 13.0).
const ProcEntry kProcs[] = {
    {"cuInit", 2000, reinterpret_cast<void*>(&cuInit)},
    {"cuDriverGetVersion", 2020, reinterpret_cast<void*>(&cuDriverGetVersion)},
    {"cuDeviceGet", 2000, reinterpret_cast<void*>(&cuDeviceGet)},
    {"cuDeviceGetCount", 2000, reinterpret_cast<void*>(&cuDeviceGetCount)},
    {"cuDeviceGetAttribute", 2000, reinterpret_cast<void*>(&cuDeviceGetAttribute)},
    {"cuDevicePrimaryCtxRetain", 7000, reinterpret_cast<void*>(&cuDevicePrimaryCtxRetain)},
    {"cuDevicePrimaryCtxRelease", 11000, reinterpret_cast<void*>(&cuDevicePrimaryCtxRelease_v2)},
    {"cuCtxSetCurrent", 4000, reinterpret_cast<void*>(&cuCtxSetCurrent)},
    {"cuCtxGetCurrent", 4000, reinterpret_cast<void*>(&cuCtxGetCurrent)},
    {"cuMemGetAllocationGranularity", 10020,
     reinterpret_cast<void*>(&cuMemGetAllocationGranularity)},
    {"cuMemGetInfo", 3020, reinterpret_cast<void*>(&cuMemGetInfo_v2)},
    {"cuMemAddressReserve", 10020, reinterpret_cast<void*>(&cuMemAddressReserve)},
    {"cuMemAddressFree", 10020, reinterpret_cast<void*>(&cuMemAddressFree)},
    {"cuMemCreate", 10020, reinterpret_cast<void*>(&cuMemCreate)},
    {"cuMemRelease", 10020, reinterpret_cast<void*>(&cuMemRelease)},
    {"cuMemMap", 10020, reinterpret_cast<void*>(&cuMemMap)},
    {"cuMemUnmap", 10020, reinterpret_cast<void*>(&cuMemUnmap)},
    {"cuMemSetAccess", 10020, reinterpret_cast<void*>(&cuMemSetAccess)},
    {"cuEventCreate", 2000, reinterpret_cast<void*>(&cuEventCreate)},
    {"cuEventRecord", 2000, reinterpret_cast<void*>(&cuEventRecord)},
    {"cuEventQuery", 2000, reinterpret_cast<void*>(&cuEventQuery)},
    {"cuEventSynchronize", 2000, reinterpret_cast<void*>(&cuEventSynchronize)},
    {"cuEventDestroy", 4000, reinterpret_cast<void*>(&cuEventDestroy_v2)},
    {"cuStreamSynchronize", 2000, reinterpret_cast<void*>(&cuStreamSynchronize)},
    {"cuStreamCreate", 2000, reinterpret_cast<void*>(&cuStreamCreate)},
    {"cuStreamDestroy", 4000, reinterpret_cast<void*>(&cuStreamDestroy_v2)},
    {"cuCtxSynchronize", 2000, reinterpret_cast<void*>(&cuCtxSynchronize)},
    {"cuCtxSynchronize", 13000, reinterpret_cast<void*>(&cuCtxSynchronize_v2)},
    {"cuStreamBeginCapture", 10010, reinterpret_cast<void*>(&cuStreamBeginCapture_v2)},
    {"cuStreamEndCapture", 10000, reinterpret_cast<void*>(&cuStreamEndCapture)},
    {"cuStreamIsCapturing", 10000, reinterpret_cast<void*>(&cuStreamIsCapturing)},
    {"cuThreadExchangeStreamCaptureMode", 10010,
     reinterpret_cast<void*>(&cuThreadExchangeStreamCaptureMode)},
    {"cuGraphDestroy", 10000, reinterpret_cast<void*>(&cuGraphDestroy)},
    {"cuMemsetD8Async", 3020, reinterpret_cast<void*>(&cuMemsetD8Async)},
    {"cuMemcpyAsync", 4000, reinterpret_cast<void*>(&cuMemcpyAsync)},
    {"cuMemcpyDtoDAsync", 3020, reinterpret_cast<void*>(&cuMemcpyDtoDAsync_v2)},
    {"cuMemcpyDtoHAsync", 3020, reinterpret_cast<void*>(&cuMemcpyDtoHAsync_v2)},
    {"cuMemcpyHtoDAsync", 3020, reinterpret_cast<void*>(&cuMemcpyHtoDAsync_v2)},
    {"cuMemHostAlloc", 2020, reinterpret_cast<void*>(&cuMemHostAlloc)},
    {"cuMemFreeHost", 2000, reinterpret_cast<void*>(&cuMemFreeHost)},
    {"cuGetErrorString", 6000, reinterpret_cast<void*>(&cuGetErrorString)},
    {"cuGetErrorName", 6000, reinterpret_cast<void*>(&cuGetErrorName)},
    {"cuGetProcAddress", 12000, reinterpret_cast<void*>(&cuGetProcAddress_v2)},
};

CUresult lookup(const char* symbol, void** pfn, int cuda_version,
                CUdriverProcAddressQueryResult* status) {
  if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (cuda_version > emu::kDriverVersion) return CUDA_ERROR_INVALID_VALUE;  // documented rule
  *pfn = nullptr;
  const ProcEntry* best = nullptr;
  bool known = false;
  for (const auto& p : kProcs) {
    if (std::strcmp(p.name, symbol) != 0 || state().hidden_symbols.count(symbol)) continue;
    known = true;
    if (cuda_version >= p.since && (best == nullptr || p.since > best->since)) best = &p;
  }
  if (best != nullptr) {
    *pfn = best->fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
  } else if (status) {
    // documented: success with a NULL pointer either way
    *status =
        known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  }
  return CUDA_SUCCESS;
}

}  // namespace

extern "C" {

// Usable before cuInit, as on the real driver (the runtime resolves entry points first).
CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult* status) {
  EMU_ENTER("cuGetProcAddress", emu::kNone);
  (void)flags;
  return lookup(symbol, pfn, cuda_version, status);
}

CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags) {
  EMU_ENTER("cuGetProcAddress", emu::kNone);
  (void)flags;
  return lookup(symbol, pfn, cuda_version, nullptr);
}

}  // extern "C"
