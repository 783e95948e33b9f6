#include "host/fault_report.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace vattention {

struct FaultRegion {
  FaultGeometry geo;
  uint64_t cache_id = 0;
  std::vector<uintptr_t> bases;  // one per virtual tensor (geometry.h numbering)
  std::atomic<bool> closed{false};
};

namespace {

constexpr int kMaxRegions = 256;
std::atomic<FaultRegion*> g_regions[kMaxRegions];
std::mutex g_mu;  // registration only
std::atomic<uint64_t> g_next_id{1};
struct sigaction g_old_segv, g_old_bus;
bool g_installed = false;

// ---- async-signal-safe output ----------------------------------------------------------------
struct Out {
  char buf[768];
  size_t n = 0;
  void str(const char* s) {
    while (*s && n < sizeof buf - 1) buf[n++] = *s++;
  }
  void num(uint64_t v) {
    char tmp[24];
    int k = 0;
    do {
      tmp[k++] = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v && k < 24);
    while (k && n < sizeof buf - 1) buf[n++] = tmp[--k];
  }
  void flush() {
    size_t off = 0;
    while (off < n) {
      ssize_t w = write(2, buf + off, n - off);
      if (w <= 0) break;
      off += static_cast<size_t>(w);
    }
  }
};

bool describe(uintptr_t addr) {
  for (auto& slot : g_regions) {
    const FaultRegion* r = slot.load(std::memory_order_acquire);
    if (!r) continue;
    for (size_t t = 0; t < r->bases.size(); ++t) {
      const uintptr_t base = r->bases[t];
      if (addr < base || addr >= base + r->geo.tensor_bytes[t]) continue;
      const FaultGeometry& g = r->geo;
      const size_t off = addr - base;
      const uint64_t slot_index = off / g.slot_bytes[t];
      const size_t in_row = off % g.slot_bytes[t];
      const uint64_t token = in_row / g.token_bytes[t];
      const bool is_v = g.mega ? t == 1 : static_cast<int64_t>(t) >= g.num_layers;
      const uint64_t layer = g.mega
                                 ? (in_row % g.token_bytes[t]) / g.layer_bytes
                                 : static_cast<uint64_t>(t) % static_cast<uint64_t>(g.num_layers);
      Out o;
      o.str("\nvattention: fatal memory access to KV cache #");
      o.num(r->cache_id);
      o.str(": ");
      o.str(is_v ? "V" : "K");
      o.str(" of layer ");
      o.num(layer);
      o.str(", slot ");
      o.num(slot_index);
      if (static_cast<int64_t>(token) < g.max_seq) {
        o.str(", token ");
        o.num(token);
      } else {
        o.str(" (row padding beyond max_seq_len)");
      }
      o.str(".\n");
      if (r->closed.load(std::memory_order_relaxed)) {
        o.str(
            "vattention: the cache is closed: its tensors have no memory behind them any more."
            " Do not use tensors from layer()/k_cache/v_cache after close().\n");
      } else {
        o.str(
            "vattention: that position has no physical page. A tensor is only valid up to "
            "cache.mapped_tokens(");
        o.num(slot_index);
        o.str("): call cache.step({");
        o.num(slot_index);
        o.str(
            ": length}) before touching it, slice rows to their length (k[slot, :length]), and"
            " never read a whole row or print a whole layer tensor.\n");
      }
      o.flush();
      return true;
    }
  }
  return false;
}

void chain(int sig, siginfo_t* info, void* ctx, const struct sigaction& old) {
  if (old.sa_flags & SA_SIGINFO) {
    if (old.sa_sigaction) {
      old.sa_sigaction(sig, info, ctx);
      return;
    }
  } else if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN && old.sa_handler) {
    old.sa_handler(sig);
    return;
  }
  // Default action: put it back and return; the access faults again and the process dies of it.
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigaction(sig, &dfl, nullptr);
}

void on_fault(int sig, siginfo_t* info, void* ctx) {
  const struct sigaction& old = sig == SIGBUS ? g_old_bus : g_old_segv;
  if (info && describe(reinterpret_cast<uintptr_t>(info->si_addr))) {
    // Ours: after the message, the previous handler gets the repeated fault (Python's
    // faulthandler prints the traceback; the default action ends the process with the signal).
    sigaction(sig, &old, nullptr);
    return;
  }
  chain(sig, info, ctx, old);
}

void install_locked() {
  if (g_installed) return;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGSEGV, &sa, &g_old_segv) != 0) return;
  if (sigaction(SIGBUS, &sa, &g_old_bus) != 0) {
    sigaction(SIGSEGV, &g_old_segv, nullptr);
    return;
  }
  g_installed = true;
}

}  // namespace

FaultReport::FaultReport(const FaultGeometry& geometry, const std::vector<uintptr_t>& bases)
    : region_(new FaultRegion()) {
  region_->geo = geometry;
  region_->bases = bases;
  region_->cache_id = g_next_id.fetch_add(1);
  std::lock_guard<std::mutex> lock(g_mu);
  install_locked();
  for (int i = 0; i < kMaxRegions; ++i) {
    if (g_regions[i].load(std::memory_order_relaxed) == nullptr) {
      g_regions[i].store(region_, std::memory_order_release);
      index_ = i;
      break;
    }
  }
}

FaultReport::~FaultReport() {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (index_ >= 0) g_regions[index_].store(nullptr, std::memory_order_release);
  }
  delete region_;
}

void FaultReport::mark_closed() { region_->closed.store(true, std::memory_order_relaxed); }

}  // namespace vattention
