// AMX-BF16 tiles for the prefill and shared-prefix items of bf16 caches. A fragment: isa_amx.cpp
// includes it after vec_avx512.h (avx512's vector type), amx_tiles.h (the tile state) and
// isa_kernels.h, inside its own namespace, under a target pragma with amx-tile and amx-bf16;
// everything else of that variant (decode items, whose scores amx_tiles.h computes where a tile
// holds one token, other dtypes, head_dim not a multiple of 32) is the avx512 vector code (FMAs
// over widened bf16, no bf16 dot product: isa_amx.cpp says why).
//
// An item's rows (queries x group heads of one KV head, up to kAmxRows) against a block of keys, as
// tile matmuls with fp32 accumulation (TDPBF16PS: C[16][16] fp32 += A[16][32] bf16 . B, B in
// pairs of rows, "VNNI" order). Every tile is 16 rows x 64 bytes: tiles 0-3 accumulate, 4-5 hold
// A operands, 6-7 B operands, and the loops run 2 x 2 accumulators at a time (two A and two B
// loads per four TDPBF16PS), each load issued just before the first product that reads it: with
// the four loads grouped ahead of the four products, the products ran at a quarter of their rate
// on the SPR machine (7 ns a TDPBF16PS interleaved, 28 ns grouped; a bf16 prefill about 1.6x
// faster).
// - Scores, transposed: S^T[key][row] = K[key][:] . q[row][:]: A is 16 K rows, copied once per
//   block into contiguous tiles (k_tiles: the cache's rows are a token stride apart, often a
//   multiple of 4 KB, and a block's last tile needs zero rows past the range anyway), B is q
//   packed once per item in pairs of d (Qt[d / 2][rows], the avx512bf16 prefill's layout). The
//   scores land in sc[key][row], the layout of the vector kernel's vertical online softmax.
// - Softmax and P tiles per 16 rows (softmax_p_tiles): p = exp2(s c - m) for 32 keys at a time
//   (the scale fused into the exponent's argument), summed into l and written as P V's tiles:
//   the probabilities never go back to sc. m is the rows' running max as it stands while the
//   block's p stay small (one pass), else the block's row max first (two passes, earlier sums
//   rescaled).
// - The tile products and this vector work run one after the other. On the SPR machine vector
//   work between tile products ran ~1.6x slower than alone (an exp2 of 16 lanes 7 cycles
//   instead of 4.3), so it hid behind the products only up to ~8 such vectors per 4 products,
//   and the softmax has more: each pair's P V with the next pair's softmax spread between its
//   chunks (bit-identical) ran 0.9x as fast as one after the other.
// - P V in columns (items of at least 3 / 4 d rows, pv_in_columns): O^T[d][row] += V^T[d][key]
//   . P^T[key][row]. The probabilities come out of the vertical softmax as P^T's columns, so
//   its B tiles are two keys' vectors interleaved (one shuffle per 16 probabilities); A is V^T,
//   transposed once per block and item (v_tiles). O^T stays in fp32 scratch between blocks
//   (loaded and stored as tiles; a row's rescale is one vector per row tile) and is transposed
//   once at the item's end, straight to the output rows (amx_output). On the SPR machine (calls
//   alternated in one process, docs/benchmarks.md) bf16 prefills ran 1.06x-1.15x faster than
//   with P V in rows at d = 64, where the transposes of P weighed most, and 0.91x-1.04x at
//   d = 128, where the tile products weigh more and transposing V costs twice as much.
// - P V in rows (smaller items, where transposing V would cost more than P): O[row][d] +=
//   P[row][key] . V[key][d]: A is P, transposed in registers from P^T to rows (four shuffles
//   per 16 probabilities), rows x 32 keys. B is V with two keys' rows interleaved value by value
//   (v_pairs). O stays in fp32 scratch between blocks, rescaled row by row.
// - P is split in two bf16 terms, hi = p truncated to bf16 (its upper 16 bits) and lo = bf16(p -
//   hi) (p - hi is exact in fp32), both multiplied by V (twice the P V tiles): the weights then
//   carry 2^-15 of relative error instead of bf16's 2^-8, which keeps the result near the fp32
//   P V that the other variants compute (tests/support/attention_bound.py derives both).
//   Truncating hi takes one AND and one word permute (either layout) where rounding it took a
//   conversion and a widening back: on the SPR machine (docs/benchmarks.md), one thread, 1024-token
//   prompts at 32 / 8 x 64, the softmax pass went from 47-51% of the items' cycles to 35-43%.
//
// The tile state is configured at the start of an item and released at its end (TileScope), on
// whichever OpenMP thread runs it; the process asked the OS for it once (attention.cpp).

constexpr int64_t kAmxBlockKeys = 128;  // keys per block: 4 P V tiles of 32 keys per O load/store
// Rows per item: a block's K tiles and V pairs are copied once per item, so four times the vector
// kernels' 64 rows spends a quarter of that copy per row; row tiles that see none of a block skip
// it (a causal item's early rows stop at their diagonal as 64-row items did).
constexpr int64_t kAmxRows = 256;

// Whether an item of this call takes the tiles: bf16 q and cache, d a whole number of 32-value
// tiles (other head sizes run the avx512 vector code).
template <typename KT>
inline bool amx_rows(const Args& a) {
  return std::is_same<KT, bf16_t>::value && a.dtype == DType::kBFloat16 && a.head_dim % 32 == 0;
}

// Scratch of an AMX item (rp rows, a multiple of 16; bk keys per block; d a multiple of 32).
struct AmxScratch {
  int32_t* qt;  // [d / 2][rp] q in pairs of d (bf16, unscaled)
  float* sc;  // [bk][rp] scores
  float* ot;  // [d][rp] unnormalized output transposed: P V's accumulators in columns
  float* o;  // [rp][d] unnormalized output: P V's accumulators in rows
  // [bk / 32][rp / 16][16][32] P tiles, hi terms: in rows, a tile's row r holds row r's 32 keys
  // of the chunk; in columns (P^T), its row i holds keys 2 i and 2 i + 1, interleaved, of 16 rows
  bf16_t* phi;
  bf16_t* plo;  // the same, lo terms
  // [bk / 2][2 d] V, two keys interleaved (v_pairs), or [bk / 32][d / 16][16][32] V^T tiles
  // (v_tiles): the B or A operands of P V in rows or in columns
  bf16_t* vp;
  bf16_t* kp;  // [bk / 16][d / 32][16][32] the block's K rows as tiles (keys past the range 0)
  float *m, *l, *alpha;
  int32_t *lo, *hi;
  // per row tile (16 rows): the union of its real rows' key ranges [kb, ke), the keys none of
  // them masks [max_lo, min_hi), how many of the current block's keys its pair of tiles reads
  // (0: none; the keys after the last one a row of the pair sees are left out), and whether its
  // P V accumulators hold anything yet (until then they are not read: the first products start
  // from zero tiles, and a tile that none reached outputs zeros)
  int32_t *tkb, *tke, *tmax_lo, *tmin_hi, *active, *started;
  AmxScratch(float* p, int64_t d, int64_t rp, int64_t bk) {
    qt = reinterpret_cast<int32_t*>(p);
    sc = p + d / 2 * rp;
    ot = sc + bk * rp;
    o = ot + d * rp;
    phi = reinterpret_cast<bf16_t*>(o + rp * d);
    plo = phi + bk * rp;
    vp = plo + bk * rp;
    kp = vp + bk * d;
    m = reinterpret_cast<float*>(kp + bk * d);
    l = m + rp;
    alpha = l + rp;
    lo = reinterpret_cast<int32_t*>(alpha + rp);
    hi = lo + rp;
    const int64_t tiles = rp / 16;
    tkb = hi + rp;
    tke = tkb + tiles;
    tmax_lo = tke + tiles;
    tmin_hi = tmax_lo + tiles;
    active = tmin_hi + tiles;
    started = active + tiles;
  }
  static int64_t floats(int64_t d, int64_t rp, int64_t bk) {
    return d / 2 * rp + bk * rp + 2 * rp * d + bk * rp + bk * d / 2 + bk * d / 2 + 5 * rp +
           6 * (rp / 16);
  }
};

inline int64_t amx_scratch_floats(const Args& a, const Shape& s) {
  if (a.head_dim % 32 != 0) return 0;
  const int64_t rp = round_up(std::max<int64_t>(s.prefill_rows, s.group), 16);
  return AmxScratch::floats(a.head_dim, rp, kAmxBlockKeys) + 16;
}

// S^T for NK (1 or 2) key tiles from kt0 on and NR (1 or 2) row tiles from rt0 on: tile (key
// tile i, row tile j) accumulates in tile 2 i + j, over d / 32 steps. kp: the block's K tiles
// (k_tiles), qt: Qt (rp pairs per row, its tile j at column 16 (rt0 + j)).
template <int NK, int NR>
inline void qk_tiles(const bf16_t* kp, const int32_t* qt, int64_t rp, int64_t rt0, int64_t steps,
                     float* sc, int64_t kt0) {
  const bf16_t* k0 = kp + kt0 * steps * 512;
  const bf16_t* k1 = k0 + steps * 512;
  tiles_see_stores();
  _tile_zero(0);
  if constexpr (NR > 1) _tile_zero(1);
  if constexpr (NK > 1) _tile_zero(2);
  if constexpr (NK > 1 && NR > 1) _tile_zero(3);
  const int32_t* q0 = qt + rt0 * 16;
  const int64_t qld = rp * 4;
  for (int64_t x = 0; x < steps; ++x) {
    _tile_loadd(4, k0 + x * 512, 64);
    _tile_loadd(6, q0 + x * 16 * rp, qld);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NR > 1) {
      _tile_loadd(7, q0 + x * 16 * rp + 16, qld);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NK > 1) {
      _tile_loadd(5, k1 + x * 512, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NR > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  float* c = sc + kt0 * 16 * rp + rt0 * 16;
  _tile_stored(0, c, rp * 4);
  if constexpr (NR > 1) _tile_stored(1, c + 16, rp * 4);
  if constexpr (NK > 1) _tile_stored(2, c + 16 * rp, rp * 4);
  if constexpr (NK > 1 && NR > 1) _tile_stored(3, c + 16 * rp + 16, rp * 4);
}

// P V in rows (small items, see pv_in_columns): O += P V for NR (1 or 2) row tiles from rt0 on and
// ND (1 or 2) tiles of 16 values of d from dt0 on, over `chunks` chunks of 32 keys: accumulator
// (row tile i, d tile j) is tile 2 i + j, loaded from (zero where fresh) and stored back to o
// ([rp][d] fp32). P tiles hi then lo (split) for each chunk.
template <int NR, int ND>
inline void pv_row_tiles(float* o, int64_t d, const bf16_t* phi, const bf16_t* plo,
                         int64_t rt_count, const bf16_t* vv, int64_t rt0, int64_t dt0,
                         int64_t chunks, bool fresh) {
  tiles_see_stores();
  float* c = o + rt0 * 16 * d + dt0 * 16;
  const int64_t old = d * 4;
  if (fresh) {
    _tile_zero(0);
    if constexpr (ND > 1) _tile_zero(1);
    if constexpr (NR > 1) _tile_zero(2);
    if constexpr (NR > 1 && ND > 1) _tile_zero(3);
  } else {
    _tile_loadd(0, c, old);
    if constexpr (ND > 1) _tile_loadd(1, c + 16, old);
    if constexpr (NR > 1) _tile_loadd(2, c + 16 * d, old);
    if constexpr (NR > 1 && ND > 1) _tile_loadd(3, c + 16 * d + 16, old);
  }
  const int64_t vld = 2 * d * 2;  // bytes per row of vv (two keys' d values)
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const bf16_t* b = vv + kc * 16 * 2 * d + dt0 * 32;
    for (int half = 0; half < 2; ++half) {
      // each load just before its first use: loads grouped ahead of the products ran at a
      // quarter of the products' rate on the SPR machine (docs/benchmarks.md)
      const bf16_t* pa = (half ? plo : phi) + (kc * rt_count + rt0) * 512;
      _tile_loadd(4, pa, 64);
      if (half == 0) _tile_loadd(6, b, vld);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (ND > 1) {
        if (half == 0) _tile_loadd(7, b + 32, vld);
        _tile_dpbf16ps(1, 4, 7);
      }
      if constexpr (NR > 1) {
        _tile_loadd(5, pa + 512, 64);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (ND > 1) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  _tile_stored(0, c, old);
  if constexpr (ND > 1) _tile_stored(1, c + 16, old);
  if constexpr (NR > 1) _tile_stored(2, c + 16 * d, old);
  if constexpr (NR > 1 && ND > 1) _tile_stored(3, c + 16 * d + 16, old);
}

// P V in columns (large items): O^T += V^T P^T for two d tiles from dt0 on and NR (1 or 2) row
// tiles from rt0 on, over `chunks` chunks of 32 keys: accumulator (d tile i, row tile j) is tile 2
// i + j, loaded from (zero where fresh) and stored back to ot ([d][rp] fp32). A is V^T (v_tiles),
// B the P^T tiles, hi then lo (split) for each chunk, the V^T tiles read once for both.
template <int NR>
inline void pv_col_tiles(float* ot, int64_t rp, const bf16_t* phi, const bf16_t* plo,
                         int64_t rt_count, const bf16_t* vt, int64_t dtiles, int64_t rt0,
                         int64_t dt0, int64_t chunks, bool fresh) {
  tiles_see_stores();
  float* c = ot + dt0 * 16 * rp + rt0 * 16;
  const int64_t old = rp * 4;
  if (fresh) {
    _tile_zero(0);
    if constexpr (NR > 1) _tile_zero(1);
    _tile_zero(2);
    if constexpr (NR > 1) _tile_zero(3);
  } else {
    _tile_loadd(0, c, old);
    if constexpr (NR > 1) _tile_loadd(1, c + 16, old);
    _tile_loadd(2, c + 16 * rp, old);
    if constexpr (NR > 1) _tile_loadd(3, c + 16 * rp + 16, old);
  }
  for (int64_t kc = 0; kc < chunks; ++kc) {
    // each load just before its first use: loads grouped ahead of the products ran at a quarter
    // of the products' rate on the SPR machine (docs/benchmarks.md)
    const bf16_t* va = vt + (kc * dtiles + dt0) * 512;
    const int64_t pt = (kc * rt_count + rt0) * 512;
    _tile_loadd(4, va, 64);
    _tile_loadd(6, phi + pt, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NR > 1) {
      _tile_loadd(7, phi + pt + 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_loadd(5, va + 512, 64);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (NR > 1) _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(6, plo + pt, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NR > 1) {
      _tile_loadd(7, plo + pt + 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (NR > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, old);
  if constexpr (NR > 1) _tile_stored(1, c + 16, old);
  _tile_stored(2, c + 16 * rp, old);
  if constexpr (NR > 1) _tile_stored(3, c + 16 * rp + 16, old);
}

// 16 x 16 fp32 transpose in registers: r[i] lane j <- r[j] lane i (bits moved as they are: any
// 32-bit lanes). Inlined: called, it spilled its 16 vectors to the stack and back.
__attribute__((always_inline)) inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] =
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4a + b] now holds, in each 128-bit lane L, rows 4a..4a+3 of column 4L + b; t[b] then
  // columns b and 4 + b (rows 0-7), t[b + 4] columns 8 + b and 12 + b (rows 0-7), t[b + 8] and
  // t[b + 12] the same of rows 8-15
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], _MM_SHUFFLE(1, 0, 1, 0));
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], _MM_SHUFFLE(3, 2, 3, 2));
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], _MM_SHUFFLE(1, 0, 1, 0));
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], _MM_SHUFFLE(2, 0, 2, 0));
    r[i + 4] = _mm512_shuffle_f32x4(t[i], t[i + 8], _MM_SHUFFLE(3, 1, 3, 1));
    r[i + 8] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], _MM_SHUFFLE(2, 0, 2, 0));
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// Qt ([d / 2][rp] words, d a multiple of 32) of an item's rp rows: row r's d bf16 values (at
// row_of(r), r < n; rows n to rp zero) in pairs, one 32-bit lane per pair, 16 rows and 16 pairs at
// a time transposed in registers: one store per pair of 16 rows, where a row at a time wrote each
// pair's word to another line (on the SPR machine an eighth of a 100-token prompt's call).
template <typename RowOf>
inline void stage_q_pair_tiles(RowOf row_of, int64_t n, int64_t d, int32_t* qt, int64_t rp) {
  for (int64_t r0 = 0; r0 < rp; r0 += 16) {
    const float* src[16];
    for (int i = 0; i < 16; ++i)
      src[i] = r0 + i < n ? static_cast<const float*>(row_of(r0 + i)) : nullptr;
    for (int64_t x0 = 0; x0 < d / 2; x0 += 16) {
      __m512 z[16];
      for (int i = 0; i < 16; ++i) z[i] = src[i] ? _mm512_loadu_ps(src[i] + x0) : Vec::zero();
      transpose16(z);  // z[x]: pair x0 + x of the 16 rows
      for (int x = 0; x < 16; ++x)
        _mm512_storeu_ps(reinterpret_cast<float*>(qt + (x0 + x) * rp + r0), z[x]);
    }
  }
}

// Indices of a 16-bit permute that interleaves two sources value by value: lane 2 j takes value j
// of the first, lane 2 j + 1 value j of the second, whose values start at index `second` (32: the
// other vector of a two-source permute; 16: the upper half of the same vector).
inline __m512i interleave_idx(int second) {
  int16_t idx[32];
  for (int j = 0; j < 32; ++j) idx[j] = static_cast<int16_t>(j / 2 + (j % 2) * second);
  return _mm512_loadu_si512(idx);
}

// V rows of keys [c0, c0 + nb) (vst apart) as B tiles: row i of vv holds keys c0 + 2 i and
// c0 + 2 i + 1 interleaved value by value, for i < pairs; keys at or past nb read as zero rows.
inline void v_pairs(const bf16_t* v, int64_t vst, int64_t nb, int64_t pairs, int64_t d,
                    bf16_t* vv) {
  const __m512i lo_idx = interleave_idx(32);  // the two keys' values 0-15, then 16-31
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t i = 0; i < pairs; ++i) {
    const bf16_t* r0 = 2 * i < nb ? v + 2 * i * vst : nullptr;
    const bf16_t* r1 = 2 * i + 1 < nb ? v + (2 * i + 1) * vst : nullptr;
    bf16_t* dst = vv + i * 2 * d;
    for (int64_t x = 0; x < d; x += 32) {
      const __m512i a = r0 ? _mm512_loadu_si512(r0 + x) : _mm512_setzero_si512();
      const __m512i b = r1 ? _mm512_loadu_si512(r1 + x) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * x, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_storeu_si512(dst + 2 * x + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
  }
}

// V rows of a block's nb keys (vst apart) as A tiles of O^T += V^T P^T, per chunk of 32 keys
// and d tile of 16 values: row x of tile (chunk c, d tile t) holds value t 16 + x of keys
// c 32 .. c 32 + 31, in pairs per 32-bit lane as the tiles read them; keys at or past nb zero
// (their probabilities are 0, and 0 times a stale NaN would not be). Two keys' rows interleaved
// value by value give 16 lanes of pairs along d, and 16 of those transposed, 16 rows of 16 pairs
// along the keys: once per block and item, where transposing P instead cost every row tile's
// softmax four shuffles per 16 probabilities.
inline void v_tiles(const bf16_t* v, int64_t vst, int64_t nb, int64_t chunks, int64_t d,
                    bf16_t* vt) {
  const __m512i pair_idx = interleave_idx(32);  // two keys' 16 values (in the lower halves)
  const int64_t dtiles = d / 16;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t t = 0; t < dtiles; ++t) {
      __m512 z[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t k0 = c * 32 + 2 * i;
        const __m512i a = k0 < nb ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                        reinterpret_cast<const __m256i*>(v + k0 * vst + t * 16)))
                                  : _mm512_setzero_si512();
        const __m512i b = k0 + 1 < nb
                              ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(v + (k0 + 1) * vst + t * 16)))
                              : _mm512_setzero_si512();
        z[i] = _mm512_castsi512_ps(_mm512_permutex2var_epi16(a, pair_idx, b));
      }
      transpose16(z);  // z[x] lane i: keys 2 i and 2 i + 1 of value t 16 + x
      bf16_t* dst = vt + (c * dtiles + t) * 512;
      for (int x = 0; x < 16; ++x) _mm512_storeu_ps(dst + x * 32, z[x]);
    }
  }
}

// A tile whose rows all have a running max keeps it while each row's sum of the block's
// probabilities stays at most this (so no key outweighs that max's key by more than 2^16): its
// sums and O go unrescaled, and its scores take one pass.
constexpr float kAmxLazyLimit = 65536.0f;

// The block's online softmax and its P tiles, per active row tile (16 rows, one vector; tiles
// that see none of the block keep their state, their P tiles are not read; a tile reads the
// block's first w.active keys, nb below): p = exp2(s c - m) for 32 keys at a time (the scale fused
// into the exponent's argument: one rounding where scaling and subtracting took two; masked keys
// and keys at or past nb 0), summed into l, transposed in registers to the rows' P tiles and split
// into hi and lo bf16 terms. m is the rows' running max as it stands (one pass; any m measures the
// weights exactly as well, as long as one key's weight is 1 and none overflows) unless a row has
// none yet or the block's sums pass kAmxLazyLimit: then the block's max first (a second pass) and
// the earlier sums rescaled. The scores stay as the tiles stored them. Returns whether any row's
// rescale factor is not 1.
template <bool kCols>
inline bool softmax_p_tiles(const float* sc, int64_t rp, int64_t c0, const AmxScratch& w, float* m,
                            float* l, float* alpha, F scale, bf16_t* phi, bf16_t* plo,
                            int64_t rt_count) {
  const int32_t *lo = w.lo, *hi = w.hi;
  const bool negative = Vec::lane0(scale) < 0.0f;
  bool rescale = false;
  const __m512i upper = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  // The upper 16 bits of each lane of two vectors: rows, the first vector's 16 then the
  // second's; columns, interleaved (lane 2 j from the first's lane j, 2 j + 1 the second's).
  int16_t idx[32];
  for (int j = 0; j < 32; ++j) {
    idx[j] = static_cast<int16_t>(kCols ? 2 * (j / 2) + 1 + (j % 2) * 32
                                        : 2 * (j % 16) + 1 + (j / 16) * 32);
  }
  const __m512i odd = _mm512_loadu_si512(idx);
  const __m512i halves = interleave_idx(16);  // columns: the lo terms of two keys interleaved
  for (int64_t rt = 0; rt < rt_count; ++rt) {
    const int64_t nb = w.active[rt], chunks = (nb + 31) / 32;
    if (nb == 0) continue;
    const bool mask = c0 < w.tmax_lo[rt] || c0 + nb > w.tmin_hi[rt];
    const int64_t v = rt * 16;
    const I vlo = Vec::iload(lo + v), vhi = Vec::iload(hi + v);
    // the tile's probabilities against max m (as -m), to its P tiles; returns their sums
    auto p_tiles = [&](const F neg_m) {
      F lsum = Vec::zero();
      auto p_of = [&](int64_t key) {
        if (key >= nb) return Vec::zero();
        F x = Vec::fmadd(Vec::load(sc + key * rp + v), scale, neg_m);
        if (mask) x = Vec::mask_range(x, Vec::iset1(static_cast<int32_t>(c0 + key)), vlo, vhi);
        const F p = Vec::exp2(x);
        lsum = Vec::add(lsum, p);
        return p;
      };
      for (int64_t kc = 0; kc < chunks; ++kc) {
        // pairs of vectors whose 16-bit halves make the tiles' rows: for P^T (columns), keys 2 i
        // and 2 i + 1 of the chunk, 16 rows each; for P (rows), row r's keys 0-15 and 16-31 of
        // the chunk, transposed from the scores' columns
        __m512 a[16], b[16];
        if constexpr (kCols) {
          for (int i = 0; i < 16; ++i) {
            a[i] = p_of(kc * 32 + 2 * i);
            b[i] = p_of(kc * 32 + 2 * i + 1);
          }
        } else {
          for (int i = 0; i < 16; ++i) a[i] = p_of(kc * 32 + i);
          for (int i = 0; i < 16; ++i) b[i] = p_of(kc * 32 + 16 + i);
          transpose16(a);
          transpose16(b);
        }
        const int64_t tile = (kc * rt_count + rt) * 512;
        for (int r = 0; r < 16; ++r) {
          // hi: p truncated to its upper 16 bits (a bf16 as it is), lo: the rest (exact in fp32)
          // rounded to bf16; one instruction packs the upper halves, one converts both rests
          // (and, for columns, one interleaves them)
          const __m512i ai = _mm512_castps_si512(a[r]), bi = _mm512_castps_si512(b[r]);
          const __m512 ra = _mm512_sub_ps(a[r], _mm512_castsi512_ps(_mm512_and_si512(ai, upper)));
          const __m512 rb = _mm512_sub_ps(b[r], _mm512_castsi512_ps(_mm512_and_si512(bi, upper)));
          __m512i lo_terms = (__m512i)_mm512_cvtne2ps_pbh(rb, ra);
          if constexpr (kCols) lo_terms = _mm512_permutexvar_epi16(halves, lo_terms);
          _mm512_storeu_si512(phi + tile + r * 32, _mm512_permutex2var_epi16(ai, odd, bi));
          _mm512_storeu_si512(plo + tile + r * 32, lo_terms);
        }
      }
      return lsum;
    };
    const F m_old = Vec::load(m + v);
    if (_mm512_cmp_ps_mask(m_old, Vec::set1(-HUGE_VALF), _CMP_EQ_OQ) == 0) {
      const F lsum = p_tiles(Vec::sub(Vec::zero(), m_old));
      if (_mm512_cmp_ps_mask(lsum, Vec::set1(kAmxLazyLimit), _CMP_LE_OQ) == 0xFFFF) {
        Vec::store(l + v, Vec::add(Vec::load(l + v), lsum));
        Vec::store(alpha + v, Vec::set1(1.0f));
        continue;
      }
    }
    // The largest scaled score as the largest raw one, scaled (the smallest where the scale is
    // negative): rounding is monotonic, so this is the max of the products, one multiply a row
    // where each score took one. Masked keys are -inf (+inf when negative), which scale to -inf.
    F mb = Vec::set1(negative ? HUGE_VALF : -HUGE_VALF);
    const F cut = mb;
    for (int64_t kc = 0; kc < nb; ++kc) {
      F x = Vec::load(sc + kc * rp + v);
      if (mask) x = Vec::mask_range(x, Vec::iset1(static_cast<int32_t>(c0 + kc)), vlo, vhi, cut);
      mb = negative ? _mm512_min_ps(mb, x) : Vec::max(mb, x);
    }
    // a row with every key masked stays at -inf (cut times a zero scale would be NaN)
    mb = _mm512_mask_mov_ps(Vec::mul(mb, scale), _mm512_cmp_ps_mask(mb, cut, _CMP_EQ_OQ),
                            Vec::set1(-HUGE_VALF));
    const F m_new = Vec::max(m_old, mb);
    const F m_safe = Vec::replace_neginf(m_new, 0.0f);
    // rows with no max before this block have l and O zero: their factor is 1, not 0, so that
    // a tile's first block rescales nothing
    const F al = _mm512_mask_mov_ps(Vec::exp2(Vec::sub(m_old, m_safe)),
                                    _mm512_cmp_ps_mask(m_old, Vec::set1(-HUGE_VALF), _CMP_EQ_OQ),
                                    Vec::set1(1.0f));
    const F lsum = p_tiles(Vec::sub(Vec::zero(), m_safe));
    Vec::store(l + v, Vec::fmadd(Vec::load(l + v), al, lsum));
    Vec::store(m + v, m_new);
    Vec::store(alpha + v, al);
    rescale = rescale || !Vec::all_equal(al, Vec::set1(1.0f));
  }
  return rescale;
}

// Whether an item of rp rows takes P V in columns (O^T += V^T P^T: V transposed once per block,
// no transpose per row tile) or in rows (O += P V: P transposed per row tile, V only paired).
// Transposing V costs about d / 22 times one row tile's transposes of P (a 32-key chunk of V^T
// takes 80 shuffles per 16 values of d, a row tile's chunk of P 128 less the 16 its columns
// add), so columns pay from about 3 / 4 d rows on: on the SPR machine, calls alternated in one
// process, one thread, 16 rows of d = 64 ran 0.90x and 64 rows 1.06x in columns, 16 rows of
// d = 128 0.88x.
inline bool pv_in_columns(int64_t rp, int64_t d) { return 4 * rp >= 3 * d; }

// The rows' online softmax over keys [rr.kb, rr.ke) of one KV head in tiles (attend_rows' contract:
// on entry w.qt holds the n real q rows as pairs and the padded rows zero (stage_q_pair_tiles),
// w.lo / w.hi every padded row's range; on return w.o, w.m, w.l hold each row's unnormalized
// output, running max and sum). kCols: P V in columns (pv_in_columns).
template <bool kCols>
inline void amx_attend_rows(const Args& a, const Shape& s, const bf16_t* kbase, const bf16_t* vbase,
                            const AmxScratch& w, const RowRanges& rr, int64_t n, int64_t rp) {
  const int64_t d = a.head_dim, bk = kAmxBlockKeys, rt_count = rp / 16, steps = d / 32;
  float* const acc = kCols ? w.ot : w.o;  // O^T or O
  for (int64_t r = 0; r < rp; ++r) {
    w.m[r] = -HUGE_VALF;
    w.l[r] = 0.0f;
  }
  for (int64_t rt = 0; rt < rt_count; ++rt) {
    // the keys the tile's real rows read; the unmasked keys of all 16 (padding rows have row 0's)
    const RowRanges kr = reduce_ranges(w.lo, w.hi, rt * 16, std::min(n, rt * 16 + 16));
    const RowRanges all = reduce_ranges(w.lo, w.hi, rt * 16, rt * 16 + 16);
    w.tkb[rt] = static_cast<int32_t>(kr.kb);
    w.tke[rt] = static_cast<int32_t>(kr.ke);
    w.tmax_lo[rt] = static_cast<int32_t>(all.max_lo);
    w.tmin_hi[rt] = static_cast<int32_t>(all.min_hi);
    w.started[rt] = 0;
  }
  const F qscale = Vec::set1(s.q_scale);
  const int64_t kst = a.k_cache.s_token, vst = a.v_cache.s_token;
  // K and V rows of `tokens` keys from `key` on, to L2 (per_step left to the caller)
  auto block_prefetch = [&](int64_t key, int64_t tokens) {
    BlockPrefetch p;
    p.k = reinterpret_cast<const char*>(kbase + key * kst);
    p.v = reinterpret_cast<const char*>(vbase + key * vst);
    p.kst = kst * 2;
    p.vst = vst * 2;
    p.run = d * 2;
    p.tokens = std::max<int64_t>(0, tokens);
    p.to_l2 = true;
    return p;
  };
  {  // the first block: no block before it to spread over
    BlockPrefetch first = block_prefetch(rr.kb, std::min(bk, rr.ke - rr.kb));
    first.per_step = first.tokens * ((first.run + 63) / 64);
    first.step();
  }
  const TileScope tiles;
  for (int64_t c0 = rr.kb; c0 < rr.ke; c0 += bk) {
    const int64_t nb = std::min(bk, rr.ke - c0);
    const int64_t ktiles = (nb + 15) / 16, chunks = (nb + 31) / 32;
    // The next block's K and V rows to L2, spread over this block's tile calls (one step per
    // call): a K tile's 16 rows are a token stride apart, each in another 4 KB page where the
    // hardware prefetchers stop, and without this the tile loads waited on them; issued all at
    // once (as attend_rows does for fp32 caches), the prefetches stalled on the fill buffers.
    // Pairs of row tiles (the tile loops' unit) of which a row sees a key of the block, and how
    // far into the block (a causal item's rows end at their diagonal: whole key tiles and P V
    // chunks past a pair's last key are skipped).
    int64_t rt_pairs = 0;
    for (int64_t rt = 0; rt < rt_count; rt += 2) {
      int64_t keys = 0;
      for (int64_t t = rt; t < std::min(rt + 2, rt_count); ++t) {
        if (w.tkb[t] < c0 + nb && w.tke[t] > c0)
          keys = std::max(keys, std::min<int64_t>(nb, w.tke[t] - c0));
      }
      for (int64_t t = rt; t < std::min(rt + 2, rt_count); ++t)
        w.active[t] = static_cast<int32_t>(keys);
      rt_pairs += keys > 0;
    }
    BlockPrefetch pf = block_prefetch(c0 + nb, std::min(bk, rr.ke - c0 - nb));
    const int64_t calls = std::max<int64_t>(1, (ktiles + 1) / 2 * rt_pairs + rt_pairs * d / 32);
    pf.per_step = (pf.tokens * ((pf.run + 63) / 64) + calls - 1) / calls;
    k_tiles(kbase + c0 * kst, kst, nb, ktiles, d, w.kp);
    for (int64_t t = 0; t < ktiles; t += 2) {
      for (int64_t rt = 0; rt < rt_count; rt += 2) {
        const int64_t pair_tiles = (w.active[rt] + 15) / 16;
        if (t >= pair_tiles) continue;
        const bool two = t + 1 < pair_tiles;
        pf.step();
        if (rt + 1 < rt_count) {
          if (two) {
            qk_tiles<2, 2>(w.kp, w.qt, rp, rt, steps, w.sc, t);
          } else {
            qk_tiles<1, 2>(w.kp, w.qt, rp, rt, steps, w.sc, t);
          }
        } else if (two) {
          qk_tiles<2, 1>(w.kp, w.qt, rp, rt, steps, w.sc, t);
        } else {
          qk_tiles<1, 1>(w.kp, w.qt, rp, rt, steps, w.sc, t);
        }
      }
    }
    const bool rescale =
        softmax_p_tiles<kCols>(w.sc, rp, c0, w, w.m, w.l, w.alpha, qscale, w.phi, w.plo, rt_count);
    if (rescale) {
      for (int64_t rt = 0; rt < rt_count; ++rt) {
        const F al = Vec::load(w.alpha + rt * 16);
        if (!w.active[rt] || Vec::all_equal(al, Vec::set1(1.0f))) continue;
        if constexpr (kCols) {  // O^T's columns are the rows: one vector of factors per tile
          for (int64_t x = 0; x < d; ++x) {
            float* o = acc + x * rp + rt * 16;
            Vec::store(o, Vec::mul(Vec::load(o), al));
          }
        } else {
          for (int64_t r = rt * 16; r < rt * 16 + 16; ++r) {
            if (w.alpha[r] == 1.0f) continue;
            const F ar = Vec::set1(w.alpha[r]);
            for (int64_t x = 0; x < d; x += W)
              Vec::store(acc + r * d + x, Vec::mul(Vec::load(acc + r * d + x), ar));
          }
        }
      }
    }
    const int64_t dtiles = d / 16;  // even: d is a multiple of 32
    if constexpr (kCols) {
      v_tiles(vbase + c0 * vst, vst, nb, chunks, d, w.vp);
    } else {
      v_pairs(vbase + c0 * vst, vst, nb, chunks * 16, d, w.vp);
    }
    for (int64_t rt = 0; rt < rt_count; rt += 2) {
      const int64_t pair_chunks = (w.active[rt] + 31) / 32;
      if (pair_chunks == 0) continue;
      const bool fresh = !w.started[rt];
      for (int64_t dt = 0; dt < dtiles; dt += 2) {
        pf.step();
        if constexpr (kCols) {
          if (rt + 1 < rt_count) {
            pv_col_tiles<2>(acc, rp, w.phi, w.plo, rt_count, w.vp, dtiles, rt, dt, pair_chunks,
                            fresh);
          } else {
            pv_col_tiles<1>(acc, rp, w.phi, w.plo, rt_count, w.vp, dtiles, rt, dt, pair_chunks,
                            fresh);
          }
        } else if (rt + 1 < rt_count) {
          pv_row_tiles<2, 2>(acc, d, w.phi, w.plo, rt_count, w.vp, rt, dt, pair_chunks, fresh);
        } else {
          pv_row_tiles<1, 2>(acc, d, w.phi, w.plo, rt_count, w.vp, rt, dt, pair_chunks, fresh);
        }
      }
      for (int64_t t = rt; t < std::min(rt + 2, rt_count); ++t) w.started[t] = 1;
    }
    pf.per_step = pf.tokens * ((pf.run + 63) / 64);  // what the steps left, if any
    pf.step();
  }
}

inline void amx_attend(const Args& a, const Shape& s, const bf16_t* kbase, const bf16_t* vbase,
                       const AmxScratch& w, const RowRanges& rr, int64_t n, int64_t rp) {
  if (pv_in_columns(rp, a.head_dim)) return amx_attend_rows<true>(a, s, kbase, vbase, w, rr, n, rp);
  amx_attend_rows<false>(a, s, kbase, vbase, w, rr, n, rp);
}

// The n rows' unnormalized outputs after amx_attend, 16 rows at a time: begin(r0, count) for rows
// r0 .. r0 + count - 1 (count <= 16), then emit(r, x, values x..x+15 of row r0 + r) for each. In
// columns (pv_in_columns) they come out of O^T transposed per 16 rows and 16 values, straight to
// the caller's rows (where a pass to O in rows first stored and loaded them once more); in rows,
// out of O; zeros for rows of a tile that no key reached.
template <typename Begin, typename Emit>
inline void amx_output(const AmxScratch& w, int64_t n, int64_t rp, int64_t d, Begin&& begin,
                       Emit&& emit) {
  const bool cols = pv_in_columns(rp, d);
  for (int64_t r0 = 0; r0 < n; r0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - r0);
    begin(r0, count);
    if (!w.started[r0 / 16]) {  // no key reached these rows: their sums are zero, never written
      for (int64_t r = 0; r < count; ++r)
        for (int64_t x = 0; x < d; x += 16) emit(r, x, Vec::zero());
      continue;
    }
    if (!cols) {
      for (int64_t r = 0; r < count; ++r)
        for (int64_t x = 0; x < d; x += 16) emit(r, x, Vec::load(w.o + (r0 + r) * d + x));
      continue;
    }
    for (int64_t x0 = 0; x0 < d; x0 += 16) {
      __m512 z[16];
      for (int x = 0; x < 16; ++x) z[x] = Vec::load(w.ot + (x0 + x) * rp + r0);
      transpose16(z);  // z[r]: row r0 + r
      for (int64_t r = 0; r < count; ++r) emit(r, x0, z[r]);
    }
  }
}

// prefill_item and shared_item (isa_kernels.h) on the tiles: the same rows, ranges and outputs.
inline void amx_prefill_item(const Args& a, const Shape& s, const Request& rq, const WorkItem& it,
                             float* scratch, const PartialView* part) {
  const int64_t d = a.head_dim;
  const RowMap map{it.q_begin, s.group, it.kv_head};
  const int64_t n = (it.q_end - it.q_begin) * s.group;
  const int64_t rp = round_up(n, 16);
  const AmxScratch w(scratch, d, rp, kAmxBlockKeys);
  const RowRanges rr = row_ranges(a, rq, it, map, n, rp, w.lo, w.hi);
  stage_q_pair_tiles([&](int64_t r) { return q_row(a, rq, map.query(r), map.head(r)); }, n, d, w.qt,
                     rp);
  amx_attend(a, s, cache_ptr<bf16_t>(a.k_cache, rq.row, 0, it.kv_head),
             cache_ptr<bf16_t>(a.v_cache, rq.row, 0, it.kv_head), w, rr, n, rp);
  if (part) {  // a partial of the row's keys: m, l and the unnormalized output (emit_row's)
    float* acc = nullptr;
    amx_output(
        w, n, rp, d,
        [&](int64_t r0, int64_t count) {
          acc = part->acc + r0 * s.dp;
          for (int64_t r = r0; r < r0 + count; ++r) {
            part->m[r] = w.m[r];
            part->l[r] = w.l[r];
          }
        },
        [&](int64_t r, int64_t x, F v) { Vec::store(acc + r * s.dp + x, v); });
    return;
  }
  bf16_t* dst[16];  // emit_row's output rows (q's dtype: bf16, amx_rows) and scales, 16 at a time
  float scale[16];
  amx_output(
      w, n, rp, d,
      [&](int64_t r0, int64_t count) {
        for (int64_t r = 0; r < count; ++r) {
          dst[r] = static_cast<bf16_t*>(out_row(a, rq, map.query(r0 + r), map.head(r0 + r)));
          const float l = w.l[r0 + r];
          scale[r] = l > 0.0f ? s.out_scale / l : 0.0f;
        }
      },
      [&](int64_t r, int64_t x, F v) { Vec::store(dst[r] + x, Vec::mul(v, Vec::set1(scale[r]))); });
}

inline void amx_shared_item(const Args& a, const Shape& s, const Request& rq, const WorkItem& it,
                            float* scratch) {
  const int64_t d = a.head_dim, n = it.num_rows;
  const int64_t rp = round_up(n, 16);
  const AmxScratch w(scratch, d, rp, kAmxBlockKeys);
  for (int64_t r = 0; r < rp; ++r) {
    w.lo[r] = static_cast<int32_t>(it.k_begin);
    w.hi[r] = static_cast<int32_t>(it.k_end);
  }
  RowRanges rr;
  rr.kb = rr.max_lo = it.k_begin;
  rr.ke = rr.min_hi = it.k_end;
  stage_q_pair_tiles([&](int64_t r) { return it.rows[r].q; }, n, d, w.qt, rp);
  amx_attend(a, s, cache_ptr<bf16_t>(a.k_cache, rq.row, 0, it.kv_head),
             cache_ptr<bf16_t>(a.v_cache, rq.row, 0, it.kv_head), w, rr, n, rp);
  const SharedRow* rows = nullptr;
  amx_output(
      w, n, rp, d,
      [&](int64_t r0, int64_t count) {
        rows = it.rows + r0;
        for (int64_t r = 0; r < count; ++r) {
          *rows[r].m = w.m[r0 + r];
          *rows[r].l = w.l[r0 + r];
        }
      },
      [&](int64_t r, int64_t x, F v) { Vec::store(rows[r].acc + x, v); });
}

inline void amx_run_item(const Args& a, const Shape& s, const Request& rq, const WorkItem& it,
                         float* scratch, const PartialView* part) {
  if (a.cache_dtype == DType::kBFloat16 && amx_rows<bf16_t>(a)) {
    if (it.kind == ItemKind::kPrefill) return amx_prefill_item(a, s, rq, it, scratch, part);
    if (it.kind == ItemKind::kShared) return amx_shared_item(a, s, rq, it, scratch);
  }
  run_item(a, s, rq, it, scratch, part);
}

inline int64_t amx_kernel_scratch_floats(const Args& a, const Shape& s) {
  return std::max(scratch_floats(a, s), amx_scratch_floats(a, s));
}

inline int64_t amx_prefill_rows(const Args& a) {
  return a.cache_dtype == DType::kBFloat16 && amx_rows<bf16_t>(a) ? kAmxRows : kPrefillRows;
}

inline KernelTable amx_table(const char* name) {
  return KernelTable{name, W, &amx_run_item, &amx_kernel_scratch_floats, &amx_prefill_rows};
}
