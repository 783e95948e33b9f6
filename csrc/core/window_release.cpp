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
  const size_t from = s.head_of(static_cast<size_t>(tensor));
  const size_t to = std::min(parts_.geo.releasable_pages(tensor, query), s.mapped);
  return std::max(from, to);
}

size_t WindowRelease::release_head(Slot& s, int index, int64_t query) {
  if (query < s.release_at) return 0;
  const CacheGeometry& geo = parts_.geo;
  const size_t T = static_cast<size_t>(geo.num_tensors());
  const size_t C = geo.columns();
  if (s.head.empty()) s.head.assign(T, 0);
  const std::vector<size_t> old_head = s.head;
  const size_t free_before = parts_.pool.free();
  for (size_t t = 0; t < T; ++t) {
    const int tensor = static_cast<int>(t);
    const size_t from = s.head[t], to = release_end(s, tensor, query);
    if (to <= from) continue;
    parts_.mapper.unmap_run(tensor, index, from, to);
    ++parts_.counters.unmap_calls;
    const size_t first = geo.first_column(tensor), n = geo.index_pages(tensor);
    for (size_t p = from; p < to; ++p) {
      for (size_t j = 0; j < n; ++j) {
        PageHandle& page = s.pages[p * C + first + j];
        parts_.pool.release(page);
        page = kNoPage;
      }
    }
    s.head[t] = to;
  }
  if (!s.blocks.empty()) {
    // A group's tensors share one window (geometry.h): its block at a released index is unmapped
    // from this row as a whole.
    const size_t G = static_cast<size_t>(geo.num_groups());
    for (size_t t = 0; t < T; ++t) {
      const size_t g = static_cast<size_t>(geo.group_of(static_cast<int>(t)));
      for (size_t p = old_head[t]; p < s.head[t]; ++p) {
        int64_t& b = s.blocks[p * G + g];
        if (b == kNoBlock) continue;
        parts_.blocks.unmapped(b);
        b = kNoBlock;
      }
    }
  }
  s.refresh_release_at(geo);
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
          first_query(lens, old_lens, i) >= parts_.slots[i].release_at;
  }
  if (!due) return 0;
  parts_.memory.sync_stream(stream);  // kernels of earlier steps may still read the keys to go
  size_t released = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == SlotTable::kUnlisted || lens[i] <= 0) continue;
    released += release_head(parts_.slots[i], static_cast<int>(i), first_query(lens, old_lens, i));
  }
  return released;
}

size_t WindowRelease::releasable(const std::vector<int64_t>& lens) const {
  const CacheGeometry& geo = parts_.geo;
  if (!geo.any_window()) return 0;
  size_t pages = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    const Slot& s = parts_.slots[i];
    if (lens[i] == SlotTable::kUnlisted || lens[i] <= 0 || s.state != Slot::State::Active) continue;
    const int64_t query = std::min(s.seq_len, lens[i] - 1);
    if (query < s.release_at) continue;
    const size_t C = geo.columns();
    for (int t = 0; t < geo.num_tensors(); ++t) {
      const size_t first = geo.first_column(t), n = geo.index_pages(t);
      for (size_t p = s.head_of(static_cast<size_t>(t)); p < release_end(s, t, query); ++p) {
        for (size_t j = 0; j < n; ++j) pages += parts_.pool.refs(s.pages[p * C + first + j]) == 1;
      }
    }
  }
  return pages;
}

void WindowRelease::check(int slot, int64_t len, const char* what) const {
  const Slot& s = parts_.slots[static_cast<size_t>(slot)];
  for (size_t t = 0; t < s.head.size(); ++t) {
    const int64_t w = parts_.geo.window(static_cast<int>(t));
    const int64_t start = parts_.geo.first_token_at(s.head[t]);
    if (s.head[t] == 0 || len - w >= start) continue;
    throw Error(Error::Kind::SequenceTooLong,
                std::string(what) + "=" + std::to_string(len) + " for slot " +
                    std::to_string(slot) + " needs keys from token " +
                    std::to_string(std::max<int64_t>(0, len - w)) + " (sliding_window=" +
                    std::to_string(w) + "), but tokens below " + std::to_string(start) +
                    " were released; lengths must be >= " + std::to_string(start + w))
        .with("slot", slot)
        .with("seq_len", len)
        .with("window_start", start);
  }
}

std::vector<int64_t> WindowRelease::starts(int slot) const {
  const CacheGeometry& geo = parts_.geo;
  const Slot& s = parts_.slots[static_cast<size_t>(slot)];
  std::vector<int64_t> out(static_cast<size_t>(geo.num_layers), 0);
  if (s.head.empty()) return out;
  for (int t = 0; t < geo.num_tensors(); ++t) {
    const int64_t start = geo.first_token_at(s.head[static_cast<size_t>(t)]);
    if (geo.mega) {
      for (int64_t& v : out) v = std::max(v, start);
    } else {
      int64_t& v = out[static_cast<size_t>(t % geo.num_layers)];
      v = std::max(v, start);
    }
  }
  return out;
}

void WindowRelease::reset_slot(Slot& s, int index) {
  if (s.holes(parts_.geo) == 0) {
    s.head.clear();
    s.refresh_release_at(parts_.geo);
    return;
  }
  parts_.memory.unmap_tail(s, index, 0);  // an idle slot waits for its fence inside
}

void WindowRelease::add_stats(Stats& out) const {
  out.emplace_back("window_released_pages", static_cast<int64_t>(released_pages_));
}

}  // namespace vattention
