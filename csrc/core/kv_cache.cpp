#include "core/kv_cache.h"

#include <algorithm>
#include <map>

namespace vattention {
namespace {

CacheGeometry checked(CacheGeometry g) {
  g.validate();
  g.derive();
  return g;
}

const std::unique_ptr<Backend>& matching(const std::unique_ptr<Backend>& backend,
                                         const CacheGeometry& geo) {
  if (geo.page_bytes != backend->page_bytes()) {
    throw Error(Error::Kind::Config, "geometry page_bytes=" + std::to_string(geo.page_bytes) +
                                         " differs from the backend's " +
                                         std::to_string(backend->page_bytes()));
  }
  backend->bind_thread();
  return backend;
}

}  // namespace

KVCacheCore::KVCacheCore(std::unique_ptr<Backend> backend, const CacheGeometry& geometry,
                         int64_t budget_bytes, ReclaimPolicy policy, int64_t lookahead_tokens)
    : geo_(checked(geometry)),
      backend_(std::move(backend)),
      mapper_(*matching(backend_, geo_), geo_),
      pool_(*backend_, budget_bytes),
      slots_(geo_.max_batch, geo_.max_seq),
      gate_(pool_),
      blocks_(geo_, pool_, slots_),
      memory_(geo_, *backend_, mapper_, pool_, blocks_, counters_),
      supply_(geo_, *backend_, pool_, slots_, gate_, memory_, counters_, policy),
      scrubber_(*backend_, geo_, mapper_),
      staging_(*backend_, pool_, counters_),
      parts_{geo_,    *backend_, mapper_,   pool_,    slots_, counters_,
             memory_, supply_,   scrubber_, staging_, blocks_},
      windows_(parts_),
      sharing_(parts_, windows_),
      swap_(parts_),
      tables_(parts_),
      // reset_slot runs in this order (released windows, shared pages, then zero what the new
      // request inherits); check() in this order too: the sharing check counts the mappings and
      // the swap handles' references, not the engine blocks' own (added last). stats() lists the
      // features' entries in this order.
      features_{&windows_, &swap_, &sharing_, &scrubber_, &staging_, &blocks_} {
  set_lookahead(lookahead_tokens);
  watch_ = backend_->watch_cache(geo_, mapper_.bases());
  prefetcher_ =
      std::make_unique<Prefetcher>([this](const Prefetcher::Job& job) { run_prefetch(job); });
}

KVCacheCore::~KVCacheCore() {
  try {
    close();
  } catch (...) {
    // Destructors must not throw; close() already released what it could.
  }
  prefetcher_.reset();
  watch_.reset();  // before the ranges go: they may be reused by anything
  // A reservation with live mappings cannot be freed (cuMemAddressFree refuses); if close() could
  // not unmap everything, leaking the address range is the only safe choice.
  for (const Slot& s : slots_) {
    if (s.mapped > 0) mapper_.keep_reserved();
  }
}

bool KVCacheCore::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

KVCacheCore::Lock KVCacheCore::enter(bool exclusive) {
  if (exclusive) prefetcher_->wait();
  Lock lock(mu_);
  // Another thread may have queued a prefetch since (rule R, prefetch_gate.h).
  if (exclusive) gate_.settle(lock);
  check_open();
  rethrow_background_error();
  return lock;
}

void KVCacheCore::check_open() const {
  if (closed_) throw Error(Error::Kind::Closed, "the KV cache is closed; create a new KVCache");
}

void KVCacheCore::rethrow_background_error() {
  if (background_error_) {
    std::exception_ptr e = background_error_;
    background_error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void KVCacheCore::record_background_error(std::exception_ptr error) {
  background_error_ = error;
  ++counters_.prefetch_errors;
}

uint64_t KVCacheCore::driver_calls() const {
  return counters_.driver_calls(pool_.pages_created(), pool_.pages_destroyed());
}

// ---- slots --------------------------------------------------------------------------------------

int KVCacheCore::alloc(const std::vector<std::vector<int64_t>>* hits) {
  Lock lock = enter();
  if (hits != nullptr) tables_.validate_hits(*hits);
  // A slot freed while the prefetch thread maps it is a candidate here, and its new owner may
  // unmap (reset_slot) or map below the range in flight: let that mapping publish first.
  while (gate_.flight().slot >= 0 &&
         slots_[static_cast<size_t>(gate_.flight().slot)].state != Slot::State::Active) {
    gate_.await_publish(lock);  // the thread only starts mappings of active slots
    check_open();
    rethrow_background_error();
  }
  supply_.drain_eager();
  const int best =
      hits == nullptr
          ? slots_.pick_for_alloc()
          : slots_.pick_for_alloc([&](const Slot& s) { return tables_.kept_hits(s, *hits); });
  Slot& s = slots_[static_cast<size_t>(best)];
  // Before the fence goes: features may unmap what the new request must not inherit.
  for (CacheFeature* f : features_) f->reset_slot(s, best);
  // The new owner's writes are ordered after the old owner's reads on the same stream; the fence
  // only guards unmapping, which this slot no longer faces.
  memory_.forget_fence(s);
  s.state = Slot::State::Active;
  s.seq_len = 0;
  s.last_step = slots_.step_count();
  return best;
}

void KVCacheCore::free(int slot, uintptr_t stream) {
  Lock lock = enter();
  slots_.require_active(slot, "slot",
                        "is not allocated (already freed, or never returned by alloc())");
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.mapped > 0) {
    s.fence = backend_->record_fence(stream);  // may throw: before any state change
    s.has_fence = true;
  }
  s.state = s.mapped > 0 ? Slot::State::Idle : Slot::State::Free;
  s.seq_len = 0;
  s.freed_at = slots_.next_free_order();
  if (supply_.policy() == ReclaimPolicy::Eager && s.mapped > 0) {
    supply_.queue_eager(slot);
    supply_.drain_eager();
  }
}

// ---- queries ------------------------------------------------------------------------------------

int64_t KVCacheCore::mapped_tokens(int slot) const {
  Lock lock(mu_);
  check_open();
  slots_.validate(slot);
  return geo_.tokens_in(slots_[static_cast<size_t>(slot)].mapped);
}

int64_t KVCacheCore::seq_len(int slot) const {
  Lock lock(mu_);
  check_open();
  slots_.validate(slot);
  return slots_[static_cast<size_t>(slot)].seq_len;
}

std::vector<int> KVCacheCore::active_slots() const {
  Lock lock(mu_);
  check_open();
  return slots_.active();
}

std::vector<std::vector<int64_t>> KVCacheCore::block_table(int slot) const {
  Lock lock(mu_);
  check_open();
  slots_.validate(slot);
  return slots_[static_cast<size_t>(slot)].table;
}

void KVCacheCore::use_blocks(int64_t num_blocks, bool cache) {
  Lock lock = enter(/*exclusive=*/true);
  if (num_blocks < 0) {
    throw Error(Error::Kind::Config,
                "num_blocks=" + std::to_string(num_blocks) + " must be >= 0 (0: no engine blocks)");
  }
  if (slots_.step_count() > 0 || !slots_.active().empty() ||
      std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.mapped > 0; })) {
    throw Error(Error::Kind::Config,
                "use_blocks() names pages by engine blocks from a cache's start: this cache has "
                "already mapped pages");
  }
  blocks_.configure(num_blocks, cache);
}

std::vector<int64_t> KVCacheCore::window_starts(int slot) const {
  Lock lock(mu_);
  check_open();
  slots_.validate(slot);
  return windows_.starts(slot);
}

Stats KVCacheCore::stats() const {
  Lock lock(mu_);
  check_open();
  int64_t active = 0, idle = 0, free_slots = 0, tokens = 0, mappings = 0;
  for (const Slot& s : slots_) {
    mappings += static_cast<int64_t>(s.live_pages(geo_));
    if (s.state == Slot::State::Active) {
      ++active;
      tokens += s.seq_len;
    } else if (s.state == Slot::State::Idle) {
      ++idle;
    } else {
      ++free_slots;
    }
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
      {"oom_events", u(counters_.oom_events)},
      {"reclaimed_pages", u(counters_.reclaimed_pages)},
      {"fence_waits", u(counters_.fence_waits)},
      {"prefetch_shortfall_pages", u(counters_.prefetch_shortfall_pages)},
  };
  for (const CacheFeature* f : features_) f->add_stats(out);
  return out;
}

std::string KVCacheCore::check_invariants() const {
  Lock lock(mu_);
  if (closed_) return "";
  const size_t T = static_cast<size_t>(geo_.num_tensors());
  const size_t C = geo_.columns();
  std::map<PageHandle, uint32_t> seen;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    const std::string where = "slot " + std::to_string(i) + ": ";
    if (s.pages.size() != s.mapped * C) return where + "page list does not match mapped count";
    if (s.state == Slot::State::Free && s.mapped != 0) return where + "free slot holds pages";
    if (s.state == Slot::State::Idle && s.mapped == 0) return where + "idle slot without pages";
    if (s.state == Slot::State::Active && geo_.pages_for(s.seq_len) > s.mapped) {
      return where + "active slot backs fewer tokens than its length";
    }
    if (s.backed != geo_.tokens_in(s.mapped)) return where + "cached backed tokens are stale";
    if (!s.head.empty() && s.head.size() != T) return where + "head has the wrong size";
    for (size_t k = 0; k < s.pages.size(); ++k) {
      const bool hole = k / C < s.head_of(static_cast<size_t>(geo_.column_tensor(k % C)));
      if (hole != (s.pages[k] == kNoPage))
        return where + "released pages are not a per-tensor prefix";
      if (!hole) ++seen[s.pages[k]];
    }
    if (gate_.in_flight(i) && s.mapped != gate_.flight().from) {
      return where + "mapped " + std::to_string(s.mapped) + " pages while pages from " +
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

// ---- prefix sharing, swap -----------------------------------------------------------------------

void KVCacheCore::refuse_with_blocks(const char* call) const {
  if (!blocks_.enabled()) return;
  throw Error(Error::Kind::Config,
              std::string(call) +
                  "() is not available on a cache whose pages are named by "
                  "engine blocks (num_blocks=" +
                  std::to_string(blocks_.num_blocks()) +
                  "): the engine shares and moves pages through its block tables");
}

int KVCacheCore::fork(int src, int64_t num_tokens, uintptr_t stream) {
  Lock lock = enter(/*exclusive=*/true);
  refuse_with_blocks("fork");
  supply_.drain_eager();
  slots_.validate(src);
  const int64_t n = num_tokens < 0 ? slots_[static_cast<size_t>(src)].seq_len : num_tokens;
  sharing_.check_source(src, n);
  // dst stays free or idle until share() commits, so reclaiming its pages meanwhile waits on its
  // fence like any idle slot's, and a failure leaves it as it was.
  const int dst = slots_.pick_fresh();
  sharing_.share(src, dst, n, stream);
  return dst;
}

void KVCacheCore::share_prefix(int src, int dst, int64_t num_tokens, uintptr_t stream) {
  Lock lock = enter(/*exclusive=*/true);
  refuse_with_blocks("share_prefix");
  sharing_.check_pair(src, dst, num_tokens);
  sharing_.share(src, dst, num_tokens, stream);
}

size_t KVCacheCore::ensure_private(int slot, int64_t start_token, uintptr_t stream) {
  Lock lock = enter(/*exclusive=*/true);
  refuse_with_blocks("ensure_private");
  return sharing_.ensure_private(slot, start_token, stream);
}

int64_t KVCacheCore::swap_out(int slot, uintptr_t stream) {
  Lock lock = enter(/*exclusive=*/true);
  refuse_with_blocks("swap_out");
  return swap_.swap_out(slot, stream);
}

int KVCacheCore::swap_in(int64_t handle, uintptr_t stream) {
  Lock lock = enter(/*exclusive=*/true);
  refuse_with_blocks("swap_in");
  supply_.drain_eager();
  return swap_.swap_in(handle, stream);
}

void KVCacheCore::swap_drop(int64_t handle) {
  Lock lock(mu_);
  check_open();
  swap_.drop(handle);
}

void KVCacheCore::set_swap_budget(int64_t budget_bytes) {
  Lock lock(mu_);
  check_open();
  swap_.set_budget(budget_bytes);
}

std::vector<int> KVCacheCore::pick_victims(size_t bytes_needed) const {
  Lock lock(mu_);
  check_open();
  return swap_.pick_victims(bytes_needed);
}

// ---- teardown -----------------------------------------------------------------------------------

void KVCacheCore::close() {
  prefetcher_->stop();
  Lock lock(mu_);
  if (closed_) return;
  closed_ = true;
  if (watch_) watch_->mark_closed();
  std::exception_ptr first;
  try {
    // Kernels may still read active slots: wait for the legacy default stream (which orders after
    // all blocking streams) before unmapping anything. The host backend has nothing in flight.
    memory_.sync_stream(0);
  } catch (...) {
    first = std::current_exception();
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    // A failed unmap leaves the slot's record intact (unmap_tail restores it); try once more so a
    // transient failure does not leave mappings behind a reservation about to be freed.
    for (int attempt = 0; attempt < 2 && slots_[i].mapped > 0; ++attempt) {
      try {
        memory_.unmap_tail(slots_[i], static_cast<int>(i), 0);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    memory_.forget_fence(slots_[i]);
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
