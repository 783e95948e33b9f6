// The attention kernels, written once over a vector type `Vec` (vec_avx512.h, vec_avx2.h,
// vec_generic.h). A fragment: each isa_*.cpp includes it inside its own namespace after its Vec,
// so every function here is compiled once per instruction set, with distinct symbols (an inline
// function shared between the ISA files would let the linker keep an AVX-512 copy for all).
//
// Two kernels, both flash-attention style (online softmax over blocks of keys, fp32 accumulation,
// scores in base 2: q is pre-scaled by softmax_scale * log2(e), so exp becomes exp2):
//
// - decode_item<P, HC>: rows per KV head = queries x group heads <= 8, padded to P in
//   {1, 2, 4, 8}; one item covers every KV head of a request. Vectors run along head_dim: a tile
//   of W (token, head, row) dot products is reduced at once (Vec::reduce) into W scores. K rows
//   are read in address order (token by token, all heads of a token), so the hardware
//   prefetchers stream them; P V is token-major for P = 1 and head-major with register
//   accumulators for P >= 2 (the next block's K and V prefetched during each block, so that
//   the memory reads overlap the arithmetic: see BlockPrefetch).
//   bf16 caches on a CPU with a bf16 dot product (AVX512-BF16) take it for QK^T at P >= 2, on
//   bf16 q and K as they are. P V stays in fp32 FMAs on widened V: rounding the probabilities to
//   bf16 for a bf16 dot product there moved logprobs past stock vLLM's by more than two bf16
//   spacings (tests/test_integrations_vllm.py, the near-tie test), for 5-10% from DRAM.
// - prefill_item: up to 64 rows (queries x group heads of one KV head). q is packed transposed
//   (Qt[d][row]) once per item, so vectors run along rows: S^T[key][row] = sum_d K[key][d] *
//   Qt[d][row] is a register-blocked micro-kernel (KC keys x NV row vectors per step of d, K
//   broadcast), the softmax is vertical (row max = max over keys, no horizontal reduction), and
//   O[row][d] += P^T[key][row] * V[key][d] is a second micro-kernel (RO rows x NV vectors of d).
//   Non-fp32 caches are converted block by block into fp32 scratch (once per block, amortized
//   over all rows), except bf16 K on a CPU with the bf16 dot product: QK^T then takes it on q
//   and K as they are (Qt holds pairs of bf16 values), and the scale is applied to the scores.
//   fp32 caches are read in place, the next block's rows prefetched into L2 (see attend_rows).
//
// Neither kernel touches a key outside [it.k_begin, it.k_end), which the planner clipped to the
// union of the rows' visible ranges.

using F = Vec::F;
using I = Vec::I;
constexpr int W = Vec::W;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#ifndef VATTN_UNROLL
#define VATTN_UNROLL _Pragma("GCC unroll 32")
#endif

// The first n (< W) elements at p, zero-filled: never reads past p[n - 1].
template <typename T>
inline F load_n(const T* p, int64_t n) {
  T tmp[W];
  std::memset(static_cast<void*>(tmp), 0, sizeof(tmp));
  std::memcpy(static_cast<void*>(tmp), p, static_cast<size_t>(n) * sizeof(T));
  return Vec::load(static_cast<const T*>(tmp));
}

template <typename T>
inline void store_n(T* p, F x, int64_t n) {
  T tmp[W];
  Vec::store(tmp, x);
  std::memcpy(static_cast<void*>(p), tmp, static_cast<size_t>(n) * sizeof(T));
}

// dst[0, dp) = src[0, d) * scale, zero padded.
template <typename T>
inline void row_to_f32(const T* src, int64_t d, float scale, float* dst, int64_t dp) {
  const F s = Vec::set1(scale);
  int64_t i = 0;
  for (; i + W <= d; i += W) Vec::store(dst + i, Vec::mul(Vec::load(src + i), s));
  if (i < d) {
    Vec::store(dst + i, Vec::mul(load_n(src + i, d - i), s));
    i += W;
  }
  for (; i < dp; i += W) Vec::store(dst + i, Vec::zero());
}

inline void load_q_row(const void* src, DType dt, int64_t d, float scale, float* dst, int64_t dp) {
  switch (dt) {
    case DType::kBFloat16: return row_to_f32(static_cast<const bf16_t*>(src), d, scale, dst, dp);
    case DType::kFloat16: return row_to_f32(static_cast<const f16_t*>(src), d, scale, dst, dp);
    default: return row_to_f32(static_cast<const float*>(src), d, scale, dst, dp);
  }
}

// Row r of Qt ([d / 2][rp] words): q's d values (bf16) in pairs, one 32-bit lane per pair, as the
// bf16 dot products and the AMX tiles read them.
inline void stage_q_pairs(const void* src, int64_t d, int32_t* qt, int64_t rp, int64_t r) {
  const bf16_t* q = static_cast<const bf16_t*>(src);
  for (int64_t x = 0; x < d / 2; ++x)
    qt[x * rp + r] = static_cast<int32_t>(q[2 * x].bits | (uint32_t{q[2 * x + 1].bits} << 16));
}

template <typename T>
inline void f32_to_row(const float* src, float scale, T* dst, int64_t d) {
  const F s = Vec::set1(scale);
  int64_t i = 0;
  for (; i + W <= d; i += W) Vec::store(dst + i, Vec::mul(Vec::load(src + i), s));
  if (i < d) store_n(dst + i, Vec::mul(Vec::load(src + i), s), d - i);
}

inline void store_out_row(const float* src, float scale, void* dst, DType dt, int64_t d) {
  switch (dt) {
    case DType::kBFloat16: return f32_to_row(src, scale, static_cast<bf16_t*>(dst), d);
    case DType::kFloat16: return f32_to_row(src, scale, static_cast<f16_t*>(dst), d);
    default: return f32_to_row(src, scale, static_cast<float*>(dst), d);
  }
}

// Row r of an item -> (query j within the request, query head h).
struct RowMap {
  int64_t q_begin, group, kv_head;
  int64_t query(int64_t r) const { return q_begin + r / group; }
  int64_t head(int64_t r) const { return kv_head * group + r % group; }
};

// Visible key ranges of the item's rows, clipped to [k_begin, k_end); rows >= n copy row 0.
struct RowRanges {
  int64_t kb = 0, ke = 0;          // union over the real rows
  int64_t max_lo = 0, min_hi = 0;  // keys in [max_lo, min_hi) need no mask
};

// The union [kb, ke) of the key ranges [lo[r], hi[r]) of rows [r0, r1) (0, 0 if all are empty),
// and the keys every one of them sees, [max_lo, min_hi).
inline RowRanges reduce_ranges(const int32_t* lo, const int32_t* hi, int64_t r0, int64_t r1) {
  RowRanges rr;
  bool any = false;
  rr.max_lo = 0;
  rr.min_hi = INT64_MAX;
  for (int64_t r = r0; r < r1; ++r) {
    if (hi[r] > lo[r]) {
      rr.kb = any ? std::min<int64_t>(rr.kb, lo[r]) : lo[r];
      rr.ke = any ? std::max<int64_t>(rr.ke, hi[r]) : hi[r];
      any = true;
    }
    rr.max_lo = std::max<int64_t>(rr.max_lo, lo[r]);
    rr.min_hi = std::min<int64_t>(rr.min_hi, hi[r]);
  }
  if (!any) rr.kb = rr.ke = 0;
  return rr;
}

// Each of the n rows' keys within the item, [lo[r], hi[r]) (empty as 0, 0), padding rows up to
// `padded` given row 0's, and the ranges of the n rows together.
inline RowRanges row_ranges(const Args& a, const Request& rq, const WorkItem& it, const RowMap& map,
                            int64_t n, int64_t padded, int32_t* lo, int32_t* hi) {
  for (int64_t r0 = 0; r0 < n; r0 += map.group) {  // a query's group rows share its range
    int64_t l, h;
    key_range(a, rq, map.query(r0), &l, &h);
    l = std::max(l, it.k_begin);
    h = std::min(h, it.k_end);
    if (h <= l) l = h = 0;
    for (int64_t r = r0; r < std::min(n, r0 + map.group); ++r) {
      lo[r] = static_cast<int32_t>(l);
      hi[r] = static_cast<int32_t>(h);
    }
  }
  for (int64_t r = n; r < padded; ++r) {
    lo[r] = lo[0];
    hi[r] = hi[0];
  }
  return reduce_ranges(lo, hi, 0, n);
}

// ------------------------------------------------------------------------------------------------
// Decode kernel.
//
// An item covers all KV heads of one request over a key range and walks the keys token by token:
// the K (and V) rows of all heads of a token are adjacent in a vattention cache, so the item reads
// one sequential stream that the hardware prefetchers follow. (One head at a time reads a
// head_dim slice every token stride, a page or more apart: measured ~40% slower per core.)
//
// Score tiles hold W (token, head, row) lanes: u = (kc * hc + hh) * P + r for token kc of the
// tile, head hh of a chunk of hc heads, row r (query x group member, padded to P).

// W dot products: lane j * P + r = q[j % HC][r] . krows[j] for the W / P (token, head) pairs
// j = kc * HC + hh of the tile, pair by pair: the tile's K rows are read in address order (token
// kc, head hh), one sequential stream; krows[j] is a zero row past the range's end.
template <int P, int HC, typename KT>
inline F qk_tile(const float* const* qrows, const KT* const* krows, int64_t dp, int64_t d) {
  constexpr int kPairs = W / P;
  F acc[W];
  VATTN_UNROLL
  for (int u = 0; u < W; ++u) acc[u] = Vec::zero();
  const int64_t dfull = d - d % W;
  VATTN_UNROLL
  for (int j = 0; j < kPairs; ++j) {
    const KT* kr = krows[j];
    const float* qr = qrows[j % HC];
    for (int64_t x = 0; x < dfull; x += W) {
      const F kv = Vec::load(kr + x);
      VATTN_UNROLL
      for (int r = 0; r < P; ++r)
        acc[j * P + r] = Vec::fmadd(Vec::load(qr + r * dp + x), kv, acc[j * P + r]);
    }
    if (dfull < d) {
      const F kv = load_n(kr + dfull, d - dfull);
      VATTN_UNROLL
      for (int r = 0; r < P; ++r)
        acc[j * P + r] = Vec::fmadd(Vec::load(qr + r * dp + dfull), kv, acc[j * P + r]);
    }
  }
  return Vec::reduce(acc);
}

// qk_tile for bf16 q and K with a bf16 dot product instruction (Vec::kBf16Dot): 2 W values of d
// per step, no conversion; q rows (bf16, unscaled) are zero-padded to dq = round_up(d, 2 W).
template <int P, int HC>
inline F qk_tile_bf16(const bf16_t* const* qrows, const bf16_t* const* krows, int64_t dq,
                      int64_t d) {
  constexpr int kPairs = W / P;
  F acc[W];
  VATTN_UNROLL
  for (int u = 0; u < W; ++u) acc[u] = Vec::zero();
  const int64_t dfull = d - d % (2 * W);
  VATTN_UNROLL
  for (int j = 0; j < kPairs; ++j) {
    const bf16_t* kr = krows[j];
    const bf16_t* qr = qrows[j % HC];
    for (int64_t x = 0; x < dfull; x += 2 * W) {
      const I kv = Vec::load_bits(kr + x);
      VATTN_UNROLL
      for (int r = 0; r < P; ++r)
        acc[j * P + r] = Vec::dot_bf16(acc[j * P + r], qr + r * dq + x, kv);
    }
    if (dfull < d) {
      bf16_t tail[2 * W];
      std::memset(static_cast<void*>(tail), 0, sizeof(tail));
      std::memcpy(static_cast<void*>(tail), kr + dfull,
                  static_cast<size_t>(d - dfull) * sizeof(bf16_t));
      const I kv = Vec::load_bits(tail);
      VATTN_UNROLL
      for (int r = 0; r < P; ++r)
        acc[j * P + r] = Vec::dot_bf16(acc[j * P + r], qr + r * dq + dfull, kv);
    }
  }
  return Vec::reduce(acc);
}

// acc[r][0, d) += p[r] * v[0, d) for the P rows of one head and one token (acc rows ald apart).
template <int P, typename VT>
inline void pv_token(float* acc, int64_t ald, int64_t d, const float* p, const VT* v) {
  F pb[P];
  VATTN_UNROLL
  for (int r = 0; r < P; ++r) pb[r] = Vec::set1(p[r]);
  const int64_t dfull = d - d % W;
  for (int64_t x = 0; x < dfull; x += W) {
    const F vv = Vec::load(v + x);
    VATTN_UNROLL
    for (int r = 0; r < P; ++r)
      Vec::store(acc + r * ald + x, Vec::fmadd(pb[r], vv, Vec::load(acc + r * ald + x)));
  }
  if (dfull < d) {
    const F vv = load_n(v + dfull, d - dfull);
    VATTN_UNROLL
    for (int r = 0; r < P; ++r) {
      Vec::store(acc + r * ald + dfull, Vec::fmadd(pb[r], vv, Vec::load(acc + r * ald + dfull)));
    }
  }
}

// Reads one byte of every cache line of one token's rows of `heads` heads (`head_stride` elements
// apart), in address order, folding them into `sink` (never past the rows' last byte): the first
// block's V, for the head-major P V pass (later blocks are prefetched, see BlockPrefetch). Demand
// loads, not prefetches: on this project's Zen 5 machine, software prefetches of V during QK^T
// (t0, t2 or nta hints, 1 to 32 tokens ahead) made no measurable difference and the head-major
// P V pass stalled on V; touching the lines in address order brings them into L2 for that pass
// (GQA-4 decode on 2 threads: bf16 26 -> 36 GB/s, fp32 36 -> 40 GB/s).
template <typename T>
inline uint64_t touch_token(const T* p, int64_t heads, int64_t head_stride, int64_t d,
                            uint64_t sink) {
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  const bool adjacent = head_stride == d;
  const int64_t runs = adjacent ? 1 : heads;
  const int64_t run_bytes = adjacent ? heads * row_bytes : row_bytes;
  for (int64_t h = 0; h < runs; ++h) {
    const char* c = reinterpret_cast<const char*>(p + h * head_stride);
    for (int64_t off = 0; off < run_bytes; off += 64) sink ^= static_cast<unsigned char>(c[off]);
  }
  return sink;
}

// Software prefetch of the next block's K and V rows, spread over the current block's work
// (step() a few lines at a time from the QK^T tiles and the P V passes). The head-major P V pass
// (P >= 2) reads only cache, so without this the memory system idles during it and a call took
// about the sum of its compute time and its read time: GQA-4 bf16 decode over 4k-token rows, one
// thread, Zen 4: 27 -> 18 ms per call; two threads, where both cores share the memory bandwidth,
// 0-15% to 1.3-1.6x by the run (docs/benchmarks.md). Lines are visited token by token, K and V
// at the same offset, covering the item's heads of each token ([first head, last head],
// contiguous in every cache this project and vLLM build; prefetches never fault, so the few
// lines past K's last head where V's head stride is larger are harmless).
struct BlockPrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t kst = 0, vst = 0;  // token strides, bytes
  int64_t run = 0;           // bytes per token to cover
  int64_t tokens = 0;        // tokens left, the current one included
  int64_t off = 0;           // next line offset within the current token
  int64_t per_step = 0;      // lines (each of K and V) per step()
  bool to_l2 = false;        // prefetcht1 (scattered rows, see decode_item), else prefetcht0

  __attribute__((always_inline)) inline void step() {
    if (to_l2) {
      step_with<2>();
    } else {
      step_with<3>();
    }
  }

  template <int kLocality>
  __attribute__((always_inline)) inline void step_with() {
    for (int64_t i = 0; i < per_step && tokens > 0; ++i) {
      __builtin_prefetch(k + off, 0, kLocality);
      __builtin_prefetch(v + off, 0, kLocality);
      off += 64;
      if (off >= run) {
        off = 0;
        k += kst;
        v += vst;
        --tokens;
      }
    }
  }
};

// Head-major P V over a block: acc[r][x0, x0 + NV * W) += sum_kk pr[kk * pst + r] * v[kk][x0, ...]
// for the P rows of one head, acc in registers for the whole block (V comes from cache: the QK
// pass touched it, or the previous block prefetched it). The last vector reads `tail` < W
// elements when tail > 0. Steps `pf` once per key, on a local copy: through the reference its
// fields went back to memory at every step.
template <int P, int NV, typename VT>
inline void pv_head(float* acc, int64_t ald, const VT* v, int64_t vst, int64_t nb, const float* pr,
                    int64_t pst, int64_t tail, BlockPrefetch& pf_io) {
  BlockPrefetch pf = pf_io;
  F o[P][NV];
  VATTN_UNROLL
  for (int r = 0; r < P; ++r) {
    VATTN_UNROLL
    for (int i = 0; i < NV; ++i) o[r][i] = Vec::load(acc + r * ald + i * W);
  }
  for (int64_t kk = 0; kk < nb; ++kk) {
    pf.step();
    const float* pk = pr + kk * pst;
    const VT* vr = v + kk * vst;
    F vv[NV];
    VATTN_UNROLL
    for (int i = 0; i < NV; ++i)
      vv[i] = (tail && i == NV - 1) ? load_n(vr + i * W, tail) : Vec::load(vr + i * W);
    VATTN_UNROLL
    for (int r = 0; r < P; ++r) {
      const F pb = Vec::set1(pk[r]);
      VATTN_UNROLL
      for (int i = 0; i < NV; ++i) o[r][i] = Vec::fmadd(pb, vv[i], o[r][i]);
    }
  }
  VATTN_UNROLL
  for (int r = 0; r < P; ++r) {
    VATTN_UNROLL
    for (int i = 0; i < NV; ++i) Vec::store(acc + r * ald + i * W, o[r][i]);
  }
  pf_io = pf;
}

// Dense decode tiles: where a chunk's heads are adjacent in the cache (head stride d, as in every
// vattention and vLLM cache) and d is VPD whole vectors, the K rows of a tile are kt tokens of
// HC * d contiguous values, kst apart, so every address is one of kt row pointers plus a
// compile-time offset. The general tiles keep one pointer per (token, head) pair: 16 of them
// do not fit in the registers, and reloading them from the stack cost more than the dot products
// where the rows are in cache (a shared prefix read by every request of a batch).
template <int P, int HC, int VPD, typename KT>
inline F qk_tile_dense(const float* q, const KT* k, int64_t kst) {
  constexpr int kTok = W / (HC * P);
  constexpr int64_t d = VPD * W;
  F acc[W];
  VATTN_UNROLL
  for (int u = 0; u < W; ++u) acc[u] = Vec::zero();
  const KT* kr = k;
  VATTN_UNROLL
  for (int t = 0; t < kTok; ++t) {
    if (t > 0) {
      // One register walks the token rows: the empty asm hides kr's value from the optimizer,
      // which otherwise precomputes all kTok * HC * VPD addresses k + t * kst + offset, spills
      // them and reloads one from the stack per FMA (decode calls of about 13 rows x 1400
      // tokens x 4 heads x 64, fp32: 1.37x vLLM's op time with the spills, 0.81-0.92x without)
      kr += kst;
      asm("" : "+r"(kr));
    }
    VATTN_UNROLL
    for (int hh = 0; hh < HC; ++hh) {
      VATTN_UNROLL
      for (int x = 0; x < VPD; ++x) {
        const F kv = Vec::load(kr + hh * d + x * W);
        VATTN_UNROLL
        for (int r = 0; r < P; ++r) {
          F& a = acc[(t * HC + hh) * P + r];
          a = Vec::fmadd(Vec::load(q + (hh * P + r) * d + x * W), kv, a);
        }
      }
    }
  }
  return Vec::reduce(acc);
}

// qk_tile_dense for bf16 q and K with the bf16 dot product instruction (Vec::kBf16Dot): d is VPD2
// steps of 2 W values; q rows (bf16, unscaled) are d apart.
template <int P, int HC, int VPD2>
inline F qk_tile_dense_bf16(const bf16_t* q, const bf16_t* k, int64_t kst) {
  constexpr int kTok = W / (HC * P);
  constexpr int64_t d = VPD2 * 2 * W;
  F acc[W];
  VATTN_UNROLL
  for (int u = 0; u < W; ++u) acc[u] = Vec::zero();
  const bf16_t* kr = k;
  VATTN_UNROLL
  for (int t = 0; t < kTok; ++t) {
    if (t > 0) {
      kr += kst;
      asm("" : "+r"(kr));  // see qk_tile_dense
    }
    VATTN_UNROLL
    for (int hh = 0; hh < HC; ++hh) {
      VATTN_UNROLL
      for (int x = 0; x < VPD2; ++x) {
        const I kv = Vec::load_bits(kr + hh * d + x * 2 * W);
        VATTN_UNROLL
        for (int r = 0; r < P; ++r) {
          F& a = acc[(t * HC + hh) * P + r];
          a = Vec::dot_bf16(a, q + (hh * P + r) * d + x * 2 * W, kv);
        }
      }
    }
  }
  return Vec::reduce(acc);
}

// One row per head (P = 1), SH adjacent heads of a dense chunk over a block, token by token:
// acc[h][0, d) += p[kk][h] * v[kk][h][0, d), the SH * VPD accumulators in registers (pv_token
// loads and stores them once per token), V read in address order. Steps `pf` once per key (a local
// copy, as in pv_head).
template <int SH, int VPD, typename VT>
inline void pv_dense(float* acc, const float* pt, int64_t pst, const VT* v, int64_t vst, int64_t nb,
                     BlockPrefetch& pf_io) {
  BlockPrefetch pf = pf_io;
  constexpr int kNv = SH * VPD;
  F o[kNv];
  VATTN_UNROLL
  for (int i = 0; i < kNv; ++i) o[i] = Vec::load(acc + i * W);
  for (int64_t kk = 0; kk < nb; ++kk) {
    pf.step();
    const VT* vr = v + kk * vst;
    const float* pk = pt + kk * pst;
    VATTN_UNROLL
    for (int hh = 0; hh < SH; ++hh) {
      const F pb = Vec::set1(pk[hh]);
      VATTN_UNROLL
      for (int x = 0; x < VPD; ++x)
        o[hh * VPD + x] = Vec::fmadd(pb, Vec::load(vr + (hh * VPD + x) * W), o[hh * VPD + x]);
    }
  }
  VATTN_UNROLL
  for (int i = 0; i < kNv; ++i) Vec::store(acc + i * W, o[i]);
  pf_io = pf;
}

// P V of a dense chunk of HC heads (P = 1) in passes of SH heads (SH divides HC), each pass
// pv_dense over the block's V rows: SH * VPD accumulators in registers where all HC * VPD do not
// fit (Shape::pv_head_groups). Steps `pf` once per key of each pass.
template <int HC, int SH, int VPD, typename VT>
inline void pv_dense_groups(float* acc, const float* pt, const VT* v, int64_t vst, int64_t nb,
                            BlockPrefetch& pf) {
  static_assert(HC % SH == 0, "passes of whole groups");
  constexpr int64_t kHeadFloats = VPD * W;
  VATTN_UNROLL
  for (int g0 = 0; g0 < HC; g0 += SH)
    pv_dense<SH, VPD>(acc + g0 * kHeadFloats, pt + g0, HC, v + g0 * kHeadFloats, vst, nb, pf);
}

// Accumulator vectors of one pv_head pass in pv_head_all, and its passes over a block at d.
template <int P>
constexpr int pv_head_vectors() {
  return (Vec::kRegs / 2) / P >= 8 ? 8 : ((Vec::kRegs / 2) / P >= 1 ? (Vec::kRegs / 2) / P : 1);
}
template <int P>
inline int64_t pv_head_passes(int64_t d) {
  const int64_t nfull = d / W;
  return nfull / pv_head_vectors<P>() + nfull % pv_head_vectors<P>() + (d % W ? 1 : 0);
}

template <int P, typename VT>
inline void pv_head_all(float* acc, int64_t ald, int64_t d, const VT* v, int64_t vst, int64_t nb,
                        const float* pr, int64_t pst, BlockPrefetch& pf) {
  constexpr int kNv = pv_head_vectors<P>();
  const int64_t nfull = d / W;
  int64_t i = 0;
  for (; i + kNv <= nfull; i += kNv)
    pv_head<P, kNv>(acc + i * W, ald, v + i * W, vst, nb, pr, pst, 0, pf);
  for (; i < nfull; ++i) pv_head<P, 1>(acc + i * W, ald, v + i * W, vst, nb, pr, pst, 0, pf);
  if (d % W) pv_head<P, 1>(acc + nfull * W, ald, v + nfull * W, vst, nb, pr, pst, d % W, pf);
}

template <typename T>
inline const T* cache_ptr(const Operand& o, int64_t row, int64_t t, int64_t h) {
  return static_cast<const T*>(o.data) + row * o.s_batch + t * o.s_token + h * o.s_head;
}

// Heads per chunk of a decode item: the largest power of two <= heads with hc * P <= W, so that
// a tile covers whole tokens where it can. (Tiles of 4 tokens x 1 head, which reuse each q
// vector for 4 keys, measured up to 2x slower: interleaving token rows defeats the prefetchers.)
inline int64_t decode_chunk_heads(int64_t heads, int64_t p) {
  int64_t hc = 1;
  while (hc * 2 <= heads && hc * 2 * p <= W) hc *= 2;
  return hc;
}

// Writes row (query j, query head h) of the item: the output, or partial row `slot` of `part`.
inline void emit_row(const Args& a, const Shape& s, const Request& rq, int64_t j, int64_t h,
                     const float* acc, float m, float l, const PartialView* part, int64_t slot) {
  if (part) {
    part->m[slot] = m;
    part->l[slot] = l;
    std::memcpy(part->acc + slot * s.dp, acc, static_cast<size_t>(s.dp) * sizeof(float));
  } else {
    store_out_row(acc, l > 0.0f ? s.out_scale / l : 0.0f, out_row(a, rq, j, h), a.dtype,
                  a.head_dim);
  }
}

// The K and V rows of `tokens` keys from `key` on, over `kv_heads` heads from `kv_head`, of cache
// row `row` (per_step and to_l2 left to the caller).
template <class KT>
BlockPrefetch rows_prefetch(const Args& a, int64_t row, int64_t kv_head, int64_t kv_heads,
                            int64_t key, int64_t tokens) {
  const int64_t es = static_cast<int64_t>(sizeof(KT));
  BlockPrefetch p;
  p.k = reinterpret_cast<const char*>(cache_ptr<KT>(a.k_cache, row, key, kv_head));
  p.v = reinterpret_cast<const char*>(cache_ptr<KT>(a.v_cache, row, key, kv_head));
  p.kst = a.k_cache.s_token * es;
  p.vst = a.v_cache.s_token * es;
  p.run = ((kv_heads - 1) * std::max(a.k_cache.s_head, a.v_cache.s_head) + a.head_dim) * es;
  p.tokens = tokens;
  return p;
}

// The first key block of the decode item a thread will claim next (Shape::queue); tokens 0
// (nothing to prefetch) where no item is left or the next is not a decode item (prefill items
// prefetch their own blocks).
template <class KT>
BlockPrefetch next_item_first_block(const Args& a, const Shape& s) {
  const ItemQueue& q = *s.queue;
  const int64_t j = __atomic_load_n(q.next, __ATOMIC_RELAXED);
  if (j >= q.n) return BlockPrefetch{};
  const WorkItem& it = q.items[j];
  if (it.kind != ItemKind::kDecode || it.k_end <= it.k_begin) return BlockPrefetch{};
  return rows_prefetch<KT>(a, q.reqs[it.request].row, it.kv_head, it.kv_heads, it.k_begin,
                           std::min(s.block_keys, it.k_end - it.k_begin));
}

template <int P, int HC, typename KT>
void decode_item(const Args& a, const Shape& s, const Request& rq, const WorkItem& it,
                 float* scratch, const PartialView* part) {
  constexpr int kPairs = W / P;
  const int64_t d = a.head_dim, dp = s.dp, bk = s.block_keys, g = s.group;
  const int64_t nh = it.kv_heads;
  const int64_t hc = HC;
  const int64_t chunks = (nh + hc - 1) / hc;
  const int64_t kt = W / (hc * P);                 // tokens per tile
  const int64_t tpb = (bk + kt - 1) / kt;          // tiles per block (and chunk)
  const int64_t rows = chunks * hc * P;            // padded rows, head-major: h * P + r
  const int64_t nrow = (it.q_end - it.q_begin) * g;  // real rows per head, <= P
  const RowMap map{it.q_begin, g, 0};
  float* q = scratch;                              // [rows][dp]
  const int64_t ald = dp;                          // acc row stride
  float* acc = q + rows * dp;                      // [rows][ald]
  float* sc = acc + rows * ald;                    // [chunks][tpb][W]
  float* mrun = sc + chunks * tpb * W;             // [chunks][W]
  float* lrun = mrun + chunks * W;                 // [chunks][W]
  float* mblk = lrun + chunks * W;                 // [chunks][W]
  float* zero_f = mblk + chunks * W;               // [dp] zeros: a key row for padding lanes
  std::memset(zero_f, 0, static_cast<size_t>(dp) * sizeof(float));
  std::memset(acc, 0, static_cast<size_t>(rows * ald) * sizeof(float));
  const KT* zero = reinterpret_cast<const KT*>(zero_f);

  // bf16 K with a bf16 dot instruction: q stays bf16 (it is bf16: the cache's dtype is q's), in
  // rows of dq values (fits in q's area: dq * 2 bytes <= dp * 4), and the scale is applied to the
  // scores. Only where rows share a KV head (P >= 2): with one row per head, widening K to fp32
  // for the FMA tiles took 0.75 of the dot product tiles' time (bf16 GQA-1, 16 rows x 4096
  // tokens, 8 KV heads x 128, 2 threads, Zen 4), while at GQA 4 the dot products took 0.7 of it.
  constexpr bool kDotBf16 = Vec::kBf16Dot && std::is_same<KT, bf16_t>::value && P >= 2;
  const int64_t dq = round_up(d, 2 * W);
  bf16_t* qb = reinterpret_cast<bf16_t*>(q);
  const F qscale = Vec::set1(s.q_scale);

  // Dense tiles (qk_tile_dense, pv_dense) where the heads are adjacent and d is 4 or 8 vectors
  // (d 64 or 128 with AVX-512; 32 or 64 with AVX2): 0 where the general tiles run. kDense16:
  // also d = 16 vectors (128 with AVX2) for one row per head, QK^T only (16 accumulators would
  // fill AVX2's registers, so P V stays token by token). The general tile's loop over d, one
  // (token, head) pair at a time, cost as much per element in bf16 as in fp32; the unrolled tile
  // cut a bf16 GQA-1 decode call in cache by about 30% and over 4k-token rows by about 11%.
  constexpr bool kDense16 = Vec::kDenseD16 && P == 1 && !kDotBf16;
  const int64_t vpd = d / W;
  const int64_t dense_vpd = a.k_cache.s_head == d && a.v_cache.s_head == d && d % W == 0 &&
                                    nh % HC == 0 &&
                                    (vpd == 4 || vpd == 8 || (kDense16 && vpd == 16))
                                ? vpd
                                : 0;
  int32_t lo[W], hi[W], lane_lo[W], lane_hi[W], lane_key[W];
  const RowRanges rr = row_ranges(a, rq, it, map, nrow, P, lo, hi);
  // The amx variant (VATTN_AMX_TILES, amx_tiles.h): where a tile holds one token (HC P = W = 16
  // lanes: GQA 4 in chunks of 4 heads, GQA 8 in chunks of 2), bf16 q and K, dense heads, d a
  // whole number of 32-value tile steps and at least kDecodeTileMinKeys keys, the scores of a
  // block come from tile products (decode_tile_scores) instead of the vector dot products; the
  // softmax and P V are the same.
#ifdef VATTN_AMX_TILES
  constexpr bool kTileScores = std::is_same<KT, bf16_t>::value && P >= 2 && HC * P == W;
  const bool tile_scores = kTileScores && a.dtype == DType::kBFloat16 && dense_vpd != 0 &&
                           d % 32 == 0 && rr.ke - rr.kb >= kDecodeTileMinKeys;
  const TileScope tile_state(tile_scores);
  // after zero_f: q pairs ([chunks][hc][d / 2][16] words), then the partial key group's copy
  int32_t* qtile = reinterpret_cast<int32_t*>(zero_f + dp);
  int32_t* tile_pad = qtile + chunks * decode_tile_q_words(hc, d);
  if (tile_scores) {
    std::memset(qtile, 0, static_cast<size_t>(chunks * decode_tile_q_words(hc, d)) * 4);
    for (int64_t h = 0; h < nh; ++h) {  // head h's rows in its lanes (h % hc) P + r
      int32_t* qh = qtile + h * decode_tile_q_words(1, d) + (h % hc) * P;
      for (int64_t r = 0; r < nrow; ++r)
        stage_q_pairs(q_row(a, rq, map.query(r), (it.kv_head + h) * g + r % g), d, qh, 16, r);
    }
  }
#else
  constexpr bool tile_scores = false;
#endif

  for (int64_t h = 0; h < chunks * hc; ++h) {
    for (int r = 0; r < P; ++r) {
      const bool real = h < nh && r < nrow;
      const void* src = real ? q_row(a, rq, map.query(r), (it.kv_head + h) * g + r % g) : nullptr;
      if constexpr (kDotBf16) {
        bf16_t* dst = qb + (h * P + r) * dq;
        std::memset(static_cast<void*>(dst), 0, static_cast<size_t>(dq) * sizeof(bf16_t));
        if (real)
          std::memcpy(static_cast<void*>(dst), src, static_cast<size_t>(d) * sizeof(bf16_t));
      } else {
        float* dst = q + (h * P + r) * dp;
        if (real) {
          load_q_row(src, a.dtype, d, s.q_scale, dst, dp);
        } else {
          std::memset(dst, 0, static_cast<size_t>(dp) * sizeof(float));
        }
      }
    }
  }
  for (int u = 0; u < W; ++u) {
    lane_lo[u] = lo[u % P];
    lane_hi[u] = hi[u % P];
    lane_key[u] = static_cast<int32_t>(u / (hc * P));
  }
  const I vlo = Vec::iload(lane_lo), vhi = Vec::iload(lane_hi), voff = Vec::iload(lane_key);
  for (int64_t c = 0; c < chunks; ++c) {
    Vec::store(mrun + c * W, Vec::set1(-HUGE_VALF));
    Vec::store(lrun + c * W, Vec::zero());
  }

  // P = 1: P V by pv_dense, a chunk's accumulators in registers: all its heads at once where they
  // fit (half the registers), else, for fp32 caches where s.pv_head_groups, in passes of as many
  // heads as fit (pv_dense_groups); otherwise token by token (pv_token)
  constexpr int kPvRegs = Vec::kRegs / 2;
  int64_t pv_passes = 0;
  if (P == 1 && (dense_vpd == 4 || dense_vpd == 8)) {
    if (HC * dense_vpd <= kPvRegs) {
      pv_passes = 1;
    } else if (s.pv_head_groups && sizeof(KT) == 4) {
      pv_passes = HC * dense_vpd / kPvRegs;
    }
  }
  const bool pv_dense_chunks = pv_passes > 0;
  const KT* kbase = cache_ptr<KT>(a.k_cache, rq.row, 0, it.kv_head);
  const KT* vbase = cache_ptr<KT>(a.v_cache, rq.row, 0, it.kv_head);
  const int64_t kst = a.k_cache.s_token, ksh = a.k_cache.s_head;
  const int64_t vst = a.v_cache.s_token, vsh = a.v_cache.s_head;
  const F neg_inf = Vec::set1(-HUGE_VALF);
  // probabilities of (block token kk, head h): P consecutive floats, HC * P apart from one token
  // to the next (a tile holds kt = W / (HC * P) tokens)
  auto prob = [&](int64_t kk, int64_t h) {
    return sc + ((h / HC) * tpb + kk / kt) * W + ((kk % kt) * HC + h % HC) * P;
  };
  uint64_t touch = 0;
  // Scattered rows: the item's bytes of a token are at most half of a token stride, as
  // in the mega layout, where every layer of a token shares one row, so each token's run starts
  // a new stretch that the hardware prefetchers must find again. Prefetches then go to L2
  // (prefetcht1: on the Zen 4 machine one core read 1 KB runs 16 KB apart at about 7 GB/s with
  // prefetcht0, 12-13 with prefetcht1), and the first block, which no earlier block prefetches,
  // is prefetched at once before its QK^T pass. bench_attention_layouts.py, mega, 2 threads:
  // Qwen2.5-0.5B's shape 518 -> 282 us per layer (the layer layout's 284), Llama-3.2-1B's
  // 1778 -> 1092 (layer 878). Contiguous rows keep prefetcht0, 6-8% faster there. With one row
  // per head (P = 1) only scattered rows are prefetched (contiguous ones stream on their own):
  // the decode-only calls of a long-prompt capture of the fp32 GQA-1 `small` model, replayed in a
  // mega cache (bench_attention_replay.py, 2 threads, Zen 4), went from 0.97-1.01 of vLLM's op's
  // time to 0.72-0.82 (prefetcht0: 1.06-1.07; the layer layout: 0.45-0.62). On Intel cores
  // (s.prefetch_single_rows) contiguous rows of 16-bit caches are prefetched too, with
  // prefetcht0. Sapphire Rapids, 2 threads, alternated, caches that leave the CPU's caches
  // between calls (several used in turn, as a model's layers are): bf16 GQA 1 decode 1.19x-1.42x
  // the speed on seven of nine shapes, level at 16 rows x 256 tokens and at 32 KV heads x 128;
  // fp16 1.25x-1.29x; fp32 0.94x-1.17x, so it streams on its own. Over one cache that stays in
  // L3 from call to call, bf16 went 0.90x-1.06x: a benchmark's loop, not a model
  // (docs/benchmarks.md, "Intel (SPR, AMX): where the prefetches help").
  const int64_t es = static_cast<int64_t>(sizeof(KT));
  const int64_t run = ((nh - 1) * std::max(ksh, vsh) + d) * es;
  const bool scattered = kst * es >= 2 * run || vst * es >= 2 * run;
  const bool prefetch_rows = P >= 2 || scattered || (s.prefetch_single_rows && es == 2);
  const int64_t lines_per_token = (run + 63) / 64;
  // The K and V rows of `tokens` keys from `key` on (per_step left to the caller)
  auto prefetch_from = [&](int64_t key, int64_t tokens) {
    BlockPrefetch p = rows_prefetch<KT>(a, rq.row, it.kv_head, nh, key, tokens);
    p.to_l2 = scattered;
    return p;
  };
  if (scattered) {
    BlockPrefetch first = prefetch_from(rr.kb, std::min(bk, rr.ke - rr.kb));
    first.per_step = first.tokens * lines_per_token;  // all of it in one step
    first.step();
  }
  for (int64_t c0 = rr.kb; c0 < rr.ke; c0 += bk) {
    const int64_t nb = std::min(bk, rr.ke - c0);
    const int64_t tiles = (nb + kt - 1) / kt;
    for (int64_t c = 0; c < chunks; ++c) Vec::store(mblk + c * W, neg_inf);
    // prefetch_rows: the next block's K and V rows, prefetched over this block's QK^T tiles and
    // P V passes (the first block's are read as the QK^T pass goes, K by its tiles and V touched,
    // or prefetched at once where scattered). On the item's last block, over contiguous rows, the
    // first block of the decode item claimed next instead (whichever thread runs it), which
    // would otherwise start on rows the hardware prefetchers have yet to find. Zen 5, 16 / 4 x 64
    // bf16 decode over eight layers of 64 KB pages (the vLLM plugin's), 16 rows, 2 threads,
    // alternated in one process: 1.08x-1.21x the speed at 150-300 tokens a row, 1.05x at
    // 600-1500, 0.96x-1.01x at GQA 2, 0.98x-1.07x at 32 / 8 x 128 (docs/benchmarks.md, "Zen 5:
    // the next item's first block"). Not in the Intel tuning (Shape::prefetch_next_item says
    // why). Scattered rows keep their own first-block prefetch alone.
    BlockPrefetch pf;
    const int64_t next = std::min(bk, rr.ke - (c0 + nb));
    if (prefetch_rows && next > 0) {
      pf = prefetch_from(c0 + nb, next);
    } else if (prefetch_rows && !scattered && s.prefetch_next_item && s.queue != nullptr) {
      pf = next_item_first_block<KT>(a, s);
    }
    if (pf.tokens > 0) {
      const int64_t lines = pf.tokens * ((pf.run + 63) / 64);
      // pf.step() calls: one per QK^T tile and chunk, and one per key of each P V pass (P = 1:
      // pv_dense per chunk, or the token-by-token loop)
      const int64_t pv_steps = P >= 2 ? nh * pv_head_passes<P>(d) * nb
                                      : (pv_dense_chunks ? chunks * pv_passes * nb : nb);
      const int64_t steps = tiles * chunks + pv_steps;
      pf.per_step = (lines + steps - 1) / steps;
    }
#ifdef VATTN_AMX_TILES
    if (tile_scores) {
      for (int64_t c = 0; c < chunks; ++c) {
        decode_tile_scores(qtile + c * decode_tile_q_words(hc, d), hc,
                           reinterpret_cast<const bf16_t*>(kbase + c0 * kst + c * HC * d), kst, d,
                           nb, tile_pad, sc + c * tpb * W);
      }
    }
#endif
    // QK^T, token by token (all chunks of heads of a tile's tokens before the next tile)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t key0 = c0 + t * kt;
      const bool mask = key0 < rr.max_lo || key0 + kt > rr.min_hi;
      // P >= 2, first block: this tile's V rows, read in address order for the head-major P V
      // pass below (never past the range's end)
      if (P >= 2 && c0 == rr.kb) {
        for (int64_t key = key0; key < std::min(rr.ke, key0 + kt); ++key)
          touch = touch_token(vbase + key * vst, nh, vsh, d, touch);
      }
      const bool full_tile = dense_vpd && key0 + kt <= rr.ke;
      for (int64_t c = 0; c < chunks; ++c) {
        pf.step();
        F sv;
        if (tile_scores) {  // the tile products' scores, unscaled (kt == 1: token t)
          sv = Vec::mul(Vec::load(sc + (c * tpb + t) * W), qscale);
        } else if (full_tile) {
          const KT* kc = kbase + key0 * kst + c * HC * d;
          if constexpr (kDotBf16) {
            // dq == d: d is 4 or 8 vectors of fp32, so a whole number of bf16 dot steps
            const bf16_t* qc = qb + c * HC * P * d;
            sv = Vec::mul(dense_vpd == 4 ? qk_tile_dense_bf16<P, HC, 2>(qc, kc, kst)
                                         : qk_tile_dense_bf16<P, HC, 4>(qc, kc, kst),
                          qscale);
          } else {
            const float* qc = q + c * HC * P * d;
            if (dense_vpd == 4) {
              sv = qk_tile_dense<P, HC, 4>(qc, kc, kst);
            } else if (kDense16 && dense_vpd == 16) {
              sv = qk_tile_dense<P, HC, kDense16 ? 16 : 8>(qc, kc, kst);  // 16 only if enabled
            } else {
              sv = qk_tile_dense<P, HC, 8>(qc, kc, kst);
            }
          }
        } else {
          const KT* krows[kPairs];
          for (int j = 0; j < kPairs; ++j) {
            const int64_t key = key0 + j / HC, h = c * HC + j % HC;
            krows[j] = key < rr.ke && h < nh ? kbase + key * kst + h * ksh : zero;
          }
          if constexpr (kDotBf16) {
            const bf16_t* qrows[HC];
            for (int hh = 0; hh < HC; ++hh) qrows[hh] = qb + (c * HC + hh) * P * dq;
            sv = Vec::mul(qk_tile_bf16<P, HC>(qrows, krows, dq, d), qscale);
          } else {
            const float* qrows[HC];
            for (int hh = 0; hh < HC; ++hh) qrows[hh] = q + (c * HC + hh) * P * dp;
            sv = qk_tile<P, HC>(qrows, krows, dp, d);
          }
        }
        if (mask)
          sv = Vec::mask_range(sv, Vec::iadd(Vec::iset1(static_cast<int32_t>(key0)), voff), vlo,
                               vhi);
        Vec::store(sc + (c * tpb + t) * W, sv);
        Vec::store(mblk + c * W, Vec::max(Vec::load(mblk + c * W), sv));
      }
    }
    // online softmax, per chunk: lanes with the same (head, row) sit hc * P apart
    for (int64_t c = 0; c < chunks; ++c) {
      F mb = Vec::load(mblk + c * W);
      for (int64_t sh = hc * P; sh < W; sh *= 2)
        mb = Vec::max(mb, Vec::rotate(mb, static_cast<int>(sh)));
      const F m_old = Vec::load(mrun + c * W);
      const F m_new = Vec::max(m_old, mb);
      const F m_safe = Vec::replace_neginf(m_new, 0.0f);
      const F alpha = Vec::exp2(Vec::sub(m_old, m_safe));
      F lsum = Vec::zero();
      for (int64_t t = 0; t < tiles; ++t) {
        float* st = sc + (c * tpb + t) * W;
        const F pr = Vec::exp2(Vec::sub(Vec::load(st), m_safe));
        Vec::store(st, pr);
        lsum = Vec::add(lsum, pr);
      }
      Vec::store(lrun + c * W, Vec::fmadd(Vec::load(lrun + c * W), alpha, lsum));
      Vec::store(mrun + c * W, m_new);
      if (!Vec::all_equal(alpha, Vec::set1(1.0f))) {
        float al[W];
        Vec::store(al, alpha);
        for (int64_t u = 0; u < hc * P; ++u) {  // lanes of token 0: (head, row) = u
          float* ar = acc + (c * hc * P + u) * ald;
          const F f = Vec::set1(al[u]);
          for (int64_t x = 0; x < dp; x += W) Vec::store(ar + x, Vec::mul(Vec::load(ar + x), f));
        }
      }
    }
    if (P >= 2) {
      // head by head, acc in registers for the block: V rows come from cache
      for (int64_t h = 0; h < nh; ++h) {
        pv_head_all<P>(acc + h * P * ald, ald, d, vbase + c0 * vst + h * vsh, vst, nb, prob(0, h),
                       HC * P, pf);
      }
    } else if (pv_dense_chunks) {
      // a chunk's accumulators in registers: V read in one pass where they all fit, else in
      // passes of as many heads as fit (pv_passes). The passes against the token-by-token loop:
      // on the Zen 4 machine, 8 heads x 128 at 2 threads, 1.3-1.5x the time in fp32 and 1.1x in
      // bf16; on Sapphire Rapids, fp32 caches read in turn as a model's layers are (8-16 rows x
      // 512-2048 tokens, 1 and 2 threads), 1.08x-1.32x the speed over five shapes of 8-32 heads
      // x 64 and 128 (the mega layout 1.04x), bf16 and fp16 0.93x-1.06x. Hence fp32 only, where
      // s.pv_head_groups (Intel cores).
      for (int64_t c = 0; c < chunks; ++c) {
        float* ac = acc + c * HC * d;
        const float* pt = sc + c * tpb * W;  // P = 1: token kk's HC probabilities at kk * HC
        const KT* vc = vbase + c0 * vst + c * HC * d;
        if (dense_vpd == 4) {
          pv_dense_groups<HC, std::min(HC, kPvRegs / 4), 4>(ac, pt, vc, vst, nb, pf);
        } else {
          pv_dense_groups<HC, std::max(1, std::min(HC, kPvRegs / 8)), 8>(ac, pt, vc, vst, nb, pf);
        }
      }
    } else {
      // one row per head: token by token, all heads of a token before the next, so V is read as
      // one stream the hardware prefetchers follow (two tokens at a time measured ~40% slower)
      for (int64_t kk = 0; kk < nb; ++kk) {
        pf.step();
        const KT* vrow = vbase + (c0 + kk) * vst;
        for (int64_t h = 0; h < nh; ++h)
          pv_token<P>(acc + h * P * ald, ald, d, prob(kk, h), vrow + h * vsh);
      }
    }
  }
  asm volatile("" : : "r"(touch));
  for (int64_t c = 0; c < chunks; ++c) {
    F l = Vec::load(lrun + c * W);
    for (int64_t sh = hc * P; sh < W; sh *= 2)
      l = Vec::add(l, Vec::rotate(l, static_cast<int>(sh)));
    Vec::store(lrun + c * W, l);
  }
  for (int64_t h = 0; h < nh; ++h) {
    const float* ml = mrun + (h / hc) * W + (h % hc) * P;
    const float* ll = lrun + (h / hc) * W + (h % hc) * P;
    for (int64_t r = 0; r < nrow; ++r) {
      emit_row(a, s, rq, map.query(r), (it.kv_head + h) * g + r % g, acc + (h * P + r) * ald, ml[r],
               ll[r], part, h * nrow + r);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Prefill kernel.

// S[kc][rv0*W + ...] = sum_d k[kc][d] * Qt[d][...] for KC keys and NV row vectors, in `steps`
// steps of d. fp32 (DOT false): Qt is fp32 [d][rp] (pre-scaled), k fp32, one value of d per FMA.
// bf16 (DOT true): Qt is [d / 2][rp] pairs of bf16 q values (unscaled) in 32-bit lanes, k the
// cache's bf16 rows as they are, two values of d per bf16 dot product, and the scores are scaled
// on the way out.
template <int KC, int NV, bool DOT>
inline void qk_micro(const float* qt, int64_t rp, int64_t steps, const void* kp, int64_t kld,
                     float* sc, int64_t rv0, F scale) {
  F acc[KC][NV];
  VATTN_UNROLL
  for (int c = 0; c < KC; ++c) {
    VATTN_UNROLL
    for (int v = 0; v < NV; ++v) acc[c][v] = Vec::zero();
  }
  const float* qp = qt + rv0 * W;
  for (int64_t x = 0; x < steps; ++x) {
    if constexpr (DOT) {
      const bf16_t* k = static_cast<const bf16_t*>(kp);
      I qv[NV];
      VATTN_UNROLL
      for (int v = 0; v < NV; ++v)
        qv[v] = Vec::iload(reinterpret_cast<const int32_t*>(qp + x * rp + v * W));
      VATTN_UNROLL
      for (int c = 0; c < KC; ++c) {
        int32_t pair;
        std::memcpy(&pair, k + c * kld + 2 * x, sizeof(pair));
        const I kb = Vec::iset1(pair);
        VATTN_UNROLL
        for (int v = 0; v < NV; ++v) acc[c][v] = Vec::dot_bf16_pairs(acc[c][v], qv[v], kb);
      }
    } else {
      const float* k = static_cast<const float*>(kp);
      F qv[NV];
      VATTN_UNROLL
      for (int v = 0; v < NV; ++v) qv[v] = Vec::load(qp + x * rp + v * W);
      VATTN_UNROLL
      for (int c = 0; c < KC; ++c) {
        const F kb = Vec::set1(k[c * kld + x]);
        VATTN_UNROLL
        for (int v = 0; v < NV; ++v) acc[c][v] = Vec::fmadd(kb, qv[v], acc[c][v]);
      }
    }
  }
  VATTN_UNROLL
  for (int c = 0; c < KC; ++c) {
    VATTN_UNROLL
    for (int v = 0; v < NV; ++v)
      Vec::store(sc + c * rp + (rv0 + v) * W, DOT ? Vec::mul(acc[c][v], scale) : acc[c][v]);
  }
}

template <int NV, bool DOT>
inline void qk_rows(const float* qt, int64_t rp, int64_t steps, const void* k, int64_t kld,
                    float* sc, int64_t rv0, int64_t nb, F scale) {
  using KT = typename std::conditional<DOT, bf16_t, float>::type;
  const KT* kt = static_cast<const KT*>(k);
  // KC x NV accumulators, NV q vectors and a broadcast in the registers (KC 6 with AVX-512 at
  // NV 4: 10 loads per 24 FMAs, where KC 4 took 8 per 16)
  constexpr int kFit = (Vec::kRegs - NV - 2) / NV;
  constexpr int kKc = kFit >= 8 ? 8 : (kFit >= 2 ? kFit : 1);
  int64_t c = 0;
  for (; c + kKc <= nb; c += kKc)
    qk_micro<kKc, NV, DOT>(qt, rp, steps, kt + c * kld, kld, sc + c * rp, rv0, scale);
  // the block's last keys (64 = 10 x 6 + 4) in 4s and 2s: one key at a time loads NV + 1
  // values per NV FMAs
  if constexpr (kKc > 4) {
    for (; c + 4 <= nb; c += 4)
      qk_micro<4, NV, DOT>(qt, rp, steps, kt + c * kld, kld, sc + c * rp, rv0, scale);
  }
  if constexpr (kKc > 2) {
    for (; c + 2 <= nb; c += 2)
      qk_micro<2, NV, DOT>(qt, rp, steps, kt + c * kld, kld, sc + c * rp, rv0, scale);
  }
  for (; c < nb; ++c)
    qk_micro<1, NV, DOT>(qt, rp, steps, kt + c * kld, kld, sc + c * rp, rv0, scale);
}

template <bool DOT>
inline void qk_block(const float* qt, int64_t rp, int64_t steps, const void* k, int64_t kld,
                     float* sc, int64_t nb, F scale) {
  constexpr int kNv = Vec::kRegs >= 32 ? 4 : 2;
  const int64_t rv = rp / W;
  int64_t v = 0;
  for (; v + kNv <= rv; v += kNv) qk_rows<kNv, DOT>(qt, rp, steps, k, kld, sc, v, nb, scale);
  for (; v + 2 <= rv && kNv > 2; v += 2) qk_rows<2, DOT>(qt, rp, steps, k, kld, sc, v, nb, scale);
  for (; v < rv; ++v) qk_rows<1, DOT>(qt, rp, steps, k, kld, sc, v, nb, scale);
}

// O[r0 + r][x0 + i*W ...] += sum_kc P[kc][r0 + r] * v[kc][x0 + i*W ...] for RO rows, NV vectors.
template <int RO, int NV>
inline void pv_micro(float* o, int64_t dp, const float* pt, int64_t rp, const float* v, int64_t vld,
                     int64_t nb) {
  F acc[RO][NV];
  VATTN_UNROLL
  for (int r = 0; r < RO; ++r) {
    VATTN_UNROLL
    for (int i = 0; i < NV; ++i) acc[r][i] = Vec::load(o + r * dp + i * W);
  }
  for (int64_t kc = 0; kc < nb; ++kc) {
    F vv[NV];
    VATTN_UNROLL
    for (int i = 0; i < NV; ++i) vv[i] = Vec::load(v + kc * vld + i * W);
    VATTN_UNROLL
    for (int r = 0; r < RO; ++r) {
      const F pb = Vec::set1(pt[kc * rp + r]);
      VATTN_UNROLL
      for (int i = 0; i < NV; ++i) acc[r][i] = Vec::fmadd(pb, vv[i], acc[r][i]);
    }
  }
  VATTN_UNROLL
  for (int r = 0; r < RO; ++r) {
    VATTN_UNROLL
    for (int i = 0; i < NV; ++i) Vec::store(o + r * dp + i * W, acc[r][i]);
  }
}

inline void pv_block_rows(float* o, int64_t dp, const float* pt, int64_t rp, const float* v,
                          int64_t vld, int64_t nb, int64_t rows) {
  constexpr int kRo = 4;
  constexpr int kNv = Vec::kRegs >= 32 ? 4 : 2;
  const int64_t nvec = dp / W;
  int64_t r0 = 0;
  if (Vec::kRegs >= 32 && nvec % kNv == 0) {
    // d a whole number of 4-vector tiles (64, 128 with AVX-512): 6 rows x 4 vectors, 10 loads
    // per 24 FMAs where 4 x 4 takes 8 per 16 (2048-token prompts, 32 / 8 heads x 128, fp32:
    // 334 -> 368 GFLOP/s on this project's 2-core Zen 5), in pairs so that what is left (rows is
    // a multiple of W) is a multiple of kRo for the loop below
    for (; r0 + 12 <= rows; r0 += 12) {
      for (int64_t i = 0; i < nvec; i += kNv) {
        pv_micro<6, kNv>(o + r0 * dp + i * W, dp, pt + r0, rp, v + i * W, vld, nb);
        pv_micro<6, kNv>(o + (r0 + 6) * dp + i * W, dp, pt + r0 + 6, rp, v + i * W, vld, nb);
      }
    }
  }
  for (int64_t r = r0; r < rows; r += kRo) {
    int64_t i = 0;
    for (; i + kNv <= nvec; i += kNv)
      pv_micro<kRo, kNv>(o + r * dp + i * W, dp, pt + r, rp, v + i * W, vld, nb);
    for (; i + 2 <= nvec && kNv > 2; i += 2)
      pv_micro<kRo, 2>(o + r * dp + i * W, dp, pt + r, rp, v + i * W, vld, nb);
    for (; i < nvec; ++i) pv_micro<kRo, 1>(o + r * dp + i * W, dp, pt + r, rp, v + i * W, vld, nb);
  }
}

template <typename KT>
inline void convert_rows(const KT* src, int64_t st, int64_t nb, int64_t d, float* dst, int64_t dp) {
  for (int64_t kc = 0; kc < nb; ++kc) row_to_f32(src + kc * st, d, 1.0f, dst + kc * dp, dp);
}

// Scratch of a prefill or shared item (rp padded rows).
struct RowsScratch {
  float *qt, *sc, *o, *kf, *vf, *m, *l, *alpha;
  int32_t *lo, *hi;
  RowsScratch(float* scratch, int64_t d, int64_t rp, int64_t bk, int64_t dp) {
    qt = scratch;     // [d][rp]
    sc = qt + d * rp;  // [bk][rp]
    o = sc + bk * rp;  // [rp][dp]
    kf = o + rp * dp;  // [bk][dp]
    vf = kf + bk * dp;  // [bk][dp]
    m = vf + bk * dp;  // [rp]
    l = m + rp;        // [rp]
    alpha = l + rp;    // [rp]
    lo = reinterpret_cast<int32_t*>(alpha + rp);  // [rp]
    hi = lo + rp;                                 // [rp]
  }
};

// Whether QK^T of a prefill or shared item takes the bf16 dot product (Vec::kBf16Dot): bf16 q and
// K as they are, two values of d per instruction where the FMAs take one, and no K conversion;
// d even, so that K's pairs never reach past a row. P V stays fp32 (see decode_item).
template <typename KT>
inline bool rows_dot_bf16(const Args& a) {
  return Vec::kBf16Dot && std::is_same<KT, bf16_t>::value && a.dtype == DType::kBFloat16 &&
         a.head_dim % 2 == 0;
}

// Stages row r's q (src, in a.dtype) for attend_rows: fp32 and scaled into w.o, or with the bf16
// dot product (dot) as they are, in pairs, straight into its column of Qt.
inline void stage_q_row(const Args& a, const Shape& s, const RowsScratch& w, int64_t rp, int64_t r,
                        const void* src, bool dot) {
  if (dot) {
    stage_q_pairs(src, a.head_dim, reinterpret_cast<int32_t*>(w.qt), rp, r);
  } else {
    load_q_row(src, a.dtype, a.head_dim, s.q_scale, w.o + r * s.dp, s.dp);
  }
}

// The rows' online softmax over keys [rr.kb, rr.ke) of one KV head (K and V rows at kbase,
// vbase, s_token apart). On entry the n real q rows are staged (stage_q_row) and w.lo / w.hi
// hold every padded row's visible range; on return w.o, w.m, w.l hold each row's unnormalized
// output, running max and sum.
template <typename KT>
void attend_rows(const Args& a, const Shape& s, const KT* kbase, const KT* vbase,
                 const RowsScratch& w, const RowRanges& rr, int64_t n, int64_t rp) {
  const int64_t d = a.head_dim, dp = s.dp, bk = s.block_keys;
  float *qt = w.qt, *sc = w.sc, *o = w.o, *m = w.m, *l = w.l, *alpha = w.alpha;
  const bool dot = rows_dot_bf16<KT>(a);
  if (dot) {
    int32_t* qt2 = reinterpret_cast<int32_t*>(qt);
    for (int64_t x = 0; x < d / 2; ++x)
      for (int64_t r = n; r < rp; ++r) qt2[x * rp + r] = 0;
  } else {
    for (int64_t r = n; r < rp; ++r)
      std::memset(o + r * dp, 0, static_cast<size_t>(dp) * sizeof(float));
    for (int64_t r = 0; r < rp; ++r)
      for (int64_t x = 0; x < d; ++x) qt[x * rp + r] = o[r * dp + x];
  }
  std::memset(o, 0, static_cast<size_t>(rp * dp) * sizeof(float));
  for (int64_t r = 0; r < rp; ++r) {
    m[r] = -HUGE_VALF;
    l[r] = 0.0f;
  }
  const F qscale = Vec::set1(s.q_scale);

  const int64_t kst = a.k_cache.s_token, vst = a.v_cache.s_token;
  constexpr bool kF32 = std::is_same<KT, float>::value;
  const bool v_direct = kF32 && d % W == 0;
  for (int64_t c0 = rr.kb; c0 < rr.ke; c0 += bk) {
    const int64_t nb = std::min(bk, rr.ke - c0);
    // fp32 caches, except on Intel cores (s.prefetch_prefill_blocks): the next block's K and V rows
    // go to L2 at once, before this block's work. The micro-kernels read them straight from the
    // cache, one head's row per token (a token stride apart, each row in another 4 KB page, where
    // the hardware prefetchers stop), so without this a block began with its rows' misses on Zen 4
    // (builds alternated, 2 threads): a 2048-token prompt at 32 / 8 heads x 128 took 183-199 ->
    // 176-185 ms, 512 keys after 1536 cached 80-86 -> 76-79 ms (one thread, the prompt: 364-388 ->
    // 353-357 ms), 1024 after 2048 cached at 8 / 8 x 64 28-34 -> 28-29 ms, a 1024-token prompt at
    // 8 / 8 x 64 the same. On Intel's Sapphire Rapids the same prefetches made calls slower (one
    // thread, alternated, six shapes: without them min times 1.02x-1.15x faster, medians
    // 0.96x-1.15x; spread over the block's micro-kernels, in between). The prefetches alone, every
    // phase skipped, took a tenth of a call's time there: likely a burst of a thousand prefetches
    // that the core cannot keep in flight stalls it (no counters to confirm). bf16 caches were 1-5%
    // slower with it on Zen 4 too (half the bytes per block; V is read once anyway, to be widened),
    // so they go without.
    if (kF32 && s.prefetch_prefill_blocks && c0 + nb < rr.ke) {
      BlockPrefetch next;
      next.k = reinterpret_cast<const char*>(kbase + (c0 + nb) * kst);
      next.v = reinterpret_cast<const char*>(vbase + (c0 + nb) * vst);
      next.kst = kst * static_cast<int64_t>(sizeof(KT));
      next.vst = vst * static_cast<int64_t>(sizeof(KT));
      next.run = d * static_cast<int64_t>(sizeof(KT));
      next.tokens = std::min(bk, rr.ke - c0 - nb);
      next.per_step = next.tokens * ((next.run + 63) / 64);  // all of it in one step
      next.to_l2 = true;
      next.step();
    }
    if constexpr (kF32) {
      qk_block<false>(qt, rp, d, kbase + c0 * kst, kst, sc, nb, qscale);
    } else if (dot) {  // KT is bf16_t here
      qk_block<true>(qt, rp, d / 2, kbase + c0 * kst, kst, sc, nb, qscale);
    } else {
      convert_rows(kbase + c0 * kst, kst, nb, d, w.kf, dp);
      qk_block<false>(qt, rp, d, w.kf, dp, sc, nb, qscale);
    }
    if (c0 < rr.max_lo || c0 + nb > rr.min_hi) {
      for (int64_t kc = 0; kc < nb; ++kc) {
        const I key = Vec::iset1(static_cast<int32_t>(c0 + kc));
        for (int64_t v = 0; v < rp; v += W) {
          Vec::store(sc + kc * rp + v, Vec::mask_range(Vec::load(sc + kc * rp + v), key,
                                                       Vec::iload(w.lo + v), Vec::iload(w.hi + v)));
        }
      }
    }
    bool rescale = false;
    for (int64_t v = 0; v < rp; v += W) {
      F mb = Vec::set1(-HUGE_VALF);
      for (int64_t kc = 0; kc < nb; ++kc) mb = Vec::max(mb, Vec::load(sc + kc * rp + v));
      const F m_old = Vec::load(m + v);
      const F m_new = Vec::max(m_old, mb);
      const F m_safe = Vec::replace_neginf(m_new, 0.0f);
      const F al = Vec::exp2(Vec::sub(m_old, m_safe));
      F lsum = Vec::zero();
      for (int64_t kc = 0; kc < nb; ++kc) {
        const F p = Vec::exp2(Vec::sub(Vec::load(sc + kc * rp + v), m_safe));
        Vec::store(sc + kc * rp + v, p);
        lsum = Vec::add(lsum, p);
      }
      Vec::store(l + v, Vec::fmadd(Vec::load(l + v), al, lsum));
      Vec::store(m + v, m_new);
      Vec::store(alpha + v, al);
      rescale = rescale || !Vec::all_equal(al, Vec::set1(1.0f));
    }
    if (rescale) {
      for (int64_t r = 0; r < rp; ++r) {
        if (alpha[r] == 1.0f) continue;
        const F ar = Vec::set1(alpha[r]);
        for (int64_t x = 0; x < dp; x += W)
          Vec::store(o + r * dp + x, Vec::mul(Vec::load(o + r * dp + x), ar));
      }
    }
    const float* v;
    int64_t vld;
    if (v_direct) {
      v = reinterpret_cast<const float*>(vbase + c0 * vst);  // KT is float here
      vld = vst;
    } else {
      convert_rows(vbase + c0 * vst, vst, nb, d, w.vf, dp);
      v = w.vf;
      vld = dp;
    }
    pv_block_rows(o, dp, sc, rp, v, vld, nb, rp);
  }
}

template <typename KT>
void prefill_item(const Args& a, const Shape& s, const Request& rq, const WorkItem& it,
                  float* scratch, const PartialView* part) {
  const int64_t d = a.head_dim, dp = s.dp;
  const RowMap map{it.q_begin, s.group, it.kv_head};
  const int64_t n = (it.q_end - it.q_begin) * s.group;
  const int64_t rp = round_up(n, W);
  const RowsScratch w(scratch, d, rp, s.block_keys, dp);
  const RowRanges rr = row_ranges(a, rq, it, map, n, rp, w.lo, w.hi);
  const bool dot = rows_dot_bf16<KT>(a);
  for (int64_t r = 0; r < n; ++r)
    stage_q_row(a, s, w, rp, r, q_row(a, rq, map.query(r), map.head(r)), dot);
  attend_rows(a, s, cache_ptr<KT>(a.k_cache, rq.row, 0, it.kv_head),
              cache_ptr<KT>(a.v_cache, rq.row, 0, it.kv_head), w, rr, n, rp);
  for (int64_t r = 0; r < n; ++r)
    emit_row(a, s, rq, map.query(r), map.head(r), w.o + r * dp, w.m[r], w.l[r], part, r);
}

// A shared prefix: every row sees all of [k_begin, k_end) (the planner checked), read from the
// row of `rq`; each row's partial result goes where its SharedRow points.
template <typename KT>
void shared_item(const Args& a, const Shape& s, const Request& rq, const WorkItem& it,
                 float* scratch) {
  const int64_t d = a.head_dim, dp = s.dp, n = it.num_rows;
  const int64_t rp = round_up(n, W);
  const RowsScratch w(scratch, d, rp, s.block_keys, dp);
  for (int64_t r = 0; r < rp; ++r) {
    w.lo[r] = static_cast<int32_t>(it.k_begin);
    w.hi[r] = static_cast<int32_t>(it.k_end);
  }
  RowRanges rr;
  rr.kb = rr.max_lo = it.k_begin;
  rr.ke = rr.min_hi = it.k_end;
  const bool dot = rows_dot_bf16<KT>(a);
  for (int64_t r = 0; r < n; ++r) stage_q_row(a, s, w, rp, r, it.rows[r].q, dot);
  attend_rows(a, s, cache_ptr<KT>(a.k_cache, rq.row, 0, it.kv_head),
              cache_ptr<KT>(a.v_cache, rq.row, 0, it.kv_head), w, rr, n, rp);
  for (int64_t r = 0; r < n; ++r) {
    const SharedRow& row = it.rows[r];
    *row.m = w.m[r];
    *row.l = w.l[r];
    std::memcpy(row.acc, w.o + r * dp, static_cast<size_t>(dp) * sizeof(float));
  }
}

// ------------------------------------------------------------------------------------------------
// Entry points.

template <int P, int HC, typename KT>
inline void decode_dispatch(const Args& a, const Shape& s, const Request& rq, const WorkItem& it,
                            float* scratch, const PartialView* part) {
  if constexpr (HC * P <= W) decode_item<P, HC, KT>(a, s, rq, it, scratch, part);
}

template <typename KT>
void run_item_typed(const Args& a, const Shape& s, const Request& rq, const WorkItem& it,
                    float* scratch, const PartialView* part) {
  if (it.kind == ItemKind::kPrefill) return prefill_item<KT>(a, s, rq, it, scratch, part);
  if (it.kind == ItemKind::kShared) return shared_item<KT>(a, s, rq, it, scratch);
  const int64_t rows = (it.q_end - it.q_begin) * s.group;
  const int64_t p = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
  switch (p * 100 + decode_chunk_heads(it.kv_heads, p)) {
    case 101: return decode_dispatch<1, 1, KT>(a, s, rq, it, scratch, part);
    case 102: return decode_dispatch<1, 2, KT>(a, s, rq, it, scratch, part);
    case 104: return decode_dispatch<1, 4, KT>(a, s, rq, it, scratch, part);
    case 108: return decode_dispatch<1, 8, KT>(a, s, rq, it, scratch, part);
    case 116: return decode_dispatch<1, 16, KT>(a, s, rq, it, scratch, part);
    case 201: return decode_dispatch<2, 1, KT>(a, s, rq, it, scratch, part);
    case 202: return decode_dispatch<2, 2, KT>(a, s, rq, it, scratch, part);
    case 204: return decode_dispatch<2, 4, KT>(a, s, rq, it, scratch, part);
    case 208: return decode_dispatch<2, 8, KT>(a, s, rq, it, scratch, part);
    case 401: return decode_dispatch<4, 1, KT>(a, s, rq, it, scratch, part);
    case 402: return decode_dispatch<4, 2, KT>(a, s, rq, it, scratch, part);
    case 404: return decode_dispatch<4, 4, KT>(a, s, rq, it, scratch, part);
    case 801: return decode_dispatch<8, 1, KT>(a, s, rq, it, scratch, part);
    default: return decode_dispatch<8, 2, KT>(a, s, rq, it, scratch, part);
  }
}

inline void run_item(const Args& a, const Shape& s, const Request& rq, const WorkItem& it,
                     float* scratch, const PartialView* part) {
  switch (a.cache_dtype) {
    case DType::kBFloat16: return run_item_typed<bf16_t>(a, s, rq, it, scratch, part);
    case DType::kFloat16: return run_item_typed<f16_t>(a, s, rq, it, scratch, part);
    case DType::kFloat8E4M3: return run_item_typed<e4m3_t>(a, s, rq, it, scratch, part);
    case DType::kFloat8E5M2: return run_item_typed<e5m2_t>(a, s, rq, it, scratch, part);
    default: return run_item_typed<float>(a, s, rq, it, scratch, part);
  }
}

inline int64_t decode_scratch_floats(int64_t nh, int64_t p, int64_t dp, int64_t bk) {
  const int64_t hc = decode_chunk_heads(nh, p), chunks = (nh + hc - 1) / hc, kt = W / (hc * p);
  const int64_t rows = chunks * hc * p, tpb = (bk + kt - 1) / kt;
  int64_t tile = 0;  // decode_item's tile scores (amx): q pairs and a partial key group
#ifdef VATTN_AMX_TILES
  tile = chunks * decode_tile_q_words(hc, dp) + decode_tile_pad_words(dp);
#endif
  return 2 * rows * dp + chunks * tpb * W + 3 * chunks * W + dp + tile;
}

// Floats of scratch one thread needs for any item of this call.
inline int64_t scratch_floats(const Args& a, const Shape& s) {
  const int64_t dp = s.dp, bk = s.block_keys, d = a.head_dim;
  int64_t decode = 0;
  for (int64_t p = 1; p <= kMaxDecodeRows; p *= 2) {
    decode = std::max(decode, decode_scratch_floats(a.num_kv_heads, p, dp, bk));
  }
  const int64_t rp = round_up(std::max<int64_t>(s.prefill_rows, s.group), W);
  const int64_t prefill = d * rp + bk * rp + rp * dp + 2 * bk * dp + 5 * rp + 64;
  return std::max(decode, prefill);
}

inline int64_t prefill_rows(const Args&) { return kPrefillRows; }

inline KernelTable table(const char* name) {
  return KernelTable{name, W, &run_item, &scratch_floats, &prefill_rows};
}
