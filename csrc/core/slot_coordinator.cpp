#include "core/slot_coordinator.h"

#include <limits>
#include <string>

namespace vattention {

SlotCoordinator::SlotCoordinator(std::unique_ptr<Backend> backend, const CacheGeometry& geometry,
                                 const CacheOptions& options)
    : KVCacheCore(std::move(backend), geometry, options),
      staging_(*backend_, pool_, counters_),
      sharing_(parts_, windows_, staging_),
      swap_(parts_, staging_) {
  // check() runs in this order: the sharing check counts the rows' mappings and the swap
  // handles' references; stats() lists the entries in this order too.
  features_ = {&windows_, &swap_, &sharing_, &scrubber_, &staging_};
}

SlotCoordinator::~SlotCoordinator() {
  try {
    close();  // while this coordinator's parts still exist: they give back what they hold
  } catch (...) {
  }
  features_.clear();  // they go with this object (kv_cache.h: the destruction contract)
}

SlotCoordinator::Lock SlotCoordinator::enter_exclusive() {
  prefetcher_->wait();
  return guard_.enter_settled(gate_);  // another thread may have queued a prefetch since
}

int SlotCoordinator::take_slot(const BlockIds* hits, uintptr_t stream) {
  if (hits != nullptr) {
    throw Error(Error::Kind::Config,
                "alloc(hits=...) needs a cache whose pages are named by engine blocks: create it "
                "with KVCacheConfig(num_blocks=...)");
  }
  supply_.drain_eager();
  const int slot = slots_.pick_for_alloc();
  // In this order: released window pages (the new request starts at token 0), pages another row
  // still reads, then zeros over what the new request inherits.
  windows_.clear(slot);
  sharing_.clear(slot);
  scrubber_.scrub(slot, 0, slots_[static_cast<size_t>(slot)].pages.mapped(), stream);
  return slot;
}

bool SlotCoordinator::try_step(const std::vector<int64_t>& lens) {
  Lock lock(guard_.mutex(), std::try_to_lock);
  if (!lock.owns_lock() || !backed_as_is(lens)) return false;
  slots_.commit(lens);
  ++counters_.steps;
  return true;
}

void SlotCoordinator::step(const std::vector<int64_t>& lens,
                           const std::vector<BlockUpdate>& updates, uintptr_t stream) {
  if (!updates.empty()) {
    throw Error(Error::Kind::Config,
                "block tables need a cache whose pages are named by engine blocks: create it with "
                "KVCacheConfig(num_blocks=...)");
  }
  Lock lock(guard_.mutex());
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
  const std::vector<int64_t> old_lens =
      step_transaction(lens, [&](const std::vector<int64_t>& old) {
        try {
          grow(plan, stream);
        } catch (const Error& e) {
          // Window pages no query of this step reads may cover the shortfall: release them and
          // retry once.
          if (e.kind() != Error::Kind::OutOfPages || windows_.release(lens, old, stream) == 0)
            throw;
          --counters_.oom_events;  // not raised after all unless the retry fails too
          grow(plan, stream);
        }
      });
  windows_.release(lens, old_lens, stream);
  background_.top_up(lock, *prefetcher_);
}

void SlotCoordinator::grow(const std::vector<Growth>& plan, uintptr_t stream) {
  const size_t C = geo_.columns();
  size_t need = 0;
  for (const Growth& g : plan) need += (g.to - g.from) * C;
  if (need == 0) return;
  std::vector<PageHandle> pages;
  try {
    pages = supply_.obtain(need, plan, true);
  } catch (const Error& e) {
    if (e.kind() == Error::Kind::OutOfPages) ++counters_.oom_events;
    throw;
  }
  size_t used = 0;
  size_t done = 0;
  try {
    for (const Growth& g : plan) {
      memory_.map(g.slot, g.from, g.to, pages.data() + used);
      used += (g.to - g.from) * C;
      ++done;
      scrubber_.scrub(g.slot, g.from, g.to, stream);  // a failure unmaps this growth too
    }
  } catch (...) {
    for (size_t k = 0; k < done; ++k) {
      try {
        memory_.unmap_tail(plan[k].slot, plan[k].from);
      } catch (...) {
      }
    }
    for (size_t i = used; i < pages.size(); ++i) pool_.release(pages[i]);
    throw;
  }
}

BlockIds SlotCoordinator::block_table(int slot) const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  slots_.validate(slot);
  return {};
}

size_t SlotCoordinator::release_blocks(const std::vector<int64_t>&) { refuse("release_blocks"); }

void SlotCoordinator::refuse(const char* call) const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  throw Error(Error::Kind::Config,
              std::string(call) +
                  "() needs a cache whose pages are named by engine blocks: this cache's slots "
                  "own their pages (no num_blocks); create it with KVCacheConfig(num_blocks=...)");
}

// ---- prefix sharing and swap --------------------------------------------------------------------

int SlotCoordinator::fork(int src, int64_t num_tokens, uintptr_t stream) {
  Lock lock = enter_exclusive();
  supply_.drain_eager();
  slots_.validate(src);
  const int64_t n = num_tokens < 0 ? slots_[static_cast<size_t>(src)].use.seq_len() : num_tokens;
  sharing_.check_source(src, n);
  // dst stays free or idle until share() commits, so reclaiming its pages meanwhile waits on its
  // fence like any idle slot's, and a failure leaves it as it was.
  const int dst = slots_.pick_fresh();
  sharing_.share(src, dst, n, stream);
  return dst;
}

void SlotCoordinator::share_prefix(int src, int dst, int64_t num_tokens, uintptr_t stream) {
  Lock lock = enter_exclusive();
  sharing_.check_pair(src, dst, num_tokens);
  sharing_.share(src, dst, num_tokens, stream);
}

size_t SlotCoordinator::ensure_private(int slot, int64_t start_token, uintptr_t stream) {
  Lock lock = enter_exclusive();
  return sharing_.ensure_private(slot, start_token, stream);
}

int64_t SlotCoordinator::swap_out(int slot, uintptr_t stream) {
  Lock lock = enter_exclusive();
  return swap_.swap_out(slot, stream);
}

int SlotCoordinator::swap_in(int64_t handle, uintptr_t stream) {
  Lock lock = enter_exclusive();
  supply_.drain_eager();
  return swap_.swap_in(handle, stream);
}

void SlotCoordinator::swap_drop(int64_t handle) {
  Lock lock(guard_.mutex());
  guard_.check_open();
  swap_.drop(handle);
}

void SlotCoordinator::set_swap_budget(int64_t budget_bytes) {
  Lock lock(guard_.mutex());
  guard_.check_open();
  swap_.set_budget(budget_bytes);
}

}  // namespace vattention
