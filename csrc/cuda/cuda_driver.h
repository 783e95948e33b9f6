// The CUDA driver entry-point table.
//
// Why run-time loading: the package must import, and the host backend must work, on machines with
// no NVIDIA driver, so nothing links against libcuda or cudart. The driver is dlopen()ed on first
// use ("libcuda.so.1", or the path in $VATTENTION_LIBCUDA, which tests point at the strict
// emulation), and each entry point is resolved through cuGetProcAddress_v2 (falling back to
// cuGetProcAddress) at the CUDA version pinned in the one list below, so the ABI we call is the one
// our cuda.h declares, whatever newer driver is installed.
//
// Compiled only with -DVATTENTION_WITH_CUDA (setup.py adds it when cuda.h is found); otherwise this
// header declares nothing.
#pragma once

#ifdef VATTENTION_WITH_CUDA

#include <cuda.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

namespace vattention::cuda {

// X(name, pinned CUDA version): the version that introduced the ABI declared in cuda.h for that
// base name (cuda.h maps e.g. cuEventDestroy to cuEventDestroy_v2, introduced in 4.0).
#define VATTENTION_CUDA_DRIVER_ENTRIES(X)     \
  X(cuInit, 2000)                             \
  X(cuDriverGetVersion, 2020)                 \
  X(cuDeviceGet, 2000)                        \
  X(cuDeviceGetCount, 2000)                   \
  X(cuDeviceGetAttribute, 2000)               \
  X(cuDevicePrimaryCtxRetain, 7000)           \
  X(cuDevicePrimaryCtxRelease, 11000)         \
  X(cuCtxSetCurrent, 4000)                    \
  X(cuCtxGetCurrent, 4000)                    \
  X(cuMemGetAllocationGranularity, 10020)     \
  X(cuMemAddressReserve, 10020)               \
  X(cuMemAddressFree, 10020)                  \
  X(cuMemCreate, 10020)                       \
  X(cuMemRelease, 10020)                      \
  X(cuMemMap, 10020)                          \
  X(cuMemUnmap, 10020)                        \
  X(cuMemSetAccess, 10020)                    \
  X(cuEventCreate, 2000)                      \
  X(cuEventRecord, 2000)                      \
  X(cuEventQuery, 2000)                       \
  X(cuEventSynchronize, 2000)                 \
  X(cuEventDestroy, 4000)                     \
  X(cuMemcpyAsync, 4000)                      \
  X(cuMemcpyDtoHAsync, 3020)                  \
  X(cuMemcpyHtoDAsync, 3020)                  \
  X(cuMemHostAlloc, 2020)                     \
  X(cuMemFreeHost, 2000)                      \
  X(cuMemsetD8Async, 3020)                    \
  X(cuStreamCreate, 2000)                     \
  X(cuStreamDestroy, 4000)                    \
  X(cuCtxSynchronize, 2000)                   \
  X(cuThreadExchangeStreamCaptureMode, 10010) \
  X(cuGetErrorString, 6000)                   \
  X(cuGetErrorName, 6000)

// Function pointers, one per entry above, typed from cuda.h's own declarations (decltype only:
// no symbol is referenced at link time). Members keep the driver's names, so calls read
// `api.cuMemMap(...)` (cuda.h's renaming macros apply to both sides consistently).
struct DriverApi {
#define VATTENTION_CUDA_MEMBER(name, version) decltype(&::name) name = nullptr;
  VATTENTION_CUDA_DRIVER_ENTRIES(VATTENTION_CUDA_MEMBER)
#undef VATTENTION_CUDA_MEMBER
  std::string library_path;  // what was dlopen()ed
  int driver_version = 0;  // cuDriverGetVersion, e.g. 12040
};

// The process-wide table, loaded on first call (thread-safe). Throws Error(Kind::Unavailable)
// naming the library/symbol when the driver cannot be loaded; later calls rethrow the same reason.
// The library stays loaded for the life of the process (unloading a driver is never safe).
const DriverApi& driver();

// "" when driver() would succeed, else the reason. Never throws.
std::string driver_unavailable_reason();

// A value to show in error messages: addresses in hex, sizes in decimal.
using Arg = std::pair<const char*, uint64_t>;

// The one check every CUresult goes through. On failure throws Error(Kind::Driver) whose message
// names the call, its arguments, the numeric code and the driver's error string, and whose fields
// are call, code, error_string plus each argument (so Python gets them as attributes).
// CUDA_ERROR_OUT_OF_MEMORY from cuMemCreate is mapped by the caller, not here.
void check(CUresult result, const char* call, std::initializer_list<Arg> args = {});

// "CUDA_ERROR_INVALID_VALUE (1): invalid argument"-style text for a code.
std::string describe(CUresult result);

}  // namespace vattention::cuda

#endif  // VATTENTION_WITH_CUDA
