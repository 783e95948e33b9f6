// How long one TDPBF16PS takes when its A operand (and C) has 16, 8, 4 or 1 rows: four
// independent accumulators, two A and two B tile loads per four products (the kernel's loop), the
// row counts alternated over many rounds and the fastest round kept, as the machine this was made
// for shares its AMX unit with another tenant at times (products then take about three times as
// long). The CPU attention kernel's decode scores (csrc/attention/amx_tiles.h) rest on the
// answer: on the SPR machine every row count took the same time (docs/benchmarks.md), so a tile
// of 16 keys by 16 (head, row) lanes costs what a tile of one head's 4 rows costs. x86-64 Linux
// with AMX-BF16 only:
//
//   g++ -O2 -mamx-tile -mamx-bf16 benchmarks/amx_tile_rows.cpp -o /tmp/tile_rows
//   /tmp/tile_rows
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kSteps = 16;  // 4 products a step
alignas(64) static uint16_t a_src[2 * kSteps * 512], b_src[2 * kSteps * 512];
alignas(64) static float c_out[4 * 256];

__attribute__((noinline)) void products() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int x = 0; x < kSteps; ++x) {
    _tile_loadd(4, a_src + x * 512, 64);
    _tile_loadd(6, b_src + x * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b_src + (kSteps + x) * 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a_src + (kSteps + x) * 512, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c_out, 64);
  _tile_stored(1, c_out + 256, 64);
  _tile_stored(2, c_out + 512, 64);
  _tile_stored(3, c_out + 768, 64);
}

int main() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::puts("the OS refused the AMX tile state");
    return 1;
  }
  const int row_counts[] = {16, 8, 4, 1};
  double best[4] = {1e9, 1e9, 1e9, 1e9};
  constexpr int kRounds = 200, kCalls = 20000;
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < 4; ++i) {
      TileConfig c;
      for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = t == 6 || t == 7 ? 16 : row_counts[i];  // B keeps 16 rows (K = 32)
      }
      _tile_loadconfig(&c);
      const auto t0 = std::chrono::steady_clock::now();
      for (int n = 0; n < kCalls; ++n) products();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s < best[i]) best[i] = s;
    }
  }
  _tile_release();
  for (int i = 0; i < 4; ++i) {
    std::printf("A with %2d rows: %.1f ns per TDPBF16PS (fastest of %d rounds)\n", row_counts[i],
                best[i] / kCalls / (4 * kSteps) * 1e9, kRounds);
  }
  return 0;
}
