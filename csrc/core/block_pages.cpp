#include "core/block_pages.h"

#include <string>

namespace vattention {

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
  out.emplace_back("blocks_released", static_cast<int64_t>(released_));
  out.emplace_back("pages_released_by_blocks", static_cast<int64_t>(pages_released_));
}

std::string BlockPages::check(const std::vector<uint32_t>& counted,
                              std::map<PageHandle, uint32_t>& seen) const {
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

void BlockPages::forget_all() {
  for (Entry& e : entries_) e = Entry{};  // the pool destroys every page next
}

}  // namespace vattention
