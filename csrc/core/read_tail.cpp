#include "core/read_tail.h"

#include <algorithm>
#include <string>

namespace vattention {

std::vector<ReadTail::Zeroing> ReadTail::plan(const std::vector<int64_t>& lens) const {
  std::vector<Zeroing> out;
  const CacheGeometry& geo = parts_.geo;
  if (geo.tile_tokens <= 0) return out;
  for (size_t i = 0; i < lens.size(); ++i) {
    const int64_t len = lens[i];
    if (len == SlotTable::kUnlisted || len <= 0) continue;
    const int64_t finite = parts_.slots[i].pages.finite();
    const int64_t end = geo.read_end(len);
    // Tokens [finite, len) are the request's own (it writes them before a kernel reads them).
    if (end > finite) out.push_back(Zeroing{static_cast<int>(i), std::max(finite, len), end});
  }
  return out;
}

void ReadTail::zero_tokens(int slot, int64_t from, int64_t to, uintptr_t stream) {
  if (to <= from) return;
  const CacheGeometry& geo = parts_.geo;
  // A row's tokens are contiguous in each tensor (token stride token_bytes(t)); in the mega
  // layout a token row holds every layer, so one call covers the tile of all of them.
  for (int t = 0; t < geo.num_tensors(); ++t) {
    const size_t tb = geo.token_bytes(t);
    const size_t bytes = static_cast<size_t>(to - from) * tb;
    parts_.backend.zero(parts_.mapper.page_va(t, slot, 0) + static_cast<size_t>(from) * tb, bytes,
                        stream);
    ++parts_.counters.tail_zero_calls;
    parts_.counters.tail_zeroed_bytes += bytes;
  }
}

void ReadTail::zero(std::vector<Zeroing>& plan, uintptr_t stream) {
  for (Zeroing& z : plan) {
    // Past the length, everything the row maps now (its read end at least: the step grew it,
    // and trimming under pressure keeps it): one call a tensor now instead of one per tile
    // later, and none while its pages come zeroed from the prefetch thread. Look-ahead the
    // step's supply trimmed from this row is not zeroed, nor counted finite.
    z.to = std::max(z.to, parts_.slots[static_cast<size_t>(z.slot)].pages.backed());
    zero_tokens(z.slot, z.from, z.to, stream);
  }
}

void ReadTail::commit(const std::vector<Zeroing>& plan) {
  for (const Zeroing& z : plan) parts_.memory.set_finite(z.slot, z.to);
}

void ReadTail::settle(int slot, int64_t len, uintptr_t stream) {
  if (parts_.geo.tile_tokens <= 0) return;  // no kernel reads past len: nothing to zero
  const int64_t end = parts_.slots[static_cast<size_t>(slot)].pages.backed();
  zero_tokens(slot, len, end, stream);
  parts_.memory.set_finite(slot, end);
}

void ReadTail::forget(int slot) { parts_.memory.set_finite(slot, 0); }

void ReadTail::add_stats(Stats& out) const {
  out.emplace_back("kv_tile_tokens", parts_.geo.tile_tokens);
  out.emplace_back("tail_zero_calls", static_cast<int64_t>(parts_.counters.tail_zero_calls));
  out.emplace_back("tail_zeroed_bytes", static_cast<int64_t>(parts_.counters.tail_zeroed_bytes));
}

std::string ReadTail::check(std::map<PageHandle, uint32_t>& /*seen*/) const {
  const CacheGeometry& geo = parts_.geo;
  if (geo.tile_tokens <= 0) return "";
  for (size_t i = 0; i < parts_.slots.size(); ++i) {
    const Slot& s = parts_.slots[i];
    const std::string where = "slot " + std::to_string(i) + ": ";
    if (s.pages.finite() > s.pages.backed()) {
      return where + "finite tokens (" + std::to_string(s.pages.finite()) + ") past the " +
             std::to_string(s.pages.backed()) + " it backs";
    }
    if (!s.use.active()) continue;
    const int64_t end = geo.read_end(s.use.seq_len());
    if (s.pages.backed() < end) {
      return where + "backs " + std::to_string(s.pages.backed()) +
             " tokens, short of its read end " + std::to_string(end) + " (length " +
             std::to_string(s.use.seq_len()) + ")";
    }
    if (s.pages.finite() < end) {
      return where + "finite up to token " + std::to_string(s.pages.finite()) +
             ", short of its read end " + std::to_string(end);
    }
  }
  return "";
}

}  // namespace vattention
