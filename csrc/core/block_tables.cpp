#include "core/block_tables.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace vattention {
namespace {

Error table_error(const std::string& message, int slot) {
  return Error(Error::Kind::Config, message).with("slot", slot);
}

size_t table_size(const Slot& s) { return s.table.empty() ? 0 : s.table[0].size(); }

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

bool BlockTables::hole(const Slot& s, size_t p, size_t g) const {
  const std::vector<size_t> cols = parts_.geo.group_columns(static_cast<int>(g));
  return s.pages[p * parts_.geo.columns() + cols[0]] == kNoPage;
}

void BlockTables::validate(const std::vector<int64_t>& lens,
                           const std::vector<BlockUpdate>& updates) const {
  const BlockPages& blocks = parts_.blocks;
  const SlotTable& slots = parts_.slots;
  const CacheGeometry& geo = parts_.geo;
  if (!blocks.enabled()) {
    if (updates.empty()) return;
    throw Error(Error::Kind::Config,
                "block tables need a cache whose pages are named by engine blocks: create it with "
                "KVCacheConfig(num_blocks=...)");
  }
  const size_t G = static_cast<size_t>(geo.num_groups());
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
    const Slot& s = slots[static_cast<size_t>(u.slot)];
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
    const size_t size = updated[i] ? new_size[i] : table_size(slots[i]);
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

void BlockTables::validate_hits(const std::vector<std::vector<int64_t>>& ids) const {
  const BlockPages& blocks = parts_.blocks;
  if (!blocks.enabled()) {
    throw Error(Error::Kind::Config,
                "alloc(hits=...) needs a cache whose pages are named by engine blocks: create it "
                "with KVCacheConfig(num_blocks=...)");
  }
  check_ids(ids, static_cast<size_t>(parts_.geo.num_groups()), blocks.num_blocks(), 0,
            "alloc(hits=...)", "", -1);
}

size_t BlockTables::kept_hits(const Slot& s, const std::vector<std::vector<int64_t>>& ids) const {
  const size_t G = ids.size();
  const size_t n = std::min(s.mapped, ids.empty() ? 0 : ids[0].size());
  size_t p = 0;
  for (; p < n; ++p) {
    for (size_t g = 0; g < G; ++g) {
      // The same rule as step 1 of apply() for a hit: the row maps that block there, or, for the
      // null block, has a hole there.
      const bool agrees = ids[g][p] == kNoBlock ? hole(s, p, g) : s.blocks[p * G + g] == ids[g][p];
      if (!agrees) return p;
    }
  }
  return p;
}

void BlockTables::free_fresh(int64_t b, int slot, size_t page, size_t group) {
  BlockPages& blocks = parts_.blocks;
  if (blocks.mappings(b) > 0) {
    const size_t G = static_cast<size_t>(parts_.geo.num_groups());
    const size_t self = page * G + group;
    bool detached = false;
    for (size_t i = 0; i < parts_.slots.size() && blocks.mappings(b) > 0; ++i) {
      Slot& s = parts_.slots[i];
      for (size_t k = 0; k < s.blocks.size(); ++k) {
        if (s.blocks[k] != b || (static_cast<int>(i) == slot && k == self)) continue;
        if (s.state != Slot::State::Active) {
          // An idle row: its request is gone, so its pages are only deferred memory; unmap it
          // (after its free() fence). It may map b at several indices: all go.
          parts_.memory.unmap_tail(s, static_cast<int>(i), 0);
          break;
        }
        // An active row still maps b where its window passed (the engine released it first):
        // the row keeps the pages as anonymous ones until its own release.
        s.blocks[k] = kNoBlock;
        blocks.unmapped(b);
        blocks.count_detached();
        detached = true;
      }
    }
    // Pages a detached row still maps cannot take b's new content.
    if (detached && blocks.has_pages(b)) blocks.drop(b);
  }
}

void BlockTables::apply(const std::vector<int64_t>& lens, const std::vector<BlockUpdate>& updates) {
  const CacheGeometry& geo = parts_.geo;
  SlotTable& slots = parts_.slots;
  BlockPages& blocks = parts_.blocks;
  PagePool& pool = parts_.pool;
  const size_t G = static_cast<size_t>(geo.num_groups());
  const size_t C = geo.columns();
  std::vector<std::vector<size_t>> cols(G);
  for (size_t g = 0; g < G; ++g) cols[g] = geo.group_columns(static_cast<int>(g));

  // 1. the new tables; each row keeps what agrees with its table, and anonymous pages under fresh
  //    entries (they are adopted below).
  struct Index {
    int slot;
    size_t page, group;
  };
  std::vector<Index> kept_fresh;  // a fresh id the row already maps there: cleared in 5
  for (const BlockUpdate& u : updates) {
    Slot& s = slots[static_cast<size_t>(u.slot)];
    const size_t end = u.start + u.ids[0].size();
    s.table.resize(G);
    for (size_t g = 0; g < G; ++g) {
      s.table[g].resize(u.start);
      s.table[g].insert(s.table[g].end(), u.ids[g].begin(), u.ids[g].end());
    }
    if (u.cached > 0 || u.start < s.fresh_from) s.fresh_from = u.start + u.cached;
    size_t cut = s.mapped;
    for (size_t p = u.start; p < s.mapped && cut == s.mapped; ++p) {
      for (size_t g = 0; g < G; ++g) {
        const int64_t have = s.blocks[p * G + g];
        const bool gap = hole(s, p, g);
        bool keep;
        if (p >= end) {
          keep = have == kNoBlock && !gap;  // look-ahead past the table
        } else if (s.table[g][p] == kNoBlock) {
          keep = gap;
        } else if (p >= s.fresh_from) {
          keep = have == s.table[g][p] || (have == kNoBlock && !gap);
        } else {
          keep = have == s.table[g][p];
        }
        if (!keep) {
          cut = p;
          break;
        }
      }
    }
    if (cut < s.mapped) parts_.memory.unmap_tail(s, u.slot, cut);
    for (size_t p = std::max(u.start, s.fresh_from); p < std::min(cut, end); ++p) {
      for (size_t g = 0; g < G; ++g) {
        if (s.table[g][p] != kNoBlock && s.blocks[p * G + g] == s.table[g][p]) {
          kept_fresh.push_back(Index{u.slot, p, g});
        }
      }
    }
    // Hits the row still maps (an idle row's blocks, kept for its next request) are hits served
    // with no map call at all; step 5 counts the ones it maps.
    for (size_t p = u.start; p < std::min(cut, u.start + u.cached); ++p) {
      for (size_t g = 0; g < G; ++g) {
        if (s.table[g][p] != kNoBlock) blocks.count_hit(true);
      }
    }
  }

  // 2. fresh ids: adopt anonymous pages where a row has them, free the ids from earlier holders,
  //    and count the pages still missing.
  struct Row {
    int slot;
    size_t from, to;
  };
  std::vector<Row> rows;
  std::vector<Growth> plan;
  std::vector<std::vector<char>> reuse(slots.size());  // p * G + g: the block's own old pages
  size_t missing = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == SlotTable::kUnlisted) continue;
    Slot& s = slots[i];
    const int slot = static_cast<int>(i);
    const size_t named = std::min(s.mapped, table_size(s));
    for (size_t p = s.fresh_from; p < named; ++p) {
      for (size_t g = 0; g < G; ++g) {
        const int64_t b = s.table[g][p];
        // Kept, or released by the row's window (the engine's table keeps the stale id there).
        if (b == kNoBlock || s.blocks[p * G + g] == b || hole(s, p, g)) continue;
        free_fresh(b, slot, p, g);
        if (blocks.has_pages(b)) blocks.drop(b);  // its old content is dead, nobody maps it
        std::vector<PageHandle> pages(cols[g].size());
        for (size_t j = 0; j < pages.size(); ++j) pages[j] = s.pages[p * C + cols[g][j]];
        blocks.assign(b, std::move(pages));
        blocks.mapped(b);
        s.blocks[p * G + g] = b;
        blocks.count_adopted();
        parts_.scrubber.scrub_columns(slot, p, cols[g]);
      }
    }
    const size_t to = geo.pages_for(lens[i]);
    if (to <= s.mapped) continue;
    reuse[i].assign(to * G, 0);
    for (size_t p = s.mapped; p < to; ++p) {
      for (size_t g = 0; g < G; ++g) {
        const int64_t b = s.table[g][p];
        if (b == kNoBlock || p < s.fresh_from) continue;  // a hole, or a hit: pages exist
        free_fresh(b, slot, p, g);
        // The old pages take the new content in place if the block filled a group as wide.
        if (blocks.has_pages(b) && blocks.pages(b).size() != cols[g].size()) blocks.drop(b);
        if (blocks.has_pages(b)) {
          reuse[i][p * G + g] = 1;
        } else {
          missing += cols[g].size();
        }
      }
    }
    rows.push_back(Row{slot, s.mapped, to});
    plan.push_back(Growth{slot, s.mapped, to});
  }

  // 3. every missing page, all or nothing; then the pages each new block will name (a hit on
  //    it in this step, from a row scheduled after its filler, maps the same pages).
  std::vector<PageHandle> fresh;
  if (missing > 0) {
    try {
      fresh = parts_.supply.obtain(missing, plan, true);
    } catch (const Error& e) {
      if (e.kind() == Error::Kind::OutOfPages) ++parts_.counters.oom_events;
      throw;
    }
  }
  std::unordered_map<int64_t, std::vector<PageHandle>> planned;  // new block -> its pages
  size_t next = 0;
  for (const Row& r : rows) {
    const Slot& s = slots[static_cast<size_t>(r.slot)];
    for (size_t p = std::max(r.from, s.fresh_from); p < r.to; ++p) {
      for (size_t g = 0; g < G; ++g) {
        const int64_t b = s.table[g][p];
        if (b == kNoBlock || reuse[static_cast<size_t>(r.slot)][p * G + g]) continue;
        planned[b].assign(fresh.begin() + static_cast<long>(next),
                          fresh.begin() + static_cast<long>(next + cols[g].size()));
        next += cols[g].size();
      }
    }
  }
  auto pages_of = [&](int64_t b) -> const std::vector<PageHandle>& {
    const auto it = planned.find(b);
    return it != planned.end() ? it->second : blocks.pages(b);
  };

  // 4. map each row's new indices. A new block's pages come with one reference from the pool,
  //    which its filler's mapping takes over; every other mapping takes a reference of its own.
  //    A driver error undoes the rows mapped so far and gives back what no row took.
  std::unordered_set<int64_t> taken;  // new blocks whose filler's row is mapped
  size_t done = 0;
  try {
    for (const Row& r : rows) {
      Slot& s = slots[static_cast<size_t>(r.slot)];
      std::vector<PageHandle> h((r.to - r.from) * C, kNoPage);
      std::vector<PageHandle> shares;
      std::vector<int64_t> fills;
      for (size_t p = r.from; p < r.to; ++p) {
        for (size_t g = 0; g < G; ++g) {
          const int64_t b = s.table[g][p];
          if (b == kNoBlock) continue;
          const bool fills_it = p >= s.fresh_from && !reuse[static_cast<size_t>(r.slot)][p * G + g];
          const std::vector<PageHandle>& pages = pages_of(b);
          for (size_t j = 0; j < cols[g].size(); ++j) {
            h[(p - r.from) * C + cols[g][j]] = pages[j];
            if (!fills_it) shares.push_back(pages[j]);
          }
          if (fills_it) fills.push_back(b);
        }
      }
      parts_.memory.map(s, r.slot, r.from, r.to, h.data(), false);
      for (PageHandle page : shares) pool.share(page);
      taken.insert(fills.begin(), fills.end());
      ++done;
    }
  } catch (...) {
    for (size_t k = 0; k < done; ++k) {
      try {
        parts_.memory.unmap_tail(slots[static_cast<size_t>(rows[k].slot)], rows[k].slot,
                                 rows[k].from);
      } catch (...) {
      }
    }
    for (const auto& entry : planned) {
      if (taken.count(entry.first) != 0) continue;
      for (PageHandle page : entry.second) pool.release(page);
    }
    throw;
  }

  // 5. record which block is where.
  for (const Row& r : rows) {
    Slot& s = slots[static_cast<size_t>(r.slot)];
    for (size_t p = r.from; p < r.to; ++p) {
      for (size_t g = 0; g < G; ++g) {
        const int64_t b = s.table[g][p];
        if (b == kNoBlock) continue;
        s.blocks[p * G + g] = b;
        if (p < s.fresh_from) {
          blocks.count_hit(false);
        } else {
          if (reuse[static_cast<size_t>(r.slot)][p * G + g]) {
            blocks.count_reused();
          } else {
            blocks.assign(b, planned[b]);
          }
          parts_.scrubber.scrub_columns(r.slot, p, cols[g]);
        }
        blocks.mapped(b);
      }
    }
  }
  for (const Index& k : kept_fresh) parts_.scrubber.scrub_columns(k.slot, k.page, cols[k.group]);
}

void BlockTables::commit(const std::vector<int64_t>& lens) {
  const CacheGeometry& geo = parts_.geo;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == SlotTable::kUnlisted) continue;
    Slot& s = parts_.slots[i];
    s.shared_pages = static_cast<size_t>(s.seq_len) * geo.unit_bytes() / geo.page_bytes;
  }
}

}  // namespace vattention
