// SwapManager: swapping slots to host memory.
//
// Why swap pages and not tokens: a slot's memory is whole pages in every tensor, so the cheapest
// faithful copy is page by page; swap-in maps pages back in one run and copies them,
// bit-identical, into a possibly different slot (addresses differ, contents do not).
//
// Shared pages are swapped by reference: while another active slot maps a page, swapping it out
// frees no memory, so the handle keeps a pool reference instead of a copy. A page whose only
// holders are handles (or idle slots) is copied to host exactly once, at the next swap_out, and
// every handle referring to it then shares that one host buffer.
//
// Ordering (CUDA): copies are stream-ordered; swap_out waits on a fence on the caller's stream
// before it unmaps the slot (unmapping is not stream-ordered), swap_in before it frees host
// buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/cache_feature.h"
#include "core/cache_parts.h"
#include "core/staging_page.h"
#include "core/swap_store.h"

namespace vattention {

class SwapManager final : public CacheFeature {
 public:
  SwapManager(CacheParts& parts, StagingPage& staging)
      : parts_(parts), staging_(staging), store_(parts.backend, parts.geo.page_bytes) {}

  // Saves the active slot's pages [0, read_pages(seq_len)) and frees the slot (its pages are
  // unmapped at once). Throws SwapSpace (nothing changed) when the swap budget is too small.
  int64_t swap_out(int slot, uintptr_t stream);
  // Restores a handle into a fresh slot (SlotTable::pick_fresh), bit-identical, with the same
  // seq_len and read-only prefix. Consumes the handle. OutOfPages/InvalidSlot: nothing changed.
  int swap_in(int64_t handle, uintptr_t stream);
  // Discards a handle: its host memory and device references go.
  void drop(int64_t handle);
  void set_budget(int64_t budget_bytes);  // -1 = none; never drops existing handles

  void add_stats(Stats& out) const override;
  std::string check(std::map<PageHandle, uint32_t>& seen) const override;  // device references
  void close() override;  // host buffers go; device references die with the pool

 private:
  void copy_page_to_host(PageHandle page, void* dst, uintptr_t stream);

  CacheParts& parts_;
  StagingPage& staging_;
  SwapStore store_;
  uint64_t swap_out_pages_ = 0;  // pages copied to host by swap_out (each page once)
  uint64_t swap_in_pages_ = 0;  // pages copied back from host by swap_in
};

}  // namespace vattention
