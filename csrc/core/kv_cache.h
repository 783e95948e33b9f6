// KVCacheCore: virtual KV tensors whose physical pages are mapped on demand, per slot.
//
// Why: attention kernels want a dense [B, S, H, D] cache; serving wants memory proportional to the
// tokens really held. The cache reserves each tensor's full virtual range once (addresses never
// move, so tensors and CUDA graphs stay valid) and maps physical pages at the end of a slot's row
// as its sequence grows (DESIGN.md section 3).
//
// The coordinator: it owns the mutex, the slots and the parts below, and runs each public call as
// one transaction over them; the parts each own one concept (docs/architecture.md):
//   SlotMapper    addresses and reservations; maps/unmaps runs (no cache state: runs unlocked)
//   PagePool      physical pages, budget, references        SlotTable   slots and their checks
//   SlotMemory    a slot's mapped range, record and counts  PageSupply  where pages come from
//   PrefetchGate  the range the prefetch thread maps unlocked (rule R), and the waits for it
//   Scrubber, StagingPage, WindowRelease, PrefixSharing, SwapManager, BlockPages: features,
//   registered as CacheFeature so alloc(), stats(), check_invariants() and close() call none of
//   them by name; BlockTables: rows that follow an engine's block tables.
//
// Transactions: step() validates everything before touching state, gets all the pages it needs
// before mapping any, and undoes its own mappings if a backend call fails part-way. Running out of
// pages raises Error(OutOfPages) with nothing changed; capacity() says beforehand, mapping nothing.
//
// Reclamation: free() keeps a slot's pages mapped ("idle"); alloc() prefers idle slots that hold
// pages, so a new request inherits mapped memory for free. Pages of idle slots go back to the pool
// only when another slot needs them (least recently freed first), on reclaim(), or at once under
// the "eager" policy. A slot freed at step N is unmapped only after the fence recorded by free()
// has completed: unmapping is not stream-ordered on CUDA.
//
// Thread-safety and lock order: every public method may be called from any thread. mu_ guards all
// state; the prefetch thread takes mu_ per slot it maps and makes the driver calls themselves
// without it (prefetch_gate.h). Order: Prefetcher::mu_ is never held while taking mu_, and mu_ is
// never held while waiting on the prefetcher. The backend's own locks are leaves below mu_.
#pragma once

#include <climits>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/backend.h"
#include "core/block_pages.h"
#include "core/block_tables.h"
#include "core/cache_feature.h"
#include "core/cache_parts.h"
#include "core/geometry.h"
#include "core/page_pool.h"
#include "core/page_supply.h"
#include "core/prefetch_gate.h"
#include "core/prefetcher.h"
#include "core/prefix_sharing.h"
#include "core/scrubber.h"
#include "core/slot_mapper.h"
#include "core/slot_memory.h"
#include "core/slot_table.h"
#include "core/staging_page.h"
#include "core/stats.h"
#include "core/swap_manager.h"
#include "core/window_release.h"

namespace vattention {

// What a set of lengths would cost, from capacity(): all counts are physical pages.
struct Capacity {
  size_t pages_needed = 0;  // pages step(lens) must map, plus new requests' pages
  size_t pages_free = 0;  // in the pool's free list
  size_t pages_creatable = 0;  // creatable within the budget (SIZE_MAX: no budget)
  size_t pages_reclaimable = 0;  // idle slots, look-ahead beyond lengths, window pages to release
  size_t pages_short = 0;  // what is missing: 0 when step(lens) would not run out
};

class KVCacheCore {
 public:
  static constexpr int64_t kUnlisted = SlotTable::kUnlisted;  // "leave this slot alone" in lens

  KVCacheCore(std::unique_ptr<Backend> backend, const CacheGeometry& geometry, int64_t budget_bytes,
              ReclaimPolicy policy, int64_t lookahead_tokens);
  ~KVCacheCore();
  KVCacheCore(const KVCacheCore&) = delete;
  KVCacheCore& operator=(const KVCacheCore&) = delete;

  const CacheGeometry& geometry() const { return geo_; }
  Backend& backend() { return *backend_; }
  // Base address of virtual tensor t (geometry.h numbers them). Valid until destruction.
  uintptr_t tensor_base(int t) const { return mapper_.tensor_base(t); }
  bool closed() const;

  // ---- slots and steps ---------------------------------------------------------------------
  // Returns a slot for a new request: an idle slot holding the most pages, else a free one.
  // With `hits` (engine blocks: the request's leading cache hits, one list per group), the idle
  // slot whose row already maps the longest run of them comes first (BlockTables::kept_hits).
  // Throws InvalidSlot when every slot is active, Config for bad hits (nothing changed).
  int alloc(const std::vector<std::vector<int64_t>>* hits = nullptr);
  // Ends the request in `slot`. Records a fence on `stream` (0 = legacy default stream) so the
  // slot's pages are unmapped only after work already queued there has finished.
  void free(int slot, uintptr_t stream);
  // The decode hot path: records `lens` if every listed slot is already backed and nothing else
  // is due (no page to map or release, no eager reclaim); else returns false having changed
  // nothing, as it does when the lock is busy (so a caller can drop the GIL and call step()).
  bool try_step(const std::vector<int64_t>& lens);
  // Makes every listed slot back at least its length. lens has max_batch entries; kUnlisted leaves
  // a slot alone. Waits for the prefetch thread only for a slot it is mapping now. All or nothing.
  void step(const std::vector<int64_t>& lens, uintptr_t stream);
  // The same on a cache whose pages are named by engine blocks (use_blocks): `updates` change the
  // listed rows' block tables, and every listed row maps its table up to its length
  // (block_tables.h says what happens to whose pages; errors as there).
  void step(const std::vector<int64_t>& lens, const std::vector<BlockUpdate>& updates,
            uintptr_t stream);
  // Names pages by an engine's block ids [0, num_blocks) from now on; `cache`: a block keeps its
  // pages after its last mapping, until the engine hands the id out fresh (its prefix cache may
  // hit it meanwhile). Only before the first alloc(). Throws Config.
  void use_blocks(int64_t num_blocks, bool cache);
  // The engine's block table of `slot`, one list per KV cache group (kNoBlock: the null block).
  std::vector<std::vector<int64_t>> block_table(int slot) const;
  // What step(lens), plus new requests of `new_lens` tokens each, would need and could get;
  // maps nothing, changes nothing (the same accounting step() uses).
  Capacity capacity(const std::vector<int64_t>& lens, const std::vector<int64_t>& new_lens) const;
  // Queues background mapping of each listed slot up to its length + lookahead (-1 = configured).
  void prefetch(const std::vector<int64_t>& lens, int64_t lookahead_tokens);
  // Joins outstanding prefetch work; rethrows a background error.
  void wait();

  // ---- physical memory ---------------------------------------------------------------------
  // Ensures the pool holds at least `bytes` of pages (rounded up). All-or-nothing.
  void reserve(size_t bytes);
  // Unmaps every idle slot's pages back to the pool. Returns pages unmapped.
  size_t reclaim();
  // Destroys free pages until the pool holds at most keep_bytes. Returns pages destroyed.
  size_t shrink(size_t keep_bytes);
  // Changes the budget (-1 = none). Lowering it shrinks free pages, reclaims idle ones and trims
  // look-ahead until under budget; returns the bytes still over it (active tokens need preemption).
  // On a driver error the old budget is restored; pages already reclaimed stay in the pool.
  int64_t set_memory_budget(int64_t budget_bytes);
  void set_lookahead(int64_t tokens);
  // Zero every page a request receives (scrubber.h says why and what it costs).
  void set_scrub(bool on);

  // ---- queries ------------------------------------------------------------------------------
  int64_t mapped_tokens(int slot) const;
  int64_t seq_len(int slot) const;
  std::vector<int> active_slots() const;
  Stats stats() const;
  // Checks internal invariants (page accounting, refcounts); returns "" or a description.
  std::string check_invariants() const;

  // ---- prefix sharing, swap and eviction (prefix_sharing.h, swap_manager.h) ----------------
  // A slot's page indices [0, Slot::shared_pages) are READ-ONLY by contract: they may be mapped by
  // other slots or kept by swap handles. Writing there (or appending after rewinding below them)
  // needs ensure_private() first. `stream` orders the copies; see Backend::copy.
  //
  // New active slot whose tokens [0, num_tokens) (-1: src's seq_len) equal src's: full pages are
  // shared, the partial last page is copied. Throws InvalidSlot (src not active, no slot free),
  // SequenceTooLong (num_tokens outside [0, seq_len(src)]), OutOfPages (nothing changed).
  int fork(int src, int64_t num_tokens, uintptr_t stream);
  // The same into dst, which must be active and fresh (seq_len 0, as after alloc()); dst's own
  // pages go back to the pool. Afterwards seq_len(dst) == num_tokens.
  void share_prefix(int src, int dst, int64_t num_tokens, uintptr_t stream);
  // Replaces every shared page of `slot` from the page holding start_token on with a private copy,
  // so those tokens may be rewritten. Returns the number of pages copied. All-or-nothing.
  size_t ensure_private(int slot, int64_t start_token, uintptr_t stream);
  // Saves the slot's pages and frees the slot; returns a handle (swap_manager.h).
  int64_t swap_out(int slot, uintptr_t stream);
  // Restores a handle into a free (else least recently freed idle) slot, bit-identical.
  int swap_in(int64_t handle, uintptr_t stream);
  void swap_drop(int64_t handle);
  void set_swap_budget(int64_t budget_bytes);  // -1 = none; never drops existing handles
  // Active slots to preempt, in order, until their freed pages reach bytes_needed.
  std::vector<int> pick_victims(size_t bytes_needed) const;
  // Per layer, the first token of `slot` still backed (window_release.h).
  std::vector<int64_t> window_starts(int slot) const;

  // Unmaps everything, destroys pages, stops the prefetch thread. The virtual reservations live on
  // (PROT_NONE) until the object is destroyed, so a tensor outliving close() faults, never aliases.
  void close();

 private:
  using Lock = std::unique_lock<std::mutex>;

  // The prologue of every call: the mutex, then "open?" and a prefetch-thread error to rethrow.
  // With exclusive, first joins queued prefetch work and settles the flight, for calls that may
  // map, unmap or pick any slot (rule R, prefetch_gate.h).
  Lock enter(bool exclusive = false);
  void check_open() const;
  void rethrow_background_error();
  void record_background_error(std::exception_ptr error);
  // Checks state and input, and lists the slots whose pages must grow for `lens`.
  std::vector<Growth> plan_step(const std::vector<int64_t>& lens);
  // Engine blocks: true when the page indices `len` tokens need are all named by s's table.
  bool named(const Slot& s, int64_t len) const;
  // Maps the growth plan (all or nothing). Throws OutOfPages/Driver with state unchanged.
  void grow(const std::vector<Growth>& plan, bool from_prefetch);
  // The prefetch thread: plan one slot under the lock, map without it, publish under it.
  // Returns false when the job must stop (closed, error, pool dry).
  void run_prefetch(const Prefetcher::Job& job);
  bool prefetch_slot(int slot, int64_t target_tokens);
  // Creates up to n pages for the pool with mu_ released (held on entry and on return).
  // Returns false when the job must stop (a driver error, now in background_error_).
  bool create_unlocked(Lock& lock, size_t n);
  uint64_t driver_calls() const;
  // Throws Config for `call` (fork, swap, ...) on a cache whose pages are named by engine blocks.
  void refuse_with_blocks(const char* call) const;

  const CacheGeometry geo_;
  std::unique_ptr<Backend> backend_;
  SlotMapper mapper_;
  PagePool pool_;
  SlotTable slots_;
  CacheCounters counters_;
  PrefetchGate gate_;
  BlockPages blocks_;
  SlotMemory memory_;
  PageSupply supply_;
  Scrubber scrubber_;
  StagingPage staging_;
  CacheParts parts_;
  WindowRelease windows_;
  PrefixSharing sharing_;
  SwapManager swap_;
  BlockTables tables_;
  std::vector<CacheFeature*> features_;  // in registration order
  std::unique_ptr<CacheWatch> watch_;  // the backend's per-cache watch (host: fault report)
  mutable std::mutex mu_;
  int64_t lookahead_tokens_ = 0;
  std::exception_ptr background_error_;
  bool closed_ = false;
  std::unique_ptr<Prefetcher> prefetcher_;  // last: its thread uses everything above
};

}  // namespace vattention
