#include "core/block_coordinator.h"

namespace vattention {

BlockCoordinator::BlockCoordinator(std::unique_ptr<Backend> backend, const CacheGeometry& geometry,
                                   const CacheOptions& options)
    : KVCacheCore(std::move(backend), geometry, options),
      tables_(parts_, options.num_blocks, options.block_cache) {
  memory_.observe(tables_);
  // check() runs in this order: the tables' read-only check counts the rows' mappings only.
  features_ = {&windows_, &scrubber_, &tables_};
}

BlockCoordinator::~BlockCoordinator() {
  try {
    close();  // while the tables still exist: close() unmaps rows, which tells them
  } catch (...) {
  }
  // They go with this object (kv_cache.h: the destruction contract).
  features_.clear();
  memory_.observe(RowObserver::none());
}

int BlockCoordinator::take_slot(const BlockIds* hits, uintptr_t /*stream*/) {
  if (hits != nullptr) tables_.validate_hits(*hits);
  supply_.drain_eager();
  const int slot = hits == nullptr
                       ? slots_.pick_for_alloc()
                       : slots_.pick_for_alloc([&](int i) { return tables_.kept_hits(i, *hits); });
  // The new request starts at token 0, which a window may have released; it brings its own
  // table, and its first step keeps what of the row agrees with it (a hit on the blocks an idle
  // row still maps costs no map call) and unmaps the rest after the free() fence the row keeps.
  // The row is not scrubbed: its pages belong to blocks the engine may still hit; a block's pages
  // are when it is handed out fresh.
  windows_.clear(slot);
  tables_.clear(slot);
  return slot;
}

size_t BlockCoordinator::pages_beyond_rows() const {
  return tables_.caching() ? static_cast<size_t>(tables_.num_blocks()) * geo_.group_width() : 0;
}

bool BlockCoordinator::try_step(const std::vector<int64_t>& lens) {
  Lock lock(guard_.mutex(), std::try_to_lock);
  if (!lock.owns_lock() || !backed_as_is(lens)) return false;
  for (size_t i = 0; i < lens.size(); ++i) {
    const int64_t len = lens[i];
    if (len != kUnlisted && len > 0 && !tables_.named(static_cast<int>(i), len)) return false;
  }
  slots_.commit(lens);
  ++counters_.steps;
  tables_.commit(lens);
  return true;
}

void BlockCoordinator::step(const std::vector<int64_t>& lens,
                            const std::vector<BlockUpdate>& updates, uintptr_t stream) {
  Lock lock(guard_.mutex());
  gate_.settle(lock);  // the thread maps one slot at a time, so this waits for one at most
  plan_step(lens);     // checks state, lengths and windows
  tables_.validate(lens, updates);
  try {
    step_transaction(lens, [&](const std::vector<int64_t>& old_lens) {
      // Windows first: the engine frees a window's blocks at the same point, and may hand them
      // out fresh in this very step (block_tables.h).
      windows_.release(lens, old_lens, stream);
      tables_.apply(lens, updates, stream);
    });
  } catch (...) {
    // The tables stay recorded, and a row whose table this step replaced may have lost the tail
    // its new table disagrees with (block_tables.h, phase 1): no table names those tokens any
    // more, so the row's length is what it still backs.
    for (const BlockUpdate& u : updates) {
      slots_.limit_length(u.slot,
                          geo_.tokens_in(slots_[static_cast<size_t>(u.slot)].pages.mapped()));
    }
    throw;
  }
  tables_.commit(lens);
  background_.top_up(lock, *prefetcher_);
}

BlockIds BlockCoordinator::block_table(int slot) const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  slots_.validate(slot);
  return tables_.table(slot);
}

size_t BlockCoordinator::release_blocks(const std::vector<int64_t>& ids) {
  Lock lock = guard_.enter();
  // A slot freed while the prefetch thread maps it is idle, and this call may unmap idle rows:
  // let that mapping publish first (rule R). Active rows only lose block records here, below
  // the range in flight.
  while (gate_.flight().slot >= 0 &&
         !slots_[static_cast<size_t>(gate_.flight().slot)].use.active()) {
    gate_.await_publish(lock);
    guard_.check_open();
    guard_.rethrow_background_error();
  }
  tables_.validate_release(ids);
  return tables_.release(ids);
}

// ---- refused: the engine shares and moves pages through its block tables ---------------------

void BlockCoordinator::refuse(const char* call) const {
  Lock lock(guard_.mutex());
  guard_.check_open();
  throw Error(Error::Kind::Config,
              std::string(call) +
                  "() is not available on a cache whose pages are named by engine blocks "
                  "(num_blocks=" +
                  std::to_string(tables_.num_blocks()) +
                  "): the engine shares and moves pages through its block tables");
}

int BlockCoordinator::fork(int, int64_t, uintptr_t) { refuse("fork"); }
void BlockCoordinator::share_prefix(int, int, int64_t, uintptr_t) { refuse("share_prefix"); }
size_t BlockCoordinator::ensure_private(int, int64_t, uintptr_t) { refuse("ensure_private"); }
int64_t BlockCoordinator::swap_out(int, uintptr_t) { refuse("swap_out"); }
int BlockCoordinator::swap_in(int64_t, uintptr_t) { refuse("swap_in"); }
void BlockCoordinator::swap_drop(int64_t) { refuse("swap_drop"); }
void BlockCoordinator::set_swap_budget(int64_t) { refuse("set_swap_budget"); }

}  // namespace vattention
