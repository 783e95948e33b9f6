// KVCacheCore, scrubbing: zero pages when they change owner (KVCacheConfig(scrub=True), issue 12).
//
// Why: a page a request receives may hold the previous owner's K/V: an idle slot hands its mapped
// pages to the next request (deferred reclamation), the pool recycles pages without clearing them,
// and fresh CUDA pages are uninitialised. Kernels that read only [0, seq_len) never see it; a
// kernel with padded reads, or a multi-tenant server, may.
//
// Where: at hand-out, after the page is mapped into its new owner's slot, so zeroing needs no
// extra mapping: in grow() (step()), in the prefetch thread (zeroing without the cache lock, on the
// range only it maps, before publishing: see prefetch_slot), in
// alloc() for an idle slot's pages, and for the fresh part of fork()'s partial page. Pages that
// are overwritten whole (swap_in's copies, ensure_private's copies) are not zeroed first.
// Host memory is cleared with memset; device memory with a copy from a page of zeros in host
// memory (Backend::copy_from_host on the legacy default stream, which orders before later work
// on blocking streams; close() waits for it before freeing the zeros).
#include <cstring>

#include "kv_cache.h"

namespace vattention {

void KVCacheCore::set_scrub(bool on) {
  Lock lock(mu_);
  check_open();
  scrub_ = on;
}

void KVCacheCore::scrub_pages(int slot, size_t from, size_t to) {
  if (!scrub_ || to <= from) return;
  prepare_scrub();
  zero_pages(slot, from, to);
  scrubbed_pages_ += (to - from) * geo_.columns();
}

void KVCacheCore::prepare_scrub() {
  const bool host_memory = backend_->device().dl_device_type == 1;
  if (!scrub_ || host_memory || zero_block_ != nullptr) return;
  const size_t P = geo_.page_bytes;
  zero_block_ = backend_->alloc_host(P);
  if (zero_block_ == nullptr) {
    throw Error(Error::Kind::Driver, "scrub: could not allocate " + std::to_string(P) +
                                         " bytes of host memory for the zero page")
        .with("call", std::string("alloc_host"))
        .with("bytes", static_cast<int64_t>(P));
  }
  std::memset(zero_block_, 0, P);
}

void KVCacheCore::zero_pages(int slot, size_t from, size_t to) const {
  const size_t P = geo_.page_bytes;
  const bool host_memory = backend_->device().dl_device_type == 1;
  for (int t = 0; t < geo_.num_tensors(); ++t) {
    const uintptr_t va = page_va(t, slot, from);
    const size_t pages = (to - from) * geo_.index_pages(t);
    if (host_memory) {
      std::memset(reinterpret_cast<void*>(va), 0, pages * P);
    } else {
      for (size_t p = 0; p < pages; ++p) backend_->copy_from_host(va + p * P, zero_block_, P, 0);
    }
  }
}

void KVCacheCore::scrub_stats(std::vector<std::pair<std::string, int64_t>>& out) const {
  out.emplace_back("scrub", scrub_ ? 1 : 0);
  out.emplace_back("scrubbed_pages", static_cast<int64_t>(scrubbed_pages_));
}

}  // namespace vattention
