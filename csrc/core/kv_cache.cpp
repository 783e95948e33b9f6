// KVCacheCore: the calls both modes run the same way (kv_cache.h), and make_cache().
#include "core/kv_cache.h"

#include <algorithm>
#include <limits>
#include <map>
#include <unordered_map>

#include "core/block_coordinator.h"
#include "core/preemption.h"
#include "core/slot_coordinator.h"

namespace vattention {
namespace {

CacheGeometry checked(CacheGeometry g) {
  g.validate();
  g.derive();
  return g;
}

// Pages a cache can ever use: its virtual tensors', plus what it may keep beyond its rows.
size_t usable_pages(const CacheGeometry& geo, size_t beyond_rows) {
  return geo.virtual_bytes() / geo.page_bytes + beyond_rows;
}

size_t pages_in(size_t bytes, size_t page_bytes) {  // rounded up, overflow-safe
  return bytes / page_bytes + (bytes % page_bytes != 0 ? 1 : 0);
}

const std::unique_ptr<Backend>& matching(const std::unique_ptr<Backend>& backend,
                                         const CacheGeometry& geo) {
  if (geo.page_bytes != backend->page_bytes()) {
    throw Error(Error::Kind::Config, "geometry page_bytes=" + std::to_string(geo.page_bytes) +
                                         " differs from the backend's " +
                                         std::to_string(backend->page_bytes()));
  }
  return backend;
}

}  // namespace

std::unique_ptr<KVCacheCore> make_cache(std::unique_ptr<Backend> backend,
                                        const CacheGeometry& geometry,
                                        const CacheOptions& options) {
  if (options.num_blocks < 0) {
    throw Error(Error::Kind::Config, "num_blocks=" + std::to_string(options.num_blocks) +
                                         " must be >= 0 (0: pages owned by slots)");
  }
  if (options.num_blocks == 0) {
    if (options.block_cache) {
      throw Error(Error::Kind::Config,
                  "block_cache=True needs num_blocks (pages named by engine blocks)");
    }
    return std::make_unique<SlotCoordinator>(std::move(backend), geometry, options);
  }
  return std::make_unique<BlockCoordinator>(std::move(backend), geometry, options);
}

KVCacheCore::KVCacheCore(std::unique_ptr<Backend> backend, const CacheGeometry& geometry,
                         const CacheOptions& options)
    : geo_(checked(geometry)),
      backend_(std::move(backend)),
      mapper_(*matching(backend_, geo_), geo_),
      pool_(*backend_, options.budget_bytes),
      slots_(geo_.max_batch, geo_.max_seq),
      gate_(pool_),
      memory_(geo_, *backend_, mapper_, pool_, slots_, counters_),
      supply_(geo_, pool_, slots_, gate_, memory_, counters_, options.policy),
      scrubber_(*backend_, geo_, mapper_),
      parts_{geo_, *backend_, mapper_, pool_, slots_, counters_, memory_, supply_, scrubber_},
      windows_(parts_),
      background_(parts_, gate_, guard_) {
  Tuning tuning;
  tuning.lookahead_tokens = options.lookahead_tokens;
  tune(tuning);
  registration_ = backend_->register_cache(geo_, mapper_.bases());
  prefetcher_ =
      std::make_unique<Prefetcher>([this](const Prefetcher::Job& job) { background_.run(job); });
}

KVCacheCore::~KVCacheCore() {
  try {
    close();
  } catch (...) {
    // Destructors must not throw; close() already released what it could.
  }
  prefetcher_.reset();
  registration_.reset();  // before the ranges go: they may be reused by anything
  // A reservation with live mappings cannot be freed (cuMemAddressFree refuses); if close() could
  // not unmap everything, leaking the address range is the only safe choice.
  for (const Slot& s : slots_) {
    if (s.pages.mapped() > 0) mapper_.keep_reserved();
  }
}

bool KVCacheCore::closed() const {
  Lock lock(guard_.mutex());
  return guard_.closed();
}

// ---- slots --------------------------------------------------------------------------------------

int KVCacheCore::alloc(const BlockIds* hits, uintptr_t stream) {
  Lock lock = guard_.enter();
  // A slot freed while the prefetch thread maps it is a candidate here, and its new owner may
  // unmap (take_slot) or map below the range in flight: let that mapping publish first.
  while (gate_.flight().slot >= 0 &&
         !slots_[static_cast<size_t>(gate_.flight().slot)].use.active()) {
    gate_.await_publish(lock);  // the thread only starts mappings of active slots
    guard_.check_open();
    guard_.rethrow_background_error();
  }
  // The mode may unmap what the new request must not inherit (waiting for the free() fence).
  const int slot = take_slot(hits, stream);
  // The fence stays with the row: the new request inherits what the row still maps, which the old
  // request's last kernels may still read, and a later unmapping of it (a block table that
  // disagrees, a trim of look-ahead, a window) waits for the fence as an idle row's would
  // (slot_memory.h). Mapping, and a step that unmaps nothing, never look at it.
  slots_.activate(slot, 0);
  return slot;
}

void KVCacheCore::free(int slot, uintptr_t stream) {
  Lock lock = guard_.enter();
  slots_.require_active(slot, "slot",
                        "is not allocated (already freed, or never returned by alloc())");
  memory_.fence_on_free(slot, stream);  // may throw: before any state change
  slots_.deactivate(slot);
  if (supply_.policy() == ReclaimPolicy::Eager &&
      slots_[static_cast<size_t>(slot)].pages.mapped() > 0) {
    supply_.queue_eager(slot);
    supply_.drain_eager();
  }
  background_.top_up(lock, *prefetcher_);
}

std::vector<Growth> KVCacheCore::plan_step(const std::vector<int64_t>& lens) {
  guard_.check_open();
  guard_.rethrow_background_error();
  supply_.drain_eager();
  slots_.validate_lens(lens, true);
  std::vector<Growth> plan;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == kUnlisted) continue;
    windows_.check(static_cast<int>(i), lens[i], "seq_lens[slot]");
    const size_t need = geo_.pages_for(lens[i]);
    const size_t mapped = slots_[i].pages.mapped();
    if (need > mapped) plan.push_back(Growth{static_cast<int>(i), mapped, need});
  }
  return plan;
}

bool KVCacheCore::backed_as_is(const std::vector<int64_t>& lens) {
  // The decode hot path: one pass, no division (backed() is cached). Work the prefetch thread
  // still has queued is for later iterations: no need to wait for it.
  guard_.check_open();
  guard_.rethrow_background_error();
  if (supply_.eager_pending()) return false;
  if (static_cast<int64_t>(lens.size()) != geo_.max_batch) slots_.validate_lens(lens, true);
  for (size_t i = 0; i < lens.size(); ++i) {
    const int64_t len = lens[i];
    if (len == kUnlisted) continue;
    const Slot& s = slots_[i];
    if (len < 0 || len > geo_.max_seq || !s.use.active()) {
      slots_.validate_lens(lens, true);  // throws the precise error
    }
    if (len > s.pages.backed()) return false;
    // A window page to release (release_at is INT64_MAX without windows), or a rewind to check.
    const int64_t old = s.use.seq_len();
    if (std::min(old, len - 1) >= s.pages.release_at() || (len < old && s.pages.has_holes())) {
      return false;
    }
  }
  return true;
}

Capacity KVCacheCore::capacity(const std::vector<int64_t>& lens,
                               const std::vector<int64_t>& new_lens) const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  slots_.validate_lens(lens, true);
  for (size_t i = 0; i < new_lens.size(); ++i) {
    const int64_t len = new_lens[i];
    if (len < 0 || len > geo_.max_seq) {
      throw Error(Error::Kind::SequenceTooLong,
                  "new_requests[" + std::to_string(i) + "]=" + std::to_string(len) +
                      " is outside [0, " + std::to_string(geo_.max_seq) +
                      "] (max_seq_len=" + std::to_string(geo_.max_seq) + ")")
          .with("seq_len", len)
          .with("max_seq_len", geo_.max_seq);
    }
  }
  const size_t C = geo_.columns();
  Capacity c;
  std::vector<Growth> plan;  // as plan_step() makes it: the slots that grow
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == kUnlisted) continue;
    const size_t need = geo_.pages_for(lens[i]);
    const size_t mapped = slots_[i].pages.mapped();
    if (need <= mapped) continue;
    plan.push_back(Growth{static_cast<int>(i), mapped, need});
    c.pages_needed += (need - mapped) * C;
  }
  for (int64_t len : new_lens) c.pages_needed += geo_.pages_for(len) * C;
  // Pages the prefetch thread holds in flight become trimmable look-ahead once published.
  const size_t in_flight = gate_.flight().pages.size();
  c.pages_free = pool_.free();
  c.pages_creatable = pool_.headroom();
  c.pages_reclaimable = supply_.spare(plan, true, &lens) + windows_.releasable(lens) + in_flight;
  if (c.pages_creatable != std::numeric_limits<size_t>::max()) {
    const size_t have = c.pages_free + c.pages_creatable + c.pages_reclaimable;
    c.pages_short = c.pages_needed > have ? c.pages_needed - have : 0;
  }
  return c;
}

// ---- background mapping -------------------------------------------------------------------------

void KVCacheCore::prefetch(const std::vector<int64_t>& lens, int64_t lookahead_tokens) {
  Prefetcher::Job job(lens.size(), kUnlisted);
  {
    Lock lock = guard_.enter();
    slots_.validate_lens(lens, true);
    if (lookahead_tokens < -1) {
      throw Error(Error::Kind::Config,
                  "lookahead_tokens=" + std::to_string(lookahead_tokens) + " must be >= 0");
    }
    const int64_t ahead = lookahead_tokens < 0 ? lookahead_tokens_ : lookahead_tokens;
    bool work = false;
    for (size_t i = 0; i < lens.size(); ++i) {
      if (lens[i] == kUnlisted) continue;
      job[i] = std::min(geo_.max_seq, lens[i] + ahead);
      const Slot& s = slots_[i];
      work = work || (s.use.active() && geo_.pages_for(job[i]) > s.pages.mapped());
    }
    // Most decode steps need no new page: waking the thread for nothing would cost a context
    // switch per step on a machine whose cores the model's threads keep busy. A job ends with
    // the headroom; without one, the thread is woken only when the pool is short of it.
    if (!work) {
      background_.top_up(lock, *prefetcher_);
      return;
    }
  }
  prefetcher_->submit(std::move(job));
}

void KVCacheCore::wait() {
  prefetcher_->wait();
  Lock lock = guard_.enter();
}

// ---- physical memory ----------------------------------------------------------------------------

void KVCacheCore::reserve(size_t bytes) {
  Lock lock = guard_.enter();
  // No cache can use more pages than its virtual tensors hold, plus what it may keep beyond its
  // rows (engine blocks cached for a prefix cache).
  const size_t pages = pages_in(bytes, geo_.page_bytes);
  const size_t mappable = geo_.virtual_bytes() / geo_.page_bytes;
  const size_t cached = pages_beyond_rows();
  const size_t usable = usable_pages(geo_, cached);
  if (pages > usable) {
    throw Error(Error::Kind::Config,
                "reserve of " + std::to_string(bytes) + " bytes (" + std::to_string(pages) +
                    " pages) exceeds what this cache can ever hold: " + std::to_string(usable) +
                    " pages of " + std::to_string(geo_.page_bytes) + " bytes (its virtual size, " +
                    std::to_string(mappable * geo_.page_bytes) + " bytes" +
                    (cached ? ", plus " + std::to_string(cached) +
                                  " pages its engine blocks may keep cached"
                            : std::string()) +
                    ")")
        .with("bytes", static_cast<int64_t>(bytes > INT64_MAX ? INT64_MAX : bytes))
        .with("pages_possible", static_cast<int64_t>(usable));
  }
  try {
    pool_.reserve(pages);
  } catch (const Error& e) {
    if (e.kind() == Error::Kind::OutOfPages) ++counters_.oom_events;
    throw;
  }
}

size_t KVCacheCore::reclaim() {
  Lock lock = guard_.enter_settled(gate_);  // a slot freed while being mapped is reclaimed too
  size_t released = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.state() != Slot::State::Idle) continue;
    released += s.pages.live(geo_);  // mappings, as documented
    counters_.reclaimed_pages += memory_.unmap_tail(static_cast<int>(i), 0);
  }
  return released;
}

size_t KVCacheCore::shrink(size_t keep_bytes) {
  Lock lock = guard_.enter();
  return pool_.shrink(keep_bytes);
}

int64_t KVCacheCore::set_memory_budget(int64_t budget_bytes) {
  {
    // Nothing to trim (no budget, or room for every page held and being created): no wait for
    // the prefetch thread's job. An engine whose scheduler grants pages raises it most steps.
    Lock lock = guard_.enter();
    const size_t need = (pool_.total() + pool_.creating()) * geo_.page_bytes;
    if (budget_bytes < 0 || need <= static_cast<size_t>(budget_bytes)) {
      pool_.set_budget(budget_bytes);
      background_.top_up(lock, *prefetcher_);
      return 0;
    }
  }
  // Pages in flight count against the budget and cannot be trimmed until published.
  Lock lock = guard_.enter_settled(gate_);
  const int64_t old_budget = pool_.budget_bytes();
  pool_.set_budget(budget_bytes);
  if (budget_bytes < 0) {
    background_.top_up(lock, *prefetcher_);
    return 0;
  }
  const size_t budget = static_cast<size_t>(budget_bytes);
  const size_t P = geo_.page_bytes;
  try {
    pool_.shrink(budget);
    while (pool_.total() * P > budget) {
      const size_t over_pages = (pool_.total() * P - budget + P - 1) / P;
      if (supply_.release_spare(over_pages, {}, true) == 0) break;
      pool_.shrink(budget);
    }
  } catch (...) {
    pool_.set_budget(old_budget);  // reclaimed idle/look-ahead pages stay free: invisible state
    throw;
  }
  const size_t held = pool_.total() * P;
  const int64_t over = held > budget ? static_cast<int64_t>(held - budget) : 0;
  background_.top_up(lock, *prefetcher_);  // a raised budget may allow the headroom now
  return over;
}

void KVCacheCore::tune(const Tuning& tuning) {
  if (tuning.lookahead_tokens && *tuning.lookahead_tokens < 0) {
    throw Error(Error::Kind::Config,
                "lookahead_tokens=" + std::to_string(*tuning.lookahead_tokens) + " must be >= 0");
  }
  if (tuning.headroom_bytes && *tuning.headroom_bytes < 0) {
    throw Error(Error::Kind::Config,
                "headroom=" + std::to_string(*tuning.headroom_bytes) + " must be >= 0 bytes")
        .with("bytes", *tuning.headroom_bytes);
  }
  Lock lock(guard_.mutex());
  guard_.check_open();  // a prefetch error stays for a call that maps
  size_t headroom_pages = 0;
  if (tuning.headroom_bytes) {
    const auto bytes = static_cast<size_t>(*tuning.headroom_bytes);
    headroom_pages = pages_in(bytes, geo_.page_bytes);
    const size_t usable = usable_pages(geo_, pages_beyond_rows());
    if (headroom_pages > usable) {
      throw Error(Error::Kind::Config,
                  "headroom=" + std::to_string(bytes) + " bytes (" +
                      std::to_string(headroom_pages) +
                      " pages) exceeds what this cache can ever hold: " + std::to_string(usable) +
                      " pages of " + std::to_string(geo_.page_bytes) + " bytes")
          .with("bytes", *tuning.headroom_bytes)
          .with("pages_possible", static_cast<int64_t>(usable));
    }
  }
  if (tuning.lookahead_tokens) lookahead_tokens_ = *tuning.lookahead_tokens;
  if (tuning.scrub) scrubber_.set_enabled(*tuning.scrub);
  if (tuning.headroom_bytes) {
    pool_.set_free_target(headroom_pages);
    background_.top_up(lock, *prefetcher_);
  }
}

// ---- queries ------------------------------------------------------------------------------------

int64_t KVCacheCore::mapped_tokens(int slot) const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  slots_.validate(slot);
  return geo_.tokens_in(slots_[static_cast<size_t>(slot)].pages.mapped());
}

int64_t KVCacheCore::seq_len(int slot) const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  slots_.validate(slot);
  return slots_[static_cast<size_t>(slot)].use.seq_len();
}

std::vector<int> KVCacheCore::active_slots() const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  return slots_.active();
}

std::vector<int64_t> KVCacheCore::window_starts(int slot) const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  slots_.validate(slot);
  return windows_.starts(slot);
}

void KVCacheCore::check_reads(int tensor, const std::vector<int64_t>& slots,
                              const std::vector<int64_t>& begins,
                              const std::vector<int64_t>& ends) const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  if (tensor < 0 || tensor >= geo_.num_tensors()) {
    throw Error(Error::Kind::Config, "tensor=" + std::to_string(tensor) + " is out of range [0, " +
                                         std::to_string(geo_.num_tensors()) + ")");
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t slot = slots[i];
    slots_.validate(slot);
    const SlotPages& p = slots_[static_cast<size_t>(slot)].pages;
    const int64_t end = i < ends.size() ? ends[i] : 0;
    const int64_t mapped = geo_.tokens_in(p.mapped());
    if (end > mapped) {
      const std::string row = std::to_string(slot);
      throw Error(Error::Kind::UnmappedRead,
                  "request " + std::to_string(i) + " reads " + std::to_string(end) +
                      " tokens of cache row " + row + ", past the " + std::to_string(mapped) +
                      " tokens mapped for it (mapped_tokens(" + row +
                      ") = " + std::to_string(mapped) +
                      "): the kernel would touch unmapped memory; call KVCache.step({" + row +
                      ": " + std::to_string(end) + "}) first, or pass the lengths step() was given")
          .with("request", static_cast<int64_t>(i))
          .with("slot", slot)
          .with("length", end)
          .with("mapped_tokens", mapped);
    }
    if (i >= begins.size() || !p.has_holes()) continue;
    const int64_t start = geo_.first_token_at(p.head(static_cast<size_t>(tensor)));
    const int64_t begin = begins[i];
    if (begin < start && begin < end) {
      throw Error(Error::Kind::UnmappedRead,
                  "request " + std::to_string(i) + " reads tokens [" + std::to_string(begin) +
                      ", " + std::to_string(end) + ") of cache row " + std::to_string(slot) +
                      ", but its sliding window released the tokens below " +
                      std::to_string(start) +
                      " (window_start): pass window_size so that no query reads below it")
          .with("request", static_cast<int64_t>(i))
          .with("slot", slot)
          .with("length", end)
          .with("mapped_tokens", mapped)
          .with("window_start", start);
    }
  }
}

std::vector<int> KVCacheCore::pick_victims(size_t bytes_needed) const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  return vattention::pick_victims(slots_, pool_, geo_.page_bytes, bytes_needed);
}

Stats KVCacheCore::stats() const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  int64_t active = 0, idle = 0, free_slots = 0, tokens = 0, mappings = 0;
  for (const Slot& s : slots_) {
    mappings += static_cast<int64_t>(s.pages.live(geo_));
    switch (s.state()) {
      case Slot::State::Active:
        ++active;
        tokens += s.use.seq_len();
        break;
      case Slot::State::Idle: ++idle; break;
      case Slot::State::Free: ++free_slots; break;
    }
  }
  // Pages mapped by several rows (prefix sharing, or one engine block hit by several requests):
  // counting distinct pages walks every mapping, so only when some page has a second reference,
  // and stats() stays O(slots) for caches that never share.
  int64_t shared = 0, saved_pages = 0;
  if (pool_.extra_refs() > 0) {
    std::unordered_map<PageHandle, uint32_t> mapped;
    for (const Slot& s : slots_) {
      for (PageHandle p : s.pages.handles()) {
        if (p != kNoPage) ++mapped[p];
      }
    }
    for (const auto& entry : mapped) shared += entry.second > 1 ? 1 : 0;
    saved_pages = mappings - static_cast<int64_t>(mapped.size());
  }
  const auto P = static_cast<int64_t>(geo_.page_bytes);
  const auto total = static_cast<int64_t>(pool_.total());
  const auto in_use = static_cast<int64_t>(pool_.in_use());
  auto u = [](uint64_t v) { return static_cast<int64_t>(v); };
  Stats out = {
      {"page_bytes", P},
      {"tokens_per_page", static_cast<int64_t>(geo_.tokens_per_page())},
      {"pages_total", total},
      {"pages_free", static_cast<int64_t>(pool_.free())},
      {"pages_mapped", in_use},
      {"mappings", mappings},
      {"bytes_mapped", in_use * P},
      {"bytes_reserved", total * P},
      {"bytes_used_by_tokens", tokens * geo_.bytes_per_token()},
      {"virtual_bytes", static_cast<int64_t>(geo_.virtual_bytes())},
      {"committed_bytes", backend_->committed_bytes()},
      {"huge_page_bytes", backend_->huge_page_bytes()},
      {"memory_budget", pool_.budget_bytes()},
      {"lookahead_tokens", lookahead_tokens_},
      {"active_slots", active},
      {"idle_slots_with_pages", idle},
      {"free_slots", free_slots},
      {"shared_pages", shared},
      {"bytes_saved_by_sharing", saved_pages * P},
      {"map_calls", u(counters_.map_calls)},
      {"unmap_calls", u(counters_.unmap_calls)},
      {"set_access_calls", u(counters_.set_access_calls)},
      {"step_map_calls", u(counters_.step_map_calls)},
      {"prefetch_map_calls", u(counters_.prefetch_map_calls)},
      {"steps", u(counters_.steps)},
      {"step_driver_calls", u(counters_.step_driver_calls)},
      {"prefetch_driver_calls", u(counters_.prefetch_driver_calls)},
      {"prefetch_errors", u(counters_.prefetch_errors)},
      {"pages_created", u(pool_.pages_created())},
      {"pages_destroyed", u(pool_.pages_destroyed())},
      {"headroom_bytes", static_cast<int64_t>(pool_.free_target()) * P},
      {"step_pages_created", u(counters_.step_pages_created)},
      {"step_page_create_ns", u(counters_.step_page_create_ns)},
      {"background_pages_created", u(counters_.background_pages_created)},
      {"background_page_create_ns", u(counters_.background_page_create_ns)},
      {"page_destroy_ns", u(pool_.destroy_ns())},
      {"oom_events", u(counters_.oom_events)},
      {"reclaimed_pages", u(counters_.reclaimed_pages)},
      {"fence_waits", u(counters_.fence_waits)},
      {"prefetch_shortfall_pages", u(counters_.prefetch_shortfall_pages)},
  };
  for (const CacheFeature* f : features_) f->add_stats(out);
  return out;
}

std::string KVCacheCore::check_invariants() const {
  Lock lock(guard_.mutex());
  if (guard_.closed()) return "";
  const size_t C = geo_.columns();
  std::map<PageHandle, uint32_t> seen;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    const SlotPages& p = s.pages;
    const std::string where = "slot " + std::to_string(i) + ": ";
    if (p.handles().size() != p.mapped() * C)
      return where + "page list does not match mapped count";
    if (s.use.active() && geo_.pages_for(s.use.seq_len()) > p.mapped()) {
      return where + "active slot backs fewer tokens than its length";
    }
    if (p.backed() != geo_.tokens_in(p.mapped())) return where + "cached backed tokens are stale";
    for (size_t k = 0; k < p.handles().size(); ++k) {
      const bool hole = k / C < p.head(static_cast<size_t>(geo_.column_tensor(k % C)));
      if (hole != (p.handles()[k] == kNoPage))
        return where + "released pages are not a per-tensor prefix";
      if (!hole) ++seen[p.handles()[k]];
    }
    if (gate_.in_flight(i) && p.mapped() != gate_.flight().from) {
      return where + "mapped " + std::to_string(p.mapped()) + " pages while pages from " +
             std::to_string(gate_.flight().from) + " are being mapped outside the lock";
    }
  }
  for (PageHandle p : gate_.flight().pages) ++seen[p];  // taken from the pool, not yet published
  for (const CacheFeature* f : features_) {
    const std::string problem = f->check(seen);
    if (!problem.empty()) return problem;
  }
  size_t extra = 0;
  for (const auto& entry : seen) {
    if (pool_.refs(entry.first) != entry.second) {
      return "page " + std::to_string(entry.first) + " is mapped " + std::to_string(entry.second) +
             " times but has refcount " + std::to_string(pool_.refs(entry.first));
    }
    extra += entry.second - 1;
  }
  if (seen.size() != pool_.in_use()) {
    return std::to_string(pool_.in_use()) + " pages in use but " + std::to_string(seen.size()) +
           " are mapped";
  }
  if (extra != pool_.extra_refs()) {
    return "the pool counts " + std::to_string(pool_.extra_refs()) +
           " references beyond the first, but " + std::to_string(extra) + " exist";
  }
  if (pool_.free() + pool_.in_use() != pool_.total()) return "pool free + in use != total";
  return "";
}

// ---- teardown -----------------------------------------------------------------------------------

void KVCacheCore::close() {
  prefetcher_->stop();
  Lock lock(guard_.mutex());
  if (guard_.closed()) return;
  guard_.mark_closed();
  if (registration_) registration_->mark_closed();
  std::exception_ptr first;
  try {
    // Kernels may still read any row, on any stream: wait for all of the device's work before
    // unmapping anything. The host backend has nothing in flight.
    backend_->synchronize();
  } catch (...) {
    first = std::current_exception();
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    const int slot = static_cast<int>(i);
    // A failed unmap leaves the row's record intact (unmap_tail restores it); try once more so a
    // transient failure does not leave mappings behind a reservation about to be freed.
    for (int attempt = 0; attempt < 2 && slots_[i].pages.mapped() > 0; ++attempt) {
      try {
        memory_.unmap_tail(slot, 0);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    memory_.forget_fence(slot);
  }
  supply_.forget_eager();
  for (CacheFeature* f : features_) {
    try {
      f->close();  // swap handles, the staging mapping, the zero page (the stream was waited for)
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  try {
    pool_.destroy_all();
  } catch (...) {
    if (!first) first = std::current_exception();
  }
  // Physical memory and what holds it (host: memfd descriptors) go now, not when the last
  // tensor view lets the object die; the virtual reservations stay until then.
  backend_->release_physical();
  if (first) std::rethrow_exception(first);
}

}  // namespace vattention
