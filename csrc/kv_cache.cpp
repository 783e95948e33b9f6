#include "kv_cache.h"

#include <algorithm>
#include <climits>
#include <limits>
#include <map>

namespace vattention {
namespace {

std::string slot_range(int64_t max_batch) { return "[0, " + std::to_string(max_batch) + ")"; }

CacheGeometry checked(CacheGeometry g) {
  g.validate();
  g.derive();
  return g;
}

}  // namespace

KVCacheCore::KVCacheCore(std::unique_ptr<Backend> backend, const CacheGeometry& geometry,
                         int64_t budget_bytes, ReclaimPolicy policy, int64_t lookahead_tokens)
    : geo_(checked(geometry)), policy_(policy), backend_(std::move(backend)), lookahead_tokens_(0) {
  if (geo_.page_bytes != backend_->page_bytes()) {
    throw Error(Error::Kind::Config, "geometry page_bytes=" + std::to_string(geo_.page_bytes) +
                                         " differs from the backend's " +
                                         std::to_string(backend_->page_bytes()));
  }
  set_lookahead(lookahead_tokens);
  backend_->bind_thread();
  try {
    for (int t = 0; t < geo_.num_tensors(); ++t) bases_.push_back(backend_->reserve(geo_.tensor_bytes(t)));
  } catch (...) {
    for (size_t t = 0; t < bases_.size(); ++t) {
      backend_->release_va(bases_[t], geo_.tensor_bytes(static_cast<int>(t)));
    }
    throw;
  }
  if (backend_->name() == "host") {
    FaultGeometry fg;
    fg.num_layers = geo_.num_layers;
    fg.max_batch = geo_.max_batch;
    fg.max_seq = geo_.max_seq;
    fg.mega = geo_.mega;
    for (int t = 0; t < geo_.num_tensors(); ++t) {
      fg.slot_bytes.push_back(geo_.slot_bytes(t));
      fg.token_bytes.push_back(geo_.token_bytes(t));
      fg.tensor_bytes.push_back(geo_.tensor_bytes(t));
    }
    fg.layer_bytes = geo_.layer_token_bytes(0);
    fault_report_ = std::make_unique<FaultReport>(fg, bases_);
  }
  pool_ = std::make_unique<PagePool>(*backend_, budget_bytes);
  slots_.resize(static_cast<size_t>(geo_.max_batch));
  for (Slot& s : slots_) refresh_release_at(s);
  swap_ = std::make_unique<SwapStore>(*backend_, geo_.page_bytes);
  prefetcher_ = std::make_unique<Prefetcher>([this](const Prefetcher::Job& job) { run_prefetch(job); });
}

KVCacheCore::~KVCacheCore() {
  try {
    close();
  } catch (...) {
    // Destructors must not throw; close() already released what it could.
  }
  // A reservation with live mappings cannot be freed (cuMemAddressFree refuses); if close() could
  // not unmap everything, leaking the address range is the only safe choice.
  for (const Slot& s : slots_) {
    if (s.mapped > 0) return;
  }
  if (staged_) staging_.va = 0;  // still mapped: leak the staging range too
  fault_report_.reset();  // before the ranges go: they may be reused by anything
  for (size_t t = 0; t < bases_.size(); ++t) {
    try {
      backend_->release_va(bases_[t], geo_.tensor_bytes(static_cast<int>(t)));
    } catch (...) {
    }
  }
}

bool KVCacheCore::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
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

void KVCacheCore::validate_slot(int slot) const {
  if (slot < 0 || slot >= geo_.max_batch) {
    throw Error(Error::Kind::InvalidSlot, "slot=" + std::to_string(slot) + " is out of range " +
                                              slot_range(geo_.max_batch) + " (max_batch_size=" +
                                              std::to_string(geo_.max_batch) + ")")
        .with("slot", slot)
        .with("max_batch_size", geo_.max_batch);
  }
}

void KVCacheCore::require_active(int slot, const char* role, const char* why) const {
  validate_slot(slot);
  if (slots_[static_cast<size_t>(slot)].state != Slot::State::Active) {
    throw Error(Error::Kind::InvalidSlot, std::string(role) + "=" + std::to_string(slot) + " " + why)
        .with("slot", slot);
  }
}

Error KVCacheCore::no_free_slot() const {
  return Error(Error::Kind::InvalidSlot, "no free slot: all max_batch_size=" +
                                             std::to_string(geo_.max_batch) +
                                             " slots are active; free one first")
      .with("max_batch_size", geo_.max_batch);
}

void KVCacheCore::validate_lens(const std::vector<int64_t>& lens, bool require_active) const {
  if (static_cast<int64_t>(lens.size()) != geo_.max_batch) {
    throw Error(Error::Kind::InvalidSlot, "seq_lens has " + std::to_string(lens.size()) +
                                              " entries; a sequence must have max_batch_size=" +
                                              std::to_string(geo_.max_batch));
  }
  for (size_t i = 0; i < lens.size(); ++i) {
    const int64_t len = lens[i];
    if (len == kUnlisted) continue;
    if (len < 0 || len > geo_.max_seq) {
      throw Error(Error::Kind::SequenceTooLong,
                  "seq_lens[slot=" + std::to_string(i) + "]=" + std::to_string(len) +
                      (len < 0 ? " is negative" : " exceeds max_seq_len") + "; lengths must be in [0, " +
                      std::to_string(geo_.max_seq) + "] (max_seq_len=" + std::to_string(geo_.max_seq) +
                      ")")
          .with("slot", static_cast<int64_t>(i))
          .with("seq_len", len)
          .with("max_seq_len", geo_.max_seq);
    }
    if (require_active && slots_[i].state != Slot::State::Active) {
      throw Error(Error::Kind::InvalidSlot, "slot=" + std::to_string(i) + " has length " +
                                                std::to_string(len) +
                                                " but is not allocated (call alloc() first)")
          .with("slot", static_cast<int64_t>(i));
    }
  }
}

uintptr_t KVCacheCore::page_va(int tensor, int slot, size_t page) const {
  return bases_[static_cast<size_t>(tensor)] + static_cast<size_t>(slot) * geo_.slot_bytes(tensor) +
         page * geo_.index_bytes(tensor);
}

uintptr_t KVCacheCore::column_va(size_t column, int slot, size_t page) const {
  return page_va(geo_.column_tensor(column), slot, page) + geo_.column_sub(column) * geo_.page_bytes;
}

// ---- slots --------------------------------------------------------------------------------------

int KVCacheCore::alloc() {
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
  // A slot freed while the prefetch thread maps it is a candidate here, and its new owner may
  // unmap (forget_sharing) or map below the range in flight: let that mapping publish first.
  while (inflight_.slot >= 0 &&
         slots_[static_cast<size_t>(inflight_.slot)].state != Slot::State::Active) {
    await_publish(lock);  // the thread only starts mappings of active slots
    check_open();
    rethrow_background_error();
  }
  drain_eager();
  int best = -1;
  for (int i = 0; i < geo_.max_batch; ++i) {
    const Slot& s = slots_[static_cast<size_t>(i)];
    if (s.state == Slot::State::Idle) {
      const Slot* b = best < 0 ? nullptr : &slots_[static_cast<size_t>(best)];
      if (!b || b->state != Slot::State::Idle || s.mapped > b->mapped) best = i;
    } else if (s.state == Slot::State::Free && best < 0) {
      best = i;
    }
  }
  if (best < 0) throw no_free_slot();
  Slot& s = slots_[static_cast<size_t>(best)];
  forget_sharing(s, best);  // before the fence goes: it may unmap
  forget_window(s, best);   // the new request starts at token 0, which a window may have released
  scrub_pages(best, 0, s.mapped);  // the previous request's tokens must not reach the new one
  if (s.has_fence) {
    // The new owner's writes are ordered after the old owner's reads on the same stream; the
    // fence only guards unmapping, which this slot no longer faces.
    backend_->fence_release(s.fence);
    s.has_fence = false;
  }
  s.state = Slot::State::Active;
  s.seq_len = 0;
  s.last_step = step_counter_;
  return best;
}

void KVCacheCore::free(int slot, uintptr_t stream) {
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
  require_active(slot, "slot", "is not allocated (already freed, or never returned by alloc())");
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.mapped > 0) {
    s.fence = backend_->record_fence(stream);  // may throw: before any state change
    s.has_fence = true;
  }
  s.state = s.mapped > 0 ? Slot::State::Idle : Slot::State::Free;
  s.seq_len = 0;
  s.freed_at = ++free_counter_;
  if (policy_ == ReclaimPolicy::Eager && s.mapped > 0) {
    eager_pending_.push_back(slot);
    drain_eager();
  }
}

// ---- step and growth ----------------------------------------------------------------------------

bool KVCacheCore::step(const std::vector<int64_t>& lens, uintptr_t stream, bool fast_only) {
  if (fast_only) {
    // The decode hot path: nothing to map. One pass, no division (slot.backed is cached). Work
    // the prefetch thread still has queued is for later iterations: no need to wait for it.
    Lock lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    check_open();
    rethrow_background_error();
    if (!eager_pending_.empty()) return false;
    if (static_cast<int64_t>(lens.size()) != geo_.max_batch) validate_lens(lens, true);
    for (size_t i = 0; i < lens.size(); ++i) {
      const int64_t len = lens[i];
      if (len == kUnlisted) continue;
      if (len < 0 || len > geo_.max_seq || slots_[i].state != Slot::State::Active) {
        validate_lens(lens, true);  // throws the precise error
      }
      const Slot& s = slots_[i];
      if (len > s.backed) return false;
      // A window page to release (release_at is INT64_MAX without windows), or a rewind to check.
      if (std::min(s.seq_len, len - 1) >= s.release_at || (len < s.seq_len && !s.head.empty())) {
        return false;
      }
    }
    commit_step(lens);
    return true;
  }
  Lock lock(mu_);
  std::vector<Growth> plan = plan_step(lens);
  for (;;) {
    // The prefetch thread may be mapping one of these slots outside the lock: that range is its
    // own until it publishes, and this step needs those pages, so wait for it and plan again.
    // Slots it is not mapping are mapped here, in parallel with it: step() never waits for a
    // driver call it does not need. Pages it holds in flight are not in the pool either: when the
    // pool cannot cover the plan without them, wait too (they become trimmable look-ahead).
    bool wait = false;
    size_t need = 0;
    for (const Growth& g : plan) {
      wait = wait || in_flight(static_cast<size_t>(g.slot));
      need += (g.to - g.from) * geo_.columns();
    }
    if ((inflight_.slot >= 0 || pool_->creating() > 0) && need > 0 &&
        pool_->headroom() != std::numeric_limits<size_t>::max() &&
        pool_->free() + pool_->headroom() < need) {
      wait = true;
    }
    if (!wait) break;
    await_publish(lock);  // only this mapping: the thread may go on to other slots meanwhile
    plan = plan_step(lens);
  }
  std::vector<int64_t> old_lens(lens.size());
  for (size_t i = 0; i < lens.size(); ++i) old_lens[i] = slots_[i].seq_len;
  // New lengths first, so pages beyond them (look-ahead) are the only ones trimmed under pressure.
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] != kUnlisted) slots_[i].seq_len = std::max(lens[i], old_lens[i]);
  }
  const uint64_t calls_before = vmm_calls();
  try {
    try {
      grow(plan, false);
    } catch (const Error& e) {
      // Window pages no query of this step reads may cover the shortfall: release them, retry once.
      if (e.kind() != Error::Kind::OutOfPages || release_windows(lens, old_lens, stream) == 0) throw;
      --counters_.oom_events;  // not raised after all unless the retry fails too
      grow(plan, false);
    }
  } catch (...) {
    counters_.step_driver_calls += vmm_calls() - calls_before;
    for (size_t i = 0; i < lens.size(); ++i) slots_[i].seq_len = old_lens[i];
    throw;
  }
  counters_.step_driver_calls += vmm_calls() - calls_before;
  commit_step(lens);
  release_windows(lens, old_lens, stream);
  return true;
}

bool KVCacheCore::outside_lock_work() const {
  // pool_ is gone after close(), which joined the prefetch thread first: nothing is outside then.
  return inflight_.slot >= 0 || (pool_ && pool_->creating() > 0);
}

void KVCacheCore::settle(Lock& lock) {
  settled_.wait(lock, [this] { return !outside_lock_work(); });
}

void KVCacheCore::await_publish(Lock& lock) {
  if (!outside_lock_work()) return;
  const uint64_t seen = publishes_;
  settled_.wait(lock, [this, seen] { return publishes_ != seen; });
}

std::vector<KVCacheCore::Growth> KVCacheCore::plan_step(const std::vector<int64_t>& lens) {
  check_open();
  rethrow_background_error();
  drain_eager();
  validate_lens(lens, true);
  std::vector<Growth> plan;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == kUnlisted) continue;
    if (!slots_[i].head.empty()) check_window(static_cast<int>(i), lens[i], "seq_lens[slot]");
    const size_t need = geo_.pages_for(lens[i]);
    if (need > slots_[i].mapped) plan.push_back(Growth{static_cast<int>(i), slots_[i].mapped, need});
  }
  return plan;
}

void KVCacheCore::commit_step(const std::vector<int64_t>& lens) {
  ++step_counter_;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == kUnlisted) continue;
    slots_[i].seq_len = lens[i];
    slots_[i].last_step = step_counter_;
  }
  ++counters_.steps;
}

void KVCacheCore::grow(const std::vector<Growth>& plan, bool from_prefetch) {
  const size_t C = geo_.columns();
  size_t need = 0;
  for (const Growth& g : plan) need += (g.to - g.from) * C;
  if (need == 0) return;
  std::vector<PageHandle> pages;
  try {
    pages = obtain(need, plan, !from_prefetch);
  } catch (const Error& e) {
    if (e.kind() == Error::Kind::OutOfPages && !from_prefetch) ++counters_.oom_events;
    throw;
  }
  size_t used = 0;
  size_t done = 0;
  try {
    for (const Growth& g : plan) {
      map_slot(g.slot, g.from, g.to, pages.data() + used, from_prefetch);
      used += (g.to - g.from) * C;
      ++done;
      scrub_pages(g.slot, g.from, g.to);  // a failure unmaps this slot's growth too
    }
  } catch (...) {
    for (size_t k = 0; k < done; ++k) {
      try {
        unmap_tail(slots_[static_cast<size_t>(plan[k].slot)], plan[k].slot, plan[k].from);
      } catch (...) {
      }
    }
    for (size_t i = used; i < pages.size(); ++i) pool_->release(pages[i]);
    throw;
  }
}

void KVCacheCore::map_slot(int slot, size_t from, size_t to, const PageHandle* pages,
                           bool from_prefetch) {
  const int T = geo_.num_tensors();
  const size_t count = to - from;
  const std::vector<size_t> first = first_pages(from, to, pages);
  map_pages(slot, from, to, pages);
  bool holes = false;
  for (int t = 0; t < T; ++t) {
    const size_t begin = first[static_cast<size_t>(t)];
    holes = holes || begin > from;
    if (begin == to) continue;
    const size_t mapped = (to - begin) * geo_.index_pages(t);
    counters_.map_calls += mapped;
    (from_prefetch ? counters_.prefetch_map_calls : counters_.step_map_calls) += mapped;
    ++counters_.set_access_calls;
    // The prefetch thread populates after dropping the lock (prefetch_slot), not here.
    if (!from_prefetch) backend_->prefault(page_va(t, slot, begin), (to - begin) * geo_.index_bytes(t));
  }
  Slot& s = slots_[static_cast<size_t>(slot)];
  s.pages.insert(s.pages.end(), pages, pages + count * geo_.columns());
  if (holes) {
    // Holes only extend a prefix that is already all holes (from == head[t], e.g. a fresh slot).
    if (s.head.empty()) s.head.assign(static_cast<size_t>(T), 0);
    for (size_t t = 0; t < static_cast<size_t>(T); ++t) {
      if (first[t] > from) s.head[t] = first[t];
    }
  }
  s.mapped = to;
  s.backed = geo_.tokens_in(to);
  if (holes) refresh_release_at(s);
}

std::vector<size_t> KVCacheCore::first_pages(size_t from, size_t to,
                                             const PageHandle* pages) const {
  // Pages restored by fork or swap-in may hold released window pages (kNoPage) as a prefix of
  // each tensor (all of a tensor's columns together): tensor t maps [first[t], to) only.
  const int T = geo_.num_tensors();
  const size_t C = geo_.columns();
  std::vector<size_t> first(static_cast<size_t>(T), from);
  for (int t = 0; t < T; ++t) {
    size_t& f = first[static_cast<size_t>(t)];
    while (f < to && pages[(f - from) * C + geo_.first_column(t)] == kNoPage) ++f;
  }
  return first;
}

size_t KVCacheCore::map_pages(int slot, size_t from, size_t to, const PageHandle* pages) const {
  const int T = geo_.num_tensors();
  const size_t C = geo_.columns();
  const size_t P = geo_.page_bytes;
  const std::vector<size_t> first = first_pages(from, to, pages);
  size_t calls = 0;
  int tensors_done = 0;
  size_t pages_done = 0;  // physical pages mapped in the tensor being mapped
  try {
    for (int t = 0; t < T; ++t) {
      const size_t begin = first[static_cast<size_t>(t)];
      if (begin == to) {
        tensors_done = t + 1;
        continue;
      }
      map_run(t, slot, begin, to, pages + (begin - from) * C, pages_done);
      calls += pages_done + 1;
      tensors_done = t + 1;
      pages_done = 0;
    }
  } catch (...) {
    try {
      // One unmap per contiguous run: the tensors done, then the part of the one that failed.
      for (int t = 0; t < tensors_done; ++t) {
        const size_t begin = first[static_cast<size_t>(t)];
        if (begin < to) backend_->unmap(page_va(t, slot, begin), (to - begin) * geo_.index_bytes(t));
      }
      if (pages_done > 0) {
        backend_->unmap(page_va(tensors_done, slot, first[static_cast<size_t>(tensors_done)]),
                        pages_done * P);
      }
    } catch (...) {
      // Secondary failure while undoing: the first error is the one the caller needs.
    }
    throw;
  }
  return calls;
}

void KVCacheCore::map_run(int t, int slot, size_t begin, size_t end, const PageHandle* row,
                          size_t& mapped) const {
  // Tensor t's pages for [begin, end) form one contiguous run of index_pages(t) per index.
  const size_t C = geo_.columns(), P = geo_.page_bytes;
  const size_t n = geo_.index_pages(t), column = geo_.first_column(t);
  const uintptr_t va = page_va(t, slot, begin);
  for (size_t p = 0; p < end - begin; ++p) {
    for (size_t j = 0; j < n; ++j) {
      backend_->map(va + mapped * P, row[p * C + column + j]);
      ++mapped;
    }
  }
  // One access grant per contiguous run of new pages, not one per page.
  backend_->set_access(va, mapped * P);
}

uint64_t KVCacheCore::vmm_calls() const {
  return counters_.map_calls + counters_.set_access_calls + counters_.unmap_calls +
         pool_->pages_created() + pool_->pages_destroyed();
}

// ---- queries ------------------------------------------------------------------------------------

int64_t KVCacheCore::mapped_tokens(int slot) const {
  Lock lock(mu_);
  check_open();
  validate_slot(slot);
  return geo_.tokens_in(slots_[static_cast<size_t>(slot)].mapped);
}

int64_t KVCacheCore::seq_len(int slot) const {
  Lock lock(mu_);
  check_open();
  validate_slot(slot);
  return slots_[static_cast<size_t>(slot)].seq_len;
}

std::vector<int> KVCacheCore::active_slots() const {
  Lock lock(mu_);
  check_open();
  std::vector<int> out;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state == Slot::State::Active) out.push_back(static_cast<int>(i));
  }
  return out;
}

std::vector<std::pair<std::string, int64_t>> KVCacheCore::stats() const {
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
  const auto total = static_cast<int64_t>(pool_->total());
  const auto in_use = static_cast<int64_t>(pool_->in_use());
  auto u = [](uint64_t v) { return static_cast<int64_t>(v); };
  std::vector<std::pair<std::string, int64_t>> out = {
      {"page_bytes", P},
      {"tokens_per_page", static_cast<int64_t>(geo_.tokens_per_page())},
      {"pages_total", total},
      {"pages_free", static_cast<int64_t>(pool_->free())},
      {"pages_mapped", in_use},
      {"mappings", mappings},
      {"bytes_mapped", in_use * P},
      {"bytes_reserved", total * P},
      {"bytes_used_by_tokens", tokens * geo_.bytes_per_token()},
      {"virtual_bytes", static_cast<int64_t>(geo_.virtual_bytes())},
      {"committed_bytes", backend_->committed_bytes()},
      {"memory_budget", pool_->budget_bytes()},
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
      {"pages_created", u(pool_->pages_created())},
      {"pages_destroyed", u(pool_->pages_destroyed())},
      {"oom_events", u(counters_.oom_events)},
      {"reclaimed_pages", u(counters_.reclaimed_pages)},
      {"fence_waits", u(counters_.fence_waits)},
      {"prefetch_shortfall_pages", u(counters_.prefetch_shortfall_pages)},
      {"window_released_pages", u(window_released_pages_)},
  };
  sharing_stats(out);
  scrub_stats(out);
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
      const bool hole = k / C < head_of(s, static_cast<size_t>(geo_.column_tensor(k % C)));
      if (hole != (s.pages[k] == kNoPage)) return where + "released pages are not a per-tensor prefix";
      if (!hole) ++seen[s.pages[k]];
    }
    if (in_flight(i) && s.mapped != inflight_.from) {
      return where + "mapped " + std::to_string(s.mapped) + " pages while pages from " +
             std::to_string(inflight_.from) + " are being mapped outside the lock";
    }
  }
  for (PageHandle p : inflight_.pages) ++seen[p];  // taken from the pool, not yet published
  const std::string sharing = check_sharing(seen);
  if (!sharing.empty()) return sharing;
  for (const auto& entry : seen) {
    if (pool_->refs(entry.first) != entry.second) {
      return "page " + std::to_string(entry.first) + " is mapped " + std::to_string(entry.second) +
             " times but has refcount " + std::to_string(pool_->refs(entry.first));
    }
  }
  if (seen.size() != pool_->in_use()) {
    return std::to_string(pool_->in_use()) + " pages in use but " + std::to_string(seen.size()) +
           " are mapped";
  }
  if (pool_->free() + pool_->in_use() != pool_->total()) return "pool free + in use != total";
  return "";
}

// ---- teardown -----------------------------------------------------------------------------------

void KVCacheCore::close() {
  prefetcher_->stop();
  Lock lock(mu_);
  if (closed_) return;
  closed_ = true;
  if (fault_report_) fault_report_->mark_closed();
  std::exception_ptr first;
  try {
    // Kernels may still read active slots: wait for the legacy default stream (which orders after
    // all blocking streams) before unmapping anything. The host backend has nothing in flight.
    const uint64_t fence = backend_->record_fence(0);
    backend_->fence_wait(fence);
    backend_->fence_release(fence);
  } catch (...) {
    first = std::current_exception();
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    // A failed unmap leaves the slot's record intact (unmap_tail restores it); try once more so a
    // transient failure does not leave mappings behind a reservation about to be freed.
    for (int attempt = 0; attempt < 2 && slots_[i].mapped > 0; ++attempt) {
      try {
        unmap_tail(slots_[i], static_cast<int>(i), 0);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (slots_[i].has_fence) {
      backend_->fence_release(slots_[i].fence);
      slots_[i].has_fence = false;
    }
  }
  eager_pending_.clear();
  swap_->clear();  // host blocks go; device references die with the pool
  for (int attempt = 0; attempt < 2 && staged_; ++attempt) {
    try {
      unstage();  // a staging mapping left by a failed unmap (it retries once itself)
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  try {
    pool_->destroy_all();
  } catch (...) {
    if (!first) first = std::current_exception();
  }
  pool_.reset();
  if (zero_block_) {  // the zeroing copies were on the legacy stream, waited for above
    backend_->free_host(zero_block_);
    zero_block_ = nullptr;
  }
  // Physical memory and what holds it (host: memfd descriptors) go now, not when the last
  // tensor view lets the object die; the virtual reservations stay until then.
  backend_->release_physical();
  if (first) std::rethrow_exception(first);
}

}  // namespace vattention
