// KVCacheCore, sliding windows (issue 14): giving back the pages a windowed layer can never read.
//
// Why absolute positions: token t of a slot stays at row index t, so FlashAttention's window_size,
// SDPA masks and CUDA graphs see the same dense tensor as without a window. Only memory changes:
// a page of a windowed tensor lying wholly before the first key any query of this step can read is
// unmapped and returned to the pool, so a long request holds O(W) pages per windowed tensor.
//
// Which keys a step's queries read: step(len) after a previous length `old` writes and attends
// queries at positions [old, len); the query at q reads keys (q - W, q] (Mistral, Gemma and Qwen2
// convention; FlashAttention window_size=(W - 1, 0)). So pages wholly before min(old, len - 1) - W
// + 1 are released; a prefill (old = 0) releases nothing, a decode step (old = len - 1) releases
// pages wholly before len - W.
//
// Released page indices stay in Slot::pages as kNoPage below Slot::head[t] (a per-tensor prefix),
// so page index arithmetic (p * columns + column) is unchanged everywhere; every path that walks a
// slot's pages skips them (fork shares only what is mapped, swap saves only the mapped window).
//
// Ordering (CUDA): unmapping is not stream-ordered and kernels of earlier steps may still read the
// released keys, so release waits on a fence recorded on the step's stream first (only in steps
// that release something: once per page of tokens per windowed slot).
#include <algorithm>
#include <limits>

#include "kv_cache.h"

namespace vattention {

void KVCacheCore::refresh_release_at(Slot& s) const {
  s.release_at = std::numeric_limits<int64_t>::max();
  if (!geo_.any_window()) return;
  for (int t = 0; t < geo_.num_tensors(); ++t) {
    if (geo_.window(t) <= 0) continue;
    s.release_at = std::min(s.release_at, geo_.query_releasing(t, head_of(s, static_cast<size_t>(t)) + 1));
  }
}

size_t KVCacheCore::release_head(Slot& s, int index, int64_t first_query) {
  if (first_query < s.release_at) return 0;
  const size_t T = static_cast<size_t>(geo_.num_tensors());
  const size_t C = geo_.columns();
  if (s.head.empty()) s.head.assign(T, 0);
  const size_t free_before = pool_->free();
  for (size_t t = 0; t < T; ++t) {
    const int tensor = static_cast<int>(t);
    const size_t from = s.head[t];
    // Never beyond the mapped range: a windowed tensor keeps at least the page being written.
    const size_t to = std::min(geo_.releasable_pages(tensor, first_query), s.mapped);
    if (to <= from) continue;
    backend_->unmap(page_va(tensor, index, from), (to - from) * geo_.index_bytes(tensor));
    ++counters_.unmap_calls;
    const size_t first = geo_.first_column(tensor), n = geo_.index_pages(tensor);
    for (size_t p = from; p < to; ++p) {
      for (size_t j = 0; j < n; ++j) {
        PageHandle& page = s.pages[p * C + first + j];
        pool_->release(page);
        page = kNoPage;
      }
    }
    s.head[t] = to;
  }
  refresh_release_at(s);
  const size_t released = pool_->free() - free_before;
  window_released_pages_ += released;
  return released;
}

size_t KVCacheCore::release_windows(const std::vector<int64_t>& lens,
                                    const std::vector<int64_t>& old_lens, uintptr_t stream) {
  if (!geo_.any_window()) return 0;
  auto first_query = [&](size_t i) { return std::min(old_lens[i], lens[i] - 1); };
  bool due = false;
  for (size_t i = 0; i < lens.size() && !due; ++i) {
    due = lens[i] != kUnlisted && lens[i] > 0 && first_query(i) >= slots_[i].release_at;
  }
  if (!due) return 0;
  sync_stream(stream);  // kernels of earlier steps may still read the keys about to go
  size_t released = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == kUnlisted || lens[i] <= 0) continue;
    released += release_head(slots_[i], static_cast<int>(i), first_query(i));
  }
  return released;
}

void KVCacheCore::check_window(int slot, int64_t len, const char* what) const {
  const Slot& s = slots_[static_cast<size_t>(slot)];
  for (size_t t = 0; t < s.head.size(); ++t) {
    const int64_t w = geo_.window(static_cast<int>(t));
    const int64_t start = geo_.first_token_at(s.head[t]);
    if (s.head[t] == 0 || len - w >= start) continue;
    throw Error(Error::Kind::SequenceTooLong,
                std::string(what) + "=" + std::to_string(len) + " for slot " + std::to_string(slot) +
                    " needs keys from token " + std::to_string(std::max<int64_t>(0, len - w)) +
                    " (sliding_window=" + std::to_string(w) + "), but tokens below " +
                    std::to_string(start) + " were released; lengths must be >= " +
                    std::to_string(start + w))
        .with("slot", slot)
        .with("seq_len", len)
        .with("window_start", start);
  }
}

void KVCacheCore::forget_window(Slot& s, int index) {
  if (s.holes(geo_) == 0) {
    s.head.clear();
    refresh_release_at(s);
    return;
  }
  unmap_tail(s, index, 0);  // an idle slot waits for its fence inside
}

std::vector<int64_t> KVCacheCore::window_starts(int slot) const {
  Lock lock(mu_);
  check_open();
  validate_slot(slot);
  const Slot& s = slots_[static_cast<size_t>(slot)];
  std::vector<int64_t> out(static_cast<size_t>(geo_.num_layers), 0);
  if (s.head.empty()) return out;
  for (int t = 0; t < geo_.num_tensors(); ++t) {
    const int64_t start = geo_.first_token_at(s.head[static_cast<size_t>(t)]);
    if (geo_.mega) {
      for (int64_t& v : out) v = std::max(v, start);
    } else {
      int64_t& v = out[static_cast<size_t>(t % geo_.num_layers)];
      v = std::max(v, start);
    }
  }
  return out;
}

}  // namespace vattention
