// KVCacheCore, part 2: prefix sharing (fork, share_prefix, ensure_private) and the helpers that
// keep the rest of the cache correct when a physical page is mapped more than once.
// (Swap and eviction are in kv_cache_swap.cpp.)
//
// Why sharing is sound: a physical page may be mapped at several virtual addresses (CUDA VMM
// aliasing; MAP_SHARED extents on the host). A slot's page indices [0, Slot::shared_pages) are
// read-only by contract, because tokens are only appended past them, so a shared page never
// changes while shared. The partial page at a fork point is where both slots write next: it is
// copied at fork time. ensure_private() gives a slot private copies when it must rewrite history.
//
// References: the pool counts one reference per mapping (and one per swap entry that keeps a page
// on the device). Unmapping only drops references; a page goes back to the free list with its last
// one, so freeing a parent never frees what a child maps.
//
// Ordering (CUDA): copies are stream-ordered and may still run when Backend::copy returns, and
// unmapping is not stream-ordered. Every path here waits on a fence on the caller's stream
// (sync_stream) after copying and before it unmaps a page a kernel may read.
#include <algorithm>
#include <string>
#include <unordered_map>

#include "kv_cache.h"

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

// ---- small helpers --------------------------------------------------------------------------

void KVCacheCore::sync_stream(uintptr_t stream) {
  const uint64_t fence = backend_->record_fence(stream);
  try {
    backend_->fence_wait(fence);
  } catch (...) {
    backend_->fence_release(fence);
    throw;
  }
  backend_->fence_release(fence);
}

uintptr_t KVCacheCore::staging_va() {
  if (staging_.va == 0) {
    staging_.va = backend_->reserve(geo_.page_bytes);
    staging_.bytes = geo_.page_bytes;
    staging_.backend = backend_.get();
  }
  return staging_.va;
}

void KVCacheCore::stage(PageHandle page) {
  const uintptr_t stage = staging_va();
  if (staged_) unstage();  // a mapping an earlier failed unmap left behind
  backend_->map(stage, page);
  ++counters_.map_calls;
  try {
    backend_->set_access(stage, geo_.page_bytes);
    ++counters_.set_access_calls;
  } catch (...) {
    try {
      backend_->unmap(stage, geo_.page_bytes);
      ++counters_.unmap_calls;
    } catch (...) {
      pool_->share(page);  // still mapped: the staging keeps it out of the free list
      staged_ = true;
      staged_page_ = page;
    }
    throw;
  }
  pool_->share(page);
  staged_ = true;
  staged_page_ = page;
}

void KVCacheCore::unstage() {
  if (!staged_) return;
  for (int attempt = 0;; ++attempt) {
    try {
      backend_->unmap(staging_.va, geo_.page_bytes);
      ++counters_.unmap_calls;
      break;
    } catch (...) {
      if (attempt == 1) throw;  // the page stays staged and referenced: accounted, not leaked
    }
  }
  staged_ = false;
  pool_->release(staged_page_);
}

bool KVCacheCore::any_sharing() const {
  if (swap_->size() > 0) return true;
  return std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.shared_pages > 0; });
}

int KVCacheCore::pick_fresh_slot() const {
  // A free slot needs no unmapping; else the least recently freed idle slot (as reclamation).
  int best = -1;
  for (int i = 0; i < geo_.max_batch; ++i) {
    const Slot& s = slots_[static_cast<size_t>(i)];
    if (s.state == Slot::State::Free) return i;
    if (s.state == Slot::State::Idle &&
        (best < 0 || s.freed_at < slots_[static_cast<size_t>(best)].freed_at)) {
      best = i;
    }
  }
  if (best < 0) throw no_free_slot();
  return best;
}

void KVCacheCore::forget_sharing(Slot& s, int index) {
  if (s.shared_pages == 0) return;
  const size_t C = geo_.columns();
  size_t keep = s.mapped;
  for (size_t i = 0; i < std::min(s.shared_pages, s.mapped) * C && keep == s.mapped; ++i) {
    if (s.pages[i] != kNoPage && pool_->refs(s.pages[i]) > 1) keep = i / C;
  }
  unmap_tail(s, index, keep);  // an idle slot waits for its fence inside
  s.shared_pages = 0;
}

size_t KVCacheCore::freeable_spare(const std::vector<Growth>& plan, bool allow_trim) const {
  // A page returns to the pool only if every reference to it is a reclaimable mapping.
  const size_t C = geo_.columns();
  std::unordered_map<PageHandle, uint32_t> reclaimable;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (in_flight(i)) continue;  // never shrunk while mapped outside the lock (rule R)
    size_t from = s.mapped;
    if (s.state == Slot::State::Idle) {
      from = 0;
    } else if (allow_trim && s.state == Slot::State::Active &&
               std::none_of(plan.begin(), plan.end(),
                            [&](const Growth& g) { return g.slot == static_cast<int>(i); })) {
      from = std::min(s.mapped, geo_.pages_for(s.seq_len));
    }
    for (size_t k = from * C; k < s.pages.size(); ++k) {
      if (s.pages[k] != kNoPage) ++reclaimable[s.pages[k]];
    }
  }
  size_t spare = 0;
  for (const auto& entry : reclaimable) {
    if (entry.second == pool_->refs(entry.first)) ++spare;
  }
  return spare;
}

void KVCacheCore::check_share_args(int src, int64_t num_tokens) const {
  require_active(src, "src_slot", kNotActive);
  const Slot& s = slots_[static_cast<size_t>(src)];
  if (num_tokens < 0 || num_tokens > s.seq_len) {
    throw Error(Error::Kind::SequenceTooLong,
                "num_tokens=" + std::to_string(num_tokens) + " is outside [0, " +
                    std::to_string(s.seq_len) + "]: src_slot=" + std::to_string(src) +
                    " holds " + std::to_string(s.seq_len) + " tokens (its last step() length)")
        .with("slot", src)
        .with("num_tokens", num_tokens)
        .with("seq_len", s.seq_len);
  }
  // A window may have released keys the prefix's last query reads: those cannot be shared.
  if (!s.head.empty()) check_window(src, num_tokens, "num_tokens");
}

// ---- fork / share_prefix --------------------------------------------------------------------

int KVCacheCore::fork(int src, int64_t num_tokens, uintptr_t stream) {
  prefetcher_->wait();
  Lock lock(mu_);
  settle(lock);  // another thread may have queued a prefetch since (rule R, kv_cache_prefetch.cpp)
  check_open();
  rethrow_background_error();
  drain_eager();
  validate_slot(src);
  const int64_t n = num_tokens < 0 ? slots_[static_cast<size_t>(src)].seq_len : num_tokens;
  check_share_args(src, n);
  const int dst = pick_fresh_slot();
  // dst stays free or idle until share_locked commits, so reclaiming its pages meanwhile waits on
  // its fence like any idle slot's, and a failure leaves it as it was.
  share_locked(src, dst, n, stream);
  return dst;
}

void KVCacheCore::share_prefix(int src, int dst, int64_t num_tokens, uintptr_t stream) {
  prefetcher_->wait();
  Lock lock(mu_);
  settle(lock);  // another thread may have queued a prefetch since (rule R, kv_cache_prefetch.cpp)
  check_open();
  rethrow_background_error();
  require_active(dst, "dst_slot", kNotActive);
  check_share_args(src, num_tokens);
  const Slot& d = slots_[static_cast<size_t>(dst)];
  if (dst == src || d.seq_len != 0) {
    throw Error(Error::Kind::InvalidSlot,
                "dst_slot=" + std::to_string(dst) + " is not fresh: " +
                    (dst == src ? std::string("it is src_slot")
                                : "it holds " + std::to_string(d.seq_len) + " tokens") +
                    "; share_prefix needs a slot straight from alloc() (seq_len 0)")
        .with("slot", dst)
        .with("seq_len", d.seq_len);
  }
  share_locked(src, dst, num_tokens, stream);
}

void KVCacheCore::share_locked(int src, int dst, int64_t num_tokens, uintptr_t stream) {
  const int T = geo_.num_tensors();
  const size_t C = geo_.columns();
  const size_t P = geo_.page_bytes;
  // In page-index units: tensor t holds index_pages(t) times these bytes (geometry.h).
  const size_t used_bytes = static_cast<size_t>(num_tokens) * geo_.unit_bytes();
  const size_t full = used_bytes / P;                 // page indices wholly inside the prefix: shared
  const size_t need = geo_.pages_for(num_tokens);     // full, or full + 1 with a partial page
  const size_t partial_bytes = used_bytes - full * P;  // prefix bytes of the partial page index
  Slot& s = slots_[static_cast<size_t>(src)];
  Slot& d = slots_[static_cast<size_t>(dst)];

  // Every page first: obtain() may reclaim idle slots and trim look-ahead (dst's own pages count
  // as look-ahead, seq_len 0), and throws OutOfPages with nothing changed.
  std::vector<PageHandle> fresh;
  if (need > full) {
    try {
      fresh = obtain((need - full) * C, {}, true);
    } catch (const Error& e) {
      if (e.kind() == Error::Kind::OutOfPages) ++counters_.oom_events;
      throw;
    }
  }
  std::vector<PageHandle> handles(s.pages.begin(), s.pages.begin() + static_cast<long>(full * C));
  handles.insert(handles.end(), fresh.begin(), fresh.end());
  try {
    sync_stream(stream);  // kernels queued before may still read dst's old pages
    unmap_tail(d, dst, 0);  // an idle dst waits on its free() fence inside
    if (need > 0) map_slot(dst, 0, need, handles.data(), false);  // undoes itself on failure
  } catch (...) {
    for (PageHandle p : fresh) pool_->release(p);
    throw;
  }
  for (size_t i = 0; i < full * C; ++i) {
    if (handles[i] != kNoPage) pool_->share(handles[i]);  // released window pages stay holes
  }
  if (partial_bytes > 0) {
    try {
      scrub_pages(dst, full, need);  // the fresh page: zeros past the copied prefix
      for (int t = 0; t < T; ++t) {
        backend_->copy(page_va(t, dst, full), page_va(t, src, full),
                       partial_bytes * geo_.index_pages(t), stream);
      }
      sync_stream(stream);
    } catch (...) {
      try {
        unmap_tail(d, dst, 0);  // drops the shared references and the fresh pages again
      } catch (...) {
      }
      throw;
    }
    for (int t = 0; t < T; ++t) {  // pages the partial copies touched
      counters_.cow_pages_copied += (partial_bytes * geo_.index_pages(t) + P - 1) / P;
    }
  }
  if (d.has_fence) {
    backend_->fence_release(d.fence);
    d.has_fence = false;
  }
  d.state = Slot::State::Active;
  d.seq_len = num_tokens;
  d.shared_pages = full;
  d.last_step = step_counter_;
  s.shared_pages = std::max(s.shared_pages, full);
}

// ---- ensure_private ------------------------------------------------------------------------

size_t KVCacheCore::ensure_private(int slot, int64_t start_token, uintptr_t stream) {
  prefetcher_->wait();
  Lock lock(mu_);
  settle(lock);  // another thread may have queued a prefetch since (rule R, kv_cache_prefetch.cpp)
  check_open();
  rethrow_background_error();
  require_active(slot, "slot", kNotActive);
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (start_token < 0 || start_token > s.seq_len) {
    throw Error(Error::Kind::SequenceTooLong,
                "start_token=" + std::to_string(start_token) + " is outside [0, " +
                    std::to_string(s.seq_len) + "] (seq_len of slot " + std::to_string(slot) + ")")
        .with("slot", slot)
        .with("start_token", start_token)
        .with("seq_len", s.seq_len);
  }
  const size_t C = geo_.columns();
  const size_t P = geo_.page_bytes;
  const size_t first = static_cast<size_t>(start_token) * geo_.unit_bytes() / P;  // page index
  std::vector<size_t> shared;  // indices into s.pages
  for (size_t i = first * C; i < s.pages.size(); ++i) {
    if (s.pages[i] != kNoPage && pool_->refs(s.pages[i]) > 1) shared.push_back(i);
  }
  if (!shared.empty()) {
    std::vector<PageHandle> fresh;
    try {
      // The slot is in the plan: its own look-ahead must not be trimmed under `shared`.
      fresh = obtain(shared.size(), {Growth{slot, s.mapped, s.mapped}}, true);
    } catch (const Error& e) {
      if (e.kind() == Error::Kind::OutOfPages) ++counters_.oom_events;
      throw;
    }
    size_t done = 0;
    std::vector<PageHandle> olds(shared.size());
    for (size_t k = 0; k < shared.size(); ++k) olds[k] = s.pages[shared[k]];
    try {
      for (; done < shared.size(); ++done) {
        const size_t i = shared[done];
        const uintptr_t va = column_va(i % C, slot, i / C);
        const PageHandle old = s.pages[i], page = fresh[done];
        // Copy through the staging address, then swap the slot's mapping to the copy.
        stage(page);
        try {
          backend_->copy(staging_.va, va, P, stream);
          sync_stream(stream);  // copy done, and no queued kernel still reads `old` at va
        } catch (...) {
          try {
            unstage();
          } catch (...) {  // the page stays staged (referenced); the first error is the one
          }
          throw;
        }
        unstage();
        backend_->unmap(va, P);  // on failure nothing changed: `old` is still mapped at va
        ++counters_.unmap_calls;
        bool mapped = false;
        try {
          backend_->map(va, page);
          mapped = true;
          backend_->set_access(va, P);
        } catch (...) {
          // Undo exactly what was done, then put the shared page back so the slot's record
          // stays true (each call retried once: a hole in the slot would be worse than the error).
          try {
            if (mapped) retry_once([&] { backend_->unmap(va, P); });
            retry_once([&] { backend_->map(va, old); });
            retry_once([&] { backend_->set_access(va, P); });
          } catch (...) {
          }
          throw;
        }
        counters_.map_calls += 1;
        counters_.set_access_calls += 1;
        s.pages[i] = page;
        pool_->release(old);
      }
    } catch (...) {
      // All or nothing: pages already made private are switched back to the shared page (its
      // contents are the same), so the slot, the pool and the sharing stats are as before.
      for (size_t k = done; k-- > 0;) {
        const size_t i = shared[k];
        const uintptr_t va = column_va(i % C, slot, i / C);
        const PageHandle copy = s.pages[i], old = olds[k];
        try {
          retry_once([&] { backend_->unmap(va, P); });
        } catch (...) {
          continue;  // the private copy stays (same contents); the record stays true
        }
        try {
          retry_once([&] { backend_->map(va, old); });
          retry_once([&] { backend_->set_access(va, P); });
        } catch (...) {
        }
        pool_->share(old);
        s.pages[i] = old;
        pool_->release(copy);
      }
      for (size_t k = done; k < fresh.size(); ++k) pool_->release(fresh[k]);
      throw;
    }
    counters_.cow_pages_copied += shared.size();
  }
  s.shared_pages = std::min(s.shared_pages, first);
  return shared.size();
}

// ---- invariants and stats -------------------------------------------------------------------

std::string KVCacheCore::check_sharing(std::map<PageHandle, uint32_t>& seen) const {
  const size_t C = geo_.columns();
  if (staged_) {
    if (pool_->refs(staged_page_) == 0) {
      return "page " + std::to_string(staged_page_) +
             " is back in the pool but still mapped at the staging address";
    }
    ++seen[staged_page_];  // the staging mapping's reference
  }
  for (const auto& entry : swap_->device_refs()) seen[entry.first] += static_cast<uint32_t>(entry.second);
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    for (size_t k = s.shared_pages * C; k < s.pages.size(); ++k) {
      if (s.pages[k] != kNoPage && pool_->refs(s.pages[k]) > 1) {
        return "slot " + std::to_string(i) + " maps shared page " + std::to_string(s.pages[k]) +
               " at page index " + std::to_string(k / C) + ", outside its read-only prefix of " +
               std::to_string(s.shared_pages) + " pages";
      }
    }
  }
  return "";
}

void KVCacheCore::sharing_stats(std::vector<std::pair<std::string, int64_t>>& out) const {
  // Counting distinct pages walks every mapping: only when something can be shared at all, so
  // stats() stays O(slots) for caches that never fork.
  int64_t shared = 0, saved_pages = 0;
  if (any_sharing()) {
    std::unordered_map<PageHandle, uint32_t> mapped;
    int64_t mappings = 0;
    for (const Slot& s : slots_) {
      for (PageHandle p : s.pages) {
        if (p != kNoPage) ++mapped[p];
      }
      mappings += static_cast<int64_t>(s.live_pages(geo_));
    }
    for (const auto& entry : mapped) shared += entry.second > 1 ? 1 : 0;
    saved_pages = mappings - static_cast<int64_t>(mapped.size());
  }
  out.emplace_back("shared_pages", shared);
  out.emplace_back("bytes_saved_by_sharing", saved_pages * static_cast<int64_t>(geo_.page_bytes));
  out.emplace_back("cow_pages_copied", static_cast<int64_t>(counters_.cow_pages_copied));
  out.emplace_back("swap_handles", static_cast<int64_t>(swap_->size()));
  out.emplace_back("swap_host_bytes", static_cast<int64_t>(swap_->host_bytes()));
  out.emplace_back("swap_budget", swap_->budget_bytes());
  out.emplace_back("swap_device_pages", static_cast<int64_t>(swap_->device_refs().size()));
  out.emplace_back("swap_out_pages", static_cast<int64_t>(counters_.swap_out_pages));
  out.emplace_back("swap_in_pages", static_cast<int64_t>(counters_.swap_in_pages));
}

}  // namespace vattention
