// Scrubber: zeroes pages when they change owner (KVCacheConfig(scrub=True)).
//
// Why: a page a request receives may hold the previous owner's K/V: an idle slot hands its mapped
// pages to the next request (deferred reclamation), the pool recycles pages without clearing them,
// and fresh CUDA pages are uninitialised. Kernels that read only [0, seq_len) never see it; a
// kernel with padded reads, or a multi-tenant server, may.
//
// Where: at hand-out, after the page is mapped into its new owner's slot, so zeroing needs no extra
// mapping: in step()'s growth, in the prefetch thread (zero() without the cache mutex, on the range
// only it maps, before publishing), in alloc() for an idle slot's pages (the slot coordinator),
// and for the fresh part of a fork's partial page. A row that follows an engine's block table is
// not cleared in alloc(): its pages belong to blocks the engine may still hit in its prefix
// cache; a block's pages are cleared when the engine hands the block out fresh to a row
// (BlockTables), which covers everything a new request can read. Pages overwritten whole (swap-in's
// and ensure_private's copies) are not zeroed first. Host memory is cleared with memset; device
// memory with copies from a page of zeros in host memory (Backend::copy_from_host on the legacy
// default stream, which orders before later work on blocking streams; the cache's close() waits for
// that stream before the zeros go, in close()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/cache_feature.h"
#include "core/geometry.h"
#include "core/slot_mapper.h"

namespace vattention {

class Scrubber final : public CacheFeature {
 public:
  Scrubber(Backend& backend, const CacheGeometry& geometry, const SlotMapper& mapper);
  ~Scrubber() override;  // frees the zero page
  Scrubber(const Scrubber&) = delete;
  Scrubber& operator=(const Scrubber&) = delete;

  bool enabled() const { return enabled_; }
  void set_enabled(bool on) { enabled_ = on; }
  // With scrub on: zeroes page indices [from, to) of `slot` in every tensor (mapped, with access)
  // and counts them. Throws DriverError (nothing zeroed) if the zero page cannot be allocated.
  void scrub(int slot, size_t from, size_t to);
  // With scrub on and device memory: allocates the page of zeros. Throws DriverError.
  void prepare();
  // Zeroes [from, to) of `slot` in every tensor without counting; touches nothing but the zero
  // page (prepare() first), so it may run without the cache mutex on a range its caller alone maps.
  void zero(int slot, size_t from, size_t to) const;
  // With scrub on: zeroes the pages of `columns` at page index `page` of `slot` (an engine block's
  // fresh pages; a cache hit's pages beside them keep their content) and counts them.
  void scrub_columns(int slot, size_t page, const std::vector<size_t>& columns);
  // Counts pages zeroed by zero() (under the mutex).
  void count(size_t pages) { scrubbed_pages_ += pages; }

  void add_stats(Stats& out) const override;
  void close() override;  // frees the zero page (the caller waited for the legacy stream)

 private:
  Backend& backend_;
  const CacheGeometry& geo_;
  const SlotMapper& mapper_;
  bool enabled_ = false;
  void* zero_block_ = nullptr;  // device backends: page_bytes of zeros (alloc_host)
  uint64_t scrubbed_pages_ = 0;
};

}  // namespace vattention
