#include "host/host_backend.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/errors.h"
#include "core/geometry.h"
#include "host/fault_report.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14; older headers lack it
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1
#endif

namespace vattention {
namespace {

// Sparse size of one memfd arena. Address space of a file costs nothing until pages are committed.
constexpr size_t kArenaBytes = size_t{1} << 36;  // 64 GiB
// The x86-64 / arm64 (4 KB base pages) PMD size: one page-table entry maps this much of a folio
// this large when the virtual address and the file offset are both multiples of it.
constexpr size_t kHugeBytes = size_t{2} << 20;

bool huge_pages_wanted() {
  const char* env = std::getenv("VATTENTION_HOST_HUGE_PAGES");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

// Maps [offset, offset + bytes) of fd read-write at an `align`-aligned address (over-reserve,
// then map inside), runs use(va) on it and unmaps it. MADV_COLLAPSE works on a mapping, and only
// on whole aligned 2 MB ranges. False when the mapping could not be made (use did not run).
template <typename Use>
bool with_aligned_mapping(int fd, size_t offset, size_t bytes, size_t align, Use use) {
  const size_t span = bytes + align;
  void* raw = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return false;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
  void* va = reinterpret_cast<void*>((begin + align - 1) / align * align);
  const bool mapped = mmap(va, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                           static_cast<off_t>(offset)) != MAP_FAILED;
  if (mapped) use(va);
  munmap(raw, span);
  return mapped;
}

std::string hex(uintptr_t value) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%zx", static_cast<size_t>(value));
  return buf;
}

Error os_error(const char* call, int err, size_t bytes, uintptr_t va = 0) {
  std::string msg = std::string(call) + " failed: " + std::strerror(err) + " (errno " +
                    std::to_string(err) + ", bytes=" + std::to_string(bytes);
  if (va != 0) msg += ", va=" + hex(va);
  Error e(Error::Kind::Driver, msg + ")");
  e.with("call", std::string(call)).with("code", err).with("error_string", std::strerror(err));
  e.with("bytes", static_cast<int64_t>(bytes));
  return e;
}

std::atomic<int64_t> g_live_mappings{0};  // process-wide, over every HostBackend

int64_t read_mapping_limit() {
  if (const char* env = std::getenv("VATTENTION_HOST_MAX_MAPPINGS")) return std::atoll(env);
  int64_t max_map_count = 65530;
  if (FILE* f = std::fopen("/proc/sys/vm/max_map_count", "r")) {
    long long v = 0;
    if (std::fscanf(f, "%lld", &v) == 1 && v > 0) max_map_count = v;
    std::fclose(f);
  }
  // Leave room for everything else in the process (libraries, allocator arenas, thread stacks).
  const int64_t reserve_for_others = 8192;
  return max_map_count > 2 * reserve_for_others ? (max_map_count - reserve_for_others) / 2
                                                : max_map_count / 4;
}

}  // namespace

int64_t HostBackend::mapping_limit() {
  static const int64_t limit = read_mapping_limit();
  return limit;
}

HostBackend::HostBackend(size_t page_bytes)
    : granularity_(static_cast<size_t>(sysconf(_SC_PAGESIZE))),
      page_bytes_(page_bytes),
      pages_per_arena_(page_bytes ? kArenaBytes / page_bytes : 0) {
  if (page_bytes == 0 || page_bytes % granularity_ != 0) {
    throw Error(Error::Kind::Config,
                "page_size=" + std::to_string(page_bytes) +
                    " bytes is not a positive multiple of the host backend granularity (" +
                    std::to_string(granularity_) + " bytes, the OS page size)")
        .with("page_bytes", static_cast<int64_t>(page_bytes))
        .with("granularity", static_cast<int64_t>(granularity_));
  }
  // the same answer huge_unit() gives an engine choosing its page size (base pages of 4 KB, the
  // kernel's collapse probe, $VATTENTION_HOST_HUGE_PAGES): one decision, not two that may differ.
  // Pages that are not whole 2 MB never ask, so they never pay for the probe.
  try_huge_ = page_bytes % kHugeBytes == 0 && huge_unit() > 0;
}

int64_t HostBackend::huge_unit() {
  // Probed once per process as instantiate() collapses a page: a 2 MB memfd extent, fallocated,
  // mapped at an aligned address, collapsed. Kernels before 6.1 (no MADV_COLLAPSE),
  // shmem_enabled=deny and processes with THP disabled refuse, and a page size chosen for huge
  // pages would gain nothing.
  static const bool kernel_collapses = [] {
    if (sysconf(_SC_PAGESIZE) != 4096) return false;
    const int fd = memfd_create("vattention-huge-probe", MFD_CLOEXEC);
    if (fd < 0) return false;
    bool ok = false;
    if (ftruncate(fd, static_cast<off_t>(kHugeBytes)) == 0 &&
        fallocate(fd, 0, 0, static_cast<off_t>(kHugeBytes)) == 0) {
      with_aligned_mapping(fd, 0, kHugeBytes, kHugeBytes,
                           [&](void* va) { ok = madvise(va, kHugeBytes, MADV_COLLAPSE) == 0; });
    }
    close(fd);
    return ok;
  }();
  return kernel_collapses && huge_pages_wanted() ? static_cast<int64_t>(kHugeBytes) : 0;
}

HostBackend::~HostBackend() {
  for (Arena& a : arenas_) close(a.fd);
}

void HostBackend::inject_fault(const std::string& op, int nth, bool out_of_memory) {
  std::lock_guard<std::mutex> lock(mu_);
  if (nth <= 0) {
    faults_.erase(op);
  } else {
    faults_[op] = Fault{nth, out_of_memory};
  }
}

int64_t HostBackend::calls(const std::string& op) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(op);
  return it == calls_.end() ? 0 : it->second;
}

void HostBackend::maybe_fail(const char* op) {
  std::lock_guard<std::mutex> lock(mu_);
  ++calls_[op];
  auto it = faults_.find(op);
  if (it == faults_.end() || --it->second.countdown > 0) return;
  bool oom = it->second.out_of_memory;
  faults_.erase(it);
  if (oom) {
    throw Error(Error::Kind::OutOfPages, std::string("injected out-of-memory in ") + op)
        .with("pages_needed", 1)
        .with("pages_available", 0);
  }
  throw Error(Error::Kind::Driver, std::string("injected fault in host backend call ") + op)
      .with("call", std::string(op))
      .with("code", -1)
      .with("error_string", std::string("injected fault"));
}

uintptr_t HostBackend::reserve(size_t bytes) {
  maybe_fail("reserve");
  // Over-reserve by one page and trim, so the base is page_bytes aligned as it is on CUDA.
  const size_t span = bytes + page_bytes_;
  void* raw = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) throw os_error("mmap(PROT_NONE reserve)", errno, bytes);
  const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t base = (begin + page_bytes_ - 1) / page_bytes_ * page_bytes_;
  if (base > begin) munmap(raw, base - begin);
  const uintptr_t end = begin + span;
  if (end > base + bytes) munmap(reinterpret_cast<void*>(base + bytes), end - (base + bytes));
  return base;
}

void HostBackend::release_va(uintptr_t va, size_t bytes) {
  if (munmap(reinterpret_cast<void*>(va), bytes) != 0) throw os_error("munmap", errno, bytes, va);
}

PageHandle HostBackend::create_page() {
  maybe_fail("create_page");
  int fd;
  size_t offset;
  PageHandle page = commit_extent(&fd, &offset);
  if (instantiate(fd, offset)) {
    std::lock_guard<std::mutex> lock(mu_);
    huge_[page] = 1;
    ++huge_pages_;
  }
  return page;
}

PageHandle HostBackend::commit_extent(int* fd_out, size_t* offset_out) {
  std::lock_guard<std::mutex> lock(mu_);
  PageHandle page;
  bool reused = !free_extents_.empty();
  if (reused) {
    page = free_extents_.back();
  } else {
    if (arenas_.empty() || arenas_.back().next_unused == pages_per_arena_) {
      int fd = memfd_create("vattention-kv", MFD_CLOEXEC);
      if (fd < 0) throw os_error("memfd_create", errno, page_bytes_);
      if (ftruncate(fd, static_cast<off_t>(kArenaBytes)) != 0) {
        int err = errno;
        close(fd);
        throw os_error("ftruncate(memfd arena)", err, kArenaBytes);
      }
      arenas_.push_back(Arena{fd, 0});
    }
    page = (arenas_.size() - 1) * pages_per_arena_ + arenas_.back().next_unused;
  }
  // Sized before the fallocate, so that nothing can fail once the extent is committed.
  if (huge_.size() <= page) huge_.resize(page + 1, 0);
  const int fd = arenas_[page / pages_per_arena_].fd;
  const off_t offset = static_cast<off_t>((page % pages_per_arena_) * page_bytes_);
  if (fallocate(fd, 0, offset, static_cast<off_t>(page_bytes_)) != 0) {
    int err = errno;
    if (err == ENOSPC || err == ENOMEM) {
      throw Error(Error::Kind::OutOfPages, "host memory exhausted: fallocate of a " +
                                               std::to_string(page_bytes_) + "-byte page failed (" +
                                               std::strerror(err) + ")")
          .with("pages_needed", 1)
          .with("pages_available", 0);
    }
    throw os_error("fallocate(memfd page)", err, page_bytes_);
  }
  if (reused) {
    free_extents_.pop_back();
  } else {
    arenas_.back().next_unused++;
  }
  *fd_out = fd;
  *offset_out = static_cast<size_t>(offset);
  return page;
}

bool HostBackend::instantiate(int fd, size_t offset) {
  // A scratch mapping at a 2 MB-aligned address (with_aligned_mapping). MADV_COLLAPSE gathers the
  // extent's fallocated 4 KB pages into zero-filled 2 MB folios that stay in the memfd after the
  // scratch mapping goes (measured: 0.4-1 ms per 2 MB, on top of the fallocate's 0.5 ms). It fails
  // with EINVAL on a range with no pages at all, hence after the fallocate. Without it,
  // MADV_POPULATE_WRITE has the kernel clear the 4 KB pages now. Both are best effort: a page they
  // could not instantiate is cleared at its first fault, as before.
  const bool huge = try_huge_;
  bool collapsed = false;
  with_aligned_mapping(fd, offset, page_bytes_, huge ? kHugeBytes : granularity_, [&](void* va) {
    if (huge) {
      collapsed = madvise(va, page_bytes_, MADV_COLLAPSE) == 0;
      // EINVAL before any success: no MADV_COLLAPSE in this kernel, or refused for shmem
      // (shmem_enabled=deny, THP disabled for the process); it will not change its mind, so
      // stop trying. After a success, EINVAL is also the kernel's answer for a failure of one
      // range (a page it could not get or copy), as EAGAIN and ENOMEM (no free 2 MB block now)
      // are: the next page tries again.
      if (collapsed) {
        ever_collapsed_ = true;
      } else if (errno == EINVAL && !ever_collapsed_) {
        try_huge_ = false;
      }
    }
    if (!collapsed) (void)madvise(va, page_bytes_, MADV_POPULATE_WRITE);
  });
  return collapsed;
}

int64_t HostBackend::huge_page_bytes() const {
  if (granularity_ != 4096 || page_bytes_ % kHugeBytes != 0) return -1;
  std::lock_guard<std::mutex> lock(mu_);
  return huge_pages_ * static_cast<int64_t>(page_bytes_);
}

void HostBackend::destroy_page(PageHandle page) {
  maybe_fail("destroy_page");
  std::lock_guard<std::mutex> lock(mu_);
  size_t offset = 0;
  const int fd = arena_fd(page, &offset);
  // Punching the hole frees the memory now if unmapped, else when the last mapping goes.
  if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                static_cast<off_t>(page_bytes_)) != 0) {
    throw os_error("fallocate(PUNCH_HOLE)", errno, page_bytes_);
  }
  if (page < huge_.size() && huge_[page]) {
    huge_[page] = 0;
    --huge_pages_;
  }
  free_extents_.push_back(page);
}

int HostBackend::arena_fd(PageHandle page, size_t* offset) const {
  *offset = (page % pages_per_arena_) * page_bytes_;
  return arenas_.at(page / pages_per_arena_).fd;
}

void HostBackend::map(uintptr_t va, PageHandle page) {
  maybe_fail("map");
  if (g_live_mappings.fetch_add(1) + 1 > mapping_limit()) {
    g_live_mappings.fetch_sub(1);
    throw Error(
        Error::Kind::OutOfPages,
        "host backend: a page mapping beyond this process's limit of " +
            std::to_string(mapping_limit()) +
            " (half of vm.max_map_count minus 8192 for the rest of the process): use larger "
            "pages, a smaller budget, or raise vm.max_map_count")
        .with("pages_needed", 1)
        .with("pages_available", 0)
        .with("mapping_limit", mapping_limit());
  }
  size_t offset = 0;
  int fd;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fd = arena_fd(page, &offset);
  }
  void* got = mmap(reinterpret_cast<void*>(va), page_bytes_, PROT_NONE, MAP_SHARED | MAP_FIXED, fd,
                   static_cast<off_t>(offset));
  if (got == MAP_FAILED) {
    g_live_mappings.fetch_sub(1);
    throw os_error("mmap(MAP_FIXED|MAP_SHARED page)", errno, page_bytes_, va);
  }
}

void HostBackend::set_access(uintptr_t va, size_t bytes) {
  maybe_fail("set_access");
  if (mprotect(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE) != 0) {
    throw os_error("mprotect", errno, bytes, va);
  }
}

void HostBackend::prefault(uintptr_t va, size_t bytes) noexcept {
  // READ, not WRITE: the memfd pages exist already (fallocate), a read fault maps them writable
  // in a MAP_SHARED shmem mapping (no write notification), and it maps its neighbours from the
  // page cache too (fault-around), so populating costs about half as much as WRITE's one fault
  // per 4 KB page (measured: 16 rows x 7 blocks of 256 KB, 8.5 ms against 17 ms).
  // Failure is harmless: old kernels lack MADV_POPULATE_READ (pages then fault in on first
  // touch), and a range unmapped meanwhile (PROT_NONE) simply is not populated.
  (void)madvise(reinterpret_cast<void*>(va), bytes, MADV_POPULATE_READ);
}

void HostBackend::unmap(uintptr_t va, size_t bytes) {
  maybe_fail("unmap");
  void* got = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (got == MAP_FAILED) throw os_error("mmap(PROT_NONE unmap)", errno, bytes, va);
  g_live_mappings.fetch_sub(static_cast<int64_t>(bytes / page_bytes_));
}

void HostBackend::release_physical() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  for (Arena& a : arenas_) close(a.fd);
  arenas_.clear();
  free_extents_.clear();
  huge_.clear();
  huge_pages_ = 0;
}

int64_t HostBackend::committed_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const Arena& a : arenas_) {
    struct stat st;
    if (fstat(a.fd, &st) == 0) total += static_cast<int64_t>(st.st_blocks) * 512;
  }
  return total;
}

std::unique_ptr<Backend::CacheRegistration> HostBackend::register_cache(
    const CacheGeometry& geo, const std::vector<uintptr_t>& bases) {
  FaultGeometry fg;
  fg.num_layers = geo.num_layers;
  fg.max_batch = geo.max_batch;
  fg.max_seq = geo.max_seq;
  fg.mega = geo.mega;
  for (int t = 0; t < geo.num_tensors(); ++t) {
    fg.slot_bytes.push_back(geo.slot_bytes(t));
    fg.token_bytes.push_back(geo.token_bytes(t));
    fg.tensor_bytes.push_back(geo.tensor_bytes(t));
  }
  fg.layer_bytes = geo.layer_token_bytes(0);
  return std::make_unique<FaultReport>(fg, bases);
}

void HostBackend::copy(uintptr_t dst, uintptr_t src, size_t bytes, uintptr_t /*stream*/) {
  std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
}

void HostBackend::copy_to_host(void* dst, uintptr_t src, size_t bytes, uintptr_t /*stream*/) {
  std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
}

void HostBackend::copy_from_host(uintptr_t dst, const void* src, size_t bytes,
                                 uintptr_t /*stream*/) {
  std::memcpy(reinterpret_cast<void*>(dst), src, bytes);
}

void HostBackend::zero(uintptr_t va, size_t bytes, uintptr_t /*stream*/) {
  maybe_fail("zero");
  std::memset(reinterpret_cast<void*>(va), 0, bytes);
}

void* HostBackend::alloc_host(size_t bytes) { return std::malloc(bytes); }

void HostBackend::free_host(void* ptr) { std::free(ptr); }

}  // namespace vattention
