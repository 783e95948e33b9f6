// BlockCoordinator: the cache whose pages are named by an engine's block ids.
//
// A block-based engine (vLLM) stays the admission authority: its scheduler decides which request
// runs, and its block manager which block holds which tokens and which blocks a new request hits
// in its prefix cache. The cache stays the memory authority: a step records each listed row's
// block table and maps it (block_tables.h), so a prefix-cache hit maps the block's pages again
// (zero copy) and a block's pages outlive its row while the engine may still hit it. The engine
// shares and moves pages through its tables: fork, share_prefix, ensure_private and swap are
// refused (Config). Its parts: the shared ones (kv_cache.h) plus BlockTables, which also keeps
// its rows' block records true through SlotMemory's RowObserver calls.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/block_tables.h"
#include "core/kv_cache.h"

namespace vattention {

class BlockCoordinator final : public KVCacheCore {
 public:
  BlockCoordinator(std::unique_ptr<Backend> backend, const CacheGeometry& geometry,
                   const CacheOptions& options);
  ~BlockCoordinator() override;

  bool try_step(const std::vector<int64_t>& lens) override;
  // Rows may unmap tails and fresh blocks may take pages from idle rows, so this waits for the
  // one slot the prefetch thread may be mapping (rule R).
  void step(const std::vector<int64_t>& lens, const std::vector<BlockUpdate>& updates,
            uintptr_t stream) override;
  BlockIds block_table(int slot) const override;
  // Waits only when the slot the prefetch thread maps was freed meanwhile (it may unmap that
  // row: rule R), as alloc() does; then BlockTables::release.
  size_t release_blocks(const std::vector<int64_t>& ids) override;

  // Config: the engine shares and moves pages through its block tables.
  int fork(int src, int64_t num_tokens, uintptr_t stream) override;
  void share_prefix(int src, int dst, int64_t num_tokens, uintptr_t stream) override;
  size_t ensure_private(int slot, int64_t start_token, uintptr_t stream) override;
  int64_t swap_out(int slot, uintptr_t stream) override;
  int swap_in(int64_t handle, uintptr_t stream) override;
  void swap_drop(int64_t handle) override;
  void set_swap_budget(int64_t budget_bytes) override;

 private:
  int take_slot(const BlockIds* hits, uintptr_t stream) override;
  size_t pages_beyond_rows() const override;
  // Takes the mutex as every call does, then throws Config for `call` (fork, swap_in, ...).
  [[noreturn]] void refuse(const char* call) const;

  BlockTables tables_;
};

}  // namespace vattention
