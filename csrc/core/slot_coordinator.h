// SlotCoordinator: the cache whose slots own their pages.
//
// The cache decides what each row maps: step(lens) grows every listed row to its length with
// pages from the supply (free list, budget, idle rows, look-ahead), in parallel with the prefetch
// thread, which maps other rows outside the lock (rule R, prefetch_gate.h). Rows share pages
// through fork/share_prefix (copy-on-write by contract: a read-only prefix) and leave to host
// memory through swap. Its parts: the shared ones (kv_cache.h) plus PrefixSharing, SwapManager
// and the StagingPage both copy through.
#pragma once

#include <memory>
#include <vector>

#include "core/kv_cache.h"
#include "core/prefix_sharing.h"
#include "core/staging_page.h"
#include "core/swap_manager.h"

namespace vattention {

class SlotCoordinator final : public KVCacheCore {
 public:
  SlotCoordinator(std::unique_ptr<Backend> backend, const CacheGeometry& geometry,
                  const CacheOptions& options);
  ~SlotCoordinator() override;

  bool try_step(const std::vector<int64_t>& lens) override;
  // Waits for the prefetch thread only for a slot it is mapping now; `updates` must be empty.
  void step(const std::vector<int64_t>& lens, const std::vector<BlockUpdate>& updates,
            uintptr_t stream) override;
  BlockIds block_table(int slot) const override;  // always empty
  // Config: there are no engine blocks to release.
  size_t release_blocks(const std::vector<int64_t>& ids) override;

  int fork(int src, int64_t num_tokens, uintptr_t stream) override;
  void share_prefix(int src, int dst, int64_t num_tokens, uintptr_t stream) override;
  size_t ensure_private(int slot, int64_t start_token, uintptr_t stream) override;
  int64_t swap_out(int slot, uintptr_t stream) override;
  int swap_in(int64_t handle, uintptr_t stream) override;
  void swap_drop(int64_t handle) override;
  void set_swap_budget(int64_t budget_bytes) override;

 private:
  int take_slot(const BlockIds* hits, uintptr_t stream) override;
  size_t pages_beyond_rows() const override { return 0; }
  // The prologue of calls that may map, unmap or pick any slot: joins queued prefetch work and
  // settles the flight (rule R), then takes the mutex as every call does.
  Lock enter_exclusive();
  // Maps the growth plan (all or nothing), zeroing on `stream` with scrub on. Throws
  // OutOfPages/Driver with state unchanged.
  void grow(const std::vector<Growth>& plan, uintptr_t stream);
  // Takes the mutex as every call does, then throws Config for `call` (release_blocks).
  [[noreturn]] void refuse(const char* call) const;

  StagingPage staging_;
  PrefixSharing sharing_;
  SwapManager swap_;
};

}  // namespace vattention
