#include "core/prefix_sharing.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

namespace vattention {
namespace {

constexpr const char* kNotActive = "is not an active slot (call alloc() or fork() first)";

// Rollback steps get one retry: leaving a hole in a slot would be worse than the error itself.
template <typename F>
void retry_once(F&& call) {
  try {
    call();
  } catch (...) {
    call();
  }
}

}  // namespace

void PrefixSharing::check_source(int src, int64_t num_tokens) const {
  parts_.slots.require_active(src, "src_slot", kNotActive);
  const Slot& s = parts_.slots[static_cast<size_t>(src)];
  if (num_tokens < 0 || num_tokens > s.seq_len) {
    throw Error(Error::Kind::SequenceTooLong,
                "num_tokens=" + std::to_string(num_tokens) + " is outside [0, " +
                    std::to_string(s.seq_len) + "]: src_slot=" + std::to_string(src) + " holds " +
                    std::to_string(s.seq_len) + " tokens (its last step() length)")
        .with("slot", src)
        .with("num_tokens", num_tokens)
        .with("seq_len", s.seq_len);
  }
  // A window may have released keys the prefix's last query reads: those cannot be shared.
  if (!s.head.empty()) windows_.check(src, num_tokens, "num_tokens");
}

void PrefixSharing::check_pair(int src, int dst, int64_t num_tokens) const {
  parts_.slots.require_active(dst, "dst_slot", kNotActive);
  check_source(src, num_tokens);
  const Slot& d = parts_.slots[static_cast<size_t>(dst)];
  if (dst == src || d.seq_len != 0) {
    throw Error(Error::Kind::InvalidSlot,
                "dst_slot=" + std::to_string(dst) + " is not fresh: " +
                    (dst == src ? std::string("it is src_slot")
                                : "it holds " + std::to_string(d.seq_len) + " tokens") +
                    "; share_prefix needs a slot straight from alloc() (seq_len 0)")
        .with("slot", dst)
        .with("seq_len", d.seq_len);
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
  const size_t need = geo.pages_for(num_tokens);       // full, or full + 1 with a partial page
  const size_t partial_bytes = used_bytes - full * P;  // prefix bytes of the partial page index
  Slot& s = parts_.slots[static_cast<size_t>(src)];
  Slot& d = parts_.slots[static_cast<size_t>(dst)];

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
  std::vector<PageHandle> handles(s.pages.begin(), s.pages.begin() + static_cast<long>(full * C));
  handles.insert(handles.end(), fresh.begin(), fresh.end());
  try {
    parts_.memory.sync_stream(stream);    // kernels queued before may still read dst's old pages
    parts_.memory.unmap_tail(d, dst, 0);  // an idle dst waits on its free() fence inside
    if (need > 0) parts_.memory.map(d, dst, 0, need, handles.data(), false);
  } catch (...) {
    for (PageHandle p : fresh) parts_.pool.release(p);
    throw;
  }
  for (size_t i = 0; i < full * C; ++i) {
    if (handles[i] != kNoPage) parts_.pool.share(handles[i]);  // released window pages stay holes
  }
  if (partial_bytes > 0) {
    try {
      parts_.scrubber.scrub(dst, full, need);  // the fresh page: zeros past the copied prefix
      for (int t = 0; t < T; ++t) {
        parts_.backend.copy(parts_.mapper.page_va(t, dst, full),
                            parts_.mapper.page_va(t, src, full), partial_bytes * geo.index_pages(t),
                            stream);
      }
      parts_.memory.sync_stream(stream);
    } catch (...) {
      try {
        parts_.memory.unmap_tail(d, dst, 0);  // drops the shared references and the fresh pages
      } catch (...) {
      }
      throw;
    }
    for (int t = 0; t < T; ++t) {  // pages the partial copies touched
      cow_pages_copied_ += (partial_bytes * geo.index_pages(t) + P - 1) / P;
    }
  }
  parts_.memory.forget_fence(d);
  d.state = Slot::State::Active;
  d.seq_len = num_tokens;
  d.shared_pages = full;
  d.last_step = parts_.slots.step_count();
  s.shared_pages = std::max(s.shared_pages, full);
}

size_t PrefixSharing::ensure_private(int slot, int64_t start_token, uintptr_t stream) {
  parts_.slots.require_active(slot, "slot", kNotActive);
  Slot& s = parts_.slots[static_cast<size_t>(slot)];
  if (start_token < 0 || start_token > s.seq_len) {
    throw Error(Error::Kind::SequenceTooLong,
                "start_token=" + std::to_string(start_token) + " is outside [0, " +
                    std::to_string(s.seq_len) + "] (seq_len of slot " + std::to_string(slot) + ")")
        .with("slot", slot)
        .with("start_token", start_token)
        .with("seq_len", s.seq_len);
  }
  const CacheGeometry& geo = parts_.geo;
  Backend& backend = parts_.backend;
  PagePool& pool = parts_.pool;
  const size_t C = geo.columns();
  const size_t P = geo.page_bytes;
  const size_t first = static_cast<size_t>(start_token) * geo.unit_bytes() / P;  // page index
  std::vector<size_t> shared;  // indices into s.pages
  for (size_t i = first * C; i < s.pages.size(); ++i) {
    if (s.pages[i] != kNoPage && pool.refs(s.pages[i]) > 1) shared.push_back(i);
  }
  if (!shared.empty()) {
    std::vector<PageHandle> fresh;
    try {
      // The slot is in the plan: its own look-ahead must not be trimmed under `shared`.
      fresh = parts_.supply.obtain(shared.size(), {Growth{slot, s.mapped, s.mapped}}, true);
    } catch (const Error& e) {
      if (e.kind() == Error::Kind::OutOfPages) ++parts_.counters.oom_events;
      throw;
    }
    size_t done = 0;
    std::vector<PageHandle> olds(shared.size());
    for (size_t k = 0; k < shared.size(); ++k) olds[k] = s.pages[shared[k]];
    try {
      for (; done < shared.size(); ++done) {
        const size_t i = shared[done];
        const uintptr_t va = parts_.mapper.column_va(i % C, slot, i / C);
        const PageHandle old = s.pages[i], page = fresh[done];
        // Copy through the staging address, then swap the slot's mapping to the copy.
        parts_.staging.stage(page);
        try {
          backend.copy(parts_.staging.va(), va, P, stream);
          parts_.memory.sync_stream(stream);  // copy done, and no queued kernel reads `old` at va
        } catch (...) {
          try {
            parts_.staging.unstage();
          } catch (...) {  // the page stays staged (referenced); the first error is the one
          }
          throw;
        }
        parts_.staging.unstage();
        backend.unmap(va, P);  // on failure nothing changed: `old` is still mapped at va
        ++parts_.counters.unmap_calls;
        bool mapped = false;
        try {
          backend.map(va, page);
          mapped = true;
          backend.set_access(va, P);
        } catch (...) {
          // Undo exactly what was done, then put the shared page back so the slot's record
          // stays true (each call retried once: a hole in the slot would be worse than the error).
          try {
            if (mapped) retry_once([&] { backend.unmap(va, P); });
            retry_once([&] { backend.map(va, old); });
            retry_once([&] { backend.set_access(va, P); });
          } catch (...) {
          }
          throw;
        }
        parts_.counters.map_calls += 1;
        parts_.counters.set_access_calls += 1;
        s.pages[i] = page;
        pool.release(old);
      }
    } catch (...) {
      // All or nothing: pages already made private are switched back to the shared page (its
      // contents are the same), so the slot, the pool and the sharing stats are as before.
      for (size_t k = done; k-- > 0;) {
        const size_t i = shared[k];
        const uintptr_t va = parts_.mapper.column_va(i % C, slot, i / C);
        const PageHandle copy = s.pages[i], old = olds[k];
        try {
          retry_once([&] { backend.unmap(va, P); });
        } catch (...) {
          continue;  // the private copy stays (same contents); the record stays true
        }
        try {
          retry_once([&] { backend.map(va, old); });
          retry_once([&] { backend.set_access(va, P); });
        } catch (...) {
        }
        pool.share(old);
        s.pages[i] = old;
        pool.release(copy);
      }
      for (size_t k = done; k < fresh.size(); ++k) pool.release(fresh[k]);
      throw;
    }
    cow_pages_copied_ += shared.size();
  }
  s.shared_pages = std::min(s.shared_pages, first);
  return shared.size();
}

void PrefixSharing::reset_slot(Slot& s, int index) {
  // Engine blocks: the new request's first table keeps what agrees with it and unmaps the rest
  // (BlockTables::apply), and a row writes nothing its table does not name: a hit on the blocks
  // an idle row still maps costs no map call.
  if (s.shared_pages == 0 || parts_.blocks.enabled()) return;
  const size_t C = parts_.geo.columns();
  size_t keep = s.mapped;
  for (size_t i = 0; i < std::min(s.shared_pages, s.mapped) * C && keep == s.mapped; ++i) {
    if (s.pages[i] != kNoPage && parts_.pool.refs(s.pages[i]) > 1) keep = i / C;
  }
  parts_.memory.unmap_tail(s, index, keep);  // an idle slot waits for its fence inside
  s.shared_pages = 0;
}

std::string PrefixSharing::check(std::map<PageHandle, uint32_t>& seen) const {
  // `seen` counts the slots' mappings and the swap handles' references (the features registered
  // before this one); engine blocks' own references come after: a block's pages are shared only
  // when two rows map them (which the engine allows on full, never rewritten blocks).
  const size_t C = parts_.geo.columns();
  for (size_t i = 0; i < parts_.slots.size(); ++i) {
    const Slot& s = parts_.slots[i];
    for (size_t k = s.shared_pages * C; k < s.pages.size(); ++k) {
      if (s.pages[k] != kNoPage && seen[s.pages[k]] > 1) {
        return "slot " + std::to_string(i) + " maps shared page " + std::to_string(s.pages[k]) +
               " at page index " + std::to_string(k / C) + ", outside its read-only prefix of " +
               std::to_string(s.shared_pages) + " pages";
      }
    }
  }
  return "";
}

void PrefixSharing::add_stats(Stats& out) const {
  // Counting distinct pages walks every mapping: only when some page has a second reference, so
  // stats() stays O(slots) for caches that never share.
  int64_t shared = 0, saved_pages = 0;
  if (parts_.pool.extra_refs() > 0) {
    std::unordered_map<PageHandle, uint32_t> mapped;
    int64_t mappings = 0;
    for (const Slot& s : parts_.slots) {
      for (PageHandle p : s.pages) {
        if (p != kNoPage) ++mapped[p];
      }
      mappings += static_cast<int64_t>(s.live_pages(parts_.geo));
    }
    for (const auto& entry : mapped) shared += entry.second > 1 ? 1 : 0;
    saved_pages = mappings - static_cast<int64_t>(mapped.size());
  }
  out.emplace_back("shared_pages", shared);
  out.emplace_back("bytes_saved_by_sharing",
                   saved_pages * static_cast<int64_t>(parts_.geo.page_bytes));
  out.emplace_back("cow_pages_copied", static_cast<int64_t>(cow_pages_copied_));
}

}  // namespace vattention
