// The attention kernels compiled for AVX2 + FMA + F16C, picked at run time by attention.cpp.
// vec_avx2.h and isa_kernels.h are included inside namespace isa_avx2 under a target pragma,
// so only these functions use the wider instructions (the rest of the build stays baseline).
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

#if defined(__x86_64__) && !defined(VATTENTION_SKIP_AVX2)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace vattention {
namespace attention {
namespace isa_avx2 {
// clang-format off: the vector type must come before the kernels that use it.
#include "attention/vec_avx2.h"
#include "attention/isa_kernels.h"
// clang-format on
}  // namespace isa_avx2

KernelTable kernels_avx2() { return isa_avx2::table("avx2"); }
bool avx2_compiled() { return true; }
}  // namespace attention
}  // namespace vattention
#pragma GCC pop_options
#else
// Not x86-64, or a build that leaves these kernels out (VATTENTION_SKIP_AVX2: a build that will
// not run the CPU kernel, such as `make gpu-check`'s): the generic kernels stand in.
namespace vattention {
namespace attention {
KernelTable kernels_avx2() { return kernels_generic(); }
bool avx2_compiled() { return false; }
}  // namespace attention
}  // namespace vattention
#endif
