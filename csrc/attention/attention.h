// CPU attention over dense KV caches: FlashAttention's flash_attn_with_kvcache, for a whole batch
// in one call.
//
// Why a native kernel: a Python loop with one torch SDPA call per request reads K/V at about half
// the machine's streaming rate in decode and pays ~55 us of dispatch per request and layer. This
// kernel plans (request, KV head, query block, key split) work items for the whole batch, runs
// them on the OpenMP runtime torch already uses, and reads every K/V row once per GQA group.
//
// Contract (FlashAttention semantics, FA3 varlen form):
// - Request i has Lq_i queries and new_i new keys. Its cache row is cache_batch_idx[i] (default
//   i); cache_seqlens[i] tokens are cached before the call. The new keys/values are written IN
//   PLACE at positions [cache_seqlens[i], cache_seqlens[i] + new_i) of that row, then attention
//   covers Lk_i = cache_seqlens[i] + new_i keys.
// - Query j of request i sits at absolute position p = j + Lk_i - Lq_i. It sees key t iff
//   t in [0, Lk_i), t >= p - window_left (when window_left >= 0), and t <= p (causal) or
//   t <= p + window_right (not causal, window_right >= 0). A query that sees no key outputs 0.
// - GQA: query head h reads KV head h / (num_heads / num_kv_heads).
// - Memory: no key position at or beyond Lk_i, nor below the window start of the request's
//   first query, is ever read (those pages may be unmapped). Nothing is written before every
//   argument has been checked. A shared prefix is read from one member's row, below its
//   cache_seqlens.
// - fp8 caches hold raw bytes (e4m3fn or e5m2); a cache value is stored * descale. New fp32/bf16/
//   fp16 keys are written as vLLM 0.32's CPU backend writes them (cpu_attn_reshape_and_cache):
//   x * (1 / descale), clamped to the format's largest finite value, mantissa truncated toward
//   zero, -0 and underflow stored as +0 (see fp8.h).
//
// No torch and no Python here: raw pointers, element strides, plain C++17 (+ OpenMP).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vattention {
namespace attention {

enum class DType : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kFloat8E4M3 = 3,  // float8_e4m3fn: caches only
  kFloat8E5M2 = 4,  // float8_e5m2: caches only
};

// One operand of shape [*, tokens, heads, dim] with a contiguous last dimension: element
// (b, t, h, d) is at data + b * s_batch + t * s_token + h * s_head + d (strides in elements).
struct Operand {
  void* data = nullptr;
  int64_t s_batch = 0;
  int64_t s_token = 0;
  int64_t s_head = 0;
};

struct Args {
  int64_t num_requests = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  DType dtype = DType::kFloat32;        // q, out, k_new, v_new
  DType cache_dtype = DType::kFloat32;  // k_cache, v_cache: dtype, or an fp8 format

  // Queries and output. Varlen: cu_seqlens_q[n + 1] (request i's queries are tokens
  // [cu[i], cu[i+1]) at batch index 0, s_batch unused); fixed: cu_seqlens_q == nullptr and every
  // request has seqlen_q queries at batch index i, tokens [0, seqlen_q).
  Operand q, out;
  const int32_t* cu_seqlens_q = nullptr;
  int64_t seqlen_q = 0;
  int64_t q_tokens = 0;  // varlen: rows q holds (bounds cu_seqlens_q)

  // New keys/values (k_new.data == nullptr: none). Varlen: aligned with q (request i's new keys
  // are tokens [cu_seqlens_q[i], cu_seqlens_q[i+1])); fixed: seqlen_new per request.
  Operand k_new, v_new;
  int64_t seqlen_new = 0;

  // Caches [B, S, Hkv, D]; the row of request i is cache_batch_idx[i] (nullptr: i).
  Operand k_cache, v_cache;
  int64_t cache_batch = 0;  // B
  int64_t cache_len = 0;    // S
  const int32_t* cache_seqlens = nullptr;    // [n], required
  const int32_t* cache_batch_idx = nullptr;  // [n] or nullptr

  float softmax_scale = 1.0f;
  bool causal = false;
  int64_t window_left = -1;   // -1: unlimited
  int64_t window_right = -1;  // -1: unlimited (ignored when causal: 0)
  float k_descale = 1.0f;     // fp8 caches only
  float v_descale = 1.0f;

  // Shared prefixes (both nullptr: none), a hint that never changes the result. Requests with
  // the same prefix_group[i] >= 0 promise identical K/V at key positions [0, min(prefix_len[i],
  // prefix_len[j])) of their rows (-1: no group), as the rows read after this call's appends (the
  // kernel only uses positions below every member's cache_seqlens, which no append of this call
  // writes in a member's own row). The kernel then reads that prefix once for the
  // group's decode queries that see all of it (cascade attention: one item per KV head with the
  // queries of every member as its rows), and each member's own keys separately. A prefix-cache
  // hit gives this: the same block's pages behind several rows.
  const int32_t* prefix_group = nullptr;  // [n] or nullptr
  const int32_t* prefix_len = nullptr;    // [n] or nullptr

  int num_threads = 1;  // OpenMP team size (pass torch.get_num_threads())
};

constexpr int64_t kMaxHeadDim = 512;

// Validates `args` (std::invalid_argument naming the argument and the limit, before anything is
// written), appends the new keys/values and writes the attention output.
void flash_attn_with_kvcache(const Args& args);

// The instruction set the kernels dispatch to: "amx" (AMX-BF16 tiles for bf16 prefill, with
// avx512's vector code for the rest), "avx512bf16" (AVX-512 with vdpbf16ps), "avx512", "avx2" or
// "generic". The best this CPU supports is chosen once; VATTENTION_ATTENTION_ISA=<name> in the
// environment, or set_kernel_isa(), selects a lower one (tests, benchmarks).
const char* kernel_isa();

// One instruction-set variant of the kernels, as this build and this CPU see it.
struct KernelVariant {
  std::string name;                  // "amx", "avx512bf16", "avx512", "avx2", "generic"
  bool compiled = false;  // in this build (not x86-64, or VATTENTION_SKIP_*: left out)
  std::vector<std::string> needs;  // CPU features it runs on, spelled as /proc/cpuinfo does
  std::vector<std::string> missing;  // those of `needs` this CPU (with its OS) lacks
  // Why the OS does not let this process use a state the variant needs although the CPU has
  // it ("" when it does): AMX's tile data, which Linux grants per process on request.
  std::string refused;
  bool runnable() const { return compiled && missing.empty() && refused.empty(); }
};

// Every variant, best first; the kernels run the first runnable one unless told otherwise.
// Asks the OS for AMX's tile state (once per process) where the CPU has AMX.
std::vector<KernelVariant> kernel_variants();

// Features of this CPU that no variant uses (AMX-INT8, AMX-FP16, AVX512-FP16), /proc/cpuinfo
// spelling: a CPU with them runs (and tests) the variants above.
std::vector<std::string> unused_cpu_features();

// Selects the kernels by name for the whole process ("" = the best this CPU supports). Returns
// false, changing nothing, when this build or CPU cannot run `name`. Not for use while another
// thread is inside flash_attn_with_kvcache.
bool set_kernel_isa(const char* name);

// The tuning the kernels take: "intel" on Intel CPUs, "other" elsewhere. It picks among
// choices that were measured differently on the two vendors' cores (software prefetches, the
// order of fp32 decode's P V) and never changes a result, bit for bit.
const char* kernel_tuning();

// Selects the tuning by name for the whole process ("intel", "other"; "" = this CPU's), so that
// either is tested on any CPU. Returns false, changing nothing, for another name. Not for use
// while another thread is inside flash_attn_with_kvcache.
bool set_kernel_tuning(const char* name);

}  // namespace attention
}  // namespace vattention
