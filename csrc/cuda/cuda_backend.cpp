// The CUDA backend: Backend primitives on the CUDA driver's virtual memory management API.
//
// reserve -> cuMemAddressReserve, create_page -> cuMemCreate (PINNED, DEVICE), map -> cuMemMap,
// set_access -> cuMemSetAccess (the cache calls it once per contiguous run of new pages: one call
// per run, not per page, because each call is a page-table update and a TLB shootdown on the GPU),
// unmap -> cuMemUnmap, destroy_page -> cuMemRelease, release_va -> cuMemAddressFree.
//
// Contexts: the driver's VMM and event calls act on the calling thread's current context. The
// device's primary context (the one the CUDA runtime and torch use) is retained once per process
// (PrimaryContexts), and every call makes it current for its duration and then puts the caller's
// own back, none included (ScopedContext): the caller's current device never moves. The prefetch
// thread, the cache's own, is bound for good (bind_thread, once), in relaxed capture mode; its
// calls then make no context call at all.
//
// Fences: unmapping is not stream-ordered (a cuMemUnmap under a running kernel makes it fault), so
// the cache records an event on free() and unmaps only after the event completed. Events are
// created with CU_EVENT_DISABLE_TIMING: timing is never read and costs a sync on some drivers.
#ifdef VATTENTION_WITH_CUDA

#include "cuda/cuda_backend.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

#include "core/errors.h"
#include "cuda/cuda_driver.h"

namespace vattention {
namespace {

using cuda::check;
using cuda::DriverApi;

std::string device_name(int ordinal) { return "cuda:" + std::to_string(ordinal); }

// cuInit, device count, device handle and the VMM attribute; Unavailable/Config errors say why.
CUdevice open_device(const DriverApi& api, int ordinal) {
  CUresult r = api.cuInit(0);
  if (r != CUDA_SUCCESS) {
    throw Error(Error::Kind::Unavailable,
                "CUDA backend unavailable: cuInit failed: " + cuda::describe(r))
        .with("code", static_cast<int64_t>(r));
  }
  int count = 0;
  check(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (count == 0) throw Error(Error::Kind::Unavailable, "CUDA backend unavailable: no CUDA device");
  if (ordinal < 0 || ordinal >= count) {
    throw Error(Error::Kind::Config,
                "device " + device_name(ordinal) + " does not exist: " + std::to_string(count) +
                    " CUDA device(s), ordinals [0, " + std::to_string(count) + ")")
        .with("ordinal", ordinal)
        .with("device_count", count);
  }
  CUdevice dev = 0;
  check(api.cuDeviceGet(&dev, ordinal), "cuDeviceGet", {{"ordinal", uint64_t(ordinal)}});
  int vmm = 0;
  check(
      api.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
      "cuDeviceGetAttribute", {{"ordinal", uint64_t(ordinal)}});
  if (vmm == 0) {
    throw Error(Error::Kind::Unavailable,
                "CUDA backend unavailable: device " + device_name(ordinal) +
                    " does not support virtual memory management "
                    "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)")
        .with("ordinal", ordinal);
  }
  return dev;
}

CUmemAllocationProp page_prop(int ordinal) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  return prop;
}

// One retain of each device's primary context for the whole process: retaining makes the context
// if nobody holds it (torch has not initialised CUDA, say), which costs a context creation, so a
// retain per cache would pay that for every cache. Backends acquire the context here and let go
// of it without releasing it; release_unused() gives back the contexts no backend uses (tests
// that reset an emulated driver between cases).
class PrimaryContexts {
 public:
  static CUcontext acquire(const DriverApi& api, CUdevice dev) {
    std::lock_guard<std::mutex> lock(mu());
    Entry& e = entries()[dev];
    if (e.ctx == nullptr) {
      check(api.cuDevicePrimaryCtxRetain(&e.ctx, dev), "cuDevicePrimaryCtxRetain",
            {{"ordinal", uint64_t(dev)}});
    }
    ++e.users;
    return e.ctx;
  }
  static void let_go(CUdevice dev) {
    std::lock_guard<std::mutex> lock(mu());
    --entries()[dev].users;
  }
  static size_t release_unused(const DriverApi& api) {
    std::lock_guard<std::mutex> lock(mu());
    size_t released = 0;
    for (auto& [dev, e] : entries()) {
      if (e.ctx == nullptr || e.users > 0) continue;
      api.cuDevicePrimaryCtxRelease(dev);  // nothing to do on failure
      e.ctx = nullptr;
      ++released;
    }
    return released;
  }

 private:
  struct Entry {
    CUcontext ctx = nullptr;
    int users = 0;
  };
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::unordered_map<CUdevice, Entry>& entries() {
    static std::unordered_map<CUdevice, Entry> e;
    return e;
  }
};

// A backend's use of the device's primary context (RAII over PrimaryContexts).
class PrimaryContext {
 public:
  PrimaryContext(const DriverApi& api, CUdevice dev)
      : dev_(dev), ctx_(PrimaryContexts::acquire(api, dev)) {}
  ~PrimaryContext() { PrimaryContexts::let_go(dev_); }
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  CUcontext get() const { return ctx_; }

 private:
  CUdevice dev_;
  CUcontext ctx_;
};

// The context bind_thread() made this thread's for good (the prefetch thread's; nullptr on every
// other thread). Nothing but this backend runs on such a thread, so its current context stays
// what bind_thread() set: its calls need no query, and binding it again is a no-op.
thread_local CUcontext t_bound_context = nullptr;

// Makes ctx current on this thread for one backend call and puts the thread's own context back
// afterwards, none included: a library call must not move the caller's current device (torch
// reads it from the current context). A thread bound to ctx (the prefetch thread) costs nothing;
// another thread already on ctx, one query.
class ScopedContext {
 public:
  ScopedContext(const DriverApi& api, CUcontext ctx) {
    if (t_bound_context == ctx) return;
    CUcontext prev = nullptr;
    check(api.cuCtxGetCurrent(&prev), "cuCtxGetCurrent");
    if (prev == ctx) return;
    check(api.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    restore_api_ = &api;
    prev_ = prev;
  }
  ~ScopedContext() {
    if (restore_api_) restore_api_->cuCtxSetCurrent(prev_);
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const DriverApi* restore_api_ = nullptr;
  CUcontext prev_ = nullptr;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int ordinal, size_t page_bytes)
      : api_(cuda::driver()),
        ordinal_(ordinal),
        device_(open_device(api_, ordinal)),
        ctx_(api_, device_),
        granularity_(query_granularity()),
        page_bytes_(page_bytes) {
    if (page_bytes_ == 0 || page_bytes_ % granularity_ != 0) {
      throw Error(Error::Kind::Config,
                  "page size " + std::to_string(page_bytes_) +
                      " bytes is not a positive multiple of the CUDA VMM granularity " +
                      std::to_string(granularity_) + " bytes of " + device_name(ordinal_))
          .with("page_bytes", static_cast<int64_t>(page_bytes_))
          .with("granularity", static_cast<int64_t>(granularity_));
    }
  }

  ~CudaBackend() override {
    // Events still held are destroyed; errors are ignored (destructors must not throw).
    try {
      ScopedContext sc(api_, ctx_.get());
      for (auto& [id, ev] : fences_) api_.cuEventDestroy(ev);
    } catch (...) {
    }
  }

  size_t granularity() const override { return granularity_; }
  size_t page_bytes() const override { return page_bytes_; }
  DeviceId device() const override { return DeviceId{2, ordinal_}; }  // kDLCUDA
  std::string name() const override { return "cuda"; }

  uintptr_t reserve(size_t bytes) override {
    ScopedContext sc(api_, ctx_.get());
    CUdeviceptr va = 0;
    check(api_.cuMemAddressReserve(&va, bytes, 0, 0, 0), "cuMemAddressReserve", {{"bytes", bytes}});
    return static_cast<uintptr_t>(va);
  }

  void release_va(uintptr_t va, size_t bytes) override {
    ScopedContext sc(api_, ctx_.get());
    check(api_.cuMemAddressFree(va, bytes), "cuMemAddressFree", {{"va", va}, {"bytes", bytes}});
  }

  PageHandle create_page() override {
    ScopedContext sc(api_, ctx_.get());
    CUmemAllocationProp prop = page_prop(ordinal_);
    CUmemGenericAllocationHandle handle = 0;
    CUresult r = api_.cuMemCreate(&handle, page_bytes_, &prop, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      throw Error(Error::Kind::OutOfPages, "cuMemCreate: " + device_name(ordinal_) +
                                               " has no memory left for a page of " +
                                               std::to_string(page_bytes_) + " bytes")
          .with("call", std::string("cuMemCreate"))
          .with("code", static_cast<int64_t>(r))
          .with("page_bytes", static_cast<int64_t>(page_bytes_));
    }
    check(r, "cuMemCreate", {{"bytes", page_bytes_}, {"ordinal", uint64_t(ordinal_)}});
    pages_live_.fetch_add(1, std::memory_order_relaxed);
    return static_cast<PageHandle>(handle);
  }

  void destroy_page(PageHandle page) override {
    ScopedContext sc(api_, ctx_.get());
    check(api_.cuMemRelease(page), "cuMemRelease", {{"handle", page}});
    pages_live_.fetch_sub(1, std::memory_order_relaxed);
  }

  void map(uintptr_t va, PageHandle page) override {
    ScopedContext sc(api_, ctx_.get());
    check(api_.cuMemMap(va, page_bytes_, 0, page, 0), "cuMemMap",
          {{"va", va}, {"bytes", page_bytes_}, {"handle", page}});
  }

  void set_access(uintptr_t va, size_t bytes) override {
    ScopedContext sc(api_, ctx_.get());
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = ordinal_;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(api_.cuMemSetAccess(va, bytes, &desc, 1), "cuMemSetAccess",
          {{"va", va}, {"bytes", bytes}});
  }

  void unmap(uintptr_t va, size_t bytes) override {
    ScopedContext sc(api_, ctx_.get());
    check(api_.cuMemUnmap(va, bytes), "cuMemUnmap", {{"va", va}, {"bytes", bytes}});
  }

  // Device memory is resident once mapped: nothing to fault in.
  void prefault(uintptr_t /*va*/, size_t /*bytes*/) noexcept override {}

  // Copies for prefix sharing and swap: stream-ordered; the cache fences after them.
  // cuMemcpyAsync with unified addressing covers device-to-device on any VMM mapping.
  void copy(uintptr_t dst, uintptr_t src, size_t bytes, uintptr_t stream) override {
    ScopedContext sc(api_, ctx_.get());
    check(api_.cuMemcpyAsync(dst, src, bytes, reinterpret_cast<CUstream>(stream)), "cuMemcpyAsync",
          {{"dst", dst}, {"src", src}, {"bytes", bytes}, {"stream", stream}});
  }

  void copy_to_host(void* dst, uintptr_t src, size_t bytes, uintptr_t stream) override {
    ScopedContext sc(api_, ctx_.get());
    check(api_.cuMemcpyDtoHAsync(dst, src, bytes, reinterpret_cast<CUstream>(stream)),
          "cuMemcpyDtoHAsync",
          {{"dst", reinterpret_cast<uintptr_t>(dst)},
           {"src", src},
           {"bytes", bytes},
           {"stream", stream}});
  }

  void copy_from_host(uintptr_t dst, const void* src, size_t bytes, uintptr_t stream) override {
    ScopedContext sc(api_, ctx_.get());
    check(api_.cuMemcpyHtoDAsync(dst, src, bytes, reinterpret_cast<CUstream>(stream)),
          "cuMemcpyHtoDAsync",
          {{"dst", dst},
           {"src", reinterpret_cast<uintptr_t>(src)},
           {"bytes", bytes},
           {"stream", stream}});
  }

  // Page-locked, so the copies above are asynchronous DMA (pageable memory would make them
  // synchronous staging copies). nullptr on failure: the swap store reports SwapSpace.
  void* alloc_host(size_t bytes) override {
    ScopedContext sc(api_, ctx_.get());
    void* p = nullptr;
    return api_.cuMemHostAlloc(&p, bytes, 0) == CUDA_SUCCESS ? p : nullptr;
  }

  // Called from destructors: never throws. Tried twice (a transient failure would leak the pinned
  // block for the life of the process); a second failure leaks it, nothing worse.
  void free_host(void* ptr) override {
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        ScopedContext sc(api_, ctx_.get());
        if (api_.cuMemFreeHost(ptr) == CUDA_SUCCESS) return;
      } catch (...) {
      }
    }
  }

  void bind_thread() override {
    if (t_bound_context == ctx_.get()) return;  // once per thread, not per prefetch job
    CUcontext current = nullptr;
    check(api_.cuCtxGetCurrent(&current), "cuCtxGetCurrent");
    if (current != ctx_.get()) check(api_.cuCtxSetCurrent(ctx_.get()), "cuCtxSetCurrent");
    // Under a global-mode capture on another thread (torch.cuda.graph's default), a VMM call or
    // event query from a thread in global mode fails and invalidates that capture; in relaxed mode
    // this thread's calls are allowed and leave it alone. Its mapping is not stream work: a graph
    // captured meanwhile does not depend on it.
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    check(api_.cuThreadExchangeStreamCaptureMode(&mode), "cuThreadExchangeStreamCaptureMode");
    t_bound_context = ctx_.get();
  }

  uint64_t record_fence(uintptr_t stream) override {
    ScopedContext sc(api_, ctx_.get());
    CUevent ev = nullptr;
    check(api_.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    CUresult r = api_.cuEventRecord(ev, reinterpret_cast<CUstream>(stream));
    if (r != CUDA_SUCCESS) {
      api_.cuEventDestroy(ev);  // leave nothing behind on failure
      check(r, "cuEventRecord", {{"stream", stream}});
    }
    std::lock_guard<std::mutex> lock(fences_mu_);
    uint64_t id = next_fence_++;
    fences_.emplace(id, ev);
    return id;
  }

  bool fence_done(uint64_t fence) override {
    if (fence == 0) return true;
    CUevent ev = lookup(fence);
    ScopedContext sc(api_, ctx_.get());
    CUresult r = api_.cuEventQuery(ev);
    if (r == CUDA_ERROR_NOT_READY) return false;
    check(r, "cuEventQuery", {{"event", reinterpret_cast<uintptr_t>(ev)}});
    return true;
  }

  void fence_wait(uint64_t fence) override {
    if (fence == 0) return;
    CUevent ev = lookup(fence);
    ScopedContext sc(api_, ctx_.get());
    check(api_.cuEventSynchronize(ev), "cuEventSynchronize",
          {{"event", reinterpret_cast<uintptr_t>(ev)}});
  }

  void fence_release(uint64_t fence) override {
    if (fence == 0) return;
    CUevent ev = nullptr;
    {
      std::lock_guard<std::mutex> lock(fences_mu_);
      auto it = fences_.find(fence);
      if (it == fences_.end()) return;  // releasing twice is harmless
      ev = it->second;
    }
    ScopedContext sc(api_, ctx_.get());
    // On failure the fence stays known, so the caller (who still holds it) can release it again.
    check(api_.cuEventDestroy(ev), "cuEventDestroy", {{"event", reinterpret_cast<uintptr_t>(ev)}});
    std::lock_guard<std::mutex> lock(fences_mu_);
    fences_.erase(fence);
  }

  void synchronize() override {
    ScopedContext sc(api_, ctx_.get());
    check(api_.cuCtxSynchronize(), "cuCtxSynchronize");
  }

  uintptr_t create_stream() override {
    ScopedContext sc(api_, ctx_.get());
    CUstream stream = nullptr;
    check(api_.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    return reinterpret_cast<uintptr_t>(stream);
  }

  void destroy_stream(uintptr_t stream) override {
    if (stream == 0) return;
    ScopedContext sc(api_, ctx_.get());
    check(api_.cuStreamDestroy(reinterpret_cast<CUstream>(stream)), "cuStreamDestroy",
          {{"stream", stream}});
  }

  void zero(uintptr_t va, size_t bytes, uintptr_t stream) override {
    ScopedContext sc(api_, ctx_.get());
    check(api_.cuMemsetD8Async(va, 0, bytes, reinterpret_cast<CUstream>(stream)), "cuMemsetD8Async",
          {{"va", va}, {"bytes", bytes}, {"stream", stream}});
  }

  // Pages created and not yet destroyed. A page destroyed while still mapped keeps its memory until
  // unmapped, which the cache never does (it unmaps first), so this is what the driver holds.
  int64_t committed_bytes() const override {
    return pages_live_.load(std::memory_order_relaxed) * static_cast<int64_t>(page_bytes_);
  }

  // Every page's memory went with cuMemRelease (the cache destroys all pages first): nothing else
  // holds any.
  void release_physical() noexcept override {}

  // Huge pages are a host-memory notion.
  int64_t huge_page_bytes() const override { return -1; }

  // Nothing to keep per cache: an access outside the mapped rows is an illegal-address error the
  // driver reports itself.
  std::unique_ptr<CacheRegistration> register_cache(
      const CacheGeometry& /*geometry*/, const std::vector<uintptr_t>& /*bases*/) override {
    return nullptr;
  }

 private:
  size_t query_granularity() {
    CUmemAllocationProp prop = page_prop(ordinal_);
    size_t g = 0;
    check(api_.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity", {{"ordinal", uint64_t(ordinal_)}});
    return g;
  }

  // The event behind a fence id. Ids are used by one owner at a time (the cache, under its lock),
  // so the event cannot be destroyed between this lookup and its use.
  CUevent lookup(uint64_t fence) {
    std::lock_guard<std::mutex> lock(fences_mu_);
    auto it = fences_.find(fence);
    if (it == fences_.end()) {
      throw Error(Error::Kind::Driver,
                  "fence " + std::to_string(fence) + " is unknown (released already?)")
          .with("fence", static_cast<int64_t>(fence));
    }
    return it->second;
  }

  const DriverApi& api_;
  const int ordinal_;
  const CUdevice device_;
  PrimaryContext ctx_;
  const size_t granularity_;
  const size_t page_bytes_;
  std::atomic<int64_t> pages_live_{0};
  std::mutex fences_mu_;  // free() records fences while the prefetch thread may poll others
  std::unordered_map<uint64_t, CUevent> fences_;
  uint64_t next_fence_ = 1;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int ordinal, size_t page_bytes) {
  return std::make_unique<CudaBackend>(ordinal, page_bytes);
}

size_t release_unused_primary_contexts() {
  const std::string why = cuda::driver_unavailable_reason();
  return why.empty() ? PrimaryContexts::release_unused(cuda::driver()) : 0;
}

std::string cuda_unavailable_reason() {
  static const std::string prefix = "CUDA backend unavailable: ";  // callers add their own
  try {
    const DriverApi& api = cuda::driver();
    open_device(api, 0);
    return "";
  } catch (const std::exception& e) {
    std::string why = e.what();
    return why.rfind(prefix, 0) == 0 ? why.substr(prefix.size()) : why;
  }
}

}  // namespace vattention

#endif  // VATTENTION_WITH_CUDA
