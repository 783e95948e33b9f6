// HostBackend: the Backend primitives on Linux host memory.
//
// Why this shape: it mirrors the CUDA VMM model closely enough that the cache logic, the tests and
// the faults are the same on both backends.
//  - A reservation is mmap(PROT_NONE, MAP_NORESERVE): address space only, touching it faults.
//  - Physical pages are page_bytes extents of a few large memfd "arenas" (one fd per page would
//    need 131,072 descriptors for 8 GB of 64 KB pages). A page is committed with fallocate() when
//    created, so creating pages really reserves memory, and handed back with PUNCH_HOLE. Creating
//    also backs the memory now (faulted in, zero-filled, through a scratch mapping), as
//    cuMemCreate backs a device page: the kernel clears a fallocated shmem page only at its first
//    fault, which made the first mapping of a page 4-5x dearer than later ones (measured:
//    populate 400-540 against 84-109 us per MB), on whichever step first mapped it.
//  - map() is mmap(MAP_FIXED|MAP_SHARED) of the page's extent at its arena offset, with no access,
//    like cuMemMap; set_access() is mprotect(RW); prefault() is MADV_POPULATE_READ, so mapped
//    memory is resident like device memory (the prefetch thread runs it outside the cache lock);
//    unmap() re-establishes the PROT_NONE reservation.
//  - Huge pages: when page_bytes is a whole number of 2 MB (and base pages are 4 KB),
//    create_page() gathers the new page's memory into 2 MB folios (MADV_COLLAPSE on a scratch
//    mapping; shmem's own huge pages are off by default, the collapse is not). Every later
//    mapping of it at its 2 MB-aligned address is then one page-table entry per 2 MB instead of
//    512: measured here, map + populate + unmap of a 2 MB page 240 us -> 6.5 us, and attention
//    reads it with 2 MB TLB entries. Best effort: a kernel without MADV_COLLAPSE (before 6.1),
//    shmem_enabled=deny, THP disabled for the process or no free 2 MB block leaves 4 KB pages,
//    which work as before; $VATTENTION_HOST_HUGE_PAGES=0 turns it off.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <vector>

#include "core/backend.h"

namespace vattention {

class HostBackend final : public Backend {
 public:
  // Throws Error(Kind::Config) if page_bytes is not a positive multiple of the OS page size.
  explicit HostBackend(size_t page_bytes);
  ~HostBackend() override;

  size_t granularity() const override { return granularity_; }
  size_t page_bytes() const override { return page_bytes_; }
  DeviceId device() const override { return DeviceId{1, 0}; }
  std::string name() const override { return "host"; }

  uintptr_t reserve(size_t bytes) override;
  void release_va(uintptr_t va, size_t bytes) override;
  PageHandle create_page() override;
  void destroy_page(PageHandle page) override;
  void map(uintptr_t va, PageHandle page) override;
  void set_access(uintptr_t va, size_t bytes) override;
  void prefault(uintptr_t va, size_t bytes) noexcept override;
  void unmap(uintptr_t va, size_t bytes) override;
  int64_t committed_bytes() const override;
  int64_t huge_page_bytes() const override;
  void release_physical() noexcept override;  // closes the memfd arenas
  // Host memory is the device's memory and nothing runs asynchronously on it: every thread can
  // call, and fences are done at once (ids 0).
  void bind_thread() override {}
  uint64_t record_fence(uintptr_t /*stream*/) override { return 0; }
  bool fence_done(uint64_t /*fence*/) override { return true; }
  void fence_wait(uint64_t /*fence*/) override {}
  void fence_release(uint64_t /*fence*/) override {}
  void synchronize() override {}
  uintptr_t create_stream() override { return 0; }
  void destroy_stream(uintptr_t /*stream*/) override {}
  // The fault report (fault_report.h): a SIGSEGV/SIGBUS in the cache's tensors names the cache,
  // tensor, slot and token instead of dying silently.
  std::unique_ptr<CacheRegistration> register_cache(const CacheGeometry& geometry,
                                                    const std::vector<uintptr_t>& bases) override;
  // Synchronous memcpy (so every copy is done when the call returns) and malloc'ed staging.
  void copy(uintptr_t dst, uintptr_t src, size_t bytes, uintptr_t stream) override;
  void copy_to_host(void* dst, uintptr_t src, size_t bytes, uintptr_t stream) override;
  void copy_from_host(uintptr_t dst, const void* src, size_t bytes, uintptr_t stream) override;
  void zero(uintptr_t va, size_t bytes, uintptr_t stream) override;
  void* alloc_host(size_t bytes) override;
  void free_host(void* ptr) override;

  // Page mappings this process may hold across all host caches. Linux caps a process's memory
  // mappings at vm.max_map_count (65,530 by default), and each mapped page can cost two (itself
  // and a split of the PROT_NONE reservation around it); at the cap even unmapping fails, because
  // re-reserving the range is an mmap. So map() refuses beyond (max_map_count - 8,192) / 2 with
  // Error(OutOfPages): recoverable and transactional. $VATTENTION_HOST_MAX_MAPPINGS overrides it.
  static int64_t mapping_limit();

  // Pages whose size is a multiple of this many bytes are created in 2 MB huge pages of the OS;
  // 0 where none can be (base pages other than 4 KB, a kernel that refuses MADV_COLLAPSE for
  // shmem, or $VATTENTION_HOST_HUGE_PAGES=0). An engine that picks its page size asks for it
  // (the vLLM plugin's block size).
  static int64_t huge_unit();

  // Test hook: the nth next call (1 = the very next) of `op` ("create_page", "map", "set_access",
  // "unmap", "reserve", "destroy_page") fails with Error(Kind::Driver), or Kind::OutOfPages for
  // create_page when out_of_memory is set. Lets tests prove rollback without exhausting real
  // memory.
  void inject_fault(const std::string& op, int nth, bool out_of_memory);
  // Test hook: how often `op` (a name as above, or "destroy_page") has been called, so a fault
  // sweep can fail every call index of a public call.
  int64_t calls(const std::string& op) const;

 private:
  struct Arena {
    int fd = -1;
    size_t next_unused = 0;  // pages [0, next_unused) of this arena have been handed out before
  };
  void maybe_fail(const char* op);
  int arena_fd(PageHandle page, size_t* offset) const;
  // create_page() under mu_: takes a free extent (or the next unused one) and fallocates it.
  PageHandle commit_extent(int* fd, size_t* offset);
  // Instantiates the extent [offset, offset + page_bytes_) of fd, in 2 MB folios where try_huge_
  // and the kernel allow (returns true then). Called without mu_ held (it writes the page).
  bool instantiate(int fd, size_t offset);

  const size_t granularity_;
  const size_t page_bytes_;
  const size_t pages_per_arena_;
  mutable std::mutex
      mu_;  // guards arenas_, free_extents_, huge_, huge_pages_, faults_, calls_ (a leaf lock)
  std::vector<Arena> arenas_;
  std::vector<PageHandle> free_extents_;  // punched extents ready for reuse
  std::vector<char> huge_;  // per page handle: its memory is in 2 MB folios
  int64_t huge_pages_ = 0;  // live pages with huge_ set
  // Whether instantiate() tries MADV_COLLAPSE: page_bytes a multiple of huge_unit() (0 where the
  // base pages are not 4 KB, the kernel's probe fails or huge pages are turned off), and the
  // kernel has not answered that it cannot (cleared on EINVAL before any success).
  std::atomic<bool> try_huge_{false};
  std::atomic<bool> ever_collapsed_{false};  // one collapse succeeded: EINVAL is then per range
  struct Fault {
    int countdown;
    bool out_of_memory;
  };
  std::map<std::string, Fault> faults_;
  std::map<std::string, int64_t> calls_;
};

}  // namespace vattention
