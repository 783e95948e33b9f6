// The CPU attention kernel (csrc/attention) from plain C++, built with
// -fsanitize=address,undefined:
// - element conversions: every bf16/fp16/fp8 code decodes and re-encodes to itself; fp8 encoding
//   follows vLLM's truncating rule on chosen values;
// - random batches (GQA, head_dim with and without a vector tail, decode/prefill mixes, varlen and
//   fixed forms, windows, fp32/bf16/fp16/fp8 caches, 1 and 2 threads, strided "mega" caches)
//   against a double-precision reference, on every instruction set this CPU runs;
// - the appended keys are in the cache bit for bit (or as the fp8 encoder stores them);
// - guard pages (PROT_NONE) after each row's last key and before the window start: a read there
//   kills the process;
// - bad arguments throw std::invalid_argument and write nothing.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention/attention.h"
#include "attention/convert.h"
#include "tests/sanitizer.h"

using namespace vattention::attention;

namespace {

int failures = 0;
double worst_ratio = 0;  // the largest error / bound over every output checked

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++failures;
  }
}

int64_t esize(DType t) {
  return t == DType::kFloat32 ? 4 : (t == DType::kBFloat16 || t == DType::kFloat16) ? 2 : 1;
}

float decode(DType t, const uint8_t* p) {
  uint16_t h;
  switch (t) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBFloat16: std::memcpy(&h, p, 2); return bf16_to_float(h);
    case DType::kFloat16: std::memcpy(&h, p, 2); return f16_to_float(h);
    case DType::kFloat8E4M3: return e4m3_to_float(*p);
    case DType::kFloat8E5M2: return e5m2_to_float(*p);
  }
  return 0;
}

void encode(DType t, float v, uint8_t* p, float inv_scale = 1.0f) {
  uint16_t h;
  switch (t) {
    case DType::kFloat32: std::memcpy(p, &v, 4); return;
    case DType::kBFloat16:
      h = float_to_bf16(v);
      std::memcpy(p, &h, 2);
      return;
    case DType::kFloat16:
      h = float_to_f16(v);
      std::memcpy(p, &h, 2);
      return;
    case DType::kFloat8E4M3: *p = float_to_e4m3(v, inv_scale); return;
    case DType::kFloat8E5M2: *p = float_to_e5m2(v, inv_scale); return;
  }
}

void test_conversions() {
  for (uint32_t c = 0; c < 65536; ++c) {
    const uint16_t h = static_cast<uint16_t>(c);
    const float b = bf16_to_float(h);
    if (!std::isnan(b)) check(float_to_bf16(b) == h, "bf16 round trip " + std::to_string(c));
    const float f = f16_to_float(h);
    if (!std::isnan(f)) check(float_to_f16(f) == h, "f16 round trip " + std::to_string(c));
  }
  for (uint32_t c = 0; c < 256; ++c) {
    const uint8_t b = static_cast<uint8_t>(c);
    const float x = e4m3_to_float(b);
    if (!std::isnan(x) && c != 0x80)
      check(float_to_e4m3(x, 1.0f) == b, "e4m3 round trip " + std::to_string(c));
    const float y = e5m2_to_float(b);
    if (std::isfinite(y) && c != 0x80)
      check(float_to_e5m2(y, 1.0f) == b, "e5m2 round trip " + std::to_string(c));
  }
  // vLLM's rule: clamp, truncate toward zero, +-0 -> 0x00, tiny negative -> 0x80
  check(float_to_e4m3(1e9f, 1.0f) == 0x7E && float_to_e4m3(-1e9f, 1.0f) == 0xFE,
        "e4m3 saturates to 448");
  check(float_to_e4m3(1.1f, 1.0f) == 0x38 && float_to_e4m3(1.124f, 1.0f) == 0x38, "e4m3 truncates");
  check(float_to_e4m3(-0.0f, 1.0f) == 0 && float_to_e4m3(-1e-4f, 1.0f) == 0x80, "e4m3 zeros");
  check(float_to_e4m3(0.003f, 1.0f) == 0x01, "e4m3 subnormal 0.003 -> 2^-9");
  check(float_to_e4m3(NAN, 1.0f) == 0x7E, "e4m3 NaN -> +448 (std::min/max order)");
  check(float_to_e5m2(1e9f, 1.0f) == 0x7B && float_to_e5m2(1.3f, 1.0f) == 0x3D,
        "e5m2 saturates, truncates");
  check(float_to_e4m3(3.0f, 1.0f / 2.0f) == float_to_e4m3(1.5f, 1.0f),
        "e4m3 scales by the inverse");
}

// ---- the error bound of an output element, derived from the kernel's arithmetic.
//
// tests/support/attention_bound.py derives it step by step (the same bound the Python tests
// use): the inputs are exact in their dtypes; each score is an fp32 dot product over d (at most
// d + 22 roundings per product, with the softmax scale's own), each weight an exp2 of a rounded
// difference, rescaled at most N / 16 + 1 times and merged once; the sums over the N keys pass at
// most N + N / 16 + 277 roundings per term (amx: a probability as two bf16 terms, hi + lo, within
// 2^-15 of it); the output is rounded once, to nearest, to q's dtype. With u = 2^-24 (plus 2^-53
// for this double reference), gamma(n) = n u / (1 - n u):
//   e_s = gamma(d + 22) S + c 2^-126 (d M + d + 22),  S >= c sum_x |q_x k_jx| for every key j,
//     c = scale log2 e, M = max(1, max |q_x|, max |k_jx|) (flushed denormals)
//   eta = 2^(e_s + 6 u (S + e_s)) (1 + 4 u)^(R + 2) - 1,  R = ceil(N / 16) + 1
//   E = 2 eta / (1 - eta) A + ((2 g / (1 - g) (1 + g3) H + g3) + 2^-15) A'
//       + 2^-126 (N (vmax + 1) + 3 N + 68 + R)
//     with g = gamma(N + R + 276), g3 = gamma(3), H = 1 + 2^-7 (1 + 2^-8), A = sum_j w_j |v_j|
//     (exact weights), A' = A (1 + eta) / (1 - eta)
//   |out - o| <= E + u_out (|o| + E) + t_out  (u_out 0 / 2^-8 / 2^-11, t_out half the smallest
//   subnormal of fp32 / bf16 / fp16)
struct OutputRounding {
  double unit, tiny;
};

OutputRounding output_rounding(DType t) {
  switch (t) {
    case DType::kBFloat16: return {std::ldexp(1.0, -8), std::ldexp(1.0, -134)};
    case DType::kFloat16: return {std::ldexp(1.0, -11), std::ldexp(1.0, -25)};
    default: return {0.0, std::ldexp(1.0, -150)};
  }
}

double gamma_n(double n) {
  const double u = std::ldexp(1.0, -24) + std::ldexp(1.0, -53);
  return n * u / (1 - n * u);
}

// The bound on |out - o| for an output in `out_dtype` of a row seeing `n` keys, d = head_dim, c the
// base-2 score scale, s the row's S, big its M, a its A (this element), o the exact output, vmax
// max |v|.
double error_bound(DType out_dtype, int64_t n, int64_t d, double c, double s, double big, double a,
                   double o, double vmax) {
  if (n <= 0) return output_rounding(out_dtype).tiny;  // no key visible (hi <= lo)
  const double u = std::ldexp(1.0, -24) + std::ldexp(1.0, -53), flush = std::ldexp(1.0, -126);
  const double dd = static_cast<double>(d), nn = static_cast<double>(n);
  const double e_s = gamma_n(dd + 22) * s + c * flush * (dd * big + dd + 22);
  const double rescales = std::ceil(nn / 16.0) + 1;
  const double eta =
      std::exp2(e_s + 6 * u * (s + e_s)) * std::pow(1 + 4 * std::ldexp(1.0, -24), rescales + 2) - 1;
  const double g = gamma_n(nn + rescales + 276), g3 = gamma_n(3);
  const double split_terms = 1 + std::ldexp(1.0, -7) * (1 + std::ldexp(1.0, -8));
  const double a_moved = a * (1 + eta) / (1 - eta);
  const double e =
      2 * eta / (1 - eta) * a +
      (2 * g / (1 - g) * (1 + g3) * split_terms + g3 + std::ldexp(1.0, -15)) * a_moved +
      flush * (nn * (vmax + 1) + 3 * nn + 68 + rescales);
  const OutputRounding r = output_rounding(out_dtype);
  return e + r.unit * (std::fabs(o) + e) + r.tiny;
}

// ---- a batch, filled with random data, and its double-precision reference.

struct Case {
  int64_t n = 1, heads = 1, kv_heads = 1, d = 16, batch = 1, seq = 64;
  DType dtype = DType::kFloat32, cache_dtype = DType::kFloat32;
  bool varlen = false, causal = true, with_new = true, mega = false;
  int64_t wl = -1, wr = -1;
  int threads = 1;
  std::vector<int32_t> lq, past, rows;
  float k_descale = 1.0f, v_descale = 1.0f;
  // shared prefix: the first `copied` tokens of every row equal rows[0]'s; the hint (empty: none)
  int64_t copied = 0;
  std::vector<int32_t> prefix_group, prefix_len;
};

std::string describe(const Case& c, const char* isa) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "isa=%s n=%lld H=%lld Hkv=%lld D=%lld dtype=%d cache=%d varlen=%d causal=%d new=%d "
                "window=(%lld,%lld) threads=%d mega=%d shared=%lld hint=%d",
                isa, (long long)c.n, (long long)c.heads, (long long)c.kv_heads, (long long)c.d,
                (int)c.dtype, (int)c.cache_dtype, c.varlen, c.causal, c.with_new, (long long)c.wl,
                (long long)c.wr, c.threads, c.mega, (long long)c.copied, !c.prefix_group.empty());
  return buf;
}

void run_case(const Case& c, std::mt19937& rng, const char* isa) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t d = c.d, hkv = c.kv_heads, h = c.heads, n = c.n;
  const int64_t layers = c.mega ? 3 : 1, layer = c.mega ? 1 : 0;
  const int64_t ce = esize(c.cache_dtype), qe = esize(c.dtype);
  // cache [B, S, L, Hkv, D] (mega) or [B, S, Hkv, D]
  const int64_t s_head = d, s_token = layers * hkv * d, s_batch = c.seq * s_token;
  std::vector<uint8_t> kc(static_cast<size_t>(c.batch * s_batch * ce)), vc(kc.size());
  const float kinv = 1.0f / c.k_descale, vinv = 1.0f / c.v_descale;
  for (size_t i = 0; i < kc.size() / ce; ++i) {
    encode(c.cache_dtype, normal(rng) * c.k_descale, &kc[i * ce], kinv);
    encode(c.cache_dtype, normal(rng) * c.v_descale, &vc[i * ce], vinv);
  }
  for (int64_t i = 1; i < n; ++i) {  // rows[i]'s first `copied` tokens := rows[0]'s
    const size_t bytes = static_cast<size_t>(c.copied * s_token * ce);
    std::memcpy(&kc[c.rows[i] * s_batch * ce], &kc[c.rows[0] * s_batch * ce], bytes);
    std::memcpy(&vc[c.rows[i] * s_batch * ce], &vc[c.rows[0] * s_batch * ce], bytes);
  }
  std::vector<int32_t> cu(n + 1, 0);
  int64_t maxq = 0;
  for (int64_t i = 0; i < n; ++i) {
    cu[i + 1] = cu[i] + c.lq[i];
    maxq = std::max<int64_t>(maxq, c.lq[i]);
  }
  const int64_t qtokens = c.varlen ? cu[n] : n * maxq;
  std::vector<uint8_t> q(static_cast<size_t>(qtokens * h * d * qe)), out(q.size(), 0xAB);
  std::vector<uint8_t> kn(static_cast<size_t>(qtokens * hkv * d * qe)), vn(kn.size());
  for (size_t i = 0; i < q.size() / qe; ++i) encode(c.dtype, normal(rng), &q[i * qe]);
  for (size_t i = 0; i < kn.size() / qe; ++i) {
    encode(c.dtype, normal(rng) * c.k_descale, &kn[i * qe]);
    encode(c.dtype, normal(rng) * c.v_descale, &vn[i * qe]);
  }
  Args a;
  a.num_requests = n;
  a.num_heads = h;
  a.num_kv_heads = hkv;
  a.head_dim = d;
  a.dtype = c.dtype;
  a.cache_dtype = c.cache_dtype;
  a.q = Operand{q.data(), c.varlen ? 0 : maxq * h * d, h * d, d};
  a.out = Operand{out.data(), a.q.s_batch, h * d, d};
  if (c.varlen) {
    a.cu_seqlens_q = cu.data();
    a.q_tokens = qtokens;
  } else {
    a.seqlen_q = maxq;
  }
  if (c.with_new) {
    a.k_new = Operand{kn.data(), c.varlen ? 0 : maxq * hkv * d, hkv * d, d};
    a.v_new = Operand{vn.data(), a.k_new.s_batch, hkv * d, d};
    a.seqlen_new = maxq;
  }
  a.k_cache = Operand{kc.data() + layer * hkv * d * ce, s_batch, s_token, s_head};
  a.v_cache = Operand{vc.data() + layer * hkv * d * ce, s_batch, s_token, s_head};
  a.cache_batch = c.batch;
  a.cache_len = c.seq;
  a.cache_seqlens = c.past.data();
  a.cache_batch_idx = c.rows.data();
  a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d));
  a.causal = c.causal;
  a.window_left = c.wl;
  a.window_right = c.wr;
  a.k_descale = c.k_descale;
  a.v_descale = c.v_descale;
  a.num_threads = c.threads;
  if (!c.prefix_group.empty()) {
    a.prefix_group = c.prefix_group.data();
    a.prefix_len = c.prefix_len.data();
  }
  const std::vector<uint8_t> kc_before = kc;
  try {
    flash_attn_with_kvcache(a);
  } catch (const std::exception& e) {
    check(false, describe(c, isa) + ": threw " + e.what());
    return;
  }
  const bool fp8 = c.cache_dtype == DType::kFloat8E4M3 || c.cache_dtype == DType::kFloat8E5M2;
  const std::string what = describe(c, isa);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lq = c.lq[i], nnew = c.with_new ? lq : 0, lk = c.past[i] + nnew, row = c.rows[i];
    const int64_t qs = c.varlen ? cu[i] : i * maxq;
    auto kat = [&](std::vector<uint8_t>& cache, int64_t t, int64_t g, int64_t x) {
      return &cache[static_cast<size_t>(
          (row * s_batch + t * s_token + layer * hkv * d + g * s_head + x) * ce)];
    };
    // appended keys: exactly the new rows, encoded as the cache stores them
    for (int64_t t = 0; t < nnew; ++t) {
      for (int64_t g = 0; g < hkv; ++g) {
        for (int64_t x = 0; x < d; ++x) {
          const size_t src = static_cast<size_t>(((qs + t) * hkv * d + g * d + x) * qe);
          uint8_t want[4], wantv[4];
          if (fp8) {
            encode(c.cache_dtype, decode(c.dtype, &kn[src]), want, kinv);
            encode(c.cache_dtype, decode(c.dtype, &vn[src]), wantv, vinv);
          } else {
            std::memcpy(want, &kn[src], qe);
            std::memcpy(wantv, &vn[src], qe);
          }
          if (std::memcmp(want, kat(kc, c.past[i] + t, g, x), ce) != 0 ||
              std::memcmp(wantv, kat(vc, c.past[i] + t, g, x), ce) != 0) {
            check(false, what + ": appended key/value differs");
            return;
          }
        }
      }
    }
    for (int64_t j = 0; j < lq; ++j) {
      const int64_t p = j + lk - lq;
      int64_t lo = 0, hi = lk;
      if (c.causal)
        hi = std::min(hi, p + 1);
      else if (c.wr >= 0)
        hi = std::min(hi, p + c.wr + 1);
      if (c.wl >= 0) lo = std::max<int64_t>(0, p - c.wl);
      for (int64_t hh = 0; hh < h; ++hh) {
        const int64_t g = hh / (h / hkv);
        std::vector<double> sc, o(d, 0.0), oabs(d, 0.0);
        double mx = -INFINITY, sum = 0, absdot_max = 0, vmax = 0, big = 1;
        const uint8_t* qr = &q[static_cast<size_t>(((qs + j) * h * d + hh * d) * qe)];
        for (int64_t x = 0; x < d; ++x)
          big = std::max(big, std::fabs(double(decode(c.dtype, qr + x * qe))));
        for (int64_t t = lo; t < hi; ++t) {
          double dot = 0, absdot = 0;
          for (int64_t x = 0; x < d; ++x) {
            const double kx = double(decode(c.cache_dtype, kat(kc, t, g, x))) * c.k_descale;
            const double p = double(decode(c.dtype, qr + x * qe)) * kx;
            big = std::max(big, std::fabs(kx));
            dot += p;
            absdot += std::fabs(p);
          }
          sc.push_back(dot * a.softmax_scale);
          mx = std::max(mx, sc.back());
          absdot_max = std::max(absdot_max, absdot);
        }
        for (int64_t t = lo; t < hi; ++t) {
          const double w = std::exp(sc[t - lo] - mx);
          sum += w;
          for (int64_t x = 0; x < d; ++x) {
            const double val = double(decode(c.cache_dtype, kat(vc, t, g, x))) * c.v_descale;
            o[x] += w * val;
            oabs[x] += w * std::fabs(val);
            vmax = std::max(vmax, std::fabs(val));
          }
        }
        const double cs = a.softmax_scale * 1.4426950408889634;  // scores in base 2
        const uint8_t* orow = &out[static_cast<size_t>(((qs + j) * h * d + hh * d) * qe)];
        for (int64_t x = 0; x < d; ++x) {
          const double want = hi > lo ? o[x] / sum : 0.0;
          const double got = decode(c.dtype, orow + x * qe);
          const double err = std::fabs(got - want);
          const double bound = error_bound(c.dtype, hi - lo, d, cs, cs * absdot_max, big,
                                           hi > lo ? oabs[x] / sum : 0.0, want, vmax);
          if (!(err <= bound)) {
            check(false, what + ": request " + std::to_string(i) + " query " + std::to_string(j) +
                             " head " + std::to_string(hh) + " dim " + std::to_string(x) +
                             ": got " + std::to_string(got) + " want " + std::to_string(want) +
                             ", error " + std::to_string(err) + " > bound " +
                             std::to_string(bound));
            return;
          }
          worst_ratio = std::max(worst_ratio, err / bound);
        }
      }
    }
  }
  (void)kc_before;
}

Case random_case(std::mt19937& rng, int threads) {
  auto pick = [&](std::initializer_list<int64_t> xs) {
    std::vector<int64_t> v(xs);
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
  };
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Case c;
  c.kv_heads = pick({1, 2});
  c.heads = c.kv_heads * pick({1, 2, 4, 8});
  c.d = pick({4, 16, 20, 64, 80});
  c.dtype = static_cast<DType>(uni(0, 2));
  c.cache_dtype = uni(0, 3) == 0 ? static_cast<DType>(uni(3, 4)) : c.dtype;
  if (c.cache_dtype == DType::kFloat8E4M3 || c.cache_dtype == DType::kFloat8E5M2) {
    c.k_descale = 0.5f + static_cast<float>(uni(0, 100)) / 50.0f;
    c.v_descale = 0.25f + static_cast<float>(uni(0, 100)) / 40.0f;
  }
  c.n = uni(1, 4);
  c.batch = c.n + uni(0, 2);
  c.seq = uni(32, 300);
  c.varlen = uni(0, 1);
  c.causal = uni(0, 3) != 0;
  c.with_new = uni(0, 3) != 0;
  c.mega = uni(0, 2) == 0;
  if (uni(0, 2) == 0) c.wl = uni(0, 40);
  if (!c.causal && uni(0, 1)) c.wr = uni(0, 10);
  c.threads = threads;
  std::vector<int32_t> rows(c.batch);
  for (int64_t r = 0; r < c.batch; ++r) rows[r] = static_cast<int32_t>(r);
  std::shuffle(rows.begin(), rows.end(), rng);
  const int64_t fixed_lq = uni(1, 3) == 1 ? uni(2, 40) : 1;
  for (int64_t i = 0; i < c.n; ++i) {
    const int64_t lq = c.varlen ? (uni(0, 2) == 0 ? uni(0, 70) : 1) : fixed_lq;
    c.lq.push_back(static_cast<int32_t>(lq));
    const int64_t nnew = c.with_new ? lq : 0;
    c.seq = std::max(c.seq, nnew);
    c.past.push_back(static_cast<int32_t>(uni(0, c.seq - nnew)));
    c.rows.push_back(rows[i]);
  }
  return c;
}

// Many decode rows (and some prefill rows) over one shared prefix, with the hint: groups and
// claimed lengths at random within the truth (the kernel's cascade path, and its fallbacks).
Case shared_prefix_case(std::mt19937& rng, int threads) {
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Case c = random_case(rng, threads);
  c.n = uni(2, 14);
  c.batch = c.n + uni(0, 2);
  c.varlen = true;
  c.copied = uni(0, 3) == 0 ? uni(520, 900) : uni(0, 300);  // long ones: split on 2 threads
  c.seq = c.copied + 200;
  std::vector<int32_t> rows(c.batch);
  for (int64_t r = 0; r < c.batch; ++r) rows[r] = static_cast<int32_t>(r);
  std::shuffle(rows.begin(), rows.end(), rng);
  c.lq.clear();
  c.past.clear();
  c.rows.clear();
  for (int64_t i = 0; i < c.n; ++i) {
    c.lq.push_back(static_cast<int32_t>(uni(0, 5) == 0 ? uni(0, 12) : 1));
    c.past.push_back(static_cast<int32_t>(std::max<int64_t>(0, c.copied + uni(-20, 120))));
    c.rows.push_back(rows[i]);
    c.prefix_group.push_back(static_cast<int32_t>(uni(-1, 2) < 0 ? -1 : uni(0, 1)));
    c.prefix_len.push_back(static_cast<int32_t>(uni(0, 4) == 0 ? uni(0, c.copied) : c.copied));
  }
  if (uni(0, 1)) c.wl = -1;  // half the batches without a window: the groups hold
  return c;
}

// ---- guard pages: reading outside [window start, length) of the row faults.

void test_guard_pages(const char* isa) {
  const long page = sysconf(_SC_PAGESIZE);
  const int64_t d = 64, seq = 4 * page / (d * 4);  // fp32, one KV head: page / 256 tokens per page
  const int64_t tokens_per_page = page / (d * 4);
  const size_t bytes = static_cast<size_t>(seq * d * 4);
  for (int mode = 0; mode < 2; ++mode) {
    void* kmem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    void* vmem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(kmem != MAP_FAILED && vmem != MAP_FAILED, "mmap");
    // keys [tokens_per_page, 3 * tokens_per_page) are readable; the rest is PROT_NONE
    const int64_t lk = 3 * tokens_per_page;
    for (void* m : {kmem, vmem}) {
      mprotect(m, static_cast<size_t>(page), PROT_NONE);
      mprotect(static_cast<char*>(m) + 3 * page, static_cast<size_t>(page), PROT_NONE);
    }
    const int64_t lq = mode == 0 ? 1 : 2 * tokens_per_page - 3;
    std::vector<float> q(static_cast<size_t>(lq * 4 * d), 0.5f), out(q.size()),
        kn(static_cast<size_t>(lq * d), 1.0f);
    std::vector<int32_t> past{static_cast<int32_t>(lk - lq)}, cu{0, static_cast<int32_t>(lq)};
    Args a;
    a.num_requests = 1;
    a.num_heads = 4;
    a.num_kv_heads = 1;
    a.head_dim = d;
    a.q = Operand{q.data(), 0, 4 * d, d};
    a.out = Operand{out.data(), 0, 4 * d, d};
    a.cu_seqlens_q = cu.data();
    a.q_tokens = lq;
    a.k_new = Operand{kn.data(), 0, d, d};
    a.v_new = Operand{kn.data(), 0, d, d};
    a.k_cache = Operand{kmem, seq * d, d, d};
    a.v_cache = Operand{vmem, seq * d, d, d};
    a.cache_batch = 1;
    a.cache_len = seq;
    a.cache_seqlens = past.data();
    a.causal = true;
    // the first query sits at lk - lq: its window starts exactly at tokens_per_page
    a.window_left = lk - lq - tokens_per_page;
    a.num_threads = 2;
    flash_attn_with_kvcache(a);  // a stray read is SIGSEGV, not a failed check
    for (float x : out) check(std::isfinite(x), std::string(isa) + ": guard-page case output");
    munmap(kmem, bytes);
    munmap(vmem, bytes);
  }
}

void test_errors() {
  std::vector<float> q(64), kc(4 * 8 * 16, 7.0f), out(64), kn(16, 1.0f);
  std::vector<int32_t> past{7}, rows{0};
  Args a;
  a.num_requests = 1;
  a.num_heads = 4;
  a.num_kv_heads = 1;
  a.head_dim = 16;
  a.q = Operand{q.data(), 64, 64, 16};
  a.out = Operand{out.data(), 64, 64, 16};
  a.seqlen_q = 1;
  a.k_new = Operand{kn.data(), 16, 16, 16};
  a.v_new = a.k_new;
  a.seqlen_new = 1;
  a.k_cache = Operand{kc.data(), 8 * 16, 16, 16};
  a.v_cache = a.k_cache;
  a.cache_batch = 4;
  a.cache_len = 8;
  a.cache_seqlens = past.data();
  a.cache_batch_idx = rows.data();
  auto expect_throw = [&](const Args& bad, const char* what, const char* needle) {
    const std::vector<float> before = kc;
    try {
      flash_attn_with_kvcache(bad);
      check(false, std::string(what) + ": no exception");
    } catch (const std::invalid_argument& e) {
      check(std::string(e.what()).find(needle) != std::string::npos,
            std::string(what) + ": message '" + e.what() + "'");
    }
    check(kc == before, std::string(what) + ": cache modified");
  };
  Args b = a;
  past[0] = 8;  // 8 + 1 > 8
  expect_throw(b, "overflowing append", "exceed the cache length 8");
  past[0] = 7;
  rows[0] = 4;
  expect_throw(b, "row out of range", "outside the cache's 4 rows");
  rows[0] = 0;
  b.head_dim = 1024;
  expect_throw(b, "head_dim", "head_dim must be in [1, 512]");
  b = a;
  b.num_heads = 3;
  b.num_kv_heads = 2;
  expect_throw(b, "GQA", "positive multiple");
  b = a;
  b.cache_dtype = DType::kFloat8E4M3;
  b.k_descale = 0.0f;
  expect_throw(b, "descale", "k_descale/v_descale");
  b = a;
  int32_t group = -2, len = 4;
  b.prefix_group = &group;
  expect_throw(b, "prefix hint alone", "must be given together");
  b.prefix_len = &len;
  expect_throw(b, "prefix group", "prefix_groups[0] = -2 must be >= -1");
  group = 0;
  len = -1;
  expect_throw(b, "prefix length", "prefix_lens[0] = -1 is negative");
  flash_attn_with_kvcache(a);  // the valid call works
  check(kc[7 * 16] == 1.0f, "valid append");
}

}  // namespace

int main() {
  test_conversions();
  test_errors();
  std::mt19937 rng(1234);
  int cases = 0;
  std::string ran, not_run;
  for (const KernelVariant& v : kernel_variants()) {
    const char* isa = v.name.c_str();
    if (!set_kernel_isa(isa)) {
      check(!v.runnable(), v.name + ": runnable, yet set_kernel_isa refused it");
      std::string why = "not compiled in";
      if (v.compiled && !v.missing.empty()) {
        why = "the CPU lacks";
        for (const std::string& f : v.missing) why += " " + f;
      } else if (v.compiled) {
        why = v.refused;
      }
      not_run += " " + v.name + " (" + why + ")";
      continue;
    }
    ran += " " + v.name;
    check(std::string(kernel_isa()) == isa, "set_kernel_isa");
    for (int i = 0; i < 60; ++i) {
      Case c = random_case(rng, i % 2 ? 2 : 1);
      run_case(c, rng, isa);
      ++cases;
    }
    // long rows on 2 threads: decode rows split across threads (flash-decoding) and prefills
    // cut into several query blocks
    for (int i = 0; i < 4; ++i) {
      Case c = random_case(rng, 2);
      c.n = 1;
      c.varlen = true;
      c.lq = {i < 2 ? 1 : 150 + i};
      c.seq = 2600;
      c.past = {static_cast<int32_t>(i % 2 ? 2400 : 700)};
      c.rows = {0};
      c.batch = 1;
      run_case(c, rng, isa);
      ++cases;
    }
    for (int i = 0; i < 24; ++i) {
      Case c = shared_prefix_case(rng, i % 2 ? 2 : 1);
      run_case(c, rng, isa);
      ++cases;
    }
    test_guard_pages(isa);
  }
  std::string unused;
  for (const std::string& f : unused_cpu_features()) unused += " " + f;
  std::printf("attention_test [%s]: variants run:%s; not run:%s; CPU features no variant uses:%s\n",
              vattention::testing::sanitizer_name(), ran.c_str(),
              not_run.empty() ? " none" : not_run.c_str(),
              unused.empty() ? " none" : unused.c_str());
  set_kernel_isa("");
  std::printf(
      "attention_test [%s]: %d random batches, largest error %.3g of the derived bound, %d "
      "failures\n",
      vattention::testing::sanitizer_name(), cases, worst_ratio, failures);
  return failures ? 1 : 0;
}
