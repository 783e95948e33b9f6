// KVCacheCore: virtual KV tensors whose physical pages are mapped on demand, per slot.
//
// Why: attention kernels want a dense [B, S, H, D] cache; serving wants memory proportional to the
// tokens really held. The cache reserves each tensor's full virtual range once (addresses never
// move, so tensors and CUDA graphs stay valid) and maps physical pages at the end of a slot's row
// as its sequence grows (DESIGN.md section 3).
//
// Transactions: step() validates everything before touching state, gets all the pages it needs
// before mapping any, and undoes its own mappings if a backend call fails part-way. Running out of
// pages raises Error(OutOfPages) with nothing changed.
//
// Reclamation: free() keeps a slot's pages mapped ("idle"); alloc() prefers idle slots that hold
// pages, so a new request inherits mapped memory for free. Pages of idle slots go back to the pool
// only when another slot needs them (least recently freed first), on reclaim(), or at once under
// the "eager" policy. A slot freed at step N is unmapped only after the fence recorded by free()
// has completed: unmapping is not stream-ordered on CUDA.
//
// Thread-safety and lock order: every public method may be called from any thread. mu_ guards all
// state; the prefetch thread takes mu_ per slot it maps, and makes the driver calls themselves
// without it (an "in-flight" range, see kv_cache_prefetch.cpp for the rules that keep that safe). Order: Prefetcher::mu_ is never held while
// taking mu_, and mu_ is never held while waiting on the prefetcher. The backend's own locks are
// leaves below mu_.
#pragma once

#include <climits>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "fault_report.h"
#include "geometry.h"
#include "page_pool.h"
#include "prefetcher.h"
#include "slot.h"
#include "stats.h"
#include "swap_store.h"

namespace vattention {

enum class ReclaimPolicy { Deferred, Eager };

class KVCacheCore {
 public:
  static constexpr int64_t kUnlisted = INT64_MIN;  // "leave this slot alone" in a lens vector

  KVCacheCore(std::unique_ptr<Backend> backend, const CacheGeometry& geometry,
              int64_t budget_bytes, ReclaimPolicy policy, int64_t lookahead_tokens);
  ~KVCacheCore();
  KVCacheCore(const KVCacheCore&) = delete;
  KVCacheCore& operator=(const KVCacheCore&) = delete;

  const CacheGeometry& geometry() const { return geo_; }
  Backend& backend() { return *backend_; }
  // Base address of virtual tensor t (see geometry.h for the numbering and per-tensor sizes).
  // Valid until destruction.
  uintptr_t tensor_base(int t) const { return bases_.at(static_cast<size_t>(t)); }
  bool closed() const;

  // Returns a slot for a new request: an idle slot holding the most pages, else a free one.
  // Throws InvalidSlot when every slot is active.
  int alloc();
  // Ends the request in `slot`. Records a fence on `stream` (0 = legacy default stream) so the
  // slot's pages are unmapped only after work already queued there has finished.
  void free(int slot, uintptr_t stream);
  // Makes every listed slot back at least its length. lens has max_batch entries; kUnlisted leaves a
  // slot alone. Joins outstanding prefetch work only when pages are missing (the thread may be
  // mapping exactly those). With fast_only, returns false without side effects if any page must
  // be mapped or the lock is busy (so the caller can drop the GIL and retry).
  bool step(const std::vector<int64_t>& lens, uintptr_t stream, bool fast_only);
  // Queues background mapping of each listed slot up to its length + lookahead (-1 = configured).
  void prefetch(const std::vector<int64_t>& lens, int64_t lookahead_tokens);
  // Joins outstanding prefetch work; rethrows a background error.
  void wait();
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
  // Zero every page a request receives: pages from the pool (mapped by step/prefetch, or the fresh
  // part of a fork) and the pages an idle slot hands to its next request in alloc(). Off by
  // default (kv_cache_scrub.cpp says why and what it costs).
  void set_scrub(bool on);
  int64_t mapped_tokens(int slot) const;
  int64_t seq_len(int slot) const;
  std::vector<int> active_slots() const;
  std::vector<std::pair<std::string, int64_t>> stats() const;
  // Checks internal invariants (page accounting, refcounts); returns "" or a description.
  std::string check_invariants() const;
  // ---- prefix sharing, swap and eviction (issue 7; defined in kv_cache_sharing.cpp) -------------
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
  // so those tokens may be rewritten. Returns the number of pages copied. All-or-nothing: on
  // OutOfPages nothing changed; on a driver error pages already made private are switched back.
  size_t ensure_private(int slot, int64_t start_token, uintptr_t stream);
  // Saves the slot's pages [0, pages_for(seq_len)) and frees the slot (its pages are unmapped at
  // once). Pages another active slot maps are kept on the device by reference; the others are
  // copied to host memory, each once (also pages earlier handles kept by reference that no active
  // slot maps any more). Throws SwapSpace (nothing changed) when the swap budget is too small.
  int64_t swap_out(int slot, uintptr_t stream);
  // Restores a handle into a free (else least recently freed idle) slot, bit-identical, with the
  // same seq_len and read-only prefix. Consumes the handle. OutOfPages/InvalidSlot: nothing changed.
  int swap_in(int64_t handle, uintptr_t stream);
  // Discards a handle: its host memory and device references go.
  void swap_drop(int64_t handle);
  void set_swap_budget(int64_t budget_bytes);  // -1 = none; never drops existing handles
  // Active slots to preempt, in order, until their pages that would really return to the pool
  // (pages nobody else maps; idle mappings count as gone) reach bytes_needed. Policy: least
  // recently stepped first, ties by fewest tokens (cheapest to recompute), then lowest index.
  // Returns every active slot if even all of them are not enough.
  std::vector<int> pick_victims(size_t bytes_needed) const;
  // ---- sliding windows (issue 14; kv_cache_window.cpp) -------------------------------------------
  // Per layer, the first token of `slot` still backed: 0 on full-attention layers, on windowed
  // layers the first token after the pages step() released. Positions below it read unmapped memory.
  std::vector<int64_t> window_starts(int slot) const;

  // Unmaps everything, destroys pages, stops the prefetch thread. The virtual reservations live on
  // (PROT_NONE) until the object is destroyed, so a tensor outliving close() faults, never aliases.
  void close();

 private:
  using Lock = std::unique_lock<std::mutex>;
  struct Growth { int slot; size_t from; size_t to; };

  void check_open() const;
  void validate_slot(int slot) const;
  // Throws InvalidSlot "<role>=<slot> <why>" unless slot is in range and active.
  void require_active(int slot, const char* role, const char* why) const;
  Error no_free_slot() const;
  void validate_lens(const std::vector<int64_t>& lens, bool require_active) const;
  // Checks state and input, and lists the slots whose pages must grow for `lens`.
  std::vector<Growth> plan_step(const std::vector<int64_t>& lens);
  // Records a successful step's lengths (every listed slot is backed by then).
  void commit_step(const std::vector<int64_t>& lens);
  // Maps the growth plan (all or nothing). Throws OutOfPages/Driver with state unchanged.
  void grow(const std::vector<Growth>& plan, bool from_prefetch);
  // Gets n pages: pool free list, new pages within budget, then idle slots (LRU), then active
  // slots' pages beyond their length. Throws OutOfPages (nothing changed) if impossible.
  // allow_trim: also take look-ahead pages of active slots outside the plan (not for prefetch).
  std::vector<PageHandle> obtain(size_t n, const std::vector<Growth>& plan, bool allow_trim);
  size_t spare_pages(const std::vector<Growth>& plan, bool allow_trim) const;
  size_t release_spare(size_t n, const std::vector<Growth>& plan, bool allow_trim);
  void map_slot(int slot, size_t from, size_t to, const PageHandle* pages, bool from_prefetch);
  // Maps pages at page indices [from, to) of `slot` in every tensor and grants access (one
  // set_access per tensor run); touches no cache state, so the prefetch thread runs it unlocked.
  // On failure unmaps what it mapped and rethrows. Returns the driver calls made.
  size_t map_pages(int slot, size_t from, size_t to, const PageHandle* pages) const;
  // Maps tensor t's pages for page indices [begin, end) of `slot` as one run and grants access to
  // it; the handles of index p are row[(p - begin) * columns + first_column(t) + j]. `mapped`
  // counts the pages mapped so far, so a caller can unmap exactly those if a call fails.
  void map_run(int t, int slot, size_t begin, size_t end, const PageHandle* row,
               size_t& mapped) const;
  // Per tensor, the first page index in [from, to) that is not a hole (kNoPage: a released
  // window page restored by fork or swap-in); `to` when the whole range is holes.
  std::vector<size_t> first_pages(size_t from, size_t to, const PageHandle* pages) const;
  // ---- the prefetch thread's mapping in flight (kv_cache_prefetch.cpp) --------------------------
  struct InFlight {
    int slot = -1;                   // -1: nothing in flight
    size_t from = 0, to = 0;         // page indices being mapped outside the lock
    std::vector<PageHandle> pages;   // taken from the pool (refcount 1), not yet in the slot
  };
  bool in_flight(size_t slot) const { return inflight_.slot == static_cast<int>(slot); }
  // Waits (releasing mu_) until nothing is in flight (no mapping, no page creation outside the
  // lock). Callers re-validate afterwards.
  void settle(Lock& lock);
  // Waits (releasing mu_) until the mapping in flight now, if any, has published; the prefetch
  // thread may start another one meanwhile. Callers re-validate afterwards.
  void await_publish(Lock& lock);
  // True while the prefetch thread maps or creates pages without mu_ (callers hold mu_).
  bool outside_lock_work() const;
  // Runs the prefetch of one slot: plan under the lock, map without it, publish under it.
  // Returns false when the job must stop (closed, error, pool dry).
  bool prefetch_slot(int slot, int64_t target_tokens);
  // Creates up to n pages for the pool with mu_ released (lock is held on entry and on return).
  // Returns false when the job must stop (a driver error, now in background_error_).
  bool create_unlocked(Lock& lock, size_t n);
  // Keeps a prefetch-thread failure for the next call on the cache, and counts it.
  void record_background_error(std::exception_ptr error);
  // VMM driver calls so far (create, release, map, set_access, unmap), for the per-step counters.
  uint64_t vmm_calls() const;
  // With scrub on: zeroes page indices [from, to) of `slot` in every tensor (mapped, with access).
  void scrub_pages(int slot, size_t from, size_t to);
  // With scrub on and device memory: allocates the page of zeros (under mu_). Throws DriverError.
  void prepare_scrub();
  // Zeroes page indices [from, to) of `slot` in every tensor (mapped, with access); touches no
  // cache state but the zero page (prepare_scrub first), so it may run without mu_ on a range
  // the caller alone maps. Does not count.
  void zero_pages(int slot, size_t from, size_t to) const;
  void scrub_stats(std::vector<std::pair<std::string, int64_t>>& out) const;
  // Unmaps page indices [keep, mapped) of a slot and releases its pages. Returns the pages that
  // reached the free list (a shared page only loses a reference).
  size_t unmap_tail(Slot& slot, int index, size_t keep);
  void wait_fence(Slot& slot);
  void drain_eager();
  void run_prefetch(const Prefetcher::Job& job);
  void rethrow_background_error();
  // Address of page index `page` of `slot` in `tensor` (the first of its index_pages(tensor)).
  uintptr_t page_va(int tensor, int slot, size_t page) const;
  // Address of column `column` of page index `page` of `slot` (Slot::pages[page * columns + column]).
  uintptr_t column_va(size_t column, int slot, size_t page) const;
  // Sharing helpers (kv_cache_sharing.cpp).
  void share_locked(int src, int dst, int64_t num_tokens, uintptr_t stream);
  void check_share_args(int src, int64_t num_tokens) const;
  // alloc() of an idle slot: unmap from its first page still shared, so the new owner never
  // writes into a page someone else reads.
  void forget_sharing(Slot& slot, int index);
  bool any_sharing() const;
  // spare_pages() when pages may be shared: only pages all of whose references are reclaimable.
  size_t freeable_spare(const std::vector<Growth>& plan, bool allow_trim) const;
  int pick_fresh_slot() const;
  void sync_stream(uintptr_t stream);
  uintptr_t staging_va();
  // Maps `page` at the staging address with access (undoing itself on failure). The staging
  // mapping holds its own pool reference, so a page whose staging unmap failed is never back on
  // the free list while mapped; unstage() drops mapping and reference (retrying a failed unmap
  // once), and a later stage() or close() clears a mapping left by an earlier failure.
  void stage(PageHandle page);
  void unstage();
  void copy_page_to_host(PageHandle page, void* dst, uintptr_t stream);
  std::string check_sharing(std::map<PageHandle, uint32_t>& seen) const;
  void sharing_stats(std::vector<std::pair<std::string, int64_t>>& out) const;
  // Window helpers (kv_cache_window.cpp). Releases, for every listed slot, the pages its windowed
  // tensors no query of this step can read; waits on a fence on `stream` before unmapping. Returns
  // the pages that reached the free list.
  size_t release_windows(const std::vector<int64_t>& lens, const std::vector<int64_t>& old_lens,
                         uintptr_t stream);
  // Releases page indices [head[t], releasable_pages(t, first_query)) of every windowed tensor.
  size_t release_head(Slot& slot, int index, int64_t first_query);
  void refresh_release_at(Slot& slot) const;
  // Throws SequenceTooLong unless the window of a `len`-token sequence is still backed in `slot`.
  void check_window(int slot, int64_t len, const char* what) const;
  // alloc() of an idle slot with released head pages: the new owner starts at token 0, so unmap all.
  void forget_window(Slot& slot, int index);
  // First page index of tensor t that is mapped (head[t], or 0).
  static size_t head_of(const Slot& slot, size_t t) { return slot.head.empty() ? 0 : slot.head[t]; }

  const CacheGeometry geo_;
  const ReclaimPolicy policy_;
  std::unique_ptr<Backend> backend_;
  std::vector<uintptr_t> bases_;
  std::unique_ptr<PagePool> pool_;
  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  int64_t lookahead_tokens_;
  uint64_t free_counter_ = 0;
  uint64_t step_counter_ = 0;
  uint64_t window_released_pages_ = 0;  // pages sliding windows returned to the pool
  std::vector<int> eager_pending_;  // eager policy: freed slots whose fence had not completed
  CacheCounters counters_;
  std::exception_ptr background_error_;
  bool closed_ = false;
  InFlight inflight_;                 // at most one slot is mapped outside the lock at a time
  uint64_t publishes_ = 0;            // in-flight mappings finished (published or given back)
  std::condition_variable settled_;   // notified when inflight_ is cleared
  std::unique_ptr<Prefetcher> prefetcher_;
  std::unique_ptr<SwapStore> swap_;   // swapped-out slots (issue 7)
  VaRange staging_;                   // one page of address space to copy into unmapped pages
  std::unique_ptr<FaultReport> fault_report_;  // host backend: names a bad access (SIGSEGV)
  bool staged_ = false;               // staging_ maps staged_page_ (holding a pool reference)
  PageHandle staged_page_ = 0;
  bool scrub_ = false;                // KVCacheConfig(scrub=True)
  void* zero_block_ = nullptr;        // device backends: page_bytes of zeros (alloc_host)
  uint64_t scrubbed_pages_ = 0;
};

}  // namespace vattention
