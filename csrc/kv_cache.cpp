#include "kv_cache.h"

#include <algorithm>
#include <climits>
#include <limits>
#include <map>

namespace vattention {
namespace {

std::string slot_range(int64_t max_batch) { return "[0, " + std::to_string(max_batch) + ")"; }

Error out_of_pages(const std::string& what, size_t needed, size_t available, size_t page_bytes) {
  return Error(Error::Kind::OutOfPages,
               what + " needs " + std::to_string(needed) + " more pages of " +
                   std::to_string(page_bytes) + " bytes, but only " + std::to_string(available) +
                   " can be had (free, creatable within the budget, or reclaimable); nothing was "
                   "mapped: preempt a request or raise the memory budget")
      .with("pages_needed", static_cast<int64_t>(needed))
      .with("pages_available", static_cast<int64_t>(available));
}

}  // namespace

KVCacheCore::KVCacheCore(std::unique_ptr<Backend> backend, const CacheGeometry& geometry,
                         int64_t budget_bytes, ReclaimPolicy policy, int64_t lookahead_tokens)
    : geo_(geometry), policy_(policy), backend_(std::move(backend)), lookahead_tokens_(0) {
  geo_.validate();
  if (geo_.page_bytes != backend_->page_bytes()) {
    throw Error(Error::Kind::Config, "geometry page_bytes=" + std::to_string(geo_.page_bytes) +
                                         " differs from the backend's " +
                                         std::to_string(backend_->page_bytes()));
  }
  set_lookahead(lookahead_tokens);
  backend_->bind_thread();
  const size_t bytes = geo_.tensor_bytes();
  try {
    for (int t = 0; t < geo_.num_tensors(); ++t) bases_.push_back(backend_->reserve(bytes));
  } catch (...) {
    for (uintptr_t base : bases_) backend_->release_va(base, bytes);
    throw;
  }
  pool_ = std::make_unique<PagePool>(*backend_, budget_bytes);
  slots_.resize(static_cast<size_t>(geo_.max_batch));
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
  for (uintptr_t base : bases_) {
    try {
      backend_->release_va(base, geo_.tensor_bytes());
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
  return bases_[static_cast<size_t>(tensor)] + static_cast<size_t>(slot) * geo_.slot_bytes() +
         page * geo_.page_bytes;
}

// ---- slots --------------------------------------------------------------------------------------

int KVCacheCore::alloc() {
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
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
  if (best < 0) {
    throw Error(Error::Kind::InvalidSlot, "no free slot: all max_batch_size=" +
                                              std::to_string(geo_.max_batch) +
                                              " slots are active; free one first")
        .with("max_batch_size", geo_.max_batch);
  }
  Slot& s = slots_[static_cast<size_t>(best)];
  forget_sharing(s, best);  // before the fence goes: it may unmap
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
  validate_slot(slot);
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.state != Slot::State::Active) {
    throw Error(Error::Kind::InvalidSlot, "slot=" + std::to_string(slot) +
                                              " is not allocated (already freed, or never "
                                              "returned by alloc())")
        .with("slot", slot);
  }
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

void KVCacheCore::drain_eager() {
  if (eager_pending_.empty()) return;
  std::vector<int> still;
  for (int i : eager_pending_) {
    Slot& s = slots_[static_cast<size_t>(i)];
    if (s.state != Slot::State::Idle) continue;  // reallocated meanwhile: nothing to reclaim
    if (s.has_fence && !backend_->fence_done(s.fence)) {
      still.push_back(i);
      continue;
    }
    counters_.reclaimed_pages += s.mapped * static_cast<size_t>(geo_.num_tensors());
    unmap_tail(s, i, 0);
  }
  eager_pending_.swap(still);
}

// ---- step and growth ----------------------------------------------------------------------------

bool KVCacheCore::step(const std::vector<int64_t>& lens, uintptr_t /*stream*/, bool fast_only) {
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
      if (len > slots_[i].backed) return false;
    }
    commit_step(lens);
    return true;
  }
  Lock lock(mu_);
  std::vector<Growth> plan = plan_step(lens);
  if (!plan.empty() && !prefetcher_->idle()) {
    // Pages are missing and the prefetch thread may be mapping them right now: let it finish
    // instead of racing it for the same pages, then plan again (other callers may have run).
    lock.unlock();
    prefetcher_->wait();
    lock.lock();
    plan = plan_step(lens);
  }
  std::vector<int64_t> old_lens(lens.size());
  for (size_t i = 0; i < lens.size(); ++i) old_lens[i] = slots_[i].seq_len;
  // New lengths first, so pages beyond them (look-ahead) are the only ones trimmed under pressure.
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] != kUnlisted) slots_[i].seq_len = std::max(lens[i], old_lens[i]);
  }
  try {
    grow(plan, false);
  } catch (...) {
    for (size_t i = 0; i < lens.size(); ++i) slots_[i].seq_len = old_lens[i];
    throw;
  }
  commit_step(lens);
  return true;
}

std::vector<KVCacheCore::Growth> KVCacheCore::plan_step(const std::vector<int64_t>& lens) {
  check_open();
  rethrow_background_error();
  drain_eager();
  validate_lens(lens, true);
  std::vector<Growth> plan;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == kUnlisted) continue;
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
  const size_t T = static_cast<size_t>(geo_.num_tensors());
  size_t need = 0;
  for (const Growth& g : plan) need += (g.to - g.from) * T;
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
      used += (g.to - g.from) * T;
      ++done;
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

size_t KVCacheCore::spare_pages(const std::vector<Growth>& plan, bool allow_trim) const {
  if (any_sharing()) return freeable_spare(plan, allow_trim);
  const size_t T = static_cast<size_t>(geo_.num_tensors());
  size_t spare = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.state == Slot::State::Idle) {
      spare += s.mapped * T;
    } else if (allow_trim && s.state == Slot::State::Active) {
      bool growing = std::any_of(plan.begin(), plan.end(),
                                 [&](const Growth& g) { return g.slot == static_cast<int>(i); });
      const size_t keep = geo_.pages_for(s.seq_len);
      if (!growing && s.mapped > keep) spare += (s.mapped - keep) * T;
    }
  }
  return spare;
}

size_t KVCacheCore::release_spare(size_t n, const std::vector<Growth>& plan, bool allow_trim) {
  const size_t T = static_cast<size_t>(geo_.num_tensors());
  size_t released = 0;
  while (released < n) {
    // Idle slots first, least recently freed first.
    int victim = -1;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (s.state == Slot::State::Idle && s.mapped > 0 &&
          (victim < 0 || s.freed_at < slots_[static_cast<size_t>(victim)].freed_at)) {
        victim = static_cast<int>(i);
      }
    }
    size_t keep_floor = 0;
    if (victim < 0 && allow_trim) {
      // Then look-ahead of active slots beyond their length, largest excess first.
      size_t best_excess = 0;
      for (size_t i = 0; i < slots_.size(); ++i) {
        const Slot& s = slots_[i];
        if (s.state != Slot::State::Active) continue;
        if (std::any_of(plan.begin(), plan.end(),
                        [&](const Growth& g) { return g.slot == static_cast<int>(i); })) {
          continue;
        }
        const size_t keep = geo_.pages_for(s.seq_len);
        if (s.mapped > keep && s.mapped - keep > best_excess) {
          best_excess = s.mapped - keep;
          victim = static_cast<int>(i);
          keep_floor = keep;
        }
      }
    }
    if (victim < 0) break;
    Slot& s = slots_[static_cast<size_t>(victim)];
    const size_t want = (n - released + T - 1) / T;
    const size_t keep = std::max(keep_floor, s.mapped > want ? s.mapped - want : 0);
    // Count pages that really went back to the pool: a shared page only loses a reference.
    const size_t free_before = pool_->free();
    unmap_tail(s, victim, keep);
    released += pool_->free() - free_before;
  }
  counters_.reclaimed_pages += released;
  return released;
}

std::vector<PageHandle> KVCacheCore::obtain(size_t n, const std::vector<Growth>& plan, bool allow_trim) {
  const size_t spare = spare_pages(plan, allow_trim);
  const size_t headroom = pool_->headroom();
  const size_t without_spare =
      headroom == std::numeric_limits<size_t>::max() ? headroom : pool_->free() + headroom;
  if (without_spare != std::numeric_limits<size_t>::max() && without_spare + spare < n) {
    throw out_of_pages("this call", n, without_spare + spare, geo_.page_bytes);
  }
  const uint64_t created_before = pool_->pages_created();
  std::vector<PageHandle> got = pool_->take(n);
  if (got.size() < n) {
    const size_t missing = n - got.size();
    if (missing > spare) {
      pool_->untake(got, static_cast<size_t>(pool_->pages_created() - created_before));
      throw out_of_pages("this call", n, got.size() + spare, geo_.page_bytes);
    }
    release_spare(missing, plan, allow_trim);
    std::vector<PageHandle> more = pool_->take(missing);
    got.insert(got.end(), more.begin(), more.end());
    if (got.size() < n) {
      pool_->untake(got, 0);
      throw out_of_pages("this call", n, got.size(), geo_.page_bytes);
    }
  }
  return got;
}

void KVCacheCore::map_slot(int slot, size_t from, size_t to, const PageHandle* pages,
                           bool from_prefetch) {
  const int T = geo_.num_tensors();
  const size_t count = to - from;
  const size_t run_bytes = count * geo_.page_bytes;
  int tensors_done = 0;
  size_t pages_done = 0;  // in the tensor being mapped
  try {
    for (int t = 0; t < T; ++t) {
      for (size_t p = from; p < to; ++p) {
        backend_->map(page_va(t, slot, p), pages[(p - from) * static_cast<size_t>(T) + static_cast<size_t>(t)]);
        ++counters_.map_calls;
        ++(from_prefetch ? counters_.prefetch_map_calls : counters_.step_map_calls);
        pages_done = p - from + 1;
      }
      // One access grant per contiguous run of new pages, not one per page.
      backend_->set_access(page_va(t, slot, from), run_bytes);
      ++counters_.set_access_calls;
      tensors_done = t + 1;
      pages_done = 0;
    }
  } catch (...) {
    try {
      for (int t = 0; t < tensors_done; ++t) {
        backend_->unmap(page_va(t, slot, from), run_bytes);
        ++counters_.unmap_calls;
      }
      if (pages_done > 0) {
        backend_->unmap(page_va(tensors_done, slot, from), pages_done * geo_.page_bytes);
        ++counters_.unmap_calls;
      }
    } catch (...) {
      // Secondary failure while undoing: the first error is the one the caller needs.
    }
    throw;
  }
  Slot& s = slots_[static_cast<size_t>(slot)];
  s.pages.insert(s.pages.end(), pages, pages + count * static_cast<size_t>(T));
  s.mapped = to;
  s.backed = geo_.tokens_in(to);
}

void KVCacheCore::wait_fence(Slot& s) {
  if (!s.has_fence) return;
  if (!backend_->fence_done(s.fence)) {
    ++counters_.fence_waits;
    backend_->fence_wait(s.fence);
  }
  backend_->fence_release(s.fence);
  s.has_fence = false;
}

void KVCacheCore::unmap_tail(Slot& s, int index, size_t keep) {
  if (keep >= s.mapped) return;
  const int T = geo_.num_tensors();
  if (s.state == Slot::State::Idle) wait_fence(s);
  const size_t bytes = (s.mapped - keep) * geo_.page_bytes;
  int t = 0;
  try {
    for (; t < T; ++t) {
      backend_->unmap(page_va(t, index, keep), bytes);
      ++counters_.unmap_calls;
    }
  } catch (...) {
    // Put back what this call unmapped so the slot's record stays true, then report.
    try {
      for (int u = 0; u < t; ++u) {
        for (size_t p = keep; p < s.mapped; ++p) {
          backend_->map(page_va(u, index, p), s.pages[p * static_cast<size_t>(T) + static_cast<size_t>(u)]);
        }
        backend_->set_access(page_va(u, index, keep), bytes);
      }
    } catch (...) {
    }
    throw;
  }
  for (size_t i = keep * static_cast<size_t>(T); i < s.pages.size(); ++i) pool_->release(s.pages[i]);
  s.pages.resize(keep * static_cast<size_t>(T));
  s.mapped = keep;
  s.backed = geo_.tokens_in(keep);
  if (s.state == Slot::State::Idle && keep == 0) s.state = Slot::State::Free;
}

// ---- prefetch -----------------------------------------------------------------------------------

void KVCacheCore::prefetch(const std::vector<int64_t>& lens, int64_t lookahead_tokens) {
  Prefetcher::Job job(lens.size(), kUnlisted);
  {
    Lock lock(mu_);
    check_open();
    rethrow_background_error();
    validate_lens(lens, true);
    if (lookahead_tokens < -1) {
      throw Error(Error::Kind::Config, "lookahead_tokens=" + std::to_string(lookahead_tokens) +
                                           " must be >= 0");
    }
    const int64_t ahead = lookahead_tokens < 0 ? lookahead_tokens_ : lookahead_tokens;
    for (size_t i = 0; i < lens.size(); ++i) {
      if (lens[i] != kUnlisted) job[i] = std::min(geo_.max_seq, lens[i] + ahead);
    }
  }
  prefetcher_->submit(std::move(job));
}

void KVCacheCore::run_prefetch(const Prefetcher::Job& job) {
  backend_->bind_thread();
  const size_t T = static_cast<size_t>(geo_.num_tensors());
  for (size_t i = 0; i < job.size(); ++i) {
    if (job[i] == kUnlisted) continue;
    Lock lock(mu_);  // per slot, so callers interleave with a long prefetch
    if (closed_ || background_error_) return;
    Slot& s = slots_[i];
    if (s.state != Slot::State::Active) continue;
    const size_t to = geo_.pages_for(job[i]);
    if (to <= s.mapped) continue;
    try {
      grow({Growth{static_cast<int>(i), s.mapped, to}}, true);
    } catch (const Error& e) {
      if (e.kind() == Error::Kind::OutOfPages) {
        // Not an error yet: step() raises only if the current need cannot be met.
        counters_.prefetch_shortfall_pages += (to - s.mapped) * T;
      } else {
        background_error_ = std::current_exception();
      }
      return;
    } catch (...) {
      background_error_ = std::current_exception();
      return;
    }
  }
}

void KVCacheCore::wait() {
  prefetcher_->wait();
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
}

// ---- pool management ----------------------------------------------------------------------------

void KVCacheCore::reserve(size_t bytes) {
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
  const size_t pages = (bytes + geo_.page_bytes - 1) / geo_.page_bytes;
  try {
    pool_->reserve(pages);
  } catch (const Error& e) {
    if (e.kind() == Error::Kind::OutOfPages) ++counters_.oom_events;
    throw;
  }
}

size_t KVCacheCore::reclaim() {
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
  size_t released = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (s.state != Slot::State::Idle) continue;
    const size_t pages = s.mapped * static_cast<size_t>(geo_.num_tensors());
    unmap_tail(s, static_cast<int>(i), 0);
    released += pages;
  }
  counters_.reclaimed_pages += released;
  return released;
}

size_t KVCacheCore::shrink(size_t keep_bytes) {
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
  return pool_->shrink(keep_bytes);
}

int64_t KVCacheCore::set_memory_budget(int64_t budget_bytes) {
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
  pool_->set_budget(budget_bytes);
  if (budget_bytes < 0) return 0;
  const size_t budget = static_cast<size_t>(budget_bytes);
  pool_->shrink(budget);
  while (pool_->total() * geo_.page_bytes > budget) {
    const size_t over_pages = (pool_->total() * geo_.page_bytes - budget + geo_.page_bytes - 1) / geo_.page_bytes;
    if (release_spare(over_pages, {}, true) == 0) break;
    pool_->shrink(budget);
  }
  const size_t held = pool_->total() * geo_.page_bytes;
  return held > budget ? static_cast<int64_t>(held - budget) : 0;
}

void KVCacheCore::set_lookahead(int64_t tokens) {
  if (tokens < 0) {
    throw Error(Error::Kind::Config, "lookahead_tokens=" + std::to_string(tokens) + " must be >= 0");
  }
  std::lock_guard<std::mutex> lock(mu_);
  lookahead_tokens_ = tokens;
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
    mappings += static_cast<int64_t>(s.pages.size());
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
      {"virtual_bytes", static_cast<int64_t>(geo_.tensor_bytes()) * geo_.num_tensors()},
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
      {"pages_created", u(pool_->pages_created())},
      {"pages_destroyed", u(pool_->pages_destroyed())},
      {"oom_events", u(counters_.oom_events)},
      {"reclaimed_pages", u(counters_.reclaimed_pages)},
      {"fence_waits", u(counters_.fence_waits)},
      {"prefetch_shortfall_pages", u(counters_.prefetch_shortfall_pages)},
  };
  sharing_stats(out);
  return out;
}

std::string KVCacheCore::check_invariants() const {
  Lock lock(mu_);
  if (closed_) return "";
  const size_t T = static_cast<size_t>(geo_.num_tensors());
  std::map<PageHandle, uint32_t> seen;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    const std::string where = "slot " + std::to_string(i) + ": ";
    if (s.pages.size() != s.mapped * T) return where + "page list does not match mapped count";
    if (s.state == Slot::State::Free && s.mapped != 0) return where + "free slot holds pages";
    if (s.state == Slot::State::Idle && s.mapped == 0) return where + "idle slot without pages";
    if (s.state == Slot::State::Active && geo_.pages_for(s.seq_len) > s.mapped) {
      return where + "active slot backs fewer tokens than its length";
    }
    if (s.backed != geo_.tokens_in(s.mapped)) return where + "cached backed tokens are stale";
    for (PageHandle p : s.pages) ++seen[p];
  }
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
  try {
    pool_->destroy_all();
  } catch (...) {
    if (!first) first = std::current_exception();
  }
  pool_.reset();
  if (first) std::rethrow_exception(first);
}

}  // namespace vattention
