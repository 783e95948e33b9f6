// The Backend interface: the physical/virtual memory primitives the KV cache is built on.
//
// Why an interface: the same cache logic (slots, layouts, transactions, reclamation) runs on the
// CUDA driver's VMM API and on Linux host memory. Both expose the same model: reserve a virtual
// range with no memory behind it, create fixed-size physical pages, map a page at a page-aligned
// address inside a reservation, grant access to a run of mapped pages, unmap whole runs.
//
// Contract shared by every implementation (the CUDA rules, which the host backend also obeys so
// that host tests catch misuse the driver would reject):
//  - all sizes and addresses are multiples of page_bytes(), itself a multiple of granularity();
//  - map() puts exactly one page at va; the range must be inside a reservation and unmapped;
//  - set_access() covers only fully mapped ranges, and may span several adjacent pages;
//  - unmap() covers whole mappings exactly;
//  - failures throw vattention::Error (Kind::OutOfPages from create_page when memory is exhausted,
//    Kind::Driver otherwise) and leave the backend as it was.
//
// No operation has a default: each one's right behaviour depends on where the memory is (a memcpy
// or a no-op fence is right for host memory and silently wrong for a device's), so a new backend
// that forgets one does not compile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace vattention {

using PageHandle = uint64_t;
struct CacheGeometry;

// DLPack device codes (kDLCPU = 1, kDLCUDA = 2), so bindings can export tensors without a table.
struct DeviceId {
  int32_t dl_device_type = 1;
  int32_t ordinal = 0;
};

class Backend {
 public:
  // What a backend keeps per cache while the cache lives (the host backend: the fault report that
  // names the cache, tensor, slot and token of a bad access). register_cache() makes it; the cache
  // drops it before its reservations go.
  class CacheRegistration {
   public:
    virtual ~CacheRegistration() = default;
    // The cache was closed: its tensors are dangling from now on.
    virtual void mark_closed() = 0;
  };

  virtual ~Backend() = default;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // Smallest legal page size in bytes (host: the OS page size; CUDA: MINIMUM granularity).
  virtual size_t granularity() const = 0;
  // Size of the pages create_page() makes, fixed at construction.
  virtual size_t page_bytes() const = 0;
  virtual DeviceId device() const = 0;
  // "host" or "cuda".
  virtual std::string name() const = 0;

  // Reserve bytes of virtual address space with no access and no memory behind it.
  virtual uintptr_t reserve(size_t bytes) = 0;
  // Give back a whole reservation. Precondition: nothing in it is mapped.
  virtual void release_va(uintptr_t va, size_t bytes) = 0;

  // Create one committed physical page of page_bytes(). Slow (CUDA: ~190 us per 2 MB page).
  virtual PageHandle create_page() = 0;
  // Return a page to the OS/driver. Legal while mapped (memory goes when the last mapping does).
  virtual void destroy_page(PageHandle page) = 0;

  // Map one page at va (page_bytes() long). The new mapping has no access until set_access().
  virtual void map(uintptr_t va, PageHandle page) = 0;
  // Grant read/write access to [va, va + bytes), which must be fully mapped.
  virtual void set_access(uintptr_t va, size_t bytes) = 0;
  // Make [va, va + bytes) resident now instead of at first touch (host: fault the page tables in;
  // device memory is resident once mapped). An optimization only: callers may invoke it without the
  // cache lock on a range unmapped meanwhile, so it must tolerate that and never throw.
  virtual void prefault(uintptr_t va, size_t bytes) noexcept = 0;
  // Unmap [va, va + bytes), which must cover whole mappings; the range stays reserved.
  virtual void unmap(uintptr_t va, size_t bytes) = 0;

  // Binds a thread the cache owns (the prefetch thread) to this backend before its first call;
  // binding it again is a no-op (the prefetch thread calls it per job). CUDA: makes the device's
  // primary context current for good and puts the thread in relaxed stream-capture mode, so its
  // driver calls never invalidate a CUDA graph another thread captures; nothing else runs on
  // such a thread, so this backend's calls there make no context query. Every other backend
  // call leaves the calling thread's current context as it found it (a caller's thread is never
  // bound: Python cannot reach this call).
  virtual void bind_thread() = 0;

  // Stream-ordered fences for deferred unmapping: unmapping is not stream-ordered, so a page a
  // kernel may still read is unmapped only after a fence recorded behind that kernel completed.
  // record_fence() records an event on `stream` (0 = legacy default stream) and returns an id;
  // fence_done() polls it; fence_wait() blocks; fence_release() frees it.
  virtual uint64_t record_fence(uintptr_t stream) = 0;
  virtual bool fence_done(uint64_t fence) = 0;
  virtual void fence_wait(uint64_t fence) = 0;
  virtual void fence_release(uint64_t fence) = 0;
  // Waits until every piece of work queued on the device so far, on any stream, has finished
  // (close(): kernels may still read any row).
  virtual void synchronize() = 0;
  // A stream of the backend's own that orders after nothing else (CUDA: non-blocking), for work
  // the cache queues outside any caller's stream (the prefetch thread's zeroing); 0 where work
  // is synchronous (host).
  virtual uintptr_t create_stream() = 0;
  virtual void destroy_stream(uintptr_t stream) = 0;

  // Called by the cache's close() after every page is destroyed: give back whatever still holds
  // physical memory or OS resources for pages (host: the memfd arenas' descriptors). No page is
  // created afterwards; reservations stay valid until release_va().
  virtual void release_physical() noexcept = 0;

  // Bytes the OS/driver really holds for this backend's pages (host: memfd blocks). -1 if unknown.
  virtual int64_t committed_bytes() const = 0;
  // Bytes of live pages collapsed into huge (2 MB) pages of the OS when created, so that a mapping
  // at an aligned address costs one page-table entry per 2 MB (host backend). -1 if not
  // applicable (another backend, a page size not a multiple of 2 MB, base pages not 4 KB).
  virtual int64_t huge_page_bytes() const = 0;

  // Called once per cache after its tensors are reserved at `bases` (one per tensor, as
  // geometry.h numbers them). nullptr: nothing to keep.
  virtual std::unique_ptr<CacheRegistration> register_cache(
      const CacheGeometry& geometry, const std::vector<uintptr_t>& bases) = 0;

  // ---- copies (prefix sharing and swap) ---------------------------------------------------------
  // Every copy is ordered on `stream` (0 = legacy default stream) after work already queued there,
  // and may still be running when the call returns: before unmapping either range, freeing a host
  // buffer or reading it on the host, the caller records a fence on `stream` and waits for it.
  //
  // Device-to-device copy of `bytes` from src to dst; both ranges mapped with access.
  virtual void copy(uintptr_t dst, uintptr_t src, size_t bytes, uintptr_t stream) = 0;
  // Device range [src, src + bytes) into host buffer dst (from alloc_host()).
  virtual void copy_to_host(void* dst, uintptr_t src, size_t bytes, uintptr_t stream) = 0;
  // Host buffer src (from alloc_host()) into device range [dst, dst + bytes).
  virtual void copy_from_host(uintptr_t dst, const void* src, size_t bytes, uintptr_t stream) = 0;
  // Zeroes device range [va, va + bytes) (mapped with access), ordered on `stream`.
  virtual void zero(uintptr_t va, size_t bytes, uintptr_t stream) = 0;
  // Host staging memory for swap (CUDA: page-locked, so the copies above are true asynchronous
  // DMA). alloc_host returns nullptr when the allocation fails; free_host is called from
  // destructors and should not throw.
  virtual void* alloc_host(size_t bytes) = 0;
  virtual void free_host(void* ptr) = 0;
};

}  // namespace vattention
