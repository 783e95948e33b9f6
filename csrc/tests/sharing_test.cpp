// Prefix sharing and swap under ThreadSanitizer and AddressSanitizer/UBSan: threads
// fork / share_prefix / ensure_private / swap_out / swap_in / swap_drop / step / prefetch / free /
// reclaim / pick_victims against one KVCacheCore on the host backend, under tight page and swap
// budgets; then the invariants hold, and freeing everything leaves no page in use. Each thread
// writes a byte pattern into its slots and checks it after every fork and swap-in, so a page
// freed while still mapped, or a wrong copy, is caught by data and by ASan. The windowed runs
// add sliding-window release: only tokens from window_starts() on are written and
// checked, and forks of a released prefix are typed errors.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/kv_cache.h"
#include "host/host_backend.h"
#include "tests/harness.h"

using namespace vattention;
using vattention::testing::check;

namespace {

// per_layer: layer 0 has twice layer 1's KV heads, so a page index is 2 + 1 pages per K/V.
std::unique_ptr<KVCacheCore> make_core(bool mega, int64_t window, bool per_layer) {
  CacheGeometry g = testing::small_geometry(1, 12, 2048, mega);
  if (window > 0) g.windows = {window, mega ? window : 0};  // layer layout: layer 1 is global
  if (per_layer) g.layer_kv_heads = {2, 1};
  auto core = testing::host_core(g, int64_t{40} << 20, ReclaimPolicy::Deferred);
  core->set_swap_budget(int64_t{8} << 20);
  return core;
}

// Token k of a slot holds byte (tag + k) % 251 in every tensor, tag being that of the last write
// covering k (segments: start token -> tag). Forks copy the segments below the fork point.
struct Seq {
  int slot;
  int64_t len;
  std::map<int64_t, uint8_t> segs;
  uint8_t tag_at(int64_t k) const { return std::prev(segs.upper_bound(k))->second; }
};

// First token of tensor t of the slot still backed (a window may have released the ones below).
int64_t readable(KVCacheCore& core, int slot, int t) {
  return core.window_starts(slot)[static_cast<size_t>(t % core.geometry().num_layers)];
}

void write(KVCacheCore& core, Seq& s, int64_t from, int64_t to, uint8_t tag) {
  if (from >= to) return;
  const uint8_t after = s.segs.empty() || to >= s.len ? tag : s.tag_at(to);
  s.segs.erase(s.segs.lower_bound(from), s.segs.end());
  s.segs[from] = tag;
  if (to < s.len) s.segs[to] = after;
  const CacheGeometry& g = core.geometry();
  for (int t = 0; t < g.num_tensors(); ++t) {
    for (int64_t k = std::max(from, readable(core, s.slot, t)); k < to; ++k) {
      auto* p = reinterpret_cast<uint8_t*>(core.tensor_base(t) +
                                           static_cast<size_t>(s.slot) * g.slot_bytes(t) +
                                           static_cast<size_t>(k) * g.token_bytes(t));
      std::memset(p, (tag + k) % 251, g.token_bytes(t));
    }
  }
}

bool intact(KVCacheCore& core, const Seq& s) {
  const CacheGeometry& g = core.geometry();
  for (int t = 0; t < g.num_tensors(); ++t) {
    for (int64_t k = readable(core, s.slot, t); k < s.len; k += 7) {
      auto* p = reinterpret_cast<const uint8_t*>(core.tensor_base(t) +
                                                 static_cast<size_t>(s.slot) * g.slot_bytes(t) +
                                                 static_cast<size_t>(k) * g.token_bytes(t));
      const int want = (s.tag_at(k) + k) % 251;
      if (p[0] != want || p[g.token_bytes(t) - 1] != want) return false;
    }
  }
  return true;
}

void hammer(KVCacheCore& core, unsigned seed, const std::atomic<bool>& stop) {
  std::mt19937 rng(seed);
  const int64_t B = core.geometry().max_batch;
  std::vector<Seq> mine;
  std::vector<std::pair<int64_t, Seq>> swapped;
  auto step_one = [&](const Seq& s, int64_t len) {
    std::vector<int64_t> lens(static_cast<size_t>(B), KVCacheCore::kUnlisted);
    lens[static_cast<size_t>(s.slot)] = len;
    core.step(lens, {}, 0);
  };
  while (!stop) {
    const unsigned op = rng() % 100;
    try {
      if (op < 15 && mine.size() < 3) {
        mine.push_back(Seq{core.alloc(), 0, {}});
        const int64_t len = 1 + rng() % 1500;
        step_one(mine.back(), len);
        write(core, mine.back(), 0, len, static_cast<uint8_t>(rng()));
        mine.back().len = len;
      } else if (op < 35 && !mine.empty()) {
        Seq& s = mine[rng() % mine.size()];
        const int64_t len = std::min<int64_t>(2048, s.len + 1 + rng() % 300);
        step_one(s, len);
        write(core, s, s.len, len, static_cast<uint8_t>(rng()));
        s.len = len;
      } else if (op < 50 && !mine.empty() && mine.size() < 4) {
        Seq src = mine[rng() % mine.size()];
        const int64_t n = src.len == 0 ? 0 : static_cast<int64_t>(rng() % (src.len + 1));
        Seq child{-1, n, {}};
        for (const auto& seg : src.segs) {
          if (seg.first < n) child.segs.insert(seg);
        }
        if (rng() % 2) {
          child.slot = core.fork(src.slot, n, 0);
        } else {
          child.slot = core.alloc();
          try {
            core.share_prefix(src.slot, child.slot, n, 0);
          } catch (...) {
            core.free(child.slot, 0);
            throw;
          }
        }
        check(intact(core, child), "fork/share_prefix copied wrong bytes");
        mine.push_back(child);
      } else if (op < 58 && !mine.empty()) {
        Seq& s = mine[rng() % mine.size()];
        const int64_t start = s.len == 0 ? 0 : static_cast<int64_t>(rng() % (s.len + 1));
        core.ensure_private(s.slot, start, 0);
        write(core, s, start, s.len, static_cast<uint8_t>(rng()));  // history rewritten
      } else if (op < 68 && !mine.empty()) {
        const size_t i = rng() % mine.size();
        const int64_t h = core.swap_out(mine[i].slot, 0);
        swapped.emplace_back(h, mine[i]);
        mine.erase(mine.begin() + static_cast<long>(i));
      } else if (op < 78 && !swapped.empty()) {
        const size_t i = rng() % swapped.size();
        Seq s = swapped[i].second;
        s.slot = core.swap_in(swapped[i].first, 0);
        swapped.erase(swapped.begin() + static_cast<long>(i));
        check(intact(core, s), "swap_in restored wrong bytes");
        mine.push_back(s);
      } else if (op < 81 && !swapped.empty()) {
        core.swap_drop(swapped.back().first);
        swapped.pop_back();
      } else if (op < 90 && !mine.empty()) {
        const size_t i = rng() % mine.size();
        check(intact(core, mine[i]), "data changed under a live slot");
        core.free(mine[i].slot, 0);
        mine.erase(mine.begin() + static_cast<long>(i));
      } else if (op < 94) {
        core.reclaim();
      } else if (op < 97) {
        core.pick_victims(1 << 20);
        core.stats();
      } else if (!mine.empty()) {
        std::vector<int64_t> lens(static_cast<size_t>(B), KVCacheCore::kUnlisted);
        for (const Seq& s : mine) lens[static_cast<size_t>(s.slot)] = s.len;
        core.prefetch(lens, 64);
      }
    } catch (const Error& e) {
      const bool expected = e.kind() == Error::Kind::OutOfPages ||
                            e.kind() == Error::Kind::SwapSpace ||
                            e.kind() == Error::Kind::InvalidSlot ||
                            e.kind() == Error::Kind::SequenceTooLong;  // fork of a released prefix
      check(expected, std::string("unexpected error: ") + e.what());
    }
  }
  for (const Seq& s : mine) {
    check(intact(core, s), "data changed under a live slot (end)");
    core.free(s.slot, 0);
  }
  for (const auto& h : swapped) core.swap_drop(h.first);
}

void run(bool mega, int64_t window, bool per_layer = false) {
  auto core = make_core(mega, window, per_layer);
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (unsigned i = 0; i < 3; ++i)
    threads.emplace_back(hammer, std::ref(*core), 100 + i, std::cref(stop));
  auto stat = [&core](const char* name) {
    for (const auto& kv : core->stats())
      if (kv.first == name) return kv.second;
    return int64_t{0};
  };
  // 1.5 s at the least, and until copy-on-write, swap-out and (with a window) a window release
  // have each happened, counted by the cache's stats
  const bool ok = testing::run_until(stop, std::chrono::milliseconds(1500), [&] {
    return stat("cow_pages_copied") > 0 && stat("swap_out_pages") > 0 &&
           (window == 0 || stat("window_released_pages") > 0);
  });
  for (auto& t : threads) t.join();
  check(ok, "a hang: sharing, swap or window release not exercised in 120 s");
  core->wait();
  check(core->check_invariants().empty(), "invariants: " + core->check_invariants());
  core->reclaim();
  std::map<std::string, int64_t> st;
  for (const auto& kv : core->stats()) st[kv.first] = kv.second;
  check(st["pages_mapped"] == 0, "pages still in use: " + std::to_string(st["pages_mapped"]));
  check(st["swap_host_bytes"] == 0, "host bytes still held");
  check(st["cow_pages_copied"] > 0 && st["swap_out_pages"] > 0, "sharing/swap never exercised");
  check(window == 0 || st["window_released_pages"] > 0, "windows never released a page");
  core->close();
}

}  // namespace

int main() {
  run(false, 0);
  run(true, 0);
  run(false, 200);
  run(true, 200);
  run(false, 0, true);
  run(false, 200, true);
  return vattention::testing::report("sharing/swap thread tests");
}
