// KVCacheCore: step() and its growth plan, the decode fast path, and capacity(), which runs the
// same accounting as step() without mapping anything.
#include <algorithm>
#include <limits>

#include "core/kv_cache.h"

namespace vattention {

bool KVCacheCore::try_step(const std::vector<int64_t>& lens) {
  // The decode hot path: nothing to map. One pass, no division (slot.backed is cached). Work the
  // prefetch thread still has queued is for later iterations: no need to wait for it.
  Lock lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  check_open();
  rethrow_background_error();
  if (supply_.eager_pending()) return false;
  if (static_cast<int64_t>(lens.size()) != geo_.max_batch) slots_.validate_lens(lens, true);
  for (size_t i = 0; i < lens.size(); ++i) {
    const int64_t len = lens[i];
    if (len == kUnlisted) continue;
    if (len < 0 || len > geo_.max_seq || slots_[i].state != Slot::State::Active) {
      slots_.validate_lens(lens, true);  // throws the precise error
    }
    const Slot& s = slots_[i];
    if (len > s.backed) return false;
    if (blocks_.enabled() && len > 0 && !named(s, len)) return false;
    // A window page to release (release_at is INT64_MAX without windows), or a rewind to check.
    if (std::min(s.seq_len, len - 1) >= s.release_at || (len < s.seq_len && !s.head.empty())) {
      return false;
    }
  }
  slots_.commit(lens);
  ++counters_.steps;
  if (blocks_.enabled()) tables_.commit(lens);
  return true;
}

void KVCacheCore::step(const std::vector<int64_t>& lens, uintptr_t stream) {
  if (blocks_.enabled()) return step(lens, {}, stream);
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
      wait = wait || gate_.in_flight(static_cast<size_t>(g.slot));
      need += (g.to - g.from) * geo_.columns();
    }
    if (gate_.busy() && need > 0 && pool_.headroom() != std::numeric_limits<size_t>::max() &&
        pool_.free() + pool_.headroom() < need) {
      wait = true;
    }
    if (!wait) break;
    gate_.await_publish(lock);  // only this mapping: the thread may go on to other slots meanwhile
    plan = plan_step(lens);
  }
  std::vector<int64_t> old_lens(lens.size());
  for (size_t i = 0; i < lens.size(); ++i) old_lens[i] = slots_[i].seq_len;
  // New lengths first, so pages beyond them (look-ahead) are the only ones trimmed under pressure.
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] != kUnlisted) slots_[i].seq_len = std::max(lens[i], old_lens[i]);
  }
  const uint64_t calls_before = driver_calls();
  try {
    try {
      grow(plan, false);
    } catch (const Error& e) {
      // Window pages no query of this step reads may cover the shortfall: release them, retry once.
      if (e.kind() != Error::Kind::OutOfPages || windows_.release(lens, old_lens, stream) == 0)
        throw;
      --counters_.oom_events;  // not raised after all unless the retry fails too
      grow(plan, false);
    }
  } catch (...) {
    counters_.step_driver_calls += driver_calls() - calls_before;
    for (size_t i = 0; i < lens.size(); ++i) slots_[i].seq_len = old_lens[i];
    throw;
  }
  counters_.step_driver_calls += driver_calls() - calls_before;
  slots_.commit(lens);
  ++counters_.steps;
  windows_.release(lens, old_lens, stream);
}

void KVCacheCore::step(const std::vector<int64_t>& lens, const std::vector<BlockUpdate>& updates,
                       uintptr_t stream) {
  if (!blocks_.enabled()) {
    tables_.validate(lens, updates);  // throws: tables need engine blocks
    return step(lens, stream);
  }
  // Rows may unmap tails, fresh blocks may take pages from idle rows: nothing may be in flight
  // (rule R, prefetch_gate.h). The thread maps one slot at a time, so this waits for one at most.
  Lock lock(mu_);
  gate_.settle(lock);
  plan_step(lens);  // checks state, lengths and windows
  tables_.validate(lens, updates);
  std::vector<int64_t> old_lens(lens.size());
  for (size_t i = 0; i < lens.size(); ++i) old_lens[i] = slots_[i].seq_len;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] != kUnlisted) slots_[i].seq_len = std::max(lens[i], old_lens[i]);
  }
  const uint64_t calls_before = driver_calls();
  try {
    // Windows first: the engine frees a window's blocks at the same point, and may hand them out
    // fresh in this very step (block_tables.h).
    windows_.release(lens, old_lens, stream);
    tables_.apply(lens, updates);
  } catch (...) {
    counters_.step_driver_calls += driver_calls() - calls_before;
    for (size_t i = 0; i < lens.size(); ++i) slots_[i].seq_len = old_lens[i];
    throw;
  }
  counters_.step_driver_calls += driver_calls() - calls_before;
  slots_.commit(lens);
  ++counters_.steps;
  tables_.commit(lens);
}

bool KVCacheCore::named(const Slot& s, int64_t len) const {
  // Rows name their pages in order: if the last index the length needs is named, all are.
  const size_t last = geo_.pages_for(len) - 1;
  const size_t G = static_cast<size_t>(geo_.num_groups());
  if (s.table.empty() || last >= s.table[0].size() || last >= s.mapped) return false;
  for (size_t g = 0; g < G; ++g) {
    if (s.blocks[last * G + g] != s.table[g][last]) return false;
  }
  return true;
}

std::vector<Growth> KVCacheCore::plan_step(const std::vector<int64_t>& lens) {
  check_open();
  rethrow_background_error();
  supply_.drain_eager();
  slots_.validate_lens(lens, true);
  std::vector<Growth> plan;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == kUnlisted) continue;
    if (!slots_[i].head.empty()) windows_.check(static_cast<int>(i), lens[i], "seq_lens[slot]");
    const size_t need = geo_.pages_for(lens[i]);
    if (need > slots_[i].mapped)
      plan.push_back(Growth{static_cast<int>(i), slots_[i].mapped, need});
  }
  return plan;
}

void KVCacheCore::grow(const std::vector<Growth>& plan, bool from_prefetch) {
  const size_t C = geo_.columns();
  size_t need = 0;
  for (const Growth& g : plan) need += (g.to - g.from) * C;
  if (need == 0) return;
  std::vector<PageHandle> pages;
  try {
    pages = supply_.obtain(need, plan, !from_prefetch);
  } catch (const Error& e) {
    if (e.kind() == Error::Kind::OutOfPages && !from_prefetch) ++counters_.oom_events;
    throw;
  }
  size_t used = 0;
  size_t done = 0;
  try {
    for (const Growth& g : plan) {
      memory_.map(slots_[static_cast<size_t>(g.slot)], g.slot, g.from, g.to, pages.data() + used,
                  from_prefetch);
      used += (g.to - g.from) * C;
      ++done;
      scrubber_.scrub(g.slot, g.from, g.to);  // a failure unmaps this slot's growth too
    }
  } catch (...) {
    for (size_t k = 0; k < done; ++k) {
      try {
        memory_.unmap_tail(slots_[static_cast<size_t>(plan[k].slot)], plan[k].slot, plan[k].from);
      } catch (...) {
      }
    }
    for (size_t i = used; i < pages.size(); ++i) pool_.release(pages[i]);
    throw;
  }
}

Capacity KVCacheCore::capacity(const std::vector<int64_t>& lens,
                               const std::vector<int64_t>& new_lens) const {
  Lock lock(mu_);
  check_open();
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
    const size_t mapped = slots_[i].mapped;
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

// ---- physical memory ----------------------------------------------------------------------------

void KVCacheCore::reserve(size_t bytes) {
  Lock lock = enter();
  // Overflow-safe rounding up. No cache can use more pages than its virtual tensors hold, plus,
  // when engine blocks keep their pages after the last row unmaps them (block_pages.h), those.
  const size_t pages = bytes / geo_.page_bytes + (bytes % geo_.page_bytes != 0 ? 1 : 0);
  const size_t mappable = geo_.virtual_bytes() / geo_.page_bytes;
  const size_t cached =
      blocks_.caching() ? static_cast<size_t>(blocks_.num_blocks()) * geo_.group_width() : 0;
  const size_t usable = mappable + cached;
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
  Lock lock(mu_);
  gate_.settle(lock);  // a slot freed while being mapped is reclaimed too (rule R)
  check_open();
  rethrow_background_error();
  size_t released = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (s.state != Slot::State::Idle) continue;
    released += s.live_pages(geo_);  // mappings, as documented
    counters_.reclaimed_pages += memory_.unmap_tail(s, static_cast<int>(i), 0);
  }
  return released;
}

size_t KVCacheCore::shrink(size_t keep_bytes) {
  Lock lock = enter();
  return pool_.shrink(keep_bytes);
}

int64_t KVCacheCore::set_memory_budget(int64_t budget_bytes) {
  Lock lock(mu_);
  gate_.settle(
      lock);  // pages in flight count against the budget and cannot be trimmed until published
  check_open();
  rethrow_background_error();
  const int64_t old_budget = pool_.budget_bytes();
  pool_.set_budget(budget_bytes);
  if (budget_bytes < 0) return 0;
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
  return held > budget ? static_cast<int64_t>(held - budget) : 0;
}

void KVCacheCore::set_lookahead(int64_t tokens) {
  if (tokens < 0) {
    throw Error(Error::Kind::Config,
                "lookahead_tokens=" + std::to_string(tokens) + " must be >= 0");
  }
  std::lock_guard<std::mutex> lock(mu_);
  lookahead_tokens_ = tokens;
}

void KVCacheCore::set_scrub(bool on) {
  Lock lock(mu_);
  check_open();
  scrubber_.set_enabled(on);
}

}  // namespace vattention
