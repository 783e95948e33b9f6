// The batch planner of the CPU attention kernel: checks the arguments, appends the new K/V, cuts
// the batch into work items, runs them on OpenMP threads and combines split items.
//
// Why this shape:
// - One OpenMP team per call, the runtime torch itself uses (torch's CPU wheel ships libgomp.so.1
//   and this extension links the same soname, so one runtime is loaded; the team size is the
//   caller's torch.get_num_threads()). Three work-shared loops with barriers between them:
//   append (every new key is in the cache before any item reads it), items, combine. Items are
//   claimed one at a time from a counter the kernels can read (ItemQueue), so that a decode item
//   prefetches the first block of the item claimed after it.
// - Decode items are (request[, key split]) over all KV heads: a token's K/V rows of all heads are
//   adjacent, so an item reads one sequential stream. Prefill items are (request, KV head, query
//   block of up to 64 rows[, key split]). All group heads of a KV head are rows of one item, so
//   each K/V row is read once per group. Items are sorted by estimated cost and handed out
//   dynamically (longest first), so a few long prefills beside many decodes balance.
// - Flash-decoding: when one item would dominate the call (cost above a quarter of a thread's
//   fair share), its keys are split across items; each writes (max, sum, unnormalized output)
//   and the combine loop merges them. A split costs one extra pass over rows x head_dim floats.
// - Scratch lives in grow-only buffers of the calling thread (no allocation per call once warm).
#include "attention/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#endif

#include "attention/plan.h"

namespace vattention {
namespace attention {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kMinSplitKeys = 256;  // keys per split item, at least
constexpr int64_t kMaxSplits = 64;
constexpr int64_t kMinSharedKeys = 16;  // shorter shared prefixes are read per request
constexpr double kSerialCost =
    100000;  // below this estimated cost (~25 us) a call runs on one thread

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

bool is_fp8(DType t) { return t == DType::kFloat8E4M3 || t == DType::kFloat8E5M2; }

int64_t element_bytes(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    default: return 1;
  }
}

// Whether this CPU, with its OS, has `feature` (/proc/cpuinfo's spelling). __builtin_cpu_supports
// takes string literals only, hence the chain; for AVX-512 it also checks that the OS saves the
// registers (XCR0), as a kernel needs.
bool cpu_has(const std::string& feature) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (feature == "avx2") return __builtin_cpu_supports("avx2");
  if (feature == "fma") return __builtin_cpu_supports("fma");
  if (feature == "f16c") return __builtin_cpu_supports("f16c");
  if (feature == "avx512f") return __builtin_cpu_supports("avx512f");
  if (feature == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (feature == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (feature == "avx512dq") return __builtin_cpu_supports("avx512dq");
  if (feature == "avx512_bf16") return __builtin_cpu_supports("avx512bf16");
  // CPUID leaf 7, subleaf 0, EDX bits 24 (AMX-TILE) and 22 (AMX-BF16); whether the OS lets this
  // process use the tiles is amx_refused()'s question
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (feature == "amx_tile") return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24));
  if (feature == "amx_bf16") return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22));
#endif
  (void)feature;
  return false;
}

// Whether this is an Intel CPU, where the kernels' prefetches and fp32 decode's P V were measured
// differently (Shape::prefetch_prefill_blocks, Shape::prefetch_single_rows,
// Shape::pv_head_groups).
bool cpu_is_intel() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}

// -1: this CPU's tuning; 0 "other", 1 "intel" (set_kernel_tuning)
std::atomic<int> g_tuning{-1};

bool tuned_for_intel() {
  const int t = g_tuning.load(std::memory_order_relaxed);
  if (t >= 0) return t == 1;
  static const bool intel = cpu_is_intel();
  return intel;
}

// Why this process may not use AMX tiles although the CPU has them ("" when it may). Linux (5.16
// and later) enables the tile state in XCR0 but hands the 8 KB of tile data to a process only when
// it asks, once: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). The request fails on older
// kernels, on VMs whose hypervisor does not expose the state, and where a thread's signal stack
// is too small for the larger signal frame; a tile instruction without it kills the process
// (SIGILL). Asked once per process, at the first call; the permission is process-wide and
// inherited by threads and children.
std::string amx_refused() {
  static const std::string why = []() -> std::string {
#if defined(__x86_64__) && defined(__linux__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    __cpuid_count(1, 0, a, b, c, d);
    if (!(c & (1u << 27))) return "the OS has not enabled XSAVE (no OSXSAVE)";
    uint32_t lo = 0, hi = 0;
    asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17))
      return "the OS has not enabled the AMX tile state (XCR0 bits 17-18 clear)";
    constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtiledata) != 0) {
      return std::string(
                 "the OS refused this process AMX tile data (arch_prctl("
                 "ARCH_REQ_XCOMP_PERM): ") +
             std::strerror(errno) + ")";
    }
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 ||
        !(granted & (1ul << kXtiledata)))
      return "the OS did not grant this process AMX tile data (ARCH_GET_XCOMP_PERM)";
    return "";
#else
    return "AMX tiles are used on x86-64 Linux only";
#endif
  }();
  return why;
}

KernelVariant variant(const char* name, bool compiled, std::vector<std::string> needs) {
  KernelVariant v;
  v.name = name;
  v.compiled = compiled;
  for (const std::string& f : needs)
    if (!cpu_has(f)) v.missing.push_back(f);
  v.needs = std::move(needs);
  return v;
}

struct IsaTables {
  KernelTable amx, avx512bf16, avx512, avx2, generic;
  bool has_amx = false, has_avx512bf16 = false, has_avx512 = false, has_avx2 = false;
};

const IsaTables& isa_tables() {
  static const IsaTables t = [] {
    IsaTables x{kernels_amx(), kernels_avx512bf16(), kernels_avx512(), kernels_avx2(),
                kernels_generic()};
    for (const KernelVariant& v : kernel_variants()) {
      if (v.name == "amx") x.has_amx = v.runnable();
      if (v.name == "avx512bf16") x.has_avx512bf16 = v.runnable();
      if (v.name == "avx512") x.has_avx512 = v.runnable();
      if (v.name == "avx2") x.has_avx2 = v.runnable();
    }
    return x;
  }();
  return t;
}

const KernelTable* find_table(const std::string& name) {
  const IsaTables& t = isa_tables();
  if (name == "amx") return t.has_amx ? &t.amx : nullptr;
  if (name == "avx512bf16") return t.has_avx512bf16 ? &t.avx512bf16 : nullptr;
  if (name == "avx512") return t.has_avx512 ? &t.avx512 : nullptr;
  if (name == "avx2") return t.has_avx2 ? &t.avx2 : nullptr;
  if (name == "generic") return &t.generic;
  if (name.empty()) {
    return t.has_amx          ? &t.amx
           : t.has_avx512bf16 ? &t.avx512bf16
           : t.has_avx512     ? &t.avx512
           : t.has_avx2       ? &t.avx2
                              : &t.generic;
  }
  return nullptr;
}

std::atomic<const KernelTable*> g_selected{nullptr};

const KernelTable& kernels() {
  const KernelTable* t = g_selected.load(std::memory_order_acquire);
  if (t) return *t;
  const char* env = std::getenv("VATTENTION_ATTENTION_ISA");
  const std::string want = env ? env : "";
  const KernelTable* best = find_table("");
  t = find_table(want);
  if (!t) t = best;  // unset, unknown, or not runnable here: the best this CPU runs
  const KernelTable* expected = nullptr;
  g_selected.compare_exchange_strong(expected, t);
  return *g_selected.load(std::memory_order_acquire);
}

// Grow-only, 64-byte aligned float buffer owned by the calling thread.
class ScratchBuffer {
 public:
  float* get(int64_t floats) {
    if (floats > capacity_) {
      const size_t bytes = (static_cast<size_t>(floats) * sizeof(float) + 63) / 64 * 64;
      void* p = std::aligned_alloc(64, bytes);
      if (!p) throw std::bad_alloc();
      data_.reset(static_cast<float*>(p));
      capacity_ = floats;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
  int64_t capacity_ = 0;
};

// ---- argument checks: every message names the argument and the limit.

std::vector<Request> check_args(const Args& a) {
  const int64_t n = a.num_requests;
  if (n < 0) fail("num_requests must be >= 0, got " + std::to_string(n));
  if (a.num_kv_heads < 1 || a.num_heads < 1 || a.num_heads % a.num_kv_heads != 0) {
    fail("q heads (" + std::to_string(a.num_heads) +
         ") must be a positive multiple of the cache's KV heads (" +
         std::to_string(a.num_kv_heads) + ")");
  }
  if (a.head_dim < 1 || a.head_dim > kMaxHeadDim) {
    fail("head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "], got " +
         std::to_string(a.head_dim));
  }
  if (a.dtype != DType::kFloat32 && a.dtype != DType::kBFloat16 && a.dtype != DType::kFloat16) {
    fail("q dtype must be float32, bfloat16 or float16");
  }
  if (a.cache_dtype != a.dtype && !is_fp8(a.cache_dtype)) {
    fail("k_cache/v_cache dtype must be q's dtype or an fp8 format (float8_e4m3fn, float8_e5m2)");
  }
  if (is_fp8(a.cache_dtype)) {
    for (float s : {a.k_descale, a.v_descale}) {
      if (!(std::isfinite(s) && s > 0.0f))
        fail("k_descale/v_descale must be finite and > 0, got " + std::to_string(s));
    }
  }
  if (!std::isfinite(a.softmax_scale)) fail("softmax_scale must be finite");
  if (a.window_left < -1 || a.window_right < -1) {
    fail("window_size entries must be >= -1 (-1: unlimited), got (" +
         std::to_string(a.window_left) + ", " + std::to_string(a.window_right) + ")");
  }
  if (a.num_threads < 1) fail("num_threads must be >= 1, got " + std::to_string(a.num_threads));
  if (a.cache_len < 0 || a.cache_len > INT32_MAX) {
    fail("cache sequence length must be in [0, 2**31 - 1], got " + std::to_string(a.cache_len));
  }
  if (n == 0) return {};
  if (!a.k_cache.data || !a.v_cache.data) fail("k_cache and v_cache are required");
  if ((a.k_new.data == nullptr) != (a.v_new.data == nullptr))
    fail("k and v must be given together");
  if (!a.cache_seqlens) fail("cache_seqlens is required");
  if (a.cache_batch < 1) fail("k_cache has no rows (batch 0)");
  if ((a.prefix_group == nullptr) != (a.prefix_len == nullptr))
    fail("prefix_groups and prefix_lens must be given together");
  const bool has_new = a.k_new.data != nullptr;
  if (a.cu_seqlens_q) {
    if (a.cu_seqlens_q[0] < 0)
      fail("cu_seqlens_q[0] must be >= 0, got " + std::to_string(a.cu_seqlens_q[0]));
    for (int64_t i = 0; i < n; ++i) {
      if (a.cu_seqlens_q[i + 1] < a.cu_seqlens_q[i]) {
        fail("cu_seqlens_q must be non-decreasing: cu_seqlens_q[" + std::to_string(i + 1) +
             "] = " + std::to_string(a.cu_seqlens_q[i + 1]) + " < cu_seqlens_q[" +
             std::to_string(i) + "] = " + std::to_string(a.cu_seqlens_q[i]));
      }
    }
    if (a.cu_seqlens_q[n] > a.q_tokens) {
      fail("cu_seqlens_q[-1] = " + std::to_string(a.cu_seqlens_q[n]) + " exceeds the " +
           std::to_string(a.q_tokens) + " query tokens of q");
    }
  } else if (a.seqlen_q < 0 || (has_new && a.seqlen_new < 0)) {
    fail("seqlen_q and seqlen_new must be >= 0");
  }
  std::vector<Request> reqs(static_cast<size_t>(n));
  std::vector<char> used(has_new ? static_cast<size_t>(a.cache_batch) : 0, 0);
  for (int64_t i = 0; i < n; ++i) {
    Request& r = reqs[static_cast<size_t>(i)];
    r.index = i;
    r.row = a.cache_batch_idx ? a.cache_batch_idx[i] : i;
    if (r.row < 0 || r.row >= a.cache_batch) {
      fail((a.cache_batch_idx ? "cache_batch_idx[" : "batch index [") + std::to_string(i) +
           "] = " + std::to_string(r.row) + " is outside the cache's " +
           std::to_string(a.cache_batch) + " rows");
    }
    if (a.cu_seqlens_q) {
      r.q_start = a.cu_seqlens_q[i];
      r.lq = a.cu_seqlens_q[i + 1] - a.cu_seqlens_q[i];
    } else {
      r.lq = a.seqlen_q;
    }
    r.nnew = has_new ? (a.cu_seqlens_q ? r.lq : a.seqlen_new) : 0;
    r.new_start = a.cu_seqlens_q ? r.q_start : 0;
    r.past = a.cache_seqlens[i];
    if (r.past < 0)
      fail("cache_seqlens[" + std::to_string(i) + "] = " + std::to_string(r.past) + " is negative");
    r.lk = r.past + r.nnew;
    if (a.prefix_group && a.prefix_group[i] < -1) {
      fail("prefix_groups[" + std::to_string(i) + "] = " + std::to_string(a.prefix_group[i]) +
           " must be >= -1 (-1: no group)");
    }
    if (a.prefix_len && a.prefix_len[i] < 0) {
      fail("prefix_lens[" + std::to_string(i) + "] = " + std::to_string(a.prefix_len[i]) +
           " is negative");
    }
    if (r.lk > a.cache_len) {
      fail("request " + std::to_string(i) + ": cache_seqlens " + std::to_string(r.past) + " + " +
           std::to_string(r.nnew) + " new tokens exceed the cache length " +
           std::to_string(a.cache_len));
    }
    if (r.lq > 0 && (!a.q.data || !a.out.data)) fail("q and out are required");
    if (has_new && r.nnew > 0) {
      char& u = used[static_cast<size_t>(r.row)];
      if (u) {
        fail("cache_batch_idx repeats row " + std::to_string(r.row) +
             ": requests appending new keys must write distinct rows");
      }
      u = 1;
    }
  }
  return reqs;
}

// ---- appending the new keys and values (in place, before any item reads the cache).

struct AppendChunk {
  int32_t request;
  int64_t t0, t1;
};

template <typename S, typename T>
void append_rows(const Args& a, const Request& rq, int64_t t0, int64_t t1, const Operand& src,
                 const Operand& dst, float inv_scale) {
  const int64_t d = a.head_dim;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      const S* s = static_cast<const S*>(src.data) + rq.index * src.s_batch +
                   (rq.new_start + t) * src.s_token + h * src.s_head;
      T* o = static_cast<T*>(dst.data) + rq.row * dst.s_batch + (rq.past + t) * dst.s_token +
             h * dst.s_head;
      if constexpr (std::is_same<T, e4m3_t>::value) {
        for (int64_t x = 0; x < d; ++x) o[x].bits = float_to_e4m3(to_float(s[x]), inv_scale);
      } else if constexpr (std::is_same<T, e5m2_t>::value) {
        for (int64_t x = 0; x < d; ++x) o[x].bits = float_to_e5m2(to_float(s[x]), inv_scale);
      } else {
        std::memcpy(static_cast<void*>(o), s, static_cast<size_t>(d) * sizeof(S));
      }
    }
  }
}

template <typename S>
void append_typed(const Args& a, const Request& rq, int64_t t0, int64_t t1) {
  switch (a.cache_dtype) {
    case DType::kFloat8E4M3:
      append_rows<S, e4m3_t>(a, rq, t0, t1, a.k_new, a.k_cache, 1.0f / a.k_descale);
      append_rows<S, e4m3_t>(a, rq, t0, t1, a.v_new, a.v_cache, 1.0f / a.v_descale);
      return;
    case DType::kFloat8E5M2:
      append_rows<S, e5m2_t>(a, rq, t0, t1, a.k_new, a.k_cache, 1.0f / a.k_descale);
      append_rows<S, e5m2_t>(a, rq, t0, t1, a.v_new, a.v_cache, 1.0f / a.v_descale);
      return;
    default:
      append_rows<S, S>(a, rq, t0, t1, a.k_new, a.k_cache, 1.0f);
      append_rows<S, S>(a, rq, t0, t1, a.v_new, a.v_cache, 1.0f);
  }
}

void append(const Args& a, const Request& rq, int64_t t0, int64_t t1) {
  switch (a.dtype) {
    case DType::kBFloat16: return append_typed<bf16_t>(a, rq, t0, t1);
    case DType::kFloat16: return append_typed<f16_t>(a, rq, t0, t1);
    default: return append_typed<float>(a, rq, t0, t1);
  }
}

// ---- planning.

struct CombineGroup {
  int32_t request, kv_head, kv_heads, q_begin, q_end;
  int32_t first_partial, num_partials;
};

// A query row of a shared-prefix item before the partial buffer exists: request, query, head.
struct SharedRowRef {
  int32_t request, query, head;
};

struct Plan {
  std::vector<AppendChunk> appends;
  std::vector<WorkItem> items;
  std::vector<CombineGroup> combines;
  std::vector<int64_t> partial_offset;  // floats, per partial slot
  int64_t partial_floats = 0;
  double total_cost = 0;
  std::vector<SharedRowRef> shared_refs;  // kShared items' rows, [it.rows_begin, + num_rows)
  std::vector<SharedRow> shared_rows;     // per kShared item, its rows resolved (resolve_shared)
  // per request: the first of its prefix's partial slots (one per part of the prefix), or -1
  std::vector<int32_t> prefix_slot;
};

// Requests that read one shared prefix [0, prefix) once per KV head (Args::prefix_group).
struct ShareGroup {
  int64_t prefix = 0;
  std::vector<int32_t> members;
};

// The groups worth a shared item: decode requests of one prefix_group whose queries all see the
// whole prefix, at least two of them, over a prefix of at least kMinSharedKeys keys. The prefix is
// the smallest member's prefix_len, clipped to what every member had cached before the call (new
// keys differ per request by definition).
std::vector<ShareGroup> share_groups(const Args& a, const Shape& s,
                                     const std::vector<Request>& reqs) {
  std::vector<ShareGroup> out;
  if (!a.prefix_group) return out;
  std::vector<std::pair<int32_t, int32_t>> keyed;  // (group, request)
  for (const Request& rq : reqs) {
    const int32_t gid = a.prefix_group[rq.index];
    if (gid >= 0 && rq.lq > 0 && rq.lq * s.group <= kMaxDecodeRows)
      keyed.emplace_back(gid, static_cast<int32_t>(rq.index));
  }
  std::sort(keyed.begin(), keyed.end());
  for (size_t b = 0, e; b < keyed.size(); b = e) {
    for (e = b; e < keyed.size() && keyed[e].first == keyed[b].first; ++e) {
    }
    ShareGroup g;
    g.prefix = INT64_MAX;
    for (size_t x = b; x < e; ++x) {
      const Request& rq = reqs[static_cast<size_t>(keyed[x].second)];
      g.prefix = std::min({g.prefix, static_cast<int64_t>(a.prefix_len[rq.index]), rq.past});
    }
    if (e - b < 2 || g.prefix < kMinSharedKeys) continue;
    for (size_t x = b; x < e; ++x) {
      const Request& rq = reqs[static_cast<size_t>(keyed[x].second)];
      bool sees_all = true;
      for (int64_t j = 0; j < rq.lq && sees_all; ++j) {
        int64_t lo, hi;
        key_range(a, rq, j, &lo, &hi);
        sees_all = lo == 0 && hi >= g.prefix;
      }
      if (sees_all) g.members.push_back(static_cast<int32_t>(rq.index));
    }
    if (g.members.size() >= 2) out.push_back(std::move(g));
  }
  return out;
}

Plan make_plan(const Args& a, const Shape& s, const std::vector<Request>& reqs, int threads) {
  Plan plan;
  const int64_t g = s.group, d = a.head_dim;
  const double bytes_per_key = 2.0 * static_cast<double>(d * element_bytes(a.cache_dtype));
  // estimated cycles of an item: per key and KV head, bytes at ~8 per cycle plus 2 FMAs per row
  // and d at 32 per cycle; plus a fixed part and the output rows
  auto item_cost = [&](double rows_padded, int64_t rows, int64_t keys) {
    const double per_key = bytes_per_key / 8.0 + rows_padded * static_cast<double>(d) / 16.0;
    return per_key * static_cast<double>(keys) + 200.0 + static_cast<double>(rows * d) / 4.0;
  };
  std::vector<int32_t> group_of(reqs.size(), -1);  // a member's share group, or -1
  const std::vector<ShareGroup> groups = share_groups(a, s, reqs);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const ShareGroup& sg = groups[gi];
    for (int32_t m : sg.members) group_of[static_cast<size_t>(m)] = static_cast<int32_t>(gi);
    // one item per KV head and run of members whose rows fill at most s.prefill_rows
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      size_t x = 0;
      while (x < sg.members.size()) {
        WorkItem it;
        it.kind = ItemKind::kShared;
        it.share_group = static_cast<int32_t>(gi);
        it.request = sg.members[x];
        it.kv_head = static_cast<int32_t>(h);
        it.k_begin = 0;
        it.k_end = sg.prefix;
        it.rows_begin = static_cast<int32_t>(plan.shared_refs.size());
        for (; x < sg.members.size(); ++x) {
          const Request& rq = reqs[static_cast<size_t>(sg.members[x])];
          if (it.num_rows > 0 && it.num_rows + rq.lq * g > s.prefill_rows) break;
          for (int64_t j = 0; j < rq.lq; ++j) {
            for (int64_t gm = 0; gm < g; ++gm) {  // group member: query head h * g + gm
              plan.shared_refs.push_back({static_cast<int32_t>(rq.index), static_cast<int32_t>(j),
                                          static_cast<int32_t>(h * g + gm)});
              ++it.num_rows;
            }
          }
        }
        it.cost =
            item_cost(static_cast<double>((it.num_rows + 15) / 16 * 16), it.num_rows, sg.prefix);
        plan.total_cost += it.cost;
        plan.items.push_back(it);
      }
    }
  }
  for (const Request& rq : reqs) {
    for (int64_t t = 0; t < rq.nnew; t += 64) {
      plan.appends.push_back({static_cast<int32_t>(rq.index), t, std::min(rq.nnew, t + 64)});
    }
    if (rq.lq == 0) continue;
    const bool decode = rq.lq * g <= kMaxDecodeRows;
    const int64_t qblock = decode ? rq.lq : std::max<int64_t>(1, s.prefill_rows / g);
    for (int64_t q0 = 0; q0 < rq.lq; q0 += qblock) {
      const int64_t q1 = std::min(rq.lq, q0 + qblock);
      int64_t kb = 0, ke = 0;
      bool any = false;
      for (int64_t j = q0; j < q1; ++j) {
        int64_t lo, hi;
        key_range(a, rq, j, &lo, &hi);
        if (hi > lo) {
          kb = any ? std::min(kb, lo) : lo;
          ke = any ? std::max(ke, hi) : hi;
          any = true;
        }
      }
      const int64_t rows = (q1 - q0) * g;
      const double rows_padded =
          decode ? static_cast<double>(rows) : static_cast<double>((rows + 15) / 16 * 16);
      const int32_t group = group_of[static_cast<size_t>(rq.index)];
      if (group >= 0)  // a member (a decode request): its group's shared items read the prefix
        kb = std::max(kb, groups[static_cast<size_t>(group)].prefix);
      const int64_t heads_per_item = decode ? a.num_kv_heads : 1;
      for (int64_t h = 0; h < a.num_kv_heads; h += heads_per_item) {
        WorkItem it;
        it.request = static_cast<int32_t>(rq.index);
        it.kv_head = static_cast<int32_t>(h);
        it.kv_heads = static_cast<int32_t>(heads_per_item);
        it.q_begin = static_cast<int32_t>(q0);
        it.q_end = static_cast<int32_t>(q1);
        it.k_begin = kb;
        it.k_end = ke;
        it.kind = decode ? ItemKind::kDecode : ItemKind::kPrefill;
        it.cost = static_cast<double>(heads_per_item) *
                  item_cost(rows_padded, rows, std::max<int64_t>(0, ke - kb));
        plan.total_cost += it.cost;
        plan.items.push_back(it);
      }
    }
  }
  // Key splits (flash-decoding), and the partial slots of requests after a shared prefix: the
  // prefix's slots first (one per part: a long prefix is split like a long row, every item of a
  // group in the same parts), then the slots of the request's own keys, combined in one group.
  const bool allow_split = threads > 1 && plan.total_cost >= kSerialCost;
  const double target = plan.total_cost / (4.0 * threads);
  auto split_step = [&](const WorkItem& it) {  // keys per part (all of them: one part)
    const int64_t keys = it.k_end - it.k_begin;
    int64_t parts = 1;
    if (allow_split) {
      parts = static_cast<int64_t>(std::ceil(it.cost / target));
      parts = std::max<int64_t>(1, std::min({parts, keys / kMinSplitKeys, kMaxSplits}));
    }
    if (parts < 2) return std::max<int64_t>(keys, 1);
    return ((keys + parts - 1) / parts + 15) / 16 * 16;
  };
  plan.prefix_slot.assign(reqs.size(), -1);
  std::vector<int64_t> group_step(groups.size(), 0);  // keys per part of each group's prefix
  std::vector<WorkItem> split;
  split.reserve(plan.items.size());
  int32_t next_partial = 0;
  auto new_slot = [&](int64_t rows) {
    plan.partial_offset.push_back(plan.partial_floats);
    plan.partial_floats += rows * (s.dp + 2);
    return next_partial++;
  };
  for (const WorkItem& it : plan.items) {
    if (it.kind == ItemKind::kShared) {  // these come first: each group's parts are set here
      int64_t& step = group_step[static_cast<size_t>(it.share_group)];
      if (step == 0) step = split_step(it);
      int32_t part_index = 0;
      for (int64_t k0 = it.k_begin; k0 < it.k_end; k0 += step) {
        WorkItem part = it;
        part.k_begin = k0;
        part.k_end = std::min(it.k_end, k0 + step);
        part.cost = it.cost * static_cast<double>(part.k_end - part.k_begin) /
                    static_cast<double>(it.k_end - it.k_begin);
        part.prefix_part = part_index++;
        split.push_back(part);
      }
      continue;
    }
    const int64_t keys = it.k_end - it.k_begin;
    const int64_t step = split_step(it);
    const int32_t group = group_of[static_cast<size_t>(it.request)];  // >= 0: after a prefix
    if (step >= keys && group < 0) {
      split.push_back(it);
      continue;
    }
    const int64_t rows = (it.q_end - it.q_begin) * g * it.kv_heads;
    CombineGroup cg{it.request, it.kv_head, it.kv_heads, it.q_begin, it.q_end, next_partial, 0};
    if (group >= 0) {
      const size_t gi = static_cast<size_t>(group);
      const int64_t prefix = groups[gi].prefix, pstep = group_step[gi];
      plan.prefix_slot[static_cast<size_t>(it.request)] = next_partial;
      for (int64_t k0 = 0; k0 < prefix; k0 += pstep) {
        new_slot(rows);
        ++cg.num_partials;
      }
    }
    for (int64_t k0 = it.k_begin; k0 < it.k_end; k0 += step) {  // none when the prefix is all
      WorkItem part = it;
      part.k_begin = k0;
      part.k_end = std::min(it.k_end, k0 + step);
      part.cost =
          it.cost * static_cast<double>(part.k_end - part.k_begin) / static_cast<double>(keys);
      part.partial = new_slot(rows);
      ++cg.num_partials;
      split.push_back(part);
    }
    plan.combines.push_back(cg);
  }
  plan.items.swap(split);
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  return plan;
}

PartialView partial_view(float* base, const Plan& plan, int32_t slot, int64_t rows, int64_t dp) {
  float* p = base + plan.partial_offset[static_cast<size_t>(slot)];
  return PartialView{p, p + rows, p + 2 * rows};
}

// Points every shared item's rows at their queries and at the rows of their requests' prefix
// slots (laid out as a decode item's: KV head * rows per head + query * group + group member).
void resolve_shared(const Args& a, const Shape& s, const std::vector<Request>& reqs,
                    float* partials, Plan& plan) {
  if (plan.shared_refs.empty()) return;
  const int64_t g = s.group;
  size_t total = 0;
  for (const WorkItem& it : plan.items)
    if (it.kind == ItemKind::kShared) total += static_cast<size_t>(it.num_rows);
  plan.shared_rows.clear();
  plan.shared_rows.reserve(total);  // no reallocation below: items point into it
  for (WorkItem& it : plan.items) {
    if (it.kind != ItemKind::kShared) continue;
    it.rows = plan.shared_rows.data() + plan.shared_rows.size();
    for (int32_t x = 0; x < it.num_rows; ++x) {
      const SharedRowRef& ref = plan.shared_refs[static_cast<size_t>(it.rows_begin + x)];
      const Request& rq = reqs[static_cast<size_t>(ref.request)];
      const int64_t per_head = rq.lq * g;
      const int32_t slot = plan.prefix_slot[static_cast<size_t>(ref.request)] + it.prefix_part;
      const PartialView pv = partial_view(partials, plan, slot, per_head * a.num_kv_heads, s.dp);
      const int64_t r = (ref.head / g) * per_head + ref.query * g + ref.head % g;
      plan.shared_rows.push_back(
          SharedRow{q_row(a, rq, ref.query, ref.head), pv.m + r, pv.l + r, pv.acc + r * s.dp});
    }
  }
}

template <typename T>
void write_row(const float* src, float scale, void* dst, int64_t d) {
  T* o = static_cast<T*>(dst);
  for (int64_t x = 0; x < d; ++x) from_float(src[x] * scale, o + x);
}

void combine(const Args& a, const Shape& s, const Request& rq, const CombineGroup& cg,
             float* partials, const Plan& plan, float* tmp) {
  const int64_t g = s.group, dp = s.dp, d = a.head_dim;
  const int64_t per_head = (cg.q_end - cg.q_begin) * g;
  const int64_t rows = per_head * cg.kv_heads;
  for (int64_t r = 0; r < rows; ++r) {
    float mmax = -HUGE_VALF;
    for (int32_t p = 0; p < cg.num_partials; ++p) {
      mmax = std::max(mmax, partial_view(partials, plan, cg.first_partial + p, rows, dp).m[r]);
    }
    float lsum = 0.0f;
    std::fill(tmp, tmp + d, 0.0f);
    if (mmax != -HUGE_VALF) {
      for (int32_t p = 0; p < cg.num_partials; ++p) {
        const PartialView pv = partial_view(partials, plan, cg.first_partial + p, rows, dp);
        if (pv.l[r] == 0.0f) continue;
        const float w = std::exp2(pv.m[r] - mmax);
        lsum += pv.l[r] * w;
        const float* acc = pv.acc + r * dp;
        for (int64_t x = 0; x < d; ++x) tmp[x] += acc[x] * w;
      }
    }
    const float scale = lsum > 0.0f ? s.out_scale / lsum : 0.0f;
    const int64_t hr = r % per_head;  // row within its KV head
    const int64_t j = cg.q_begin + hr / g, h = (cg.kv_head + r / per_head) * g + hr % g;
    void* dst = out_row(a, rq, j, h);
    switch (a.dtype) {
      case DType::kBFloat16: write_row<bf16_t>(tmp, scale, dst, d); break;
      case DType::kFloat16: write_row<f16_t>(tmp, scale, dst, d); break;
      default: write_row<float>(tmp, scale, dst, d);
    }
  }
}

}  // namespace

const char* kernel_isa() { return kernels().name; }

std::vector<KernelVariant> kernel_variants() {
  const std::vector<std::string> avx512{"avx512f",  "avx512bw", "avx512vl",
                                        "avx512dq", "fma",      "f16c"};
  std::vector<std::string> avx512bf16 = avx512;
  avx512bf16.push_back("avx512_bf16");
  std::vector<std::string> amx = avx512bf16;
  amx.push_back("amx_tile");
  amx.push_back("amx_bf16");
  KernelVariant tiles = variant("amx", amx_compiled(), amx);
  if (tiles.compiled && tiles.missing.empty()) tiles.refused = amx_refused();
  return {tiles, variant("avx512bf16", avx512bf16_compiled(), avx512bf16),
          variant("avx512", avx512_compiled(), avx512),
          variant("avx2", avx2_compiled(), {"avx2", "fma", "f16c"}), variant("generic", true, {})};
}

std::vector<std::string> unused_cpu_features() {
  std::vector<std::string> out;
#if defined(__x86_64__)
  // CPUID leaf 7: subleaf 0 EDX bits 23 (AVX512-FP16), 25 (AMX-INT8); subleaf 1 EAX bit 21
  // (AMX-FP16). AMX-TILE and AMX-BF16 are the amx variant's.
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    if (d & (1u << 25)) out.push_back("amx_int8");
    const unsigned d0 = d;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 21))) out.push_back("amx_fp16");
    if (d0 & (1u << 23)) out.push_back("avx512_fp16");
  }
#endif
  return out;
}

bool set_kernel_isa(const char* name) {
  const KernelTable* t = find_table(name ? name : "");
  if (!t) return false;
  g_selected.store(t, std::memory_order_release);
  return true;
}

const char* kernel_tuning() { return tuned_for_intel() ? "intel" : "other"; }

bool set_kernel_tuning(const char* name) {
  const std::string n = name ? name : "";
  const int t = n.empty() ? -1 : n == "intel" ? 1 : n == "other" ? 0 : -2;
  if (t == -2) return false;
  g_tuning.store(t, std::memory_order_relaxed);
  return true;
}

void flash_attn_with_kvcache(const Args& a) {
  const std::vector<Request> reqs = check_args(a);
  if (reqs.empty()) return;
  const KernelTable& kt = kernels();
  Shape s;
  s.group = a.num_heads / a.num_kv_heads;
  s.dp = (a.head_dim + kt.width - 1) / kt.width * kt.width;
  s.block_keys = std::max<int64_t>(16, std::min<int64_t>(128, 8192 / s.dp / 16 * 16));
  const bool fp8 = is_fp8(a.cache_dtype);
  s.q_scale = a.softmax_scale * kLog2e * (fp8 ? a.k_descale : 1.0f);
  s.out_scale = fp8 ? a.v_descale : 1.0f;
  s.prefill_rows = kt.prefill_rows(a);
  const bool intel = tuned_for_intel();
  s.prefetch_prefill_blocks = !intel;
  s.prefetch_single_rows = intel;
  s.pv_head_groups = intel;
  s.prefetch_next_item = !intel;

  Plan plan = make_plan(a, s, reqs, a.num_threads);
  const int threads = plan.total_cost >= kSerialCost ? a.num_threads : 1;
  const int64_t per_thread = (kt.scratch_floats(a, s) + 15) / 16 * 16;
  thread_local ScratchBuffer scratch_buffer, partial_buffer;
  float* scratch = scratch_buffer.get(per_thread * threads);
  float* partials = plan.partial_floats ? partial_buffer.get(plan.partial_floats) : nullptr;
  resolve_shared(a, s, reqs, partials, plan);
  const int64_t n_append = static_cast<int64_t>(plan.appends.size());
  const int64_t n_items = static_cast<int64_t>(plan.items.size());
  const int64_t n_combine = static_cast<int64_t>(plan.combines.size());
  // Items are claimed from a shared counter, as schedule(dynamic, 1) would hand them out, but
  // visible to the items themselves (ItemQueue).
  int64_t next_item = 0;
  const ItemQueue queue{&next_item, plan.items.data(), n_items, reqs.data()};
  s.queue = &queue;

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef _OPENMP
    float* mine = scratch + per_thread * omp_get_thread_num();
#else
    float* mine = scratch;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < n_append; ++c) {
      const AppendChunk& ch = plan.appends[static_cast<size_t>(c)];
      append(a, reqs[static_cast<size_t>(ch.request)], ch.t0, ch.t1);
    }
    for (;;) {
      const int64_t i = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED);
      if (i >= n_items) break;
      const WorkItem& it = plan.items[static_cast<size_t>(i)];
      const Request& rq = reqs[static_cast<size_t>(it.request)];
      if (it.partial >= 0) {
        const PartialView pv = partial_view(partials, plan, it.partial,
                                            (it.q_end - it.q_begin) * s.group * it.kv_heads, s.dp);
        kt.run_item(a, s, rq, it, mine, &pv);
      } else {
        kt.run_item(a, s, rq, it, mine, nullptr);
      }
    }
#pragma omp barrier  // the combines read every item's partials
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < n_combine; ++c) {
      const CombineGroup& cg = plan.combines[static_cast<size_t>(c)];
      combine(a, s, reqs[static_cast<size_t>(cg.request)], cg, partials, plan, mine);
    }
  }
}

}  // namespace attention
}  // namespace vattention
