// The attention kernels compiled for AVX-512 (F, BW, VL, DQ) + FMA + F16C + BF16, picked at run
// time by attention.cpp: as isa_avx512.cpp, plus vdpbf16ps for the decode dot products of bf16
// caches. vec_avx512.h and isa_kernels.h are included inside namespace isa_avx512bf16 under a
// target pragma, so only these functions use the wider instructions (the rest of the build stays
// baseline).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "attention/plan.h"

#if defined(__x86_64__) && !defined(VATTENTION_SKIP_AVX512BF16)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16")
// GCC 12's AVX-512 intrinsics self-initialize their "undefined" operands (__Y = __Y), which
// -W(maybe-)uninitialized reports at every use: a false positive of the headers. The same kernel
// code compiles with these warnings on in isa_avx2.cpp and isa_generic.cpp.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace vattention {
namespace attention {
namespace isa_avx512bf16 {
#define VATTN_AVX512_BF16 1
// clang-format off: the vector type must come before the kernels that use it.
#include "attention/vec_avx512.h"
#include "attention/isa_kernels.h"
// clang-format on
}  // namespace isa_avx512bf16

KernelTable kernels_avx512bf16() { return isa_avx512bf16::table("avx512bf16"); }
bool avx512bf16_compiled() { return true; }
}  // namespace attention
}  // namespace vattention
#pragma GCC pop_options
#else
// Not x86-64, or a build that leaves these kernels out (VATTENTION_SKIP_AVX512BF16: the sanitizer
// build on a CPU that cannot run them, Makefile): the generic kernels stand in.
namespace vattention {
namespace attention {
KernelTable kernels_avx512bf16() { return kernels_generic(); }
bool avx512bf16_compiled() { return false; }
}  // namespace attention
}  // namespace vattention
#endif
