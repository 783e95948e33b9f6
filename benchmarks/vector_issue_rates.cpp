// How many of a few AVX-512 instructions one core issues per second, each in a loop of 16
// independent registers (so throughput, not latency, sets the rate): the FMA, the bf16 dot
// product and the shuffles and shifts that widen bf16 to fp32. docs/benchmarks.md quotes it for
// the SPR machine, where VDPBF16PS ran at a quarter of VFMADD231PS's rate. x86-64 with
// AVX512-BF16 only:
//
//   g++ -O2 -mavx512f -mavx512bw -mavx512bf16 benchmarks/vector_issue_rates.cpp -o /tmp/rates
//   /tmp/rates
#include <chrono>
#include <cstdio>

#define R16(I) I(0) I(1) I(2) I(3) I(4) I(5) I(6) I(7) I(8) I(9) I(10) I(11) I(12) I(13) I(14) I(15)
#define FMA(j) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #j "\n\t"
#define DPB(j) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #j "\n\t"
#define ZXW(j) "vpmovzxwd %%ymm30, %%zmm" #j "\n\t"
#define SLL(j) "vpslld $16, %%zmm30, %%zmm" #j "\n\t"
#define UNP(j) "vpunpcklwd %%zmm30, %%zmm31, %%zmm" #j "\n\t"

constexpr long kIters = 20000000;

// Billions of instructions a second: kIters passes of the 16 in BODY.
#define RATE(NAME, BODY)                                                                           \
  double NAME() {                                                                                  \
    long n = kIters;                                                                               \
    const auto t = std::chrono::steady_clock::now();                                               \
    asm volatile(                                                                                  \
        "vxorps %%zmm30, %%zmm30, %%zmm30\n\tvxorps %%zmm31, %%zmm31, %%zmm31\n\t"                 \
        "1:\n\t" BODY "dec %0\n\tjnz 1b\n\t"                                                       \
        : "+r"(n)                                                                                  \
        :                                                                                          \
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
          "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm30", "xmm31");                          \
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();  \
    return kIters * 16.0 / s / 1e9;                                                                \
  }

RATE(fma, R16(FMA))
RATE(dpbf16, R16(DPB))
RATE(zxw, R16(ZXW))
RATE(sll, R16(SLL))
RATE(unp, R16(UNP))

int main() {
  for (int round = 0; round < 3; ++round) {
    std::printf(
        "billion a second: vfmadd231ps %.2f, vdpbf16ps %.2f, vpmovzxwd %.2f, vpslld %.2f, "
        "vpunpcklwd %.2f\n",
        fma(), dpbf16(), zxw(), sll(), unp());
  }
}
