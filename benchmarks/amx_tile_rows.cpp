// How long one TDPBF16PS takes when its A operand (and C) has 16, 8, 4 or 1 rows: four
// independent accumulators, two A and two B tile loads per four products (the kernel's loop), each
// row count warmed up once outside the timing, then the row counts alternated over many rounds;
// it prints the fastest and the median round, as the machine this was made for shares its AMX
// unit with another tenant at times (products then take about three times as long), and checks
// that each row count's C rows equal the first rows of the 16-row product. The CPU attention
// kernel's decode scores (csrc/attention/amx_tiles.h) use 16-row tiles where vLLM's use a head's
// 4 rows: on the SPR machine a 16-row product took about 1.7 times a 4-row one (10.3 against 6.0
// ns; with all-zero operands every row count took about 6 ns, docs/benchmarks.md). x86-64 Linux
// with AMX-BF16 only:
//
//   g++ -O2 -mamx-tile -mamx-bf16 benchmarks/amx_tile_rows.cpp -o /tmp/tile_rows
//   /tmp/tile_rows
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

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
  // bf16 values 1 + i / 128 and 1 - i / 256 (exact), so that the products are not all zero
  for (int i = 0; i < 2 * kSteps * 512; ++i) {
    const float av = 1.0f + static_cast<float>(i % 64) / 128,
                bv = 1.0f - static_cast<float>(i % 32) / 256;
    uint32_t ab, bb;
    std::memcpy(&ab, &av, 4);
    std::memcpy(&bb, &bv, 4);
    a_src[i] = static_cast<uint16_t>(ab >> 16);
    b_src[i] = static_cast<uint16_t>(bb >> 16);
  }
  const int row_counts[] = {16, 8, 4, 1};
  auto configure = [](int rows) {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = t == 6 || t == 7 ? 16 : rows;  // B keeps 16 rows (K = 32)
    }
    _tile_loadconfig(&c);
  };
  float full[4 * 256];
  bool equal = true;
  for (int i = 0; i < 4; ++i) {  // warm-up, and the outputs compared
    configure(row_counts[i]);
    products();
    if (i == 0) std::memcpy(full, c_out, sizeof(full));
    for (int t = 0; t < 4; ++t)
      equal = equal && std::memcmp(c_out + t * 256, full + t * 256, row_counts[i] * 64) == 0;
  }
  constexpr int kRounds = 200, kCalls = 20000;
  std::vector<double> times[4];
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < 4; ++i) {
      configure(row_counts[i]);
      const auto t0 = std::chrono::steady_clock::now();
      for (int n = 0; n < kCalls; ++n) products();
      times[i].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  _tile_release();
  for (int i = 0; i < 4; ++i) {
    std::sort(times[i].begin(), times[i].end());
    const double per = 1e9 / kCalls / (4 * kSteps);
    std::printf("A with %2d rows: %.1f / %.1f ns per TDPBF16PS (fastest / median of %d rounds)\n",
                row_counts[i], times[i].front() * per, times[i][kRounds / 2] * per, kRounds);
  }
  std::printf("C rows equal to the 16-row product's: %s\n", equal ? "yes" : "NO");
  return equal ? 0 : 1;
}
