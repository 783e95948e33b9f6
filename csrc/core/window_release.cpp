#include "core/window_release.h"

#include <algorithm>
#include <string>

namespace vattention {
namespace {

int64_t first_query(const std::vector<int64_t>& lens, const std::vector<int64_t>& old_lens,
                    size_t i) {
  return std::min(old_lens[i], lens[i] - 1);
}

}  // namespace

size_t WindowRelease::release_end(const Slot& s, int tensor, int64_t query) const {
  // Never beyond the mapped range: a windowed tensor keeps at least the page being written.
  const size_t from = s.pages.head(static_cast<size_t>(tensor));
  const size_t to = std::min(parts_.geo.releasable_pages(tensor, query), s.pages.mapped());
  return std::max(from, to);
}

size_t WindowRelease::release_head(int slot, int64_t query) {
  const Slot& s = parts_.slots[static_cast<size_t>(slot)];
  if (query < s.pages.release_at()) return 0;
  const size_t free_before = parts_.pool.free();
  for (int t = 0; t < parts_.geo.num_tensors(); ++t) {
    parts_.memory.release_front(slot, t, release_end(s, t, query));
  }
  const size_t released = parts_.pool.free() - free_before;
  released_pages_ += released;
  return released;
}

size_t WindowRelease::release(const std::vector<int64_t>& lens,
                              const std::vector<int64_t>& old_lens, uintptr_t stream) {
  if (!parts_.geo.any_window()) return 0;
  bool due = false;
  for (size_t i = 0; i < lens.size() && !due; ++i) {
    due = lens[i] != SlotTable::kUnlisted && lens[i] > 0 &&
          first_query(lens, old_lens, i) >= parts_.slots[i].pages.release_at();
  }
  if (!due) return 0;
  parts_.memory.sync_stream(stream);  // kernels of earlier steps may still read the keys to go
  size_t released = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == SlotTable::kUnlisted || lens[i] <= 0) continue;
    released += release_head(static_cast<int>(i), first_query(lens, old_lens, i));
  }
  return released;
}

size_t WindowRelease::releasable(const std::vector<int64_t>& lens) const {
  const CacheGeometry& geo = parts_.geo;
  if (!geo.any_window()) return 0;
  size_t pages = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    const Slot& s = parts_.slots[i];
    if (lens[i] == SlotTable::kUnlisted || lens[i] <= 0 || !s.use.active()) continue;
    const int64_t query = std::min(s.use.seq_len(), lens[i] - 1);
    if (query < s.pages.release_at()) continue;
    const size_t C = geo.columns();
    const std::vector<PageHandle>& handles = s.pages.handles();
    for (int t = 0; t < geo.num_tensors(); ++t) {
      const size_t first = geo.first_column(t), n = geo.index_pages(t);
      for (size_t p = s.pages.head(static_cast<size_t>(t)); p < release_end(s, t, query); ++p) {
        for (size_t j = 0; j < n; ++j) pages += parts_.pool.refs(handles[p * C + first + j]) == 1;
      }
    }
  }
  return pages;
}

void WindowRelease::check(int slot, int64_t len, const char* what) const {
  const SlotPages& s = parts_.slots[static_cast<size_t>(slot)].pages;
  if (!s.has_holes()) return;
  for (size_t t = 0; t < static_cast<size_t>(parts_.geo.num_tensors()); ++t) {
    const int64_t w = parts_.geo.window(static_cast<int>(t));
    const int64_t start = parts_.geo.first_token_at(s.head(t));
    // A tile-loading kernel starts at the tile of the first key (read_tail.h).
    if (s.head(t) == 0 || parts_.geo.tile_floor(len - w) >= start) continue;
    const int64_t tile = parts_.geo.tile_tokens;
    const int64_t least = (tile > 0 ? (start + tile - 1) / tile * tile : start) + w;
    throw Error(
        Error::Kind::SequenceTooLong,
        std::string(what) + "=" + std::to_string(len) + " for slot " + std::to_string(slot) +
            " needs keys from token " + std::to_string(std::max<int64_t>(0, len - w)) +
            " (sliding_window=" + std::to_string(w) + "), but tokens below " +
            std::to_string(start) + " were released; lengths must be >= " + std::to_string(least))
        .with("slot", slot)
        .with("seq_len", len)
        .with("window_start", start);
  }
}

std::vector<int64_t> WindowRelease::starts(int slot) const {
  const CacheGeometry& geo = parts_.geo;
  const SlotPages& s = parts_.slots[static_cast<size_t>(slot)].pages;
  std::vector<int64_t> out(static_cast<size_t>(geo.num_layers), 0);
  if (!s.has_holes()) return out;
  for (int t = 0; t < geo.num_tensors(); ++t) {
    const int64_t start = geo.first_token_at(s.head(static_cast<size_t>(t)));
    if (geo.mega) {
      for (int64_t& v : out) v = std::max(v, start);
    } else {
      int64_t& v = out[static_cast<size_t>(t % geo.num_layers)];
      v = std::max(v, start);
    }
  }
  return out;
}

void WindowRelease::clear(int slot) {
  if (parts_.slots[static_cast<size_t>(slot)].pages.has_holes()) parts_.memory.unmap_tail(slot, 0);
}

void WindowRelease::add_stats(Stats& out) const {
  out.emplace_back("window_released_pages", static_cast<int64_t>(released_pages_));
}

}  // namespace vattention
