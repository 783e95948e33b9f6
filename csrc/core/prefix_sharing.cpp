#include "core/prefix_sharing.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/retry.h"

namespace vattention {
namespace {

constexpr const char* kNotActive = "is not an active slot (call alloc() or fork() first)";

}  // namespace

void PrefixSharing::check_source(int src, int64_t num_tokens) const {
  parts_.slots.require_active(src, "src_slot", kNotActive);
  const int64_t len = parts_.slots[static_cast<size_t>(src)].use.seq_len();
  if (num_tokens < 0 || num_tokens > len) {
    throw Error(Error::Kind::SequenceTooLong,
                "num_tokens=" + std::to_string(num_tokens) + " is outside [0, " +
                    std::to_string(len) + "]: src_slot=" + std::to_string(src) + " holds " +
                    std::to_string(len) + " tokens (its last step() length)")
        .with("slot", src)
        .with("num_tokens", num_tokens)
        .with("seq_len", len);
  }
  // A window may have released keys the prefix's last query reads: those cannot be shared.
  windows_.check(src, num_tokens, "num_tokens");
}

void PrefixSharing::check_pair(int src, int dst, int64_t num_tokens) const {
  parts_.slots.require_active(dst, "dst_slot", kNotActive);
  check_source(src, num_tokens);
  const int64_t len = parts_.slots[static_cast<size_t>(dst)].use.seq_len();
  if (dst == src || len != 0) {
    throw Error(Error::Kind::InvalidSlot,
                "dst_slot=" + std::to_string(dst) + " is not fresh: " +
                    (dst == src ? std::string("it is src_slot")
                                : "it holds " + std::to_string(len) + " tokens") +
                    "; share_prefix needs a slot straight from alloc() (seq_len 0)")
        .with("slot", dst)
        .with("seq_len", len);
  }
}

void PrefixSharing::share(int src, int dst, int64_t num_tokens, uintptr_t stream) {
  const CacheGeometry& geo = parts_.geo;
  const int T = geo.num_tensors();
  const size_t C = geo.columns();
  const size_t P = geo.page_bytes;
  // In page-index units: tensor t holds index_pages(t) times these bytes (geometry.h).
  const size_t used_bytes = static_cast<size_t>(num_tokens) * geo.unit_bytes();
  const size_t full = used_bytes / P;                  // page indices wholly inside: shared
  const size_t need = geo.read_pages(num_tokens);      // full, or more: a partial page, a tile
  const size_t partial_bytes = used_bytes - full * P;  // prefix bytes of the partial page index
  const SlotPages& s = parts_.slots[static_cast<size_t>(src)].pages;

  // Every page first: obtain() may reclaim idle slots and trim look-ahead (dst's own pages count
  // as look-ahead, seq_len 0), and throws OutOfPages with nothing changed.
  std::vector<PageHandle> fresh;
  if (need > full) {
    try {
      fresh = parts_.supply.obtain((need - full) * C, {}, true);
    } catch (const Error& e) {
      if (e.kind() == Error::Kind::OutOfPages) ++parts_.counters.oom_events;
      throw;
    }
  }
  std::vector<PageHandle> handles(s.handles().begin(),
                                  s.handles().begin() + static_cast<long>(full * C));
  handles.insert(handles.end(), fresh.begin(), fresh.end());
  try {
    parts_.memory.sync_stream(stream);  // kernels queued before may still read dst's old pages
    parts_.memory.unmap_tail(dst, 0);   // an idle dst waits on its free() fence inside
    if (need > 0) parts_.memory.map(dst, 0, need, handles.data());
  } catch (...) {
    for (PageHandle p : fresh) parts_.pool.release(p);
    throw;
  }
  for (size_t i = 0; i < full * C; ++i) {
    if (handles[i] != kNoPage) parts_.pool.share(handles[i]);  // released window pages stay holes
  }
  const int64_t read_end = geo.read_end(num_tokens);
  if (partial_bytes > 0 || read_end > num_tokens) {
    try {
      parts_.scrubber.scrub(dst, full, need, stream);  // the fresh pages: zeros past the prefix
      if (partial_bytes > 0) {
        for (int t = 0; t < T; ++t) {
          parts_.backend.copy(parts_.mapper.page_va(t, dst, full),
                              parts_.mapper.page_va(t, src, full),
                              partial_bytes * geo.index_pages(t), stream);
        }
      }
      // What a tile-loading kernel reads past num_tokens: dst's own pages (past the shared ones).
      tail_.settle(dst, num_tokens, stream);
      parts_.memory.sync_stream(stream);
    } catch (...) {
      try {
        parts_.memory.unmap_tail(dst, 0);  // drops the shared references and the fresh pages
      } catch (...) {
      }
      throw;
    }
    for (int t = 0; t < T && partial_bytes > 0; ++t) {  // pages the partial copies touched
      cow_pages_copied_ += (partial_bytes * geo.index_pages(t) + P - 1) / P;
    }
  }
  parts_.memory.forget_fence(dst);
  parts_.slots.activate(dst, num_tokens);
  // The shared prefix is src's data; past it settle() zeroed dst's own pages and recorded them
  // finite. Without a partial page or a tile to zero, the prefix ends on a page boundary.
  if (partial_bytes == 0 && read_end == num_tokens) parts_.memory.set_finite(dst, num_tokens);
  parts_.memory.set_read_only(dst, full);
  parts_.memory.set_read_only(src, std::max(s.read_only(), full));
}

size_t PrefixSharing::ensure_private(int slot, int64_t start_token, uintptr_t stream) {
  parts_.slots.require_active(slot, "slot", kNotActive);
  const Slot& row = parts_.slots[static_cast<size_t>(slot)];
  const int64_t len = row.use.seq_len();
  if (start_token < 0 || start_token > len) {
    throw Error(Error::Kind::SequenceTooLong,
                "start_token=" + std::to_string(start_token) + " is outside [0, " +
                    std::to_string(len) + "] (seq_len of slot " + std::to_string(slot) + ")")
        .with("slot", slot)
        .with("start_token", start_token)
        .with("seq_len", len);
  }
  const CacheGeometry& geo = parts_.geo;
  PagePool& pool = parts_.pool;
  const std::vector<PageHandle>& pages = row.pages.handles();
  const size_t C = geo.columns();
  const size_t P = geo.page_bytes;
  const size_t mapped = row.pages.mapped();
  const size_t first = static_cast<size_t>(start_token) * geo.unit_bytes() / P;  // page index
  std::vector<size_t> shared;  // indices into the row's handles
  for (size_t i = first * C; i < pages.size(); ++i) {
    if (pages[i] != kNoPage && pool.refs(pages[i]) > 1) shared.push_back(i);
  }
  if (!shared.empty()) {
    std::vector<PageHandle> fresh;
    try {
      // The slot is in the plan: its own look-ahead must not be trimmed under `shared`.
      fresh = parts_.supply.obtain(shared.size(), {Growth{slot, mapped, mapped}}, true);
    } catch (const Error& e) {
      if (e.kind() == Error::Kind::OutOfPages) ++parts_.counters.oom_events;
      throw;
    }
    size_t done = 0;
    std::vector<PageHandle> olds(shared.size());
    for (size_t k = 0; k < shared.size(); ++k) olds[k] = pages[shared[k]];
    try {
      for (; done < shared.size(); ++done) {
        const size_t i = shared[done];
        const uintptr_t va = parts_.mapper.column_va(i % C, slot, i / C);
        // Copy through the staging address, then switch the row's mapping to the copy.
        staging_.stage(fresh[done]);
        try {
          parts_.backend.copy(staging_.va(), va, P, stream);
          parts_.memory.sync_stream(stream);  // copy done, and no queued kernel reads the old page
        } catch (...) {
          try {
            staging_.unstage();
          } catch (...) {  // the page stays staged (referenced); the first error is the one
          }
          throw;
        }
        staging_.unstage();
        parts_.memory.replace_page(slot, i, fresh[done]);
      }
    } catch (...) {
      // All or nothing: pages already made private are switched back to the shared page (its
      // contents are the same), so the row, the pool and the sharing stats are as before.
      for (size_t k = done; k-- > 0;) {
        const PageHandle old = olds[k];
        pool.share(old);  // the reference the row's mapping takes back
        try {
          retry_once([&] { parts_.memory.replace_page(slot, shared[k], old); });
        } catch (...) {
          pool.release(old);  // the private copy stays (same contents); the record stays true
        }
      }
      for (size_t k = done; k < fresh.size(); ++k) pool.release(fresh[k]);
      throw;
    }
    cow_pages_copied_ += shared.size();
  }
  parts_.memory.set_read_only(slot, std::min(row.pages.read_only(), first));
  return shared.size();
}

void PrefixSharing::clear(int slot) {
  const SlotPages& s = parts_.slots[static_cast<size_t>(slot)].pages;
  if (s.read_only() == 0) return;
  const size_t C = parts_.geo.columns();
  const std::vector<PageHandle>& pages = s.handles();
  size_t keep = s.mapped();
  for (size_t i = 0; i < std::min(s.read_only(), s.mapped()) * C && keep == s.mapped(); ++i) {
    if (pages[i] != kNoPage && parts_.pool.refs(pages[i]) > 1) keep = i / C;
  }
  parts_.memory.unmap_tail(slot, keep);  // an idle slot waits for its fence inside
  parts_.memory.set_read_only(slot, 0);
}

std::string PrefixSharing::check(std::map<PageHandle, uint32_t>& seen) const {
  // `seen` counts the rows' mappings and the swap handles' references (registered before this
  // part); the staging mapping's come after.
  return parts_.memory.check_read_only(seen);
}

void PrefixSharing::add_stats(Stats& out) const {
  out.emplace_back("cow_pages_copied", static_cast<int64_t>(cow_pages_copied_));
}

}  // namespace vattention
