// EMULATION, TEST-ONLY: the copy and pinned-host-memory entry points (cuMemcpyAsync,
// cuMemcpyDtoDAsync, cuMemcpyDtoHAsync, cuMemcpyHtoDAsync, cuMemHostAlloc, cuMemFreeHost).
//
// Rules enforced: every device range lies wholly inside accessible mappings (else
// CUDA_ERROR_INVALID_VALUE and a violation: on a GPU the copy would fault); host buffers of the
// Dtoh/HtoD copies come from cuMemHostAlloc (pageable memory would make them synchronous, which
// the cache's fencing must not rely on); cuMemFreeHost only frees what cuMemHostAlloc returned.
// Copies complete at once (the emulated stream has no queue), which events already model as done.
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "emu_state.h"

namespace {

using emu::state;

// [ptr, ptr + bytes) lies in mappings that tile it without holes and all have access.
bool device_range_ok(uintptr_t ptr, size_t bytes) {
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

bool pinned(const void* p, size_t bytes) {
  auto& hs = state().host_allocs;
  auto it = hs.upper_bound(reinterpret_cast<uintptr_t>(p));
  if (it == hs.begin()) return false;
  --it;
  const auto q = reinterpret_cast<uintptr_t>(p);
  return q >= it->first && q + bytes <= it->first + it->second;
}

}  // namespace

extern "C" {

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream) {
  EMU_ENTER("cuMemcpyAsync", emu::kInit | emu::kContext);
  if (!device_range_ok(dst, bytes) || !device_range_ok(src, bytes))
    return call_.violation(
        CUDA_ERROR_INVALID_VALUE,
        "cuMemcpyAsync(0x%llx <- 0x%llx, %zu): a range is not mapped with access",
        static_cast<unsigned long long>(dst), static_cast<unsigned long long>(src), bytes);
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
  return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  return cuMemcpyAsync(dst, src, bytes, stream);
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, CUstream) {
  EMU_ENTER("cuMemcpyDtoHAsync", emu::kInit | emu::kContext);
  if (!device_range_ok(src, bytes) || !pinned(dst, bytes))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemcpyDtoHAsync(%p <- 0x%llx, %zu): device range not accessible or "
                           "host buffer not from cuMemHostAlloc",
                           dst, static_cast<unsigned long long>(src), bytes);
  std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
  return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, CUstream) {
  EMU_ENTER("cuMemcpyHtoDAsync", emu::kInit | emu::kContext);
  if (!device_range_ok(dst, bytes) || !pinned(src, bytes))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemcpyHtoDAsync(0x%llx <- %p, %zu): device range not accessible or "
                           "host buffer not from cuMemHostAlloc",
                           static_cast<unsigned long long>(dst), src, bytes);
  std::memcpy(reinterpret_cast<void*>(dst), src, bytes);
  return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void** pp, size_t bytes, unsigned int) {
  EMU_ENTER("cuMemHostAlloc", emu::kInit | emu::kContext);
  if (pp == nullptr || bytes == 0)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc: bad args");
  void* p = std::malloc(bytes);
  if (p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  state().host_allocs[reinterpret_cast<uintptr_t>(p)] = bytes;
  *pp = p;
  return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void* p) {
  EMU_ENTER("cuMemFreeHost", emu::kInit | emu::kContext);
  auto& hs = state().host_allocs;
  auto it = hs.find(reinterpret_cast<uintptr_t>(p));
  if (it == hs.end())
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemFreeHost(%p): not from cuMemHostAlloc",
                           p);
  hs.erase(it);
  std::free(p);
  return CUDA_SUCCESS;
}

}  // extern "C"
