// The AMX tile state, and the tile products of bf16 decode items' scores. A fragment: isa_amx.cpp
// includes it after vec_avx512.h and before isa_kernels.h (whose decode_item calls
// decode_tile_scores where VATTN_AMX_TILES is defined), inside its own namespace, under a target
// pragma with amx-tile and amx-bf16; amx_kernels.h (prefill and shared-prefix items) uses the
// tile state too.
#define VATTN_AMX_TILES 1

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes for the scope's lifetime; released at its end (tile state in use
// makes every context switch save 8 KB more, and some CPUs keep a lower frequency meanwhile).
// Inactive (active false): touches no tile state.
class TileScope {
 public:
  explicit TileScope(bool active = true) : active_(active) {
    if (!active_) return;
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
  }
  ~TileScope() {
    if (active_) _tile_release();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  bool active_;
};

// Orders the vector code's stores before the tile loads that read them: GCC's tileloadd asm
// takes the address only, with no memory operand, so it is no barrier by itself.
inline void tiles_see_stores() { asm volatile("" ::: "memory"); }

// The fewest keys of a decode item whose scores take the tiles: an item pays for the tile state
// (configured and released), its q pairs' packing and a partial group's copy, which cost more
// than the vector dot products over short rows (SPR, `bench_attention_variants.py amx avx512`,
// 16 / 4 x 64, two threads; with every item on the tiles: 0.83x at 16 rows x 16 keys, 0.97x at
// 48, 0.90x at 64 rows x 64, 1.03x at 16 x 128, 1.13x-1.26x from 512 on; with this floor: 16 x
// 128 1.02x-1.05x, 16 x 256 1.11x, 64 x 256 1.05x, and the same code under it).
constexpr int64_t kDecodeTileMinKeys = 128;

// K rows of a block's nb keys (kst apart) as A tiles, each 16 rows of 32 values contiguous
// ([tile][step][16][32]); rows past nb zero.
inline void k_tiles(const bf16_t* k, int64_t kst, int64_t nb, int64_t ktiles, int64_t d,
                    bf16_t* kp) {
  const int64_t steps = d / 32;
  for (int64_t key = 0; key < ktiles * 16; ++key) {
    bf16_t* dst = kp + ((key / 16) * steps * 16 + key % 16) * 32;
    if (key < nb) {
      const bf16_t* src = k + key * kst;
      for (int64_t x = 0; x < steps; ++x)
        _mm512_storeu_si512(dst + x * 512, _mm512_loadu_si512(src + x * 32));
    } else {
      for (int64_t x = 0; x < steps; ++x)
        _mm512_storeu_si512(dst + x * 512, _mm512_setzero_si512());
    }
  }
}

// Scratch (in 32-bit words) of decode_tile_scores' q pairs for hc heads, and of its copy of a
// block's last, partial group of keys (k_tiles: one tile of 16 rows x 64 bytes per 32 values of d).
inline int64_t decode_tile_q_words(int64_t hc, int64_t d) { return hc * (d / 2) * 16; }
inline int64_t decode_tile_pad_words(int64_t d) { return d / 32 * 16 * 16; }

// Scores of one chunk of a decode item's heads over a block of nb keys, on the tiles, unscaled:
// sc[key][lane] = K_hh[key] . q_lane, the lanes being the chunk's (head hh, row r) pairs,
// lane = hh P + r, so that a key's 16 scores are one vector of decode_item's score tiles (there a
// tile holds one token when HC P = 16). The product is S^T = K Q^T, whose A operand, 16 keys' rows
// of one head and 32 values of d, is read from the cache where it lies (a token stride apart),
// with no repacking: q is the operand that goes in pairs (qt: [hc][d / 2][16] words, head hh's
// rows in its own lanes and zeros in the other heads', packed once per item), and each head's
// products accumulate into the same C tile. A product of 16 rows took about 1.7 times one of a
// head's 4 rows on the SPR machine (10.3 against 6.0 ns, benchmarks/amx_tile_rows.cpp), so these
// tiles spend that much more than vLLM's decode tiles (a head's rows against keys packed in its
// cache) for the same scores, and no repacking of K; still far less than the vector dot products.
// Four groups of 16 keys at a time (accumulators 0-3, A in 4 and 5, B in 6): one B load per four
// products. The block's last group, where fewer than 16 keys remain, is copied to pad with zero
// rows past nb (k_tiles, once per head; rows past the item's range may not be mapped at all).
inline void decode_tile_scores(const int32_t* qt, int64_t hc, const bf16_t* k, int64_t kst,
                               int64_t d, int64_t nb, int32_t* pad, float* sc) {
  const int64_t steps = d / 32, groups = (nb + 15) / 16, last = (groups - 1) * 16;
  bf16_t* padk = reinterpret_cast<bf16_t*>(pad);
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
    const int64_t ng = std::min<int64_t>(4, groups - g0);
    const bool partial = g0 + ng == groups && nb % 16 != 0;  // this batch ends in the last group
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t hh = 0; hh < hc; ++hh) {
      const bf16_t* kh = k + hh * d;
      if (partial) k_tiles(kh + last * kst, kst, nb - last, 1, d, padk);
      for (int64_t x = 0; x < steps; ++x) {
        tiles_see_stores();
        _tile_loadd(6, qt + (hh * (d / 2) + x * 16) * 16, 64);
        for (int64_t j = 0; j < ng; ++j) {
          const int64_t key = (g0 + j) * 16;
          const bool padded = partial && key == last;
          const void* src = padded ? padk + x * 512 : kh + key * kst + x * 32;
          const int64_t stride = padded ? 64 : kst * static_cast<int64_t>(sizeof(bf16_t));
          // tile numbers are immediates: one case per accumulator, A alternating between 4 and 5
          switch (j) {
            case 0:
              _tile_loadd(4, src, stride);
              _tile_dpbf16ps(0, 4, 6);
              break;
            case 1:
              _tile_loadd(5, src, stride);
              _tile_dpbf16ps(1, 5, 6);
              break;
            case 2:
              _tile_loadd(4, src, stride);
              _tile_dpbf16ps(2, 4, 6);
              break;
            default:
              _tile_loadd(5, src, stride);
              _tile_dpbf16ps(3, 5, 6);
              break;
          }
        }
      }
    }
    float* c = sc + g0 * 16 * 16;
    _tile_stored(0, c, 64);
    if (ng > 1) _tile_stored(1, c + 256, 64);
    if (ng > 2) _tile_stored(2, c + 512, 64);
    if (ng > 3) _tile_stored(3, c + 768, 64);
  }
}
