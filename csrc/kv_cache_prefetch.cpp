// KVCacheCore, background pre-mapping: prefetch() queues the next iteration's lengths (plus
// look-ahead) for the Prefetcher thread, which maps them slot by slot under the cache mutex.
// Running dry there is not an error (step() raises only if the current need cannot be met); any
// other failure is kept and raised, typed, by the next call on the cache.
#include <algorithm>

#include "kv_cache.h"

namespace vattention {

void KVCacheCore::prefetch(const std::vector<int64_t>& lens, int64_t lookahead_tokens) {
  Prefetcher::Job job(lens.size(), kUnlisted);
  {
    Lock lock(mu_);
    check_open();
    rethrow_background_error();
    validate_lens(lens, true);
    if (lookahead_tokens < -1) {
      throw Error(Error::Kind::Config, "lookahead_tokens=" + std::to_string(lookahead_tokens) +
                                           " must be >= 0");
    }
    const int64_t ahead = lookahead_tokens < 0 ? lookahead_tokens_ : lookahead_tokens;
    for (size_t i = 0; i < lens.size(); ++i) {
      if (lens[i] != kUnlisted) job[i] = std::min(geo_.max_seq, lens[i] + ahead);
    }
  }
  prefetcher_->submit(std::move(job));
}

void KVCacheCore::run_prefetch(const Prefetcher::Job& job) {
  backend_->bind_thread();
  const size_t T = static_cast<size_t>(geo_.num_tensors());
  for (size_t i = 0; i < job.size(); ++i) {
    if (job[i] == kUnlisted) continue;
    Lock lock(mu_);  // per slot, so callers interleave with a long prefetch
    if (closed_ || background_error_) return;
    Slot& s = slots_[i];
    if (s.state != Slot::State::Active) continue;
    const size_t to = geo_.pages_for(job[i]);
    if (to <= s.mapped) continue;
    const size_t from = s.mapped;
    try {
      grow({Growth{static_cast<int>(i), from, to}}, true);
    } catch (const Error& e) {
      if (e.kind() == Error::Kind::OutOfPages) {
        // Not an error yet: step() raises only if the current need cannot be met.
        counters_.prefetch_shortfall_pages += (to - s.mapped) * T;
      } else {
        background_error_ = std::current_exception();
      }
      return;
    } catch (...) {
      background_error_ = std::current_exception();
      return;
    }
    // Populating is the slow part on the host (~0.5 ms per 2 MB page) and needs no cache state:
    // do it unlocked so step() never waits behind it. The range may be unmapped by then; the
    // backend tolerates that.
    lock.unlock();
    for (int t = 0; t < geo_.num_tensors(); ++t) {
      backend_->prefault(page_va(t, static_cast<int>(i), from), (to - from) * geo_.page_bytes);
    }
  }
}

void KVCacheCore::wait() {
  prefetcher_->wait();
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
}

void KVCacheCore::set_lookahead(int64_t tokens) {
  if (tokens < 0) {
    throw Error(Error::Kind::Config, "lookahead_tokens=" + std::to_string(tokens) + " must be >= 0");
  }
  std::lock_guard<std::mutex> lock(mu_);
  lookahead_tokens_ = tokens;
}

}  // namespace vattention
