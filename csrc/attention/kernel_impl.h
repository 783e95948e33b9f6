// The attention kernels, written once over a vector type `Vec` (vec_avx512.h, vec_avx2.h,
// vec_generic.h). A fragment: each isa_*.cpp includes it inside its own namespace after its Vec,
// so every function here is compiled once per instruction set, with distinct symbols (an inline
// function shared between the ISA files would let the linker keep an AVX-512 copy for all).
//
// Two kernels, both flash-attention style (online softmax over blocks of keys, fp32 accumulation,
// scores in base 2: q is pre-scaled by softmax_scale * log2(e), so exp becomes exp2):
//
// - decode_item<P>: rows = queries x group heads <= 8, padded to P in {1, 2, 4, 8}. Vectors run
//   along head_dim: a tile of W/P keys x P rows makes W dot products, reduced together into one
//   vector of W scores (Vec::reduce). K and V rows are read straight from the cache, once per
//   item (so once per GQA group), in order: this kernel is bound by memory bandwidth.
// - prefill_item: up to 64 rows. q is packed transposed (Qt[d][row]) once per item, so vectors
//   run along rows: S^T[key][row] = sum_d K[key][d] * Qt[d][row] is a register-blocked
//   micro-kernel (KC keys x NV row vectors per step of d, K broadcast), the softmax is vertical
//   (row max = max over keys, no horizontal reduction), and O[row][d] += P^T[key][row] * V[key][d]
//   is a second micro-kernel (RO rows x NV vectors of d). Non-fp32 caches are converted block by
//   block into fp32 scratch (once per block, amortized over all rows).
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

constexpr int64_t kPrefetchKeys = 16;  // how far ahead the decode kernel fetches K rows

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

inline const void* q_row(const Args& a, const Request& rq, int64_t j, int64_t h) {
  const size_t esize = a.dtype == DType::kFloat32 ? 4 : 2;
  const int64_t off = rq.index * a.q.s_batch + (rq.q_start + j) * a.q.s_token + h * a.q.s_head;
  return static_cast<const char*>(a.q.data) + off * static_cast<int64_t>(esize);
}

inline void* out_row(const Args& a, const Request& rq, int64_t j, int64_t h) {
  const size_t esize = a.dtype == DType::kFloat32 ? 4 : 2;
  const int64_t off = rq.index * a.out.s_batch + (rq.q_start + j) * a.out.s_token + h * a.out.s_head;
  return static_cast<char*>(a.out.data) + off * static_cast<int64_t>(esize);
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

inline RowRanges row_ranges(const Args& a, const Request& rq, const WorkItem& it, const RowMap& map,
                            int64_t n, int64_t padded, int32_t* lo, int32_t* hi) {
  RowRanges rr;
  bool any = false;
  rr.max_lo = 0;
  rr.min_hi = INT64_MAX;
  for (int64_t r = 0; r < n; ++r) {
    int64_t l, h;
    key_range(a, rq, map.query(r), &l, &h);
    l = std::max(l, it.k_begin);
    h = std::min(h, it.k_end);
    if (h <= l) l = h = 0;
    lo[r] = static_cast<int32_t>(l);
    hi[r] = static_cast<int32_t>(h);
    if (h > l) {
      rr.kb = any ? std::min(rr.kb, l) : l;
      rr.ke = any ? std::max(rr.ke, h) : h;
      any = true;
    }
    rr.max_lo = std::max(rr.max_lo, l);
    rr.min_hi = std::min(rr.min_hi, h);
  }
  for (int64_t r = n; r < padded; ++r) {
    lo[r] = lo[0];
    hi[r] = hi[0];
  }
  if (!any) rr.kb = rr.ke = 0;
  return rr;
}

// ------------------------------------------------------------------------------------------------
// Decode kernel.

// Scores of a tile: lane kc * P + r = q_r . k_kc, for KT = W / P keys; rows[kc] points at key
// kc's row (a zero row for keys past the end of the range).
template <int P, typename KT>
inline F qk_tile(const float* q, int64_t dp, int64_t d, const KT* const* rows) {
  constexpr int kTile = W / P;
  F acc[W];
  VATTN_UNROLL
  for (int u = 0; u < W; ++u) acc[u] = Vec::zero();
  const int64_t dfull = d - d % W;
  for (int64_t x = 0; x < dfull; x += W) {
    F qv[P];
    VATTN_UNROLL
    for (int r = 0; r < P; ++r) qv[r] = Vec::load(q + r * dp + x);
    VATTN_UNROLL
    for (int kc = 0; kc < kTile; ++kc) {
      const F kv = Vec::load(rows[kc] + x);
      VATTN_UNROLL
      for (int r = 0; r < P; ++r) acc[kc * P + r] = Vec::fmadd(qv[r], kv, acc[kc * P + r]);
    }
  }
  if (dfull < d) {
    VATTN_UNROLL
    for (int kc = 0; kc < kTile; ++kc) {
      const F kv = load_n(rows[kc] + dfull, d - dfull);
      VATTN_UNROLL
      for (int r = 0; r < P; ++r) acc[kc * P + r] = Vec::fmadd(Vec::load(q + r * dp + dfull), kv, acc[kc * P + r]);
    }
  }
  return Vec::reduce(acc);
}

// Prefetch the cache lines of `bytes` bytes at p (a key or value row).
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) Vec::prefetch(c + off);
}

// acc[r][x0, x0 + NV*W) += sum over the block's keys of p[key][r] * v[key][...].
template <int P, int NV, bool kTail, typename VT>
inline void pv_rows(float* acc, int64_t dp, int64_t x0, const float* sc, const VT* v, int64_t vst,
                    int64_t nb, int64_t tail) {
  constexpr int kTile = W / P;
  F o[P][NV];
  VATTN_UNROLL
  for (int r = 0; r < P; ++r)
    VATTN_UNROLL
    for (int i = 0; i < NV; ++i) o[r][i] = Vec::load(acc + r * dp + x0 + i * W);
  for (int64_t kc = 0; kc < nb; ++kc) {
    const float* pk = sc + (kc / kTile) * W + (kc % kTile) * P;
    const VT* vr = v + kc * vst + x0;
    F vv[NV];
    VATTN_UNROLL
    for (int i = 0; i < NV; ++i) vv[i] = (kTail && i == NV - 1) ? load_n(vr + i * W, tail) : Vec::load(vr + i * W);
    VATTN_UNROLL
    for (int r = 0; r < P; ++r) {
      const F pb = Vec::set1(pk[r]);
      VATTN_UNROLL
      for (int i = 0; i < NV; ++i) o[r][i] = Vec::fmadd(pb, vv[i], o[r][i]);
    }
  }
  VATTN_UNROLL
  for (int r = 0; r < P; ++r)
    VATTN_UNROLL
    for (int i = 0; i < NV; ++i) Vec::store(acc + r * dp + x0 + i * W, o[r][i]);
}

template <int P, typename VT>
inline void pv_block(float* acc, int64_t dp, int64_t d, const float* sc, const VT* v, int64_t vst,
                     int64_t nb) {
  constexpr int kMaxNv = (Vec::kRegs / 2) / P > 0 ? ((Vec::kRegs / 2) / P > 8 ? 8 : (Vec::kRegs / 2) / P) : 1;
  const int64_t nfull = d / W;
  int64_t i = 0;
  for (; i + kMaxNv <= nfull; i += kMaxNv) pv_rows<P, kMaxNv, false>(acc, dp, i * W, sc, v, vst, nb, 0);
  for (; i + 4 <= nfull && kMaxNv > 4; i += 4) pv_rows<P, 4, false>(acc, dp, i * W, sc, v, vst, nb, 0);
  for (; i + 2 <= nfull && kMaxNv > 2; i += 2) pv_rows<P, 2, false>(acc, dp, i * W, sc, v, vst, nb, 0);
  for (; i < nfull; ++i) pv_rows<P, 1, false>(acc, dp, i * W, sc, v, vst, nb, 0);
  if (d % W) pv_rows<P, 1, true>(acc, dp, nfull * W, sc, v, vst, nb, d % W);
}

template <typename T>
inline const T* cache_ptr(const Operand& o, int64_t row, int64_t t, int64_t h) {
  return static_cast<const T*>(o.data) + row * o.s_batch + t * o.s_token + h * o.s_head;
}

// Write rows [0, n) of acc (and m, l) as the item's output or partial result.
inline void finish_rows(const Args& a, const Shape& s, const Request& rq, const RowMap& map, int64_t n,
                        const float* m, const float* l, const float* acc, int64_t acc_ld,
                        const PartialView* part) {
  const int64_t dp = s.dp;
  for (int64_t r = 0; r < n; ++r) {
    if (part) {
      part->m[r] = m[r];
      part->l[r] = l[r];
      std::memcpy(part->acc + r * dp, acc + r * acc_ld, static_cast<size_t>(dp) * sizeof(float));
    } else {
      const float scale = l[r] > 0.0f ? s.out_scale / l[r] : 0.0f;
      store_out_row(acc + r * acc_ld, scale, out_row(a, rq, map.query(r), map.head(r)),
                    a.dtype, a.head_dim);
    }
  }
}

template <int P, typename KT>
void decode_item(const Args& a, const Shape& s, const Request& rq, const WorkItem& it, float* scratch,
                 const PartialView* part) {
  constexpr int kTile = W / P;
  const int64_t d = a.head_dim, dp = s.dp, bk = s.block_keys;
  const RowMap map{it.q_begin, s.group, it.kv_head};
  const int64_t n = (it.q_end - it.q_begin) * s.group;  // real rows, <= P
  float* q = scratch;
  float* acc = q + P * dp;
  float* sc = acc + P * dp;
  const KT* zero = reinterpret_cast<const KT*>(sc + bk * P);  // dp zero floats: a zero key row
  std::memset(sc + bk * P, 0, static_cast<size_t>(dp) * sizeof(float));
  std::memset(acc, 0, static_cast<size_t>(P * dp) * sizeof(float));

  int32_t lo[W], hi[W], lane_lo[W], lane_hi[W], lane_key[W];
  const RowRanges rr = row_ranges(a, rq, it, map, n, P, lo, hi);
  VATTN_UNROLL
  for (int r = 0; r < P; ++r) {
    const int64_t rs = r < n ? r : 0;
    load_q_row(q_row(a, rq, map.query(rs), map.head(rs)), a.dtype, d, s.q_scale, q + r * dp, dp);
  }
  for (int u = 0; u < W; ++u) {
    lane_lo[u] = lo[u % P];
    lane_hi[u] = hi[u % P];
    lane_key[u] = u / P;
  }
  const I vlo = Vec::iload(lane_lo), vhi = Vec::iload(lane_hi), voff = Vec::iload(lane_key);

  const KT* kbase = cache_ptr<KT>(a.k_cache, rq.row, 0, it.kv_head);
  const KT* vbase = cache_ptr<KT>(a.v_cache, rq.row, 0, it.kv_head);
  const int64_t kst = a.k_cache.s_token, vst = a.v_cache.s_token;
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(KT));
  for (int64_t kk = rr.kb; kk < std::min(rr.ke, rr.kb + kPrefetchKeys); ++kk) prefetch_row(kbase + kk * kst, row_bytes);
  const F neg_inf = Vec::set1(-HUGE_VALF);
  F m_run = neg_inf, l_run = Vec::zero();
  for (int64_t c0 = rr.kb; c0 < rr.ke; c0 += bk) {
    const int64_t nb = std::min(bk, rr.ke - c0);
    const int64_t tiles = (nb + kTile - 1) / kTile;
    F mblk = neg_inf;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t c = c0 + t * kTile;
      const KT* rows[kTile];
      for (int kc = 0; kc < kTile; ++kc) rows[kc] = c + kc < rr.ke ? kbase + (c + kc) * kst : zero;
      // Rows of one head sit a token stride apart (often a page or more): the hardware
      // prefetchers, which stay inside a page, do not follow. Fetch K kPrefetchKeys ahead and this
      // tile's V rows (read by the PV pass of this block), never past the range's end.
      const int64_t pf_end = std::min(rr.ke, c + kTile + kPrefetchKeys);
      for (int64_t kk = std::max(c + kPrefetchKeys, c + kTile); kk < pf_end; ++kk) prefetch_row(kbase + kk * kst, row_bytes);
      for (int64_t kk = c; kk < std::min(rr.ke, c + kTile); ++kk) prefetch_row(vbase + kk * vst, row_bytes);
      F sv = qk_tile<P>(q, dp, d, rows);
      if (c < rr.max_lo || c + kTile > rr.min_hi) {
        sv = Vec::mask_range(sv, Vec::iadd(Vec::iset1(static_cast<int32_t>(c)), voff), vlo, vhi);
      }
      Vec::store(sc + t * W, sv);
      mblk = Vec::max(mblk, sv);
    }
    for (int sh = P; sh < W; sh *= 2) mblk = Vec::max(mblk, Vec::rotate(mblk, sh));
    const F m_new = Vec::max(m_run, mblk);
    const F m_safe = Vec::replace_neginf(m_new, 0.0f);
    const F alpha = Vec::exp2(Vec::sub(m_run, m_safe));
    F lsum = Vec::zero();
    for (int64_t t = 0; t < tiles; ++t) {
      const F p = Vec::exp2(Vec::sub(Vec::load(sc + t * W), m_safe));
      Vec::store(sc + t * W, p);
      lsum = Vec::add(lsum, p);
    }
    l_run = Vec::fmadd(l_run, alpha, lsum);
    m_run = m_new;
    if (!Vec::all_equal(alpha, Vec::set1(1.0f))) {
      float al[W];
      Vec::store(al, alpha);
      VATTN_UNROLL
      for (int r = 0; r < P; ++r) {
        const F ar = Vec::set1(al[r]);
        for (int64_t x = 0; x < dp; x += W) Vec::store(acc + r * dp + x, Vec::mul(Vec::load(acc + r * dp + x), ar));
      }
    }
    pv_block<P>(acc, dp, d, sc, vbase + c0 * vst, vst, nb);
  }
  for (int sh = P; sh < W; sh *= 2) l_run = Vec::add(l_run, Vec::rotate(l_run, sh));
  float m[W], l[W];
  Vec::store(m, m_run);
  Vec::store(l, l_run);
  finish_rows(a, s, rq, map, n, m, l, acc, dp, part);
}

// ------------------------------------------------------------------------------------------------
// Prefill kernel.

// S[kc][rv0*W + ...] = sum_d k[kc][d] * Qt[d][...] for KC keys and NV row vectors.
template <int KC, int NV>
inline void qk_micro(const float* qt, int64_t rp, int64_t d, const float* k, int64_t kld, float* sc,
                     int64_t rv0) {
  F acc[KC][NV];
  VATTN_UNROLL
  for (int c = 0; c < KC; ++c)
    VATTN_UNROLL
    for (int v = 0; v < NV; ++v) acc[c][v] = Vec::zero();
  const float* qp = qt + rv0 * W;
  for (int64_t x = 0; x < d; ++x) {
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
  VATTN_UNROLL
  for (int c = 0; c < KC; ++c)
    VATTN_UNROLL
    for (int v = 0; v < NV; ++v) Vec::store(sc + c * rp + (rv0 + v) * W, acc[c][v]);
}

template <int NV>
inline void qk_rows(const float* qt, int64_t rp, int64_t d, const float* k, int64_t kld, float* sc,
                    int64_t rv0, int64_t nb) {
  constexpr int kKc = (Vec::kRegs - NV - 2) / NV >= 8 ? 8 : ((Vec::kRegs - NV - 2) / NV >= 4 ? 4 : 2);
  int64_t c = 0;
  for (; c + kKc <= nb; c += kKc) qk_micro<kKc, NV>(qt, rp, d, k + c * kld, kld, sc + c * rp, rv0);
  for (; c < nb; ++c) qk_micro<1, NV>(qt, rp, d, k + c * kld, kld, sc + c * rp, rv0);
}

inline void qk_block(const float* qt, int64_t rp, int64_t d, const float* k, int64_t kld, float* sc,
                     int64_t nb) {
  constexpr int kNv = Vec::kRegs >= 32 ? 4 : 2;
  const int64_t rv = rp / W;
  int64_t v = 0;
  for (; v + kNv <= rv; v += kNv) qk_rows<kNv>(qt, rp, d, k, kld, sc, v, nb);
  for (; v + 2 <= rv && kNv > 2; v += 2) qk_rows<2>(qt, rp, d, k, kld, sc, v, nb);
  for (; v < rv; ++v) qk_rows<1>(qt, rp, d, k, kld, sc, v, nb);
}

// O[r0 + r][x0 + i*W ...] += sum_kc P[kc][r0 + r] * v[kc][x0 + i*W ...] for RO rows, NV vectors.
template <int RO, int NV>
inline void pv_micro(float* o, int64_t dp, const float* pt, int64_t rp, const float* v, int64_t vld,
                     int64_t nb) {
  F acc[RO][NV];
  VATTN_UNROLL
  for (int r = 0; r < RO; ++r)
    VATTN_UNROLL
    for (int i = 0; i < NV; ++i) acc[r][i] = Vec::load(o + r * dp + i * W);
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
  for (int r = 0; r < RO; ++r)
    VATTN_UNROLL
    for (int i = 0; i < NV; ++i) Vec::store(o + r * dp + i * W, acc[r][i]);
}

inline void pv_block_rows(float* o, int64_t dp, const float* pt, int64_t rp, const float* v, int64_t vld,
                          int64_t nb, int64_t rows) {
  constexpr int kRo = 4;
  constexpr int kNv = Vec::kRegs >= 32 ? 4 : 2;
  const int64_t nvec = dp / W;
  for (int64_t r = 0; r < rows; r += kRo) {
    int64_t i = 0;
    for (; i + kNv <= nvec; i += kNv) pv_micro<kRo, kNv>(o + r * dp + i * W, dp, pt + r, rp, v + i * W, vld, nb);
    for (; i + 2 <= nvec && kNv > 2; i += 2) pv_micro<kRo, 2>(o + r * dp + i * W, dp, pt + r, rp, v + i * W, vld, nb);
    for (; i < nvec; ++i) pv_micro<kRo, 1>(o + r * dp + i * W, dp, pt + r, rp, v + i * W, vld, nb);
  }
}

template <typename KT>
inline void convert_rows(const KT* src, int64_t st, int64_t nb, int64_t d, float* dst, int64_t dp) {
  for (int64_t kc = 0; kc < nb; ++kc) row_to_f32(src + kc * st, d, 1.0f, dst + kc * dp, dp);
}

template <typename KT>
void prefill_item(const Args& a, const Shape& s, const Request& rq, const WorkItem& it, float* scratch,
                  const PartialView* part) {
  const int64_t d = a.head_dim, dp = s.dp, bk = s.block_keys;
  const RowMap map{it.q_begin, s.group, it.kv_head};
  const int64_t n = (it.q_end - it.q_begin) * s.group;
  const int64_t rp = round_up(n, W);
  float* qt = scratch;             // [d][rp]
  float* sc = qt + d * rp;         // [bk][rp]
  float* o = sc + bk * rp;         // [rp][dp]
  float* kf = o + rp * dp;         // [bk][dp]
  float* vf = kf + bk * dp;        // [bk][dp]
  float* m = vf + bk * dp;         // [rp]
  float* l = m + rp;               // [rp]
  float* alpha = l + rp;           // [rp]
  int32_t* lo = reinterpret_cast<int32_t*>(alpha + rp);  // [rp]
  int32_t* hi = lo + rp;                                  // [rp]

  const RowRanges rr = row_ranges(a, rq, it, map, n, rp, lo, hi);
  // q rows into o (as a staging area), then transposed into qt
  for (int64_t r = 0; r < rp; ++r) {
    if (r < n) {
      load_q_row(q_row(a, rq, map.query(r), map.head(r)), a.dtype, d, s.q_scale, o + r * dp, dp);
    } else {
      std::memset(o + r * dp, 0, static_cast<size_t>(dp) * sizeof(float));
    }
  }
  for (int64_t r = 0; r < rp; ++r)
    for (int64_t x = 0; x < d; ++x) qt[x * rp + r] = o[r * dp + x];
  std::memset(o, 0, static_cast<size_t>(rp * dp) * sizeof(float));
  for (int64_t r = 0; r < rp; ++r) {
    m[r] = -HUGE_VALF;
    l[r] = 0.0f;
  }

  const KT* kbase = cache_ptr<KT>(a.k_cache, rq.row, 0, it.kv_head);
  const KT* vbase = cache_ptr<KT>(a.v_cache, rq.row, 0, it.kv_head);
  const int64_t kst = a.k_cache.s_token, vst = a.v_cache.s_token;
  constexpr bool kF32 = std::is_same<KT, float>::value;
  const bool v_direct = kF32 && d % W == 0;
  for (int64_t c0 = rr.kb; c0 < rr.ke; c0 += bk) {
    const int64_t nb = std::min(bk, rr.ke - c0);
    const float* k;
    int64_t kld;
    if (kF32) {
      k = reinterpret_cast<const float*>(kbase + c0 * kst);
      kld = kst;
    } else {
      convert_rows(kbase + c0 * kst, kst, nb, d, kf, dp);
      k = kf;
      kld = dp;
    }
    qk_block(qt, rp, d, k, kld, sc, nb);
    if (c0 < rr.max_lo || c0 + nb > rr.min_hi) {
      for (int64_t kc = 0; kc < nb; ++kc) {
        const I key = Vec::iset1(static_cast<int32_t>(c0 + kc));
        for (int64_t v = 0; v < rp; v += W) {
          Vec::store(sc + kc * rp + v, Vec::mask_range(Vec::load(sc + kc * rp + v), key, Vec::iload(lo + v), Vec::iload(hi + v)));
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
        for (int64_t x = 0; x < dp; x += W) Vec::store(o + r * dp + x, Vec::mul(Vec::load(o + r * dp + x), ar));
      }
    }
    const float* v;
    int64_t vld;
    if (v_direct) {
      v = reinterpret_cast<const float*>(vbase + c0 * vst);
      vld = vst;
    } else {
      convert_rows(vbase + c0 * vst, vst, nb, d, vf, dp);
      v = vf;
      vld = dp;
    }
    pv_block_rows(o, dp, sc, rp, v, vld, nb, rp);
  }
  finish_rows(a, s, rq, map, n, m, l, o, dp, part);
}

// ------------------------------------------------------------------------------------------------
// Entry points.

template <typename KT>
void run_item_typed(const Args& a, const Shape& s, const Request& rq, const WorkItem& it, float* scratch,
                    const PartialView* part) {
  if (it.kind == ItemKind::kPrefill) return prefill_item<KT>(a, s, rq, it, scratch, part);
  const int64_t rows = (it.q_end - it.q_begin) * s.group;
  if (rows <= 1) return decode_item<1, KT>(a, s, rq, it, scratch, part);
  if (rows <= 2) return decode_item<2, KT>(a, s, rq, it, scratch, part);
  if (rows <= 4) return decode_item<4, KT>(a, s, rq, it, scratch, part);
  return decode_item<8, KT>(a, s, rq, it, scratch, part);
}

inline void run_item(const Args& a, const Shape& s, const Request& rq, const WorkItem& it, float* scratch,
                     const PartialView* part) {
  switch (a.cache_dtype) {
    case DType::kBFloat16: return run_item_typed<bf16_t>(a, s, rq, it, scratch, part);
    case DType::kFloat16: return run_item_typed<f16_t>(a, s, rq, it, scratch, part);
    case DType::kFloat8E4M3: return run_item_typed<e4m3_t>(a, s, rq, it, scratch, part);
    case DType::kFloat8E5M2: return run_item_typed<e5m2_t>(a, s, rq, it, scratch, part);
    default: return run_item_typed<float>(a, s, rq, it, scratch, part);
  }
}

// Floats of scratch one thread needs for any item of this call (each region rounded to 16 floats).
inline int64_t scratch_floats(const Args& a, const Shape& s) {
  const int64_t dp = s.dp, bk = s.block_keys, d = a.head_dim;
  const int64_t decode = 2 * kMaxDecodeRows * dp + bk * kMaxDecodeRows + dp + 64;
  const int64_t rp = round_up(std::max<int64_t>(kPrefillRows, s.group), W);
  const int64_t prefill = d * rp + bk * rp + rp * dp + 2 * bk * dp + 5 * rp + 64;
  return std::max(decode, prefill);
}

inline KernelTable table(const char* name) { return KernelTable{name, W, &run_item, &scratch_floats}; }
