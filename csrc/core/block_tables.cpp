#include "core/block_tables.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace vattention {
namespace {

Error table_error(const std::string& message, int slot) {
  return Error(Error::Kind::Config, message).with("slot", slot);
}

// The shape every list of block ids must have: one list per KV cache group, all as long, every id
// in [0, N) or the null block. `who` names the list; its first id is at page index `start`;
// `of` follows the page index in messages (" of slot 3"); slot < 0: no slot to name.
void check_ids(const std::vector<std::vector<int64_t>>& ids, size_t G, int64_t N, size_t start,
               const std::string& who, const std::string& of, int slot) {
  auto error = [&](const std::string& message) {
    Error e(Error::Kind::Config, message);
    return slot < 0 ? e : e.with("slot", slot);
  };
  if (ids.size() != G) {
    throw error(who + " has " + std::to_string(ids.size()) +
                " groups of block ids; the cache has " + std::to_string(G) +
                " KV cache groups (layer_groups)");
  }
  const size_t n = ids[0].size();
  for (size_t g = 0; g < G; ++g) {
    if (ids[g].size() != n) {
      throw error(who + " gives " + std::to_string(ids[g].size()) + " ids for group " +
                  std::to_string(g) + " but " + std::to_string(n) +
                  " for group 0; every group's table covers the same page indices");
    }
    for (size_t k = 0; k < n; ++k) {
      const int64_t id = ids[g][k];
      if (id < kNoBlock || id >= N) {
        throw error("block " + std::to_string(id) + " at page index " + std::to_string(start + k) +
                    of + " (group " + std::to_string(g) + ") is outside [0, " + std::to_string(N) +
                    ") (num_blocks=" + std::to_string(N) + "; -1 is the null block)");
      }
    }
  }
}

}  // namespace

void BlockTables::validate(const std::vector<int64_t>& lens,
                           const std::vector<BlockUpdate>& updates) const {
  const BlockPages& blocks = pages_;
  const SlotTable& slots = parts_.slots;
  const CacheGeometry& geo = parts_.geo;
  const size_t G = groups_;
  const int64_t N = blocks.num_blocks();
  std::vector<char> updated(slots.size(), 0);
  std::vector<size_t> new_size(slots.size(), 0);
  // Fresh ids of the step first: vLLM caches a block when it schedules the step that fills it,
  // so a request scheduled after the filler in the same step may hit it (its pages are the ones
  // this step maps for the filler; the kernel appends every new key before any query reads).
  std::unordered_map<int64_t, size_t> fresh;  // id -> the width of the group it fills
  for (const BlockUpdate& u : updates) {
    if (u.ids.size() != G) continue;  // reported below
    for (size_t g = 0; g < G; ++g) {
      for (size_t k = u.cached; k < u.ids[g].size(); ++k) {
        const int64_t id = u.ids[g][k];
        if (id < 0 || id >= N) continue;  // reported below
        if (!fresh.emplace(id, geo.group_columns(static_cast<int>(g)).size()).second) {
          throw table_error("block " + std::to_string(id) + " at page index " +
                                std::to_string(u.start + k) + " of slot " + std::to_string(u.slot) +
                                " (group " + std::to_string(g) +
                                ") is handed out fresh twice in one step",
                            u.slot);
        }
      }
    }
  }
  for (const BlockUpdate& u : updates) {
    slots.validate(u.slot);
    slots.require_active(u.slot, "slot", "has a block table but is not allocated (alloc() first)");
    const std::string who = "the block update of slot " + std::to_string(u.slot);
    if (lens[static_cast<size_t>(u.slot)] == SlotTable::kUnlisted) {
      throw table_error(who + " comes with no length: list the slot in seq_lens", u.slot);
    }
    if (updated[static_cast<size_t>(u.slot)]) {
      throw table_error("two block updates for slot " + std::to_string(u.slot) + " in one step",
                        u.slot);
    }
    updated[static_cast<size_t>(u.slot)] = 1;
    check_ids(u.ids, G, N, u.start, who, " of slot " + std::to_string(u.slot), u.slot);
    const size_t n = u.ids[0].size();
    const Row& s = rows_[static_cast<size_t>(u.slot)];
    const size_t have = table_size(s);
    if (u.start > have) {
      throw table_error(who + " starts at page index " + std::to_string(u.start) +
                            " but its table has " + std::to_string(have) +
                            " entries (an append starts at the table's length)",
                        u.slot);
    }
    if (u.cached > n) {
      throw table_error(who + " says " + std::to_string(u.cached) + " of its " + std::to_string(n) +
                            " blocks are cache hits",
                        u.slot);
    }
    if (u.cached > 0 && u.start > s.fresh_from) {
      throw table_error(who + " gives cache hits at page index " + std::to_string(u.start) +
                            ", after fresh blocks from page index " + std::to_string(s.fresh_from) +
                            "; hits come first in a table",
                        u.slot);
    }
    new_size[static_cast<size_t>(u.slot)] = u.start + n;
    for (size_t g = 0; g < G; ++g) {
      for (size_t k = 0; k < n; ++k) {
        const int64_t id = u.ids[g][k];
        const size_t p = u.start + k;
        const std::string at = "block " + std::to_string(id) + " at page index " +
                               std::to_string(p) + " of slot " + std::to_string(u.slot) +
                               " (group " + std::to_string(g) + ")";
        const bool hit = k < u.cached;
        if (id == kNoBlock) {
          const int64_t before = p == 0 ? kNoBlock : (k == 0 ? s.table[g][p - 1] : u.ids[g][k - 1]);
          if (!hit || before != kNoBlock) {
            throw table_error(at + ": the null block (a hole) may only stand in a table's "
                                   "leading cache hits",
                              u.slot);
          }
        } else if (hit) {
          if (!blocks.caching()) {
            throw table_error(at + " is a cache hit, but blocks keep their pages only with "
                                   "block_cache=True (the engine's prefix caching)",
                              u.slot);
          }
          const auto filled = fresh.find(id);
          if (filled == fresh.end() && !blocks.has_pages(id)) {
            throw table_error(at + " is a cache hit but holds no pages: it was never filled, "
                                   "or its id was handed out fresh since (the engine's block "
                                   "accounting and the cache disagree)",
                              u.slot);
          }
          const size_t width = geo.group_columns(static_cast<int>(g)).size();
          const size_t held = filled != fresh.end() ? filled->second : blocks.pages(id).size();
          if (held != width) {
            throw table_error(at + " is a cache hit but holds " + std::to_string(held) +
                                  " pages; group " + std::to_string(g) + " maps " +
                                  std::to_string(width),
                              u.slot);
          }
        }
      }
    }
  }
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == SlotTable::kUnlisted) continue;
    const size_t size = updated[i] ? new_size[i] : table_size(rows_[i]);
    const size_t need = geo.pages_for(lens[i]);
    if (need > size) {
      throw Error(Error::Kind::Config,
                  "slot " + std::to_string(i) + " needs page indices [0, " + std::to_string(need) +
                      ") for seq_len " + std::to_string(lens[i]) + " but its block table names " +
                      std::to_string(size) + "; pass its blocks (step(..., blocks=...))")
          .with("slot", static_cast<int64_t>(i));
    }
  }
}

// Everything apply()'s phases hand on to each other.
struct BlockTables::StepPlan {
  struct Index {
    int slot;
    size_t page, group;
  };
  // A row that grows: page indices [from, to); reuse[(p - from) * groups + g]: the fresh block
  // there takes the new content in its own old pages (nobody maps them any more).
  struct Growing {
    int slot;
    size_t from, to;
    std::vector<char> reuse;
  };
  std::vector<Index> kept_fresh;  // fresh ids a row already maps where its table puts them
  std::vector<Growing> rows;
  std::vector<Growth> growth;  // the same rows, for the page supply
  size_t missing = 0;          // pages no block has yet
  std::unordered_map<int64_t, std::vector<PageHandle>> planned;  // new block -> its pages
  std::unordered_set<int64_t> taken;  // new blocks whose filler's row is mapped (phase 4)
  uintptr_t stream = 0;  // the step's: zeroing is ordered on it
};

BlockTables::BlockTables(CacheParts& parts, int64_t num_blocks, bool cache)
    : parts_(parts),
      groups_(static_cast<size_t>(parts.geo.num_groups())),
      columns_([&] {
        std::vector<std::vector<size_t>> cols(static_cast<size_t>(parts.geo.num_groups()));
        for (size_t g = 0; g < cols.size(); ++g) {
          cols[g] = parts.geo.group_columns(static_cast<int>(g));
        }
        return cols;
      }()),
      pages_(parts.pool, num_blocks, cache),
      rows_(parts.slots.size()) {}

size_t BlockTables::table_size(const Row& r) { return r.table.empty() ? 0 : r.table[0].size(); }

bool BlockTables::hole(int slot, size_t p, size_t g) const {
  const std::vector<PageHandle>& pages = parts_.slots[static_cast<size_t>(slot)].pages.handles();
  return pages[p * parts_.geo.columns() + columns_[g][0]] == kNoPage;
}

const std::vector<std::vector<int64_t>>& BlockTables::table(int slot) const {
  return rows_[static_cast<size_t>(slot)].table;
}

void BlockTables::clear(int slot) {
  Row& r = rows_[static_cast<size_t>(slot)];
  r.table.clear();
  r.fresh_from = 0;
  r.settled = 0;
}

bool BlockTables::named(int slot, int64_t len) const {
  // Rows name their pages in order: if the last index the length needs is named, all are.
  const Row& r = rows_[static_cast<size_t>(slot)];
  const size_t last = parts_.geo.pages_for(len) - 1;
  if (last >= table_size(r) || last >= parts_.slots[static_cast<size_t>(slot)].pages.mapped()) {
    return false;
  }
  for (size_t g = 0; g < groups_; ++g) {
    if (r.blocks[last * groups_ + g] != r.table[g][last]) return false;
  }
  return true;
}

// ---- RowObserver -------------------------------------------------------------------------------

void BlockTables::grown(int slot, size_t mapped) {
  // New page indices hold anonymous pages (prefetched look-ahead, or a step's growth the caller
  // records blocks for itself).
  rows_[static_cast<size_t>(slot)].blocks.resize(mapped * groups_, kNoBlock);
}

void BlockTables::cut(int slot, size_t keep) {
  // Without caching a block forgets its pages with its last mapping: the references SlotMemory
  // releases next are then their last.
  Row& r = rows_[static_cast<size_t>(slot)];
  for (size_t k = keep * groups_; k < r.blocks.size(); ++k) {
    if (r.blocks[k] != kNoBlock) pages_.unmapped(r.blocks[k]);
  }
  if (r.blocks.size() > keep * groups_) r.blocks.resize(keep * groups_);
  r.settled = std::min(r.settled, keep);
}

void BlockTables::released(int slot, int tensor, size_t from, size_t to) {
  // A group's tensors share one window (geometry.h): its block at a released index is unmapped
  // from this row as a whole (the first of the group's tensors to be released says so).
  Row& r = rows_[static_cast<size_t>(slot)];
  const size_t g = static_cast<size_t>(parts_.geo.group_of(tensor));
  for (size_t p = from; p < to; ++p) {
    int64_t& b = r.blocks[p * groups_ + g];
    if (b == kNoBlock) continue;
    pages_.unmapped(b);
    b = kNoBlock;
  }
}

// ---- alloc(hits) -------------------------------------------------------------------------------

void BlockTables::validate_hits(const std::vector<std::vector<int64_t>>& ids) const {
  check_ids(ids, groups_, pages_.num_blocks(), 0, "alloc(hits=...)", "", -1);
}

size_t BlockTables::kept_hits(int slot, const std::vector<std::vector<int64_t>>& ids) const {
  const Row& r = rows_[static_cast<size_t>(slot)];
  const size_t mapped = parts_.slots[static_cast<size_t>(slot)].pages.mapped();
  const size_t n = std::min(mapped, ids.empty() ? 0 : ids[0].size());
  size_t p = 0;
  for (; p < n; ++p) {
    for (size_t g = 0; g < groups_; ++g) {
      // The same rule as phase 1 for a hit: the row maps that block there, or, for the null
      // block, has a hole there.
      const bool agrees =
          ids[g][p] == kNoBlock ? hole(slot, p, g) : r.blocks[p * groups_ + g] == ids[g][p];
      if (!agrees) return p;
    }
  }
  return p;
}

// ---- release_blocks() --------------------------------------------------------------------------

void BlockTables::validate_release(const std::vector<int64_t>& ids) const {
  const int64_t N = pages_.num_blocks();
  for (size_t k = 0; k < ids.size(); ++k) {
    const int64_t id = ids[k];
    if (id >= 0 && id < N) continue;
    const std::string why =
        id < 0 ? " is negative (-1 is the core's hole, never a block with pages: leave the "
                 "engine's null block out)"
               : " is outside [0, " + std::to_string(N) + ")";
    throw Error(Error::Kind::Config, "release_blocks: block " + std::to_string(id) + " (ids[" +
                                         std::to_string(k) + "])" + why +
                                         " (num_blocks=" + std::to_string(N) + ")")
        .with("block", id)
        .with("num_blocks", N);
  }
}

size_t BlockTables::release(const std::vector<int64_t>& ids) {
  std::vector<char> listed(static_cast<size_t>(pages_.num_blocks()), 0);
  size_t blocks = 0;
  for (int64_t b : ids) {
    char& l = listed[static_cast<size_t>(b)];
    if (l || !pages_.has_pages(b)) continue;
    l = 1;
    ++blocks;
  }
  if (blocks == 0) return 0;
  auto is_listed = [&](int64_t b) { return b != kNoBlock && listed[static_cast<size_t>(b)]; };
  // Idle rows first, the only driver calls: each unmaps from the first page index that maps a
  // listed block, after its free() fence (unmap_tail waits for it: one event query, no wait, once
  // it completed). No fence on a stream: what runs there now was queued after the rows' free()s
  // and reads none of their mappings (block_tables.h).
  std::vector<std::pair<int, size_t>> cuts;
  for (size_t i = 0; i < rows_.size(); ++i) {
    if (parts_.slots[i].use.active()) continue;
    const std::vector<int64_t>& at = rows_[i].blocks;
    const auto first = std::find_if(at.begin(), at.end(), is_listed);
    if (first != at.end()) {
      cuts.emplace_back(static_cast<int>(i), static_cast<size_t>(first - at.begin()) / groups_);
    }
  }
  const size_t free_before = parts_.pool.free();
  for (const auto& cut : cuts) parts_.memory.unmap_tail(cut.first, cut.second);
  // Active rows keep the pages as anonymous ones: their requests may still read them.
  for (size_t i = 0; i < rows_.size(); ++i) {
    if (!parts_.slots[i].use.active()) continue;
    for (int64_t& b : rows_[i].blocks) {
      if (!is_listed(b)) continue;
      pages_.unmapped(b);
      pages_.count_detached();
      b = kNoBlock;
    }
  }
  for (size_t b = 0; b < listed.size(); ++b) {
    if (listed[b] && pages_.has_pages(static_cast<int64_t>(b))) {
      pages_.drop(static_cast<int64_t>(b));
    }
  }
  const size_t released = parts_.pool.free() - free_before;
  pages_.count_released(blocks, released);
  return released;
}

// ---- a step with tables ------------------------------------------------------------------------

void BlockTables::apply(const std::vector<int64_t>& lens, const std::vector<BlockUpdate>& updates,
                        uintptr_t stream) {
  StepPlan plan;
  plan.stream = stream;
  record_tables(updates, plan);
  plan_rows(lens, plan);
  take_pages(plan);
  map_rows(plan);
  record_blocks(plan);
}

size_t BlockTables::first_disagreement(const BlockUpdate& u) const {
  const Row& r = rows_[static_cast<size_t>(u.slot)];
  const size_t mapped = parts_.slots[static_cast<size_t>(u.slot)].pages.mapped();
  const size_t end = u.start + u.ids[0].size();
  for (size_t p = u.start; p < mapped; ++p) {
    for (size_t g = 0; g < groups_; ++g) {
      const int64_t have = r.blocks[p * groups_ + g];
      const bool gap = hole(u.slot, p, g);
      bool keep;
      if (p >= end) {
        keep = have == kNoBlock && !gap;  // look-ahead past the table
      } else if (r.table[g][p] == kNoBlock) {
        keep = gap;
      } else if (p >= r.fresh_from) {
        keep = have == r.table[g][p] || (have == kNoBlock && !gap);  // anonymous: adopted in 2
      } else {
        keep = have == r.table[g][p];
      }
      if (!keep) return p;
    }
  }
  return mapped;
}

void BlockTables::record_tables(const std::vector<BlockUpdate>& updates, StepPlan& plan) {
  for (const BlockUpdate& u : updates) {
    Row& r = rows_[static_cast<size_t>(u.slot)];
    const size_t end = u.start + u.ids[0].size();
    r.table.resize(groups_);
    for (size_t g = 0; g < groups_; ++g) {
      r.table[g].resize(u.start);
      r.table[g].insert(r.table[g].end(), u.ids[g].begin(), u.ids[g].end());
    }
    if (u.cached > 0 || u.start < r.fresh_from) r.fresh_from = u.start + u.cached;
    r.settled = std::min(r.settled, u.start);  // the entries from there on are new
    const size_t cut = first_disagreement(u);
    // Nothing when everything agrees; else after the free() fence of the request that left the
    // row (slot_memory.h): its last kernels may still read the tail.
    parts_.memory.unmap_tail(u.slot, cut);
    for (size_t p = std::max(u.start, r.fresh_from); p < std::min(cut, end); ++p) {
      for (size_t g = 0; g < groups_; ++g) {
        if (r.table[g][p] != kNoBlock && r.blocks[p * groups_ + g] == r.table[g][p]) {
          plan.kept_fresh.push_back(StepPlan::Index{u.slot, p, g});
        }
      }
    }
    // Hits the row still maps (an idle row's blocks, kept for its next request) are hits served
    // with no map call at all; phase 5 counts the ones it maps.
    for (size_t p = u.start; p < std::min(cut, u.start + u.cached); ++p) {
      for (size_t g = 0; g < groups_; ++g) {
        if (r.table[g][p] != kNoBlock) pages_.count_hit(true);
      }
    }
  }
}

void BlockTables::adopt_anonymous(int slot, uintptr_t stream) {
  Row& r = rows_[static_cast<size_t>(slot)];
  const std::vector<PageHandle>& handles = parts_.slots[static_cast<size_t>(slot)].pages.handles();
  const size_t C = parts_.geo.columns();
  const size_t named =
      std::min(parts_.slots[static_cast<size_t>(slot)].pages.mapped(), table_size(r));
  const size_t from = std::max(r.fresh_from, r.settled);
  r.settled = std::max(r.settled, named);
  for (size_t p = from; p < named; ++p) {
    for (size_t g = 0; g < groups_; ++g) {
      const int64_t b = r.table[g][p];
      // Kept, or released by the row's window (the engine's table keeps the stale id there).
      if (b == kNoBlock || r.blocks[p * groups_ + g] == b || hole(slot, p, g)) continue;
      free_fresh(b, slot, p, g);
      if (pages_.has_pages(b)) pages_.drop(b);  // its old content is dead, nobody maps it
      std::vector<PageHandle> pages(columns_[g].size());
      for (size_t j = 0; j < pages.size(); ++j) pages[j] = handles[p * C + columns_[g][j]];
      pages_.assign(b, std::move(pages));
      pages_.mapped(b);
      r.blocks[p * groups_ + g] = b;
      pages_.count_adopted();
      parts_.scrubber.scrub_columns(slot, p, columns_[g], stream);
    }
  }
}

void BlockTables::free_fresh(int64_t b, int slot, size_t page, size_t group) {
  if (pages_.mappings(b) == 0) return;
  const size_t self = page * groups_ + group;
  bool detached = false;
  for (size_t i = 0; i < rows_.size() && pages_.mappings(b) > 0; ++i) {
    std::vector<int64_t>& blocks = rows_[i].blocks;
    for (size_t k = 0; k < blocks.size(); ++k) {
      if (blocks[k] != b || (static_cast<int>(i) == slot && k == self)) continue;
      if (!parts_.slots[i].use.active()) {
        // An idle row: its request is gone, so its pages are only deferred memory; unmap it
        // (after its free() fence). It may map b at several indices: all go.
        parts_.memory.unmap_tail(static_cast<int>(i), 0);
        break;
      }
      // An active row still maps b where its window passed (the engine released it first):
      // the row keeps the pages as anonymous ones until its own release.
      blocks[k] = kNoBlock;
      pages_.unmapped(b);
      pages_.count_detached();
      detached = true;
    }
  }
  // Pages a detached row still maps cannot take b's new content.
  if (detached && pages_.has_pages(b)) pages_.drop(b);
}

void BlockTables::plan_rows(const std::vector<int64_t>& lens, StepPlan& plan) {
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == SlotTable::kUnlisted) continue;
    const int slot = static_cast<int>(i);
    adopt_anonymous(slot, plan.stream);
    const Row& r = rows_[i];
    const size_t mapped = parts_.slots[i].pages.mapped();
    const size_t to = parts_.geo.pages_for(lens[i]);
    if (to <= mapped) continue;
    StepPlan::Growing row{slot, mapped, to, std::vector<char>((to - mapped) * groups_, 0)};
    for (size_t p = mapped; p < to; ++p) {
      for (size_t g = 0; g < groups_; ++g) {
        const int64_t b = r.table[g][p];
        if (b == kNoBlock || p < r.fresh_from) continue;  // a hole, or a hit: pages exist
        free_fresh(b, slot, p, g);
        // The old pages take the new content in place if the block filled a group as wide.
        if (pages_.has_pages(b) && pages_.pages(b).size() != columns_[g].size()) pages_.drop(b);
        if (pages_.has_pages(b)) {
          row.reuse[(p - mapped) * groups_ + g] = 1;
        } else {
          plan.missing += columns_[g].size();
        }
      }
    }
    plan.rows.push_back(std::move(row));
    plan.growth.push_back(Growth{slot, mapped, to});
  }
}

void BlockTables::take_pages(StepPlan& plan) {
  std::vector<PageHandle> fresh;
  if (plan.missing > 0) {
    try {
      fresh = parts_.supply.obtain(plan.missing, plan.growth, true);
    } catch (const Error& e) {
      if (e.kind() == Error::Kind::OutOfPages) ++parts_.counters.oom_events;
      throw;
    }
  }
  // The pages each new block will name: a hit on it in this step, from a row scheduled after its
  // filler, maps the same pages.
  size_t next = 0;
  for (const StepPlan::Growing& row : plan.rows) {
    const Row& r = rows_[static_cast<size_t>(row.slot)];
    for (size_t p = std::max(row.from, r.fresh_from); p < row.to; ++p) {
      for (size_t g = 0; g < groups_; ++g) {
        const int64_t b = r.table[g][p];
        if (b == kNoBlock || row.reuse[(p - row.from) * groups_ + g]) continue;
        const size_t width = columns_[g].size();
        plan.planned[b].assign(fresh.begin() + static_cast<long>(next),
                               fresh.begin() + static_cast<long>(next + width));
        next += width;
      }
    }
  }
}

void BlockTables::map_rows(StepPlan& plan) {
  // A new block's pages come with one reference from the pool, which its filler's mapping takes
  // over; every other mapping takes a reference of its own. A driver error undoes the rows mapped
  // so far and gives back what no row took.
  const size_t C = parts_.geo.columns();
  auto pages_of = [&](int64_t b) -> const std::vector<PageHandle>& {
    const auto it = plan.planned.find(b);
    return it != plan.planned.end() ? it->second : pages_.pages(b);
  };
  size_t done = 0;
  try {
    for (const StepPlan::Growing& row : plan.rows) {
      const Row& r = rows_[static_cast<size_t>(row.slot)];
      std::vector<PageHandle> h((row.to - row.from) * C, kNoPage);
      std::vector<PageHandle> shares;
      std::vector<int64_t> fills;
      for (size_t p = row.from; p < row.to; ++p) {
        for (size_t g = 0; g < groups_; ++g) {
          const int64_t b = r.table[g][p];
          if (b == kNoBlock) continue;
          const bool fills_it = p >= r.fresh_from && !row.reuse[(p - row.from) * groups_ + g];
          const std::vector<PageHandle>& pages = pages_of(b);
          for (size_t j = 0; j < columns_[g].size(); ++j) {
            h[(p - row.from) * C + columns_[g][j]] = pages[j];
            if (!fills_it) shares.push_back(pages[j]);
          }
          if (fills_it) fills.push_back(b);
        }
      }
      parts_.memory.map(row.slot, row.from, row.to, h.data());
      for (PageHandle page : shares) parts_.pool.share(page);
      plan.taken.insert(fills.begin(), fills.end());
      ++done;
    }
  } catch (...) {
    for (size_t k = 0; k < done; ++k) {
      try {
        parts_.memory.unmap_tail(plan.rows[k].slot, plan.rows[k].from);
      } catch (...) {
      }
    }
    for (const auto& entry : plan.planned) {
      if (plan.taken.count(entry.first) != 0) continue;
      for (PageHandle page : entry.second) parts_.pool.release(page);
    }
    throw;
  }
}

void BlockTables::record_blocks(const StepPlan& plan) {
  for (const StepPlan::Growing& row : plan.rows) {
    Row& r = rows_[static_cast<size_t>(row.slot)];
    for (size_t p = row.from; p < row.to; ++p) {
      for (size_t g = 0; g < groups_; ++g) {
        const int64_t b = r.table[g][p];
        if (b == kNoBlock) continue;
        r.blocks[p * groups_ + g] = b;
        if (p < r.fresh_from) {
          pages_.count_hit(false);
        } else {
          if (row.reuse[(p - row.from) * groups_ + g]) {
            pages_.count_reused();
          } else {
            pages_.assign(b, plan.planned.at(b));
          }
          parts_.scrubber.scrub_columns(row.slot, p, columns_[g], plan.stream);
        }
        pages_.mapped(b);
      }
    }
    r.settled = std::max(r.settled, row.to);
  }
  for (const StepPlan::Index& k : plan.kept_fresh) {
    parts_.scrubber.scrub_columns(k.slot, k.page, columns_[k.group], plan.stream);
  }
}

void BlockTables::commit(const std::vector<int64_t>& lens) {
  const CacheGeometry& geo = parts_.geo;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == SlotTable::kUnlisted) continue;
    const int64_t len = parts_.slots[i].use.seq_len();
    parts_.memory.set_read_only(static_cast<int>(i),
                                static_cast<size_t>(len) * geo.unit_bytes() / geo.page_bytes);
  }
}

// ---- stats, invariants, close ------------------------------------------------------------------

void BlockTables::add_stats(Stats& out) const { pages_.add_stats(out); }

std::string BlockTables::check(std::map<PageHandle, uint32_t>& seen) const {
  // `seen` counts the rows' mappings only (no part registered before this one holds pages):
  // a block's pages are shared when two rows map them, which the engine allows on full, never
  // rewritten blocks only.
  const std::string read_only = parts_.memory.check_read_only(seen);
  if (!read_only.empty()) return read_only;
  const size_t C = parts_.geo.columns();
  std::vector<uint32_t> counted(static_cast<size_t>(pages_.num_blocks()), 0);
  for (size_t i = 0; i < rows_.size(); ++i) {
    const Row& r = rows_[i];
    const SlotPages& s = parts_.slots[i].pages;
    const std::string where = "slot " + std::to_string(i) + ": ";
    if (r.blocks.size() != s.mapped() * groups_) {
      return where + "block record does not match mapped count";
    }
    if (r.settled > s.mapped()) return where + "settled beyond what the row maps";
    for (size_t k = 0; k < r.blocks.size(); ++k) {
      const int64_t b = r.blocks[k];
      if (b == kNoBlock) continue;
      if (b < 0 || b >= pages_.num_blocks()) {
        return where + "maps block " + std::to_string(b) + " out of range";
      }
      ++counted[static_cast<size_t>(b)];
      const std::vector<size_t>& cols = columns_[k % groups_];
      const std::vector<PageHandle>& held = pages_.pages(b);
      if (held.size() != cols.size()) {
        return where + "maps block " + std::to_string(b) + ", which holds no pages";
      }
      for (size_t j = 0; j < cols.size(); ++j) {
        if (s.handles()[(k / groups_) * C + cols[j]] != held[j]) {
          return where + "page index " + std::to_string(k / groups_) + " does not map block " +
                 std::to_string(b) + "'s pages";
        }
      }
    }
  }
  return pages_.check(counted, seen);
}

void BlockTables::close() { pages_.forget_all(); }

}  // namespace vattention
