// What the planner (attention.cpp) hands the per-ISA kernels (isa_kernels.h): one request's
// geometry, one work item, where a split item leaves its partial result, and the table of kernel
// entry points of one instruction set.
//
// Included before any target pragma (see convert.h): these types and inline helpers are the
// same baseline code in every translation unit.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attention.h"
#include "convert.h"

namespace vattention {
namespace attention {

// Request i after validation: row of the cache, its queries and keys.
struct Request {
  int64_t index = 0;    // i
  int64_t row = 0;      // cache row (cache_batch_idx[i])
  int64_t q_start = 0;  // first query token (varlen: cu_seqlens_q[i]; fixed: 0)
  int64_t lq = 0;       // queries
  int64_t past = 0;     // keys cached before the call
  int64_t nnew = 0;     // new keys appended by the call
  int64_t new_start = 0;
  int64_t lk = 0;       // keys attended: past + nnew
};

// The keys query j (0-based within its request) may see: [lo, hi), empty when lo >= hi.
inline void key_range(const Args& a, const Request& rq, int64_t j, int64_t* lo, int64_t* hi) {
  const int64_t p = j + rq.lk - rq.lq;  // absolute position of the query
  int64_t l = 0, h = rq.lk;
  if (a.causal) {
    h = std::min(h, p + 1);
  } else if (a.window_right >= 0) {
    h = std::min(h, p + a.window_right + 1);
  }
  if (a.window_left >= 0) l = std::max<int64_t>(0, p - a.window_left);
  if (h <= l) l = h = 0;
  *lo = l;
  *hi = h;
}

// Query row (token j of request rq, query head h) of q, and its output row.
inline const void* q_row(const Args& a, const Request& rq, int64_t j, int64_t h) {
  const int64_t esize = a.dtype == DType::kFloat32 ? 4 : 2;
  const int64_t off = rq.index * a.q.s_batch + (rq.q_start + j) * a.q.s_token + h * a.q.s_head;
  return static_cast<const char*>(a.q.data) + off * esize;
}

inline void* out_row(const Args& a, const Request& rq, int64_t j, int64_t h) {
  const int64_t esize = a.dtype == DType::kFloat32 ? 4 : 2;
  const int64_t off =
      rq.index * a.out.s_batch + (rq.q_start + j) * a.out.s_token + h * a.out.s_head;
  return static_cast<char*>(a.out.data) + off * esize;
}

enum class ItemKind : int32_t { kDecode = 0, kPrefill = 1, kShared = 2 };

// One row of a shared-prefix item: a member's query row (its q, already offset to the query and
// head) and where the row's partial result (m, l, acc[dp]) goes.
struct SharedRow {
  const void* q = nullptr;
  float* m = nullptr;
  float* l = nullptr;
  float* acc = nullptr;
};

// One unit of parallel work: the rows of queries [q_begin, q_end) x all group heads of KV heads
// [kv_head, kv_head + kv_heads) of one request, against keys [k_begin, k_end) (already clipped
// to what those rows see). Decode items take every KV head of a request, prefill items one.
// partial >= 0: a key split; the item writes (m, l, unnormalized acc) of its rows (row index
// head * rows_per_head + row) to partial slot `partial` and a combine step writes the output.
// kShared: the prefix [k_begin, k_end) (or part `prefix_part` of it) of group `share_group` for
// KV head kv_head, read from the row of `request`; its rows are `rows[0, num_rows)` (any members'
// queries), each writing its own partial row. The members' decode items then cover only the keys
// after the prefix (they always write a partial, combined with the prefix's).
struct WorkItem {
  int32_t request = 0;
  int32_t kv_head = 0;
  int32_t kv_heads = 1;
  int32_t q_begin = 0;
  int32_t q_end = 0;
  int64_t k_begin = 0;
  int64_t k_end = 0;
  ItemKind kind = ItemKind::kDecode;
  int32_t partial = -1;
  int32_t share_group = -1;         // kShared
  int32_t prefix_part = 0;          // kShared
  const SharedRow* rows = nullptr;  // kShared
  int32_t num_rows = 0;
  int32_t rows_begin = 0;           // kShared: index of rows in the plan (until resolved)
  double cost = 0;
};

// Partial result of one split item: rows x (m, l, acc[head_dim_padded]).
struct PartialView {
  float* m = nullptr;    // [rows] running max (base-2 scaled scores)
  float* l = nullptr;    // [rows] sum of 2^(s - m)
  float* acc = nullptr;  // [rows][dp] sum of 2^(s - m) * v (v_descale not applied)
};

// The call's work items as a running item sees them: the index of the next one a thread will
// claim, so that an item ending its last key block can prefetch that item's first (decode_item).
// `next` is read relaxed, as a hint: whichever thread claims the item, its first rows are then
// already coming from memory (in the prefetching core's caches, nearer than memory to any).
struct ItemQueue {
  const int64_t* next = nullptr;
  const WorkItem* items = nullptr;
  int64_t n = 0;
  const Request* reqs = nullptr;
};

// Call-wide constants the kernels share.
struct Shape {
  const ItemQueue* queue = nullptr;  // null: items run with no view of the others
  int64_t group = 1;     // query heads per KV head
  int64_t dp = 0;        // head_dim rounded up to the vector width
  int64_t block_keys = 0;  // keys per block (softmax granularity)
  float q_scale = 1.0f;  // softmax_scale * log2(e) * k_descale, folded into q
  float out_scale = 1.0f;  // v_descale
  int64_t prefill_rows = 64;  // rows (queries x group heads) per prefill or shared-prefix item
  // Whether fp32 prefill items prefetch each next key block into L2 (attend_rows): not on Intel
  // cores, where it cost more than it saved; elsewhere (measured on AMD's, where it helps) yes.
  bool prefetch_prefill_blocks = true;
  // Whether decode items with one row per KV head over contiguous rows of a 16-bit cache
  // prefetch each next key block (decode_item): on Intel cores, where it was measured to help.
  bool prefetch_single_rows = false;
  // Whether fp32 decode items with one row per KV head run P V in passes of as many heads as fit
  // the registers where a chunk's heads do not all fit (decode_item): on Intel cores, where it
  // was measured faster than the token-by-token loop; on Zen 4 it was slower.
  bool pv_head_groups = false;
  // Whether a decode item's last key block over contiguous rows prefetches the first block of
  // the item claimed next (decode_item, queue): not on Intel cores, where it slowed short rows
  // (a Xeon with AMX: 100-200 tokens a row 0.81x-0.96x); elsewhere (measured on AMD's, where
  // it helped them) yes.
  bool prefetch_next_item = true;
};

// Entry points of one instruction set.
struct KernelTable {
  const char* name;
  int width;  // floats per vector
  // Runs one work item with thread-private scratch of at least scratch_floats(...) floats.
  void (*run_item)(const Args& a, const Shape& s, const Request& rq, const WorkItem& it,
                   float* scratch, const PartialView* partial);
  int64_t (*scratch_floats)(const Args& a, const Shape& s);
  // Rows per prefill or shared-prefix item for this call (a multiple of 16).
  int64_t (*prefill_rows)(const Args& a);
};

constexpr int kMaxDecodeRows = 8;    // rows (queries x group heads) per KV head of a decode item
// Rows per prefill item of the vector kernels (a multiple of every vector width).
constexpr int kPrefillRows = 64;

KernelTable kernels_amx();
KernelTable kernels_avx512bf16();
KernelTable kernels_avx512();
KernelTable kernels_avx2();
KernelTable kernels_generic();
bool amx_compiled();
bool avx512bf16_compiled();
bool avx512_compiled();
bool avx2_compiled();

}  // namespace attention
}  // namespace vattention
