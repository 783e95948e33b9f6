// Pages named by an engine's block ids (block_tables.h), under ThreadSanitizer and ASan/UBSan.
//
// An engine loop (vLLM's block accounting in miniature: an LRU pool of ids, shared prefixes that
// later requests hit, fresh ids that reuse evicted ones) steps the cache with block tables while
// the prefetch thread maps look-ahead (which fresh blocks adopt) and a reader thread takes stats()
// and check_invariants(). Every token's bytes encode the block and its generation (each fresh
// hand-out is a new generation), so a hit that mapped the wrong pages, or a reused page written
// while another row still reads it, is a wrong byte. Elastic runs also release the blocks the
// engine freed last (often mapped by an idle row the prefetch thread may still be mapping) and
// set a budget each step, while the prefetch thread keeps a headroom of free pages.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/harness.h"

using namespace vattention;
using vattention::testing::check;

namespace {

constexpr int64_t kBlocks = 48;
constexpr int kPrefixBlocks = 2;

struct Request {
  int slot = -1;
  int64_t len = 0;
  int64_t target = 0;
  int prefix = -1;  // which shared prefix it starts with (-1: none)
  std::vector<int64_t> table;
};

class Engine {
 public:
  Engine(KVCacheCore& core, bool caching, bool elastic, unsigned seed)
      : core_(core), caching_(caching), elastic_(elastic), rng_(seed), gen_(kBlocks, 0) {
    for (int64_t b = 0; b < kBlocks; ++b) free_.push_back(b);
    tpp_ = static_cast<int64_t>(core.geometry().tokens_per_page());
  }

  void run(int steps) {
    const int64_t B = core_.geometry().max_batch;
    for (int step = 0; step < steps; ++step) {
      if (reqs_.size() < static_cast<size_t>(B) && rng_() % 2 == 0) admit();
      std::vector<int64_t> lens(static_cast<size_t>(B), KVCacheCore::kUnlisted);
      std::vector<BlockUpdate> updates;
      for (Request& r : reqs_) grow(r, lens, updates);
      try {
        if (elastic_) shed();
        core_.step(lens, updates, 0);
      } catch (const Error& e) {
        check(false, std::string("step: ") + e.what());
        return;
      }
      for (Request& r : reqs_) write_and_check(r);
      std::vector<int64_t> next(lens.size(), KVCacheCore::kUnlisted);
      for (const Request& r : reqs_) next[static_cast<size_t>(r.slot)] = r.len + 1;
      core_.prefetch(next, -1);
      finish();
    }
  }

 private:
  int64_t take() {
    if (free_.empty()) return -1;
    const int64_t b = free_.front();
    free_.pop_front();
    for (auto& p : prefixes_) {  // handed out fresh: a cached copy of it is gone
      if (std::find(p.second.begin(), p.second.end(), b) != p.second.end()) p.second.clear();
    }
    ++gen_[static_cast<size_t>(b)];
    ++refs_[b];
    return b;
  }
  void release(int64_t b) {
    if (--refs_[b] == 0) free_.push_back(b);
  }

  // The scheduler's side of elastic memory: the two ids freed last give their pages back (a
  // prefix they held is gone), and the budget is what the blocks with pages, a new block per row
  // and a headroom of two blocks need.
  void shed() {
    std::vector<int64_t> ids(free_.rbegin(), free_.rbegin() + std::min<size_t>(2, free_.size()));
    for (auto& p : prefixes_) {
      for (int64_t b : ids) {
        if (std::find(p.second.begin(), p.second.end(), b) != p.second.end()) p.second.clear();
      }
    }
    core_.release_blocks(ids);
    int64_t with_pages = 0;
    for (const auto& kv : core_.stats())
      with_pages += kv.first == "blocks_with_pages" ? kv.second : 0;
    const CacheGeometry& g = core_.geometry();
    const int64_t block = static_cast<int64_t>(g.group_width() * g.page_bytes);
    core_.set_memory_budget((with_pages + g.max_batch * (kPrefixBlocks + 2) + 2) * block);
  }

  void admit() {
    Request r;
    r.prefix = static_cast<int>(rng_() % 3) - 1;
    r.len = (r.prefix >= 0 ? kPrefixBlocks * tpp_ : 0) + 1 + static_cast<int64_t>(rng_() % 40);
    r.target = r.len + 1 + static_cast<int64_t>(rng_() % 80);
    size_t hits = 0;
    if (r.prefix >= 0 && !prefixes_[r.prefix].empty()) {
      for (int64_t b : prefixes_[r.prefix]) {
        if (refs_[b]++ == 0) free_.erase(std::find(free_.begin(), free_.end(), b));
        r.table.push_back(b);
      }
      hits = r.table.size();
    }
    const size_t need = core_.geometry().pages_for(r.len);
    while (r.table.size() < need) {
      const int64_t b = take();
      if (b < 0) {
        for (int64_t x : r.table) release(x);
        return;
      }
      r.table.push_back(b);
    }
    r.slot = core_.alloc();
    pending_.push_back({r.slot, 0, {r.table}, hits});
    new_from_[r.slot] = static_cast<int64_t>(hits) * tpp_;
    r.len = -r.len;  // admitted this step: grow() lists its whole length
    reqs_.push_back(r);
  }

  void grow(Request& r, std::vector<int64_t>& lens, std::vector<BlockUpdate>& updates) {
    if (r.len < 0) {  // just admitted
      r.len = -r.len;
    } else {
      new_from_[r.slot] = r.len;
      ++r.len;
      if (core_.geometry().pages_for(r.len) > r.table.size()) {
        const int64_t b = take();
        if (b < 0) {  // the pool is dry: stay at this length (no new tokens)
          --r.len;
          new_from_[r.slot] = r.len;
        } else {
          r.table.push_back(b);
          updates.push_back({r.slot, r.table.size() - 1, {{b}}, 0});
        }
      }
    }
    lens[static_cast<size_t>(r.slot)] = r.len;
    for (BlockUpdate& u : pending_) {
      if (u.slot == r.slot) updates.push_back(u);
    }
  }

  uint8_t byte_of(const Request& r, int64_t t) const {
    const int64_t b = r.table[static_cast<size_t>(t / tpp_)];
    return static_cast<uint8_t>((b * 7 + gen_[static_cast<size_t>(b)] * 13 + t % tpp_) % 251);
  }

  void write_and_check(const Request& r) {
    const CacheGeometry& g = core_.geometry();
    const size_t row = g.slot_bytes(0), tok = g.token_bytes(0);
    for (int t = 0; t < g.num_tensors(); ++t) {
      uint8_t* base = reinterpret_cast<uint8_t*>(core_.tensor_base(t)) + r.slot * row;
      for (int64_t i = 0; i < r.len; ++i) {
        uint8_t* at = base + i * tok;
        if (i >= new_from_[r.slot]) {
          std::memset(at, byte_of(r, i), tok);
        } else if (at[0] != byte_of(r, i) || at[tok - 1] != byte_of(r, i)) {
          check(false, "slot " + std::to_string(r.slot) + " token " + std::to_string(i) +
                           " of block " + std::to_string(r.table[i / tpp_]) +
                           " reads another block's data");
          return;
        }
      }
    }
    // Full prefix blocks become the engine's cached copy of that prefix.
    if (caching_ && r.prefix >= 0 && prefixes_[r.prefix].empty() && r.len >= kPrefixBlocks * tpp_) {
      prefixes_[r.prefix].assign(r.table.begin(), r.table.begin() + kPrefixBlocks);
    }
  }

  void finish() {
    pending_.clear();
    for (auto it = reqs_.begin(); it != reqs_.end();) {
      if (it->len >= it->target) {
        core_.free(it->slot, 0);
        for (int64_t b : it->table) release(b);
        it = reqs_.erase(it);
      } else {
        ++it;
      }
    }
  }

  KVCacheCore& core_;
  const bool caching_;  // the engine's prefix caching: blocks keep their pages
  const bool elastic_;  // release blocks and set a budget every step
  std::mt19937 rng_;
  int64_t tpp_;
  std::deque<int64_t> free_;
  std::map<int64_t, int> refs_;
  std::vector<int64_t> gen_;
  std::map<int, std::vector<int64_t>> prefixes_;
  std::map<int, int64_t> new_from_;
  std::vector<Request> reqs_;
  std::vector<BlockUpdate> pending_;
};

void run(bool cache_blocks, bool elastic, unsigned seed) {
  CacheGeometry g = testing::small_geometry(1, 6, 1024);
  g.page_bytes = 4096;  // 32 tokens a page index: blocks fill and hit within a short test
  auto core =
      testing::host_core(g, int64_t{64} << 20, ReclaimPolicy::Deferred, kBlocks, cache_blocks);
  if (elastic) {
    Tuning tuning;
    tuning.headroom_bytes = static_cast<int64_t>(2 * g.group_width() * g.page_bytes);
    tuning.lookahead_tokens = 8;
    core->tune(tuning);
  }
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done) {
      const std::string inv = core->check_invariants();
      check(inv.empty(), "invariants while stepping: " + inv);
      core->stats();
    }
  });
  Engine(*core, cache_blocks, elastic, seed).run(400);
  done = true;
  reader.join();
  core->wait();
  check(core->check_invariants().empty(), "invariants: " + core->check_invariants());
  int64_t hits = 0;
  for (const auto& kv : core->stats()) hits += kv.first == "block_hits" ? kv.second : 0;
  check(!cache_blocks || hits > 0, "no cache hits: the test did not exercise them");
  if (elastic) {
    int64_t released = 0, background = 0;
    for (const auto& kv : core->stats()) {
      released += kv.first == "blocks_released" ? kv.second : 0;
      background += kv.first == "background_pages_created" ? kv.second : 0;
    }
    check(released > 0 && background > 0, "the elastic run released nothing or refilled nothing");
  }
  core->close();
}

}  // namespace

int main() {
  run(true, false, 1);
  run(true, false, 2);
  run(false, false, 3);
  run(true, true, 4);
  run(false, true, 5);
  return vattention::testing::report("engine block tests");
}
