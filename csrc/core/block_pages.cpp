#include "core/block_pages.h"

#include <algorithm>

namespace vattention {

void BlockPages::configure(int64_t num_blocks, bool cache) {
  entries_.assign(static_cast<size_t>(num_blocks), Entry{});
  cache_ = cache;
}

void BlockPages::unmapped(int64_t b) {
  Entry& e = entry(b);
  if (e.mappings > 0) --e.mappings;
  if (e.mappings == 0 && !cache_) e.pages.clear();  // the rows' references were the only ones
}

void BlockPages::assign(int64_t b, std::vector<PageHandle> pages) {
  Entry& e = entry(b);
  e.pages = std::move(pages);
  if (cache_) {
    for (PageHandle p : e.pages) pool_.share(p);  // the block's own reference
  }
}

void BlockPages::drop(int64_t b) {
  Entry& e = entry(b);
  if (cache_) {
    for (PageHandle p : e.pages) pool_.release(p);
  }
  e.pages.clear();
}

void BlockPages::reset_slot(Slot& slot, int /*index*/) {
  slot.table.clear();
  slot.fresh_from = 0;
}

void BlockPages::add_stats(Stats& out) const {
  int64_t with_pages = 0, cached = 0;
  for (const Entry& e : entries_) {
    with_pages += e.pages.empty() ? 0 : 1;
    cached += !e.pages.empty() && e.mappings == 0 ? 1 : 0;
  }
  out.emplace_back("engine_blocks", num_blocks());
  out.emplace_back("blocks_with_pages", with_pages);
  out.emplace_back("cached_blocks", cached);
  out.emplace_back("block_hits", static_cast<int64_t>(hits_));
  out.emplace_back("block_hits_in_place", static_cast<int64_t>(hits_in_place_));
  out.emplace_back("blocks_adopted", static_cast<int64_t>(adopted_));
  out.emplace_back("blocks_reused", static_cast<int64_t>(reused_));
  out.emplace_back("blocks_detached", static_cast<int64_t>(detached_));
}

std::string BlockPages::check(std::map<PageHandle, uint32_t>& seen) const {
  if (!enabled()) return "";
  const size_t G = static_cast<size_t>(geo_.num_groups());
  const size_t C = geo_.columns();
  std::vector<uint32_t> counted(entries_.size(), 0);
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    const std::string where = "slot " + std::to_string(i) + ": ";
    if (s.blocks.size() != s.mapped * G) return where + "block record does not match mapped count";
    for (size_t k = 0; k < s.blocks.size(); ++k) {
      const int64_t b = s.blocks[k];
      if (b == kNoBlock) continue;
      if (b < 0 || b >= num_blocks())
        return where + "maps block " + std::to_string(b) + " out of range";
      ++counted[static_cast<size_t>(b)];
      const std::vector<size_t> cols = geo_.group_columns(static_cast<int>(k % G));
      const Entry& e = entry(b);
      if (e.pages.size() != cols.size()) {
        return where + "maps block " + std::to_string(b) + ", which holds no pages";
      }
      for (size_t j = 0; j < cols.size(); ++j) {
        if (s.pages[(k / G) * C + cols[j]] != e.pages[j]) {
          return where + "page index " + std::to_string(k / G) + " does not map block " +
                 std::to_string(b) + "'s pages";
        }
      }
    }
  }
  for (size_t b = 0; b < entries_.size(); ++b) {
    const Entry& e = entries_[b];
    if (e.mappings != counted[b]) {
      return "block " + std::to_string(b) + " counts " + std::to_string(e.mappings) +
             " mappings but " + std::to_string(counted[b]) + " rows map it";
    }
    if (!e.pages.empty() && e.mappings == 0 && !cache_) {
      return "block " + std::to_string(b) + " keeps pages no row maps without caching";
    }
    if (cache_) {
      for (PageHandle p : e.pages) ++seen[p];  // the block's own reference
    }
  }
  return "";
}

void BlockPages::close() {
  for (Entry& e : entries_) e = Entry{};  // the pool destroys every page next
}

}  // namespace vattention
