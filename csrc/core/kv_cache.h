// KVCacheCore: virtual KV tensors whose physical pages are mapped on demand, per slot.
//
// Why: attention kernels want a dense [B, S, H, D] cache; serving wants memory proportional to the
// tokens really held. The cache reserves each tensor's full virtual range once (addresses never
// move, so tensors and CUDA graphs stay valid) and maps physical pages at the end of a slot's row
// as its sequence grows.
//
// Two modes, one coordinator class each, chosen once by make_cache() (docs/architecture.md):
//   SlotCoordinator   pages owned by slots: the cache decides what a row maps (step(lens)), and
//                     rows share pages by fork/share_prefix or leave by swap (slot_coordinator.h)
//   BlockCoordinator  pages named by an engine's block ids: a row maps its block table, and a
//                     prefix-cache hit maps a block's pages again (block_coordinator.h)
// This class is the cache's interface and the calls both modes run the same way; it owns the
// mutex and the parts both modes share:
//   SlotMapper    addresses and reservations; maps/unmaps runs (no cache state: runs unlocked)
//   PagePool      physical pages, budget, references        SlotTable   slots and their checks
//   SlotMemory    what each row maps (the one writer)        PageSupply  where pages come from
//   PrefetchGate  the range the prefetch thread maps unlocked (rule R), and the waits for it
//   WindowRelease, Scrubber: shared features; each coordinator adds its own and registers them
//   as CacheFeature, so stats(), check_invariants() and close() call none of them by name.
//
// Transactions: a step validates everything before touching state, gets all the pages it needs
// before mapping any, and undoes its own mappings if a backend call fails part-way. Running out of
// pages raises Error(OutOfPages) with nothing changed; capacity() says beforehand, mapping nothing.
//
// Reclamation: free() keeps a slot's pages mapped ("idle"); alloc() prefers idle slots that hold
// pages, so a new request inherits mapped memory for free. Pages of idle slots go back to the pool
// only when another slot needs them (least recently freed first), on reclaim(), or at once under
// the "eager" policy. What a slot maps when free() runs is unmapped only after the fence free()
// recorded has completed, also once alloc() handed the slot to a new request: unmapping is not
// stream-ordered on CUDA.
//
// Elastic memory: set_memory_budget() caps the pool (trimming free, idle and look-ahead pages),
// release_blocks() hands the pages of the blocks an engine's scheduler evicted back to the pool,
// and the prefetch thread keeps a headroom of free pages created (tune(): headroom_bytes) so that
// a step takes pages instead of creating them; stats() says what creating them cost where.
//
// Thread-safety and lock order: every public method may be called from any thread. The guard's
// mutex guards all state; the prefetch thread takes it per slot it maps and makes the driver calls
// themselves without it (prefetch_gate.h). Order: Prefetcher::mu_ is never held while taking the
// cache mutex, and the cache mutex is never held while waiting on the prefetcher. The backend's
// own locks are leaves below it.
#pragma once

#include <climits>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/background_mapper.h"
#include "core/block_update.h"
#include "core/cache_feature.h"
#include "core/cache_guard.h"
#include "core/cache_parts.h"
#include "core/geometry.h"
#include "core/page_pool.h"
#include "core/page_supply.h"
#include "core/prefetch_gate.h"
#include "core/prefetcher.h"
#include "core/scrubber.h"
#include "core/slot_mapper.h"
#include "core/slot_memory.h"
#include "core/slot_table.h"
#include "core/stats.h"
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

// How a cache is built; num_blocks picks the mode.
struct CacheOptions {
  int64_t budget_bytes = PagePool::kNoBudget;  // physical memory for pages (-1: no cap)
  ReclaimPolicy policy = ReclaimPolicy::Deferred;
  int64_t lookahead_tokens = 0;  // prefetch beyond the lengths asked for
  // > 0: pages are named by an engine's block ids [0, num_blocks) (BlockCoordinator); 0: pages
  // are owned by slots (SlotCoordinator).
  int64_t num_blocks = 0;
  // With num_blocks: a block keeps its pages after its last mapping, until the engine hands the
  // id out fresh (its prefix cache may hit it meanwhile).
  bool block_cache = false;
};

// One list of block ids per KV cache group (alloc's hits; kNoBlock: the engine's null block).
using BlockIds = std::vector<std::vector<int64_t>>;

// Settings a cache may change at run time (tune()); an unset one stays as it is.
struct Tuning {
  std::optional<int64_t> lookahead_tokens;  // prefetch beyond the lengths asked for (>= 0)
  std::optional<bool> scrub;  // zero every page a request receives (scrubber.h)
  // Bytes of created-but-free pages the prefetch thread keeps ready (rounded up to pages), within
  // the memory budget; 0: none.
  std::optional<int64_t> headroom_bytes;
};

class KVCacheCore {
 public:
  static constexpr int64_t kUnlisted = SlotTable::kUnlisted;  // "leave this slot alone" in lens

  virtual ~KVCacheCore();
  KVCacheCore(const KVCacheCore&) = delete;
  KVCacheCore& operator=(const KVCacheCore&) = delete;

  const CacheGeometry& geometry() const { return geo_; }
  Backend& backend() { return *backend_; }
  // Base address of virtual tensor t (geometry.h numbers them). Valid until destruction.
  uintptr_t tensor_base(int t) const { return mapper_.tensor_base(t); }
  bool closed() const;

  // ---- slots and steps ---------------------------------------------------------------------
  // Returns a slot for a new request: an idle slot holding the most pages, else a free one.
  // With `hits` (engine blocks: the request's leading cache hits), the idle slot whose row
  // already maps the longest run of them comes first. Work it queues (zeroing with scrub on) is
  // ordered on `stream`. Throws InvalidSlot when every slot is active, Config for bad hits or
  // hits on a cache whose slots own their pages (nothing changed).
  int alloc(const BlockIds* hits = nullptr, uintptr_t stream = 0);
  // Ends the request in `slot`. Records a fence on `stream` (0 = legacy default stream) so the
  // slot's pages are unmapped only after work already queued there has finished.
  void free(int slot, uintptr_t stream);
  // The decode hot path: records `lens` if every listed slot is already backed and nothing else
  // is due (no page to map or release, no eager reclaim); else returns false having changed
  // nothing, as it does when the lock is busy (so a caller can drop the GIL and call step()).
  virtual bool try_step(const std::vector<int64_t>& lens) = 0;
  // Makes every listed slot back at least its length. lens has max_batch entries; kUnlisted leaves
  // a slot alone. All or nothing. `updates` change listed rows' block tables (engine blocks only:
  // a cache whose slots own their pages throws Config for a non-empty list; block_tables.h).
  virtual void step(const std::vector<int64_t>& lens, const std::vector<BlockUpdate>& updates,
                    uintptr_t stream) = 0;
  // The engine's block table of `slot`, one list per KV cache group (empty without engine blocks).
  virtual BlockIds block_table(int slot) const = 0;
  // Engine blocks only (Config on a cache whose slots own their pages): each listed block forgets
  // its pages (block_tables.h, BlockTables::release); ids out of [0, num_blocks) throw Config with
  // nothing changed. An idle row it unmaps waits for the fence of the row's free() (the last use
  // of the blocks it maps), never for a stream. Returns the pages that reached the free list.
  virtual size_t release_blocks(const std::vector<int64_t>& ids) = 0;
  // What step(lens), plus new requests of `new_lens` tokens each, would need and could get;
  // maps nothing, changes nothing (the same accounting step() uses).
  Capacity capacity(const std::vector<int64_t>& lens, const std::vector<int64_t>& new_lens) const;
  // Queues background mapping of each listed slot up to its length + lookahead (-1 = configured).
  void prefetch(const std::vector<int64_t>& lens, int64_t lookahead_tokens);
  // Joins outstanding prefetch work; rethrows a background error.
  void wait();

  // ---- prefix sharing and swap (pages owned by slots; Config on engine blocks) ---------------
  // A slot's page indices [0, read_only) are READ-ONLY by contract (slot.h): they may be mapped by
  // other slots or kept by swap handles. Writing there (or appending after rewinding below them)
  // needs ensure_private() first. `stream` orders the copies; see Backend::copy.
  //
  // New active slot whose tokens [0, num_tokens) (-1: src's seq_len) equal src's: full pages are
  // shared, the partial last page is copied. Throws InvalidSlot (src not active, no slot free),
  // SequenceTooLong (num_tokens outside [0, seq_len(src)]), OutOfPages (nothing changed).
  virtual int fork(int src, int64_t num_tokens, uintptr_t stream) = 0;
  // The same into dst, which must be active and fresh (seq_len 0, as after alloc()); dst's own
  // pages go back to the pool. Afterwards seq_len(dst) == num_tokens.
  virtual void share_prefix(int src, int dst, int64_t num_tokens, uintptr_t stream) = 0;
  // Replaces every shared page of `slot` from the page holding start_token on with a private copy,
  // so those tokens may be rewritten. Returns the number of pages copied. All-or-nothing.
  virtual size_t ensure_private(int slot, int64_t start_token, uintptr_t stream) = 0;
  // Saves the slot's pages and frees the slot; returns a handle (swap_manager.h).
  virtual int64_t swap_out(int slot, uintptr_t stream) = 0;
  // Restores a handle into a free (else least recently freed idle) slot, bit-identical.
  virtual int swap_in(int64_t handle, uintptr_t stream) = 0;
  virtual void swap_drop(int64_t handle) = 0;
  virtual void set_swap_budget(int64_t budget_bytes) = 0;  // -1 = none; never drops handles

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
  // Changes the settings `tuning` sets, all or nothing (Config naming a bad value). A headroom
  // the pool lacks is created by the prefetch thread, as after every step(), free() and
  // prefetch() that leaves the free list short of it, never inline in a step.
  void tune(const Tuning& tuning);

  // ---- queries ------------------------------------------------------------------------------
  int64_t mapped_tokens(int slot) const;
  int64_t seq_len(int slot) const;
  std::vector<int> active_slots() const;
  Stats stats() const;
  // Checks internal invariants (page accounting, refcounts); returns "" or a description.
  std::string check_invariants() const;
  // Per layer, the first token of `slot` still backed (window_release.h).
  std::vector<int64_t> window_starts(int slot) const;
  // A kernel's reads, checked before it runs: request i reads tokens [begins[i], ends[i]) of row
  // slots[i] in tensor t (begins empty: from token 0). Throws Error(UnmappedRead) naming the
  // first request whose range is not backed (past mapped_tokens, or below a sliding window's
  // released head), InvalidSlot for a row out of range. Changes nothing; one lock for the batch.
  void check_reads(int tensor, const std::vector<int64_t>& slots,
                   const std::vector<int64_t>& begins, const std::vector<int64_t>& ends) const;
  // Active slots to preempt, in order, until their pages that would really return to the pool
  // reach bytes_needed: least recently stepped first, ties by fewest tokens, then lowest index.
  std::vector<int> pick_victims(size_t bytes_needed) const;

  // Unmaps everything, destroys pages, stops the prefetch thread. The virtual reservations live on
  // (PROT_NONE) until the object is destroyed, so a tensor outliving close() faults, never aliases.
  void close();

 protected:
  using Lock = CacheGuard::Lock;

  KVCacheCore(std::unique_ptr<Backend> backend, const CacheGeometry& geometry,
              const CacheOptions& options);
  // alloc(), per mode: checks `hits` (Config, nothing changed), picks the slot for a new request
  // and drops what its previous request left that the new one must not inherit (it may unmap; an
  // idle slot's fence is waited for inside). alloc() then hands the slot over, fence and all.
  virtual int take_slot(const BlockIds* hits, uintptr_t stream) = 0;
  // Pages this cache may hold beyond what its rows map (engine blocks kept for a prefix cache).
  virtual size_t pages_beyond_rows() const = 0;
  // Checks state and `lens`, and lists the slots whose pages must grow for them.
  std::vector<Growth> plan_step(const std::vector<int64_t>& lens);
  // try_step()'s common part, under the mutex: true when every listed slot is backed and nothing
  // else is due (no page to release, no eager reclaim). Throws for bad lengths.
  bool backed_as_is(const std::vector<int64_t>& lens);
  // A step's transaction, under the mutex: raises the listed slots' lengths to `lens` (so that
  // trimming under pressure takes only look-ahead), runs map(old_lens), counts its driver calls
  // and the pages it created as the step's, and commits the lengths; if map throws, the lengths are
  // restored and the error goes on (map undoes its own mappings). Returns the lengths before the
  // step. A failed step's pages are destroyed again and counted nowhere (pool_.roll_back), so
  // pages_created and step_pages_created agree; only the time they took stays counted.
  template <typename Map>
  std::vector<int64_t> step_transaction(const std::vector<int64_t>& lens, Map&& map) {
    const std::vector<int64_t> old_lens = slots_.raise_lengths(lens);
    const PagePool::Counts pool_before = pool_.counts();
    const uint64_t calls_before = parts_.driver_calls();
    const uint64_t ns_before = pool_.create_ns();
    auto count = [&] {  // no other thread creates pages while the mutex is held
      counters_.step_driver_calls += parts_.driver_calls() - calls_before;
      counters_.step_pages_created += pool_.pages_created() - pool_before.created;
      counters_.step_page_create_ns += pool_.create_ns() - ns_before;
    };
    try {
      map(old_lens);
    } catch (...) {
      pool_.roll_back(pool_before);
      count();
      slots_.restore_lengths(old_lens);
      throw;
    }
    count();
    slots_.commit(lens);
    ++counters_.steps;
    return old_lens;
  }

  const CacheGeometry geo_;
  std::unique_ptr<Backend> backend_;
  SlotMapper mapper_;
  PagePool pool_;
  SlotTable slots_;
  CacheCounters counters_;
  CacheGuard guard_;
  PrefetchGate gate_;
  SlotMemory memory_;
  PageSupply supply_;
  Scrubber scrubber_;
  CacheParts parts_;
  WindowRelease windows_;
  // The parts whose stats, invariants and close() the shared calls run, in this order; each
  // coordinator's constructor lists them.
  //
  // The destruction contract: these (and an observer given to memory_) are members of the
  // coordinator, gone before this base's destructor runs. So each coordinator's destructor calls
  // close() first (the base's close() then returns at once), then clears features_ and the
  // observer; close() makes no virtual call.
  std::vector<CacheFeature*> features_;
  std::unique_ptr<Backend::CacheRegistration> registration_;  // the backend's (host: faults)
  int64_t lookahead_tokens_ = 0;
  BackgroundMapper background_;
  std::unique_ptr<Prefetcher> prefetcher_;  // last: its thread uses everything above
};

// The coordinator for `options` (num_blocks picks the mode), over `backend`.
std::unique_ptr<KVCacheCore> make_cache(std::unique_ptr<Backend> backend,
                                        const CacheGeometry& geometry, const CacheOptions& options);

}  // namespace vattention
