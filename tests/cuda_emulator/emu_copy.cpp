// EMULATION, TEST-ONLY: the copy, memset and pinned-host-memory entry points (cuMemcpyAsync,
// cuMemcpyDtoDAsync, cuMemcpyDtoHAsync, cuMemcpyHtoDAsync, cuMemsetD8Async, cuMemHostAlloc,
// cuMemFreeHost).
//
// Rules enforced: every device range lies wholly inside accessible mappings (else
// CUDA_ERROR_INVALID_VALUE and a violation: on a GPU the copy would fault); host buffers of the
// Dtoh/HtoD copies come from cuMemHostAlloc (pageable memory would make them synchronous, which
// the cache's fencing must not rely on); cuMemFreeHost only frees what cuMemHostAlloc returned.
// Streams (emu_stream.cpp): the stream must be valid; on the legacy stream the capture rules apply;
// on a capturing stream the operation is captured (it does not act). Data moves at once; when the
// stream had earlier work not yet complete, a unit touching the device ranges stays in flight
// behind it, so unmapping those ranges before it completes is a violation as for a kernel. The
// stream of the latest accepted copy/memset is kept for tests (vaemu_last_copy_stream,
// vaemu_last_memset_stream).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iterator>

#include "emu_state.h"

namespace {

using emu::state;

// Zeroes [dst, dst + n) of device memory the way a GPU's memset costs its host: without touching
// the bytes. Whole host pages get MADV_REMOVE (a hole punched in the handles' memfds: every alias
// of them reads zeros after it, and unpopulated pages stay unpopulated); the ends and a refused
// madvise get memset. A plain memset of a fresh 2 MB page takes 512 page faults on the host (about
// 0.7 ms on a VM without shmem huge pages), which a GPU never pays and which would sit in the way
// of what the emulation times: the driver calls.
void zero_device(uintptr_t dst, size_t n) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t end = dst + n;
  const uintptr_t lo = (dst + page - 1) / page * page;
  const uintptr_t hi = end / page * page;
  if (lo >= hi) {
    std::memset(reinterpret_cast<void*>(dst), 0, n);
    return;
  }
  std::memset(reinterpret_cast<void*>(dst), 0, lo - dst);
  std::memset(reinterpret_cast<void*>(hi), 0, end - hi);
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_REMOVE) != 0)
    std::memset(reinterpret_cast<void*>(lo), 0, hi - lo);
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

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  EMU_ENTER("cuMemcpyAsync", emu::kInit | emu::kContext);
  emu::StreamOp op = emu::begin_stream_op(stream, call_.name());
  if (op.result != CUDA_SUCCESS) return op.result;
  if (op.captured) {
    state().last_copy_stream = reinterpret_cast<uintptr_t>(stream);
    return CUDA_SUCCESS;
  }
  if (!emu::device_range_accessible(dst, bytes) || !emu::device_range_accessible(src, bytes))
    return call_.violation(
        CUDA_ERROR_INVALID_VALUE,
        "cuMemcpyAsync(0x%llx <- 0x%llx, %zu): a range is not mapped with access",
        static_cast<unsigned long long>(dst), static_cast<unsigned long long>(src), bytes);
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
  state().last_copy_stream = reinterpret_cast<uintptr_t>(stream);
  emu::enqueue_behind(op.stream->info, {{dst, bytes}, {src, bytes}}, call_.name());
  return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  return cuMemcpyAsync(dst, src, bytes, stream);
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  EMU_ENTER("cuMemcpyDtoHAsync", emu::kInit | emu::kContext);
  emu::StreamOp op = emu::begin_stream_op(stream, call_.name());
  if (op.result != CUDA_SUCCESS) return op.result;
  if (op.captured) {
    state().last_copy_stream = reinterpret_cast<uintptr_t>(stream);
    return CUDA_SUCCESS;
  }
  if (!emu::device_range_accessible(src, bytes) || !pinned(dst, bytes))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemcpyDtoHAsync(%p <- 0x%llx, %zu): device range not accessible or "
                           "host buffer not from cuMemHostAlloc",
                           dst, static_cast<unsigned long long>(src), bytes);
  std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
  state().last_copy_stream = reinterpret_cast<uintptr_t>(stream);
  emu::enqueue_behind(op.stream->info, {{src, bytes}}, call_.name());
  return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  EMU_ENTER("cuMemcpyHtoDAsync", emu::kInit | emu::kContext);
  emu::StreamOp op = emu::begin_stream_op(stream, call_.name());
  if (op.result != CUDA_SUCCESS) return op.result;
  if (op.captured) {
    state().last_copy_stream = reinterpret_cast<uintptr_t>(stream);
    return CUDA_SUCCESS;
  }
  if (!emu::device_range_accessible(dst, bytes) || !pinned(src, bytes))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemcpyHtoDAsync(0x%llx <- %p, %zu): device range not accessible or "
                           "host buffer not from cuMemHostAlloc",
                           static_cast<unsigned long long>(dst), src, bytes);
  std::memcpy(reinterpret_cast<void*>(dst), src, bytes);
  state().last_copy_stream = reinterpret_cast<uintptr_t>(stream);
  emu::enqueue_behind(op.stream->info, {{dst, bytes}}, call_.name());
  return CUDA_SUCCESS;
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream stream) {
  EMU_ENTER("cuMemsetD8Async", emu::kInit | emu::kContext);
  emu::StreamOp op = emu::begin_stream_op(stream, call_.name());
  if (op.result != CUDA_SUCCESS) return op.result;
  if (op.captured) {
    state().last_memset_stream = reinterpret_cast<uintptr_t>(stream);
    return CUDA_SUCCESS;
  }
  if (n != 0 && !emu::device_range_accessible(dst, n))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemsetD8Async(0x%llx, %zu): range is not mapped with access",
                           static_cast<unsigned long long>(dst), n);
  if (n != 0 && value == 0) zero_device(dst, n);
  if (n != 0 && value != 0) std::memset(reinterpret_cast<void*>(dst), value, n);
  state().last_memset_stream = reinterpret_cast<uintptr_t>(stream);
  emu::enqueue_behind(op.stream->info, {{dst, n}}, call_.name());
  return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void** pp, size_t bytes, unsigned int) {
  EMU_ENTER("cuMemHostAlloc", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
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
  EMU_UNSAFE_DURING_CAPTURE();
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
