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
// and ensure_private's copies) are not zeroed first.
//
// How: Backend::zero (host: memset; CUDA: cuMemsetD8Async) on the stream of the call that hands
// the page out, so it is ordered before the new owner's kernels on that stream; the prefetch
// thread has no caller's stream, so it zeroes on a stream of the scrubber's own and waits for it
// before publishing.
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
  ~Scrubber() override;  // destroys its own stream
  Scrubber(const Scrubber&) = delete;
  Scrubber& operator=(const Scrubber&) = delete;

  bool enabled() const { return enabled_; }
  void set_enabled(bool on) { enabled_ = on; }
  // With scrub on: zeroes page indices [from, to) of `slot` in every tensor (mapped, with access)
  // on `stream` and counts them.
  void scrub(int slot, size_t from, size_t to, uintptr_t stream);
  // With scrub on, or `force` (the tile rule's zeroing by the prefetch thread): makes the
  // scrubber's own stream (under the cache mutex, before zero()).
  void prepare(bool force = false);
  // Zeroes [from, to) of `slot` in every tensor on the scrubber's own stream and waits for it,
  // without counting; touches no cache state (prepare() first), so it may run without the cache
  // mutex on a range its caller alone maps.
  void zero(int slot, size_t from, size_t to) const;
  // With scrub on: zeroes the pages of `columns` at page index `page` of `slot` (an engine block's
  // fresh pages; a cache hit's pages beside them keep their content) on `stream`; counts them.
  void scrub_columns(int slot, size_t page, const std::vector<size_t>& columns, uintptr_t stream);
  // Counts pages zeroed by zero() (under the mutex).
  void count(size_t pages) { scrubbed_pages_ += pages; }

  void add_stats(Stats& out) const override;
  void close() override;  // destroys its own stream (the cache synchronized the device first)

 private:
  Backend& backend_;
  const CacheGeometry& geo_;
  const SlotMapper& mapper_;
  // Zeroes [from, to) of `slot` in every tensor on `stream`.
  void zero_on(int slot, size_t from, size_t to, uintptr_t stream) const;

  bool enabled_ = false;
  uintptr_t own_stream_ = 0;  // prepare(): the prefetch thread's zeroing stream
  bool own_stream_ready_ = false;
  uint64_t scrubbed_pages_ = 0;
};

}  // namespace vattention
