// The attention kernels compiled for AVX-512 (F, BW, VL, DQ) + FMA + F16C + BF16 with AMX tiles
// (AMX-TILE, AMX-BF16), picked at run time by attention.cpp where the CPU has them and the OS has
// granted this process the tile state: the avx512 kernels, whose prefill and shared-prefix items
// on bf16 caches run as tile matmuls (amx_kernels.h), and whose bf16 decode items take their
// scores from tile products where a tile holds one token (amx_tiles.h, VATTN_AMX_TILES, which
// isa_kernels.h's decode_item checks). vec_avx512.h, amx_tiles.h, isa_kernels.h and
// amx_kernels.h are included inside namespace isa_amx under a target pragma, so only these
// functions use the tile instructions (the rest of the build stays baseline).
//
// Its vector code is avx512's, not avx512bf16's: VATTN_AVX512_BF16 stays undefined, so QK^T of bf16
// items the tiles do not take (other decode items, head sizes not a multiple of 32) widens K to
// fp32 for FMAs instead of taking VDPBF16PS. On the SPR machine VDPBF16PS (32 products) issued
// once per two cycles where VFMADD231PS (16) issued twice a cycle, so with K widened once for all
// the rows that read it the FMAs did the same work in fewer cycles (docs/benchmarks.md, "Intel
// (SPR, AMX): QK^T on FMAs"); on Zen 4, where the dot product runs at full rate, avx512bf16 keeps
// it.
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

#if defined(__x86_64__) && !defined(VATTENTION_SKIP_AMX)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16,amx-tile,amx-bf16")
// GCC 12's AVX-512 intrinsics self-initialize their "undefined" operands (__Y = __Y), which
// -W(maybe-)uninitialized reports at every use: a false positive of the headers (isa_avx512.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace vattention {
namespace attention {
namespace isa_amx {
// clang-format off: the vector type must come before the kernels that use it.
#include "attention/vec_avx512.h"
#include "attention/amx_tiles.h"
#include "attention/isa_kernels.h"
#include "attention/amx_kernels.h"
// clang-format on
}  // namespace isa_amx

KernelTable kernels_amx() { return isa_amx::amx_table("amx"); }
bool amx_compiled() { return true; }
}  // namespace attention
}  // namespace vattention
#pragma GCC pop_options
#else
// Not x86-64, or a build that leaves these kernels out (VATTENTION_SKIP_AMX: the sanitizer build
// on a CPU without AMX, Makefile): the generic kernels stand in.
namespace vattention {
namespace attention {
KernelTable kernels_amx() { return kernels_generic(); }
bool amx_compiled() { return false; }
}  // namespace attention
}  // namespace vattention
#endif
