// Paged attention on CPU: torch.ops.kiln_cpu.attend_paged_cpu (built as the module kiln._C).
//
// Reference: attend_paged_reference in kiln/ops/attention.py. This kernel has its semantics: write
// the step's new K/V into the paged cache at slot_mapping, then attend each request's queries
// causally over its whole context (cached prefix plus the new tokens). Query j of request i sits at
// context position seq_len - q_len + j and sees keys 0 .. that position; with a sliding window W > 0
// only keys p - W < j <= p (W keys, its own included, as transformers defines the window). With a
// logit soft-cap C > 0 the scaled scores s become C * tanh(s / C) before the softmax (Gemma 2).
// An FP8 (float8_e4m3fn) cache under float32 or bfloat16 q/k/v holds clamp(x / scale, +-448) with
// per-tensor scales kv_scale = (k_scale, v_scale) (1 when not given); rows are dequantized on load
// (fp8_row_to_float), k_scale is folded into q's pre-scale and v_scale into the output.
// Python side (fake impl, the kiln_cpu::attend_paged op, the correctness check):
// kiln/ops/cpu_attention.py; tests: tests/ops/test_cpu_attention.py; timing: python -m benchmarks.kernels cpu-attention.
//
// Layouts (element strides; only the last dim must be contiguous):
//
//   q     [num_tokens, num_heads,    head_dim]  row-strided views of the fused qkv projection
//   k, v  [num_tokens, num_kv_heads, head_dim]  are read in place, never copied
//   kv_cache[0 = K | 1 = V][block_id][offset in block][kv_head][head_dim]
//   slot = block_id * block_size + offset
//
// Work items: (request, tile of query tokens, kv heads, heads of each kv head's group). An item's
// rows are (query token, query head) pairs; the rows of one kv head share every K/V row it loads
// (and, for bf16, converts to float), so each is read once per item, not once per query head (GQA):
//
//   rows of kv head g:  tok0/h0 tok0/h1 tok0/h2 | tok1/h0 ...   (a group of 3 query heads)
//   keys, 16 a tile:    block_tables[req][0] -> keys 0..15 | block_tables[req][1] -> 16..31 | ...
//
// A decode is one tile of one token and reads each K/V row exactly once: it is memory bound, so
// it takes every kv head and reads whole slots (a slot's heads are adjacent in the cache). A
// prefill chunk is cut into tiles of about kTileRows rows per kv head, one kv head per item. With
// fewer requests than threads decodes take one kv head each, and with fewer items than threads
// (batch-1 decode) a group is split over items. Items go to OpenMP threads dynamically, most
// expensive first: prefill tiles near the end of a long prompt see the most keys.
//
// Per item and tile of L keys (L floats, one vector): scores for groups of 4 rows (one vector
// product per row and key, lanes summed once), an online softmax in base 2 (q is pre-scaled by
// scale * log2(e)), and P x V with the 4 rows' accumulators in registers across the keys. All
// arithmetic is float32. attend_item is a template over L, instantiated for x86-64-v4 (16 floats,
// one zmm), x86-64-v3 (8, one ymm) and the baseline (4), and the widest the CPU runs is picked at
// load time, so one binary is portable and still uses AVX-512 where it exists (vec.h has the
// vector pieces).
//
// History: the first version did one `omp simd` dot product per (row, key) and one axpy per key
// into an accumulator in memory. GCC summed each dot's lanes serially through the stack and
// round-tripped the accumulator per key: about 12 GFLOP/s on one Zen 4 core against 30-50 after.
// The next compiled 16-float vectors for every instruction set (target_clones of one body): on
// AVX2 each was two ymm registers and GCC 12 kept them on the stack. 8 floats there made SmolLM2's
// shapes 3.5-6x faster on a Zen 3 core (decode of 160 keys 95 -> 24 us, a 128-token prefill
// 4.3 -> 0.75 ms; python -m benchmarks.kernels cpu-attention).

#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "error.h"
#include "paged_attention.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <vector>

namespace kiln {
namespace {

constexpr int kTileRows = 32;  // rows (query token x head) per kv head of a prefill work item
constexpr float kLog2E = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------------
// The problem, the work items, per-thread scratch

struct Problem {
  const char* q;  // all pointers are bytes; strides are elements
  int64_t q_tok, q_head;
  const char* k;
  int64_t k_tok, k_head;
  const char* v;
  int64_t v_tok, v_head;
  char* k_cache;
  char* v_cache;
  int64_t c_block, c_slot, c_head;
  char* out;  // contiguous [num_tokens, num_heads, head_dim]
  const int64_t* slot_mapping;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int num_heads, num_kv_heads, group, head_dim, block_size;
  int64_t elt;  // bytes per element of q/k/v/out
  bool bf16;
  int64_t c_elt;  // bytes per element of the cache: elt, or 1 for FP8
  bool c_fp8;     // the cache is float8_e4m3fn (else q's dtype)
  float k_scale, v_scale;  // FP8 cache: cached value * scale = real value
  float scale_log2;  // softmax scale times log2(e): scores are in base 2
  float q_scale;     // what q is pre-scaled by: scale_log2, or scale when soft-capping
  int64_t window;    // sliding window in keys, 0 for none
  float softcap;     // logit soft-cap, 0 for none
};

struct WorkItem {
  int32_t req;
  int32_t kv_head_begin, num_kv_heads;  // kv heads of the item
  int32_t head_begin, num_heads;        // of each kv head's group: heads g * group + head_begin .. + num_heads
  int32_t tok_begin, num_toks;          // query tokens of the request's chunk
  int64_t cost;                         // rows x visible keys, for ordering
};

// Float rows are padded to a whole number of the widest vectors (`padded_dim`), so every width
// reads whole vectors; the pad lanes stay zero. A kernel of L lanes uses the first L keys' entries.
struct Scratch {
  int padded_dim;
  std::vector<float> q;       // [max_rows][padded_dim], pre-scaled queries
  std::vector<float> acc;     // [max_rows][padded_dim], unnormalised outputs
  std::vector<float> scores;  // [max_rows][L], one key tile's scores, then probabilities
  std::vector<float> row_max, row_sum, alpha;  // [max_rows]
  std::vector<float> k_rows, v_rows;           // [L][padded_dim], converted cache rows
  const float* k_ptr[kMaxLanes];
  const float* v_ptr[kMaxLanes];
  Scratch(int max_rows, int head_dim)
      : padded_dim((head_dim + kMaxLanes - 1) / kMaxLanes * kMaxLanes), q(size_t(max_rows) * padded_dim, 0.f),
        acc(size_t(max_rows) * padded_dim), scores(size_t(max_rows) * kMaxLanes), row_max(max_rows),
        row_sum(max_rows), alpha(max_rows), k_rows(size_t(kMaxLanes) * padded_dim, 0.f),
        v_rows(size_t(kMaxLanes) * padded_dim, 0.f) {}
};

// Byte offsets of keys [n0, n0 + count) of kv head 0 from the K or V cache base; a tile may span
// cache blocks when block_size < L.
KILN_INLINE void tile_offsets(const Problem& p, const int32_t* table, int64_t n0, int count, int64_t* offsets) {
  for (int n = 0; n < count; ++n) {
    const int64_t key = n0 + n;
    offsets[n] = (int64_t(table[key / p.block_size]) * p.c_block + (key % p.block_size) * p.c_slot) * p.c_elt;
  }
}

// Float rows of one key tile: read in place (float32 with a whole number of vfloats per row) or
// converted into `buf`.
KILN_INLINE void tile_rows(const Problem& p, const char* cache, const int64_t* offsets, int count, int padded_dim,
                           float* buf, const float** rows) {
  const bool in_place = !p.bf16 && !p.c_fp8 && p.head_dim == padded_dim;
  for (int n = 0; n < count; ++n) {
    const char* src = cache + offsets[n];
    if (in_place) {
      rows[n] = reinterpret_cast<const float*>(src);
    } else {
      if (p.c_fp8) {
        fp8_row_to_float(src, buf + size_t(n) * padded_dim, p.head_dim);
      } else {
        row_to_float(src, p.bf16, buf + size_t(n) * padded_dim, p.head_dim);
      }
      rows[n] = buf + size_t(n) * padded_dim;
    }
  }
}

// Scores of R rows against `count` keys: scores[r][n] = q_r . k_n (one vector product per
// row and key, summed across lanes once at the end).
template <int L, int R>
KILN_INLINE void tile_scores(const float* q, int padded_dim, const float* const* k, int count, float* scores) {
  using vfloat = typename Vec<L>::f;
  for (int n = 0; n < count; ++n) {
    vfloat t[R];
    for (int r = 0; r < R; ++r) t[r] = splat<L>(0.f);
    for (int c = 0; c < padded_dim; c += L) {
      const vfloat kv = load<L>(k[n] + c);
      for (int r = 0; r < R; ++r) t[r] += load<L>(q + size_t(r) * padded_dim + c) * kv;
    }
    for (int r = 0; r < R; ++r) scores[r * L + n] = hsum<L>(t[r]);
  }
}

// acc_r = acc_r * alpha_r + sum_n p_r[n] * v_n for R rows, one vector column of head_dim at a time,
// with the R accumulators in registers across the keys.
template <int L, int R>
KILN_INLINE void tile_accumulate(float* acc, int padded_dim, const float* probs, const float* alpha,
                                 const float* const* v, int count) {
  using vfloat = typename Vec<L>::f;
  for (int c = 0; c < padded_dim; c += L) {
    vfloat a[R];
    for (int r = 0; r < R; ++r) a[r] = load<L>(acc + size_t(r) * padded_dim + c) * alpha[r];
    for (int n = 0; n < count; ++n) {
      const vfloat vv = load<L>(v[n] + c);
      for (int r = 0; r < R; ++r) a[r] += probs[r * L + n] * vv;
    }
    for (int r = 0; r < R; ++r) store<L>(acc + size_t(r) * padded_dim + c, a[r]);
  }
}

// The two passes over rows [r, r + R) of one key tile, for `over_row_groups`.
template <int L, int R>
struct ScoresPass {
  static KILN_INLINE void run(Scratch& s, int r, int count) {
    tile_scores<L, R>(s.q.data() + size_t(r) * s.padded_dim, s.padded_dim, s.k_ptr, count,
                      s.scores.data() + size_t(r) * L);
  }
};

template <int L, int R>
struct AccumulatePass {
  static KILN_INLINE void run(Scratch& s, int r, int count) {
    tile_accumulate<L, R>(s.acc.data() + size_t(r) * s.padded_dim, s.padded_dim, s.scores.data() + size_t(r) * L,
                          s.alpha.data() + r, s.v_ptr, count);
  }
};

// Pass<L, R> over rows [r_begin, num_rows): groups of 4 rows, then one group of the 1-3 left.
template <int L, template <int, int> class Pass>
KILN_INLINE void over_row_groups(Scratch& s, int r_begin, int num_rows, int count) {
  int r = r_begin;
  for (; r + 4 <= num_rows; r += 4) Pass<L, 4>::run(s, r, count);
  switch (num_rows - r) {
    case 3: Pass<L, 3>::run(s, r, count); break;
    case 2: Pass<L, 2>::run(s, r, count); break;
    case 1: Pass<L, 1>::run(s, r, count); break;
    default: break;
  }
}

// Row m's scores for one tile (keys outside [lo, hi) of the tile are masked) become probabilities;
// its running max and sum absorb them, and alpha[m] rescales its accumulator in the accumulate
// pass. A row that sees no key of the tile (outside its window) keeps its state: alpha 1, p 0.
template <int L>
KILN_INLINE void online_softmax_step(const Problem& p, Scratch& s, int m, int lo, int hi) {
  float* sc = s.scores.data() + size_t(m) * L;
  if (lo >= hi) {
    for (int n = 0; n < L; ++n) sc[n] = 0.f;
    s.alpha[m] = 1.f;
    return;
  }
  if (p.softcap > 0.f) {  // scores are scale * q.k here; cap them, then go to base 2
    const float inv_cap = 1.f / p.softcap, cap_log2 = p.softcap * kLog2E;
    for (int n = lo; n < hi; ++n) sc[n] = cap_log2 * std::tanh(sc[n] * inv_cap);
  }
  for (int n = 0; n < lo; ++n) sc[n] = kNegInf;
  for (int n = hi; n < L; ++n) sc[n] = kNegInf;
  const typename Vec<L>::f sv = load<L>(sc);
  const float new_max = std::max(s.row_max[m], hmax<L>(sv));  // finite: the row sees a key of the tile
  const typename Vec<L>::f pv = exp2_nonpositive<L>(sv - new_max);
  store<L>(sc, pv);
  s.alpha[m] = std::exp2(s.row_max[m] - new_max);  // 0 on the first tile (max -inf)
  s.row_sum[m] = s.row_sum[m] * s.alpha[m] + hsum<L>(pv);
  s.row_max[m] = new_max;
}

KILN_INLINE void store_out_row(const Problem& p, const float* acc, float inv_sum, char* dst) {
  if (p.bf16) {
    auto* o = reinterpret_cast<c10::BFloat16*>(dst);
    for (int d = 0; d < p.head_dim; ++d) o[d] = c10::BFloat16(acc[d] * inv_sum);
  } else {
    auto* o = reinterpret_cast<float*>(dst);
#pragma omp simd
    for (int d = 0; d < p.head_dim; ++d) o[d] = acc[d] * inv_sum;
  }
}

// ---------------------------------------------------------------------------------------------
// One work item: its rows attend over the request's context, one tile of L keys at a time (L the
// vector width: the scores of a row's tile are one vector).

template <int L>
KILN_INLINE void attend_item(const Problem& p, const WorkItem& w, Scratch& s) {
  const int D = p.head_dim, P = s.padded_dim, nh = w.num_heads;
  const int rows_per_kv_head = w.num_toks * nh;
  const int num_rows = w.num_kv_heads * rows_per_kv_head;
  const int32_t q_start = p.query_start_loc[w.req];
  const int32_t q_len = p.query_start_loc[w.req + 1] - q_start;
  const int64_t first_pos = int64_t(p.seq_lens[w.req]) - q_len + w.tok_begin;  // context position of token 0
  // Row m: kv head kv_head_begin + m / rows_per_kv_head; within it, token i / nh and head i % nh of
  // the group, where i = m % rows_per_kv_head.
  for (int m = 0; m < num_rows; ++m) {
    const int i = m % rows_per_kv_head;
    const int64_t tok = q_start + w.tok_begin + i / nh;
    const int64_t head = int64_t(w.kv_head_begin + m / rows_per_kv_head) * p.group + w.head_begin + i % nh;
    float* qm = s.q.data() + size_t(m) * P;
    row_to_float(p.q + (tok * p.q_tok + head * p.q_head) * p.elt, p.bf16, qm, D);
#pragma omp simd
    for (int d = 0; d < D; ++d) qm[d] *= p.q_scale;
    s.row_max[m] = kNegInf;
    s.row_sum[m] = 0.f;
  }
  std::fill_n(s.acc.data(), size_t(num_rows) * P, 0.f);

  const int64_t kv_end = first_pos + w.num_toks;  // last token's position + 1
  const int32_t* table = p.block_tables + int64_t(w.req) * p.bt_stride;
  int64_t offsets[L];
  // With a window, keys before the first row's window are never read.
  const int64_t kv_begin = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) / L * L : 0;
  for (int64_t n0 = kv_begin; n0 < kv_end; n0 += L) {
    const int count = int(std::min<int64_t>(L, kv_end - n0));
    tile_offsets(p, table, n0, count, offsets);
    // The item's kv heads one after another over the same slots: a slot's heads are adjacent in
    // the cache, so the tile reads whole runs of memory, not one head's rows out of each.
    for (int g = 0; g < w.num_kv_heads; ++g) {
      const int64_t head_bytes = int64_t(w.kv_head_begin + g) * p.c_head * p.c_elt;
      tile_rows(p, p.k_cache + head_bytes, offsets, count, P, s.k_rows.data(), s.k_ptr);
      tile_rows(p, p.v_cache + head_bytes, offsets, count, P, s.v_rows.data(), s.v_ptr);
      // Rows are in token order, so the rows that see any key of this tile are a suffix.
      const int r_begin = g * rows_per_kv_head + int(std::max<int64_t>(0, n0 - first_pos)) * nh;
      const int r_end = (g + 1) * rows_per_kv_head;
      over_row_groups<L, ScoresPass>(s, r_begin, r_end, count);
      for (int m = r_begin; m < r_end; ++m) {
        const int64_t pos = first_pos + (m % rows_per_kv_head) / nh;
        const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1 - n0) : 0;
        online_softmax_step<L>(p, s, m, int(std::min<int64_t>(lo, count)), int(std::min<int64_t>(count, pos - n0 + 1)));
      }
      over_row_groups<L, AccumulatePass>(s, r_begin, r_end, count);
    }
  }

  for (int m = 0; m < num_rows; ++m) {
    const int i = m % rows_per_kv_head;
    const int64_t tok = q_start + w.tok_begin + i / nh;
    const int64_t head = int64_t(w.kv_head_begin + m / rows_per_kv_head) * p.group + w.head_begin + i % nh;
    store_out_row(p, s.acc.data() + size_t(m) * P, p.v_scale / s.row_sum[m], p.out + (tok * p.num_heads + head) * D * p.elt);
  }
}

// attend_item at the vector width of each instruction set's registers (vec.h): 16 floats on
// x86-64-v4, 8 on v3, 4 on the baseline. The widest the CPU runs is picked once; a test or a
// benchmark may force a narrower one (set_attention_lanes).
using AttendItemFn = void (*)(const Problem&, const WorkItem&, Scratch&);

void attend_item_4(const Problem& p, const WorkItem& w, Scratch& s) { attend_item<4>(p, w, s); }

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KILN_X86_LEVELS 1
__attribute__((target("arch=x86-64-v3"))) void attend_item_8(const Problem& p, const WorkItem& w, Scratch& s) {
  attend_item<8>(p, w, s);
}
__attribute__((target("arch=x86-64-v4"))) void attend_item_16(const Problem& p, const WorkItem& w, Scratch& s) {
  attend_item<16>(p, w, s);
}
#endif

int detect_widest_lanes() {
#if defined(KILN_X86_LEVELS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return 16;
  if (__builtin_cpu_supports("x86-64-v3")) return 8;
#endif
  return 4;
}

int widest_lanes() {
  static const int widest = detect_widest_lanes();
  return widest;
}

std::atomic<int> forced_lanes{0};  // 0: the widest

int attention_lanes() {
  const int forced = forced_lanes.load(std::memory_order_relaxed);
  return forced ? forced : widest_lanes();
}

AttendItemFn attend_item_fn() {
  switch (attention_lanes()) {
#if defined(KILN_X86_LEVELS)
    case 16: return attend_item_16;
    case 8: return attend_item_8;
#endif
    default: return attend_item_4;
  }
}

// One row to FP8 as the reference does it: x / scale in float32 (IEEE division), clamped to +-448,
// rounded to nearest even by c10's conversion (torch's own).
void store_fp8_row(const Problem& p, const char* src, float scale, char* dst) {
  float row[512];  // head_dim <= 512, checked on the host
  row_to_float(src, p.bf16, row, p.head_dim);
  auto* out = reinterpret_cast<c10::Float8_e4m3fn*>(dst);
  for (int d = 0; d < p.head_dim; ++d) {
    out[d] = c10::Float8_e4m3fn(std::min(std::max(row[d] / scale, -448.f), 448.f));
  }
}

// Copy token t's K and V rows (every kv head) into their cache slot.
void store_token(const Problem& p, int64_t t) {
  const int64_t slot = p.slot_mapping[t];
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const size_t row_bytes = size_t(p.head_dim) * p.elt;
  for (int h = 0; h < p.num_kv_heads; ++h) {
    const int64_t dst = (block * p.c_block + offset * p.c_slot + h * p.c_head) * p.c_elt;
    const char* k = p.k + (t * p.k_tok + h * p.k_head) * p.elt;
    const char* v = p.v + (t * p.v_tok + h * p.v_head) * p.elt;
    if (p.c_fp8) {
      store_fp8_row(p, k, p.k_scale, p.k_cache + dst);
      store_fp8_row(p, v, p.v_scale, p.v_cache + dst);
    } else {
      std::memcpy(p.k_cache + dst, k, row_bytes);
      std::memcpy(p.v_cache + dst, v, row_bytes);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: checks, work items, the parallel region

// Items of every request; `parts` splits each group of query heads into that many items.
std::vector<WorkItem> make_items(const Problem& p, int64_t num_reqs, bool whole_slots, int parts) {
  const int toks_per_tile = std::max(1, kTileRows / p.group);
  const int heads_per_part = (p.group + parts - 1) / parts;
  std::vector<WorkItem> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int32_t q_len = p.query_start_loc[r + 1] - p.query_start_loc[r];
    const int32_t ctx_start = p.seq_lens[r] - q_len;
    // A decode reads each K/V row once, so it is memory bound: it takes every kv head and so
    // reads whole slots. A prefill tile reuses each row across its tokens: one kv head each.
    const int kv_heads = whole_slots && q_len == 1 ? p.num_kv_heads : 1;
    for (int32_t t0 = 0; t0 < q_len; t0 += toks_per_tile) {
      const int32_t nt = std::min(toks_per_tile, q_len - t0);
      for (int g = 0; g < p.num_kv_heads; g += kv_heads) {
        for (int h0 = 0; h0 < p.group; h0 += heads_per_part) {
          const int32_t nh = std::min(heads_per_part, p.group - h0);
          const int64_t keys = ctx_start + t0 + nt;
          const int64_t cost = int64_t(kv_heads) * nt * nh * (p.window > 0 ? std::min<int64_t>(keys, p.window + nt) : keys);
          items.push_back({int32_t(r), g, kv_heads, h0, nh, t0, nt, cost});
        }
      }
    }
  }
  return items;
}

// Enough items for the threads, the most expensive first (dynamic scheduling then balances).
std::vector<WorkItem> plan_items(const Problem& p, int64_t num_reqs, int num_threads, int* max_rows) {
  std::vector<WorkItem> items = make_items(p, num_reqs, /*whole_slots=*/num_reqs >= num_threads, 1);
  if (!items.empty() && int64_t(items.size()) < num_threads && p.group > 1) {
    // Batch-1 decode: split the group, at the cost of reading the kv head's rows once per part.
    const int64_t parts = std::min<int64_t>(p.group, (num_threads + items.size() - 1) / items.size());
    items = make_items(p, num_reqs, false, int(parts));
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  *max_rows = 1;
  for (const WorkItem& w : items) *max_rows = std::max(*max_rows, w.num_kv_heads * w.num_toks * w.num_heads);
  return items;
}

void check_metadata(const Problem& p, int64_t num_tokens, int64_t num_reqs, int64_t num_blocks, int64_t table_width) {
  TORCH_CHECK(p.query_start_loc[0] == 0, "query_start_loc must start at 0");
  TORCH_CHECK(p.query_start_loc[num_reqs] <= num_tokens, "query_start_loc ends past the last token");
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int32_t q_len = p.query_start_loc[r + 1] - p.query_start_loc[r];
    const int32_t seq_len = p.seq_lens[r];
    TORCH_CHECK(q_len >= 0 && q_len <= seq_len,
                kiln::message("request ", r, ": query length ", q_len, " vs seq_len ", seq_len));
    const int64_t used = (int64_t(seq_len) + p.block_size - 1) / p.block_size;
    TORCH_CHECK(used <= table_width, kiln::message("request ", r, ": seq_len ", seq_len, " needs ", used,
                                                   " blocks, table has ", table_width));
    for (int64_t b = 0; b < used; ++b) {
      const int32_t id = p.block_tables[r * p.bt_stride + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, kiln::message("request ", r, ": block id ", id, " out of range"));
    }
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = p.slot_mapping[t];
    TORCH_CHECK(slot >= 0 && slot < num_blocks * p.block_size,
                kiln::message("token ", t, ": slot ", slot, " out of range"));
  }
}

// Below this many multiply-adds a step's attention runs on the calling thread alone (about 15 us).
constexpr int64_t kMinParallelWork = int64_t(1) << 18;

at::Tensor last_dim_contiguous(const at::Tensor& x) {
  return x.stride(-1) == 1 ? x : x.contiguous();
}

}  // namespace

// Writes every row of `out` ([num_tokens, num_heads, head_dim], contiguous, q's dtype).
void attend_paged_cpu_into(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                           at::Tensor& kv_cache, const at::Tensor& slot_mapping_in,
                           const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                           const at::Tensor& query_start_loc_in, double scale, int64_t sliding_window,
                           double logit_softcap, const std::optional<at::Tensor>& kv_scale, at::Tensor& out) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.dim() == 3, "q, k, v must be [num_tokens, heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.stride(4) == 1, "kv_cache's last dim must be contiguous");
  const auto dtype = q_in.scalar_type();
  const bool cache_fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              kiln::message("attend_paged_cpu supports float32 and bfloat16, got ", dtype));
  TORCH_CHECK(k_in.scalar_type() == dtype && v_in.scalar_type() == dtype && out.scalar_type() == dtype &&
                  (cache_fp8 || kv_cache.scalar_type() == dtype),
              "q, k, v and out must have one dtype, and kv_cache that dtype or float8_e4m3fn");
  const int64_t T = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  const int64_t KVH = kv_cache.size(3), BS = kv_cache.size(2), NB = kv_cache.size(1);
  TORCH_CHECK(kv_cache.size(4) == D && k_in.sizes() == v_in.sizes() && k_in.size(0) == T && k_in.size(1) == KVH &&
                  k_in.size(2) == D,
              "shape mismatch between q, k, v and kv_cache");
  TORCH_CHECK(out.sizes() == q_in.sizes() && out.is_contiguous(), "out must be contiguous with q's shape");
  TORCH_CHECK(H % KVH == 0, kiln::message("num_heads (", H, ") must be a multiple of num_kv_heads (", KVH, ")"));
  TORCH_CHECK(!cache_fp8 || D <= 512, "an FP8 cache needs head_dim <= 512");
  float k_scale = 1.f, v_scale = 1.f;
  if (kv_scale.has_value() && cache_fp8) {  // scales of a cache that is not FP8 are ignored
    TORCH_CHECK(kv_scale->device().is_cpu() && kv_scale->numel() == 2, "kv_scale must be 2 values on the CPU");
    const at::Tensor s = kv_scale->to(at::kFloat).contiguous();
    k_scale = s.data_ptr<float>()[0], v_scale = s.data_ptr<float>()[1];
    TORCH_CHECK(k_scale > 0.f && v_scale > 0.f, "kv_scale must be positive");
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q_in, &k_in, &v_in, &kv_cache, &slot_mapping_in,
                                                                      &block_tables_in, &seq_lens_in,
                                                                      &query_start_loc_in, &out}) {
    TORCH_CHECK(t->device().is_cpu(), "attend_paged_cpu needs CPU tensors");
  }
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const at::Tensor slot_mapping = slot_mapping_in.to(at::kLong).contiguous();
  const at::Tensor block_tables = block_tables_in.to(at::kInt).contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kInt).contiguous();
  const at::Tensor query_start_loc = query_start_loc_in.to(at::kInt).contiguous();
  const int64_t num_reqs = seq_lens.numel();
  TORCH_CHECK(slot_mapping.numel() == T, "slot_mapping needs one slot per token");
  TORCH_CHECK(query_start_loc.numel() == num_reqs + 1, "query_start_loc needs num_reqs + 1 entries");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= num_reqs, "block_tables must be [num_reqs, width]");

  Problem p{};
  p.q = static_cast<const char*>(q.data_ptr());
  p.q_tok = q.stride(0), p.q_head = q.stride(1);
  p.k = static_cast<const char*>(k.data_ptr());
  p.k_tok = k.stride(0), p.k_head = k.stride(1);
  p.v = static_cast<const char*>(v.data_ptr());
  p.v_tok = v.stride(0), p.v_head = v.stride(1);
  p.k_cache = static_cast<char*>(kv_cache.data_ptr());
  p.v_cache = p.k_cache + kv_cache.stride(0) * kv_cache.element_size();
  p.c_elt = kv_cache.element_size();
  p.c_fp8 = cache_fp8;
  p.k_scale = k_scale, p.v_scale = v_scale;
  p.c_block = kv_cache.stride(1), p.c_slot = kv_cache.stride(2), p.c_head = kv_cache.stride(3);
  p.out = static_cast<char*>(out.data_ptr());
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.bt_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.num_heads = int(H), p.num_kv_heads = int(KVH), p.group = int(H / KVH), p.head_dim = int(D), p.block_size = int(BS);
  p.elt = q.element_size();
  p.bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(sliding_window >= 0 && logit_softcap >= 0, "sliding_window and logit_softcap must be >= 0 (0: off)");
  p.scale_log2 = float(scale) * kLog2E;
  p.window = sliding_window;
  p.softcap = float(logit_softcap);
  p.q_scale = (p.softcap > 0.f ? float(scale) : p.scale_log2) * p.k_scale;
  check_metadata(p, T, num_reqs, NB, block_tables.size(1));

  // Rows past query_start_loc[-1] (padding) belong to no request: zeros, not garbage.
  const int64_t num_real = p.query_start_loc[num_reqs];
  if (num_real < T) std::memset(p.out + num_real * H * D * p.elt, 0, size_t(T - num_real) * H * D * p.elt);

  // A step too small to pay for waking a second thread (decodes over short contexts) runs on this
  // one: on 2 cores, 64 keys of SmolLM2's 9 heads take 13 us on one thread and 14 us on two, and
  // 200+ us on two while another process holds a core (the team waits at the barriers).
  int64_t work = 0;  // multiply-adds of QK^T and PV
  for (int64_t r = 0; r < num_reqs; ++r) {
    work += int64_t(p.query_start_loc[r + 1] - p.query_start_loc[r]) * p.seq_lens[r] * H * D * 2;
  }
  const int num_threads = at::in_parallel_region() || work < kMinParallelWork ? 1 : at::get_num_threads();
  int max_rows = 1;
  const std::vector<WorkItem> items = plan_items(p, num_reqs, num_threads, &max_rows);
  const int64_t num_items = int64_t(items.size());
  const AttendItemFn attend = attend_item_fn();
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) store_token(p, t);
    // The implicit barrier above: every new key is in the cache before any item reads it.
    Scratch scratch(max_rows, p.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) attend(p, items[i], scratch);
  }
}

namespace {

at::Tensor attend_paged_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                            double logit_softcap, const std::optional<at::Tensor>& kv_scale) {
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  attend_paged_cpu_into(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                        sliding_window, logit_softcap, kv_scale, out);
  return out;
}

at::Tensor& attend_paged_cpu_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                                 const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                 int64_t sliding_window, double logit_softcap,
                                 const std::optional<at::Tensor>& kv_scale, at::Tensor& out) {
  attend_paged_cpu_into(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                        sliding_window, logit_softcap, kv_scale, out);
  return out;
}

// The vector width the kernel runs at from now on: 0 for the widest this CPU has, or 4, 8 or 16
// floats where it has them (tests check each against the reference; benchmarks compare them).
// Returns the width in use; a width the CPU cannot run leaves it unchanged (these two ops never
// throw: kiln.ops.cpu_attention.set_attention_lanes turns a refusal into a Python error).
int64_t set_attention_lanes(int64_t lanes) {
  if (lanes == 0 || ((lanes == 4 || lanes == 8 || lanes == 16) && lanes <= widest_lanes())) {
    forced_lanes.store(int(lanes), std::memory_order_relaxed);
  }
  return attention_lanes();
}

int64_t max_attention_lanes() { return widest_lanes(); }

}  // namespace
}  // namespace kiln

// The out= overload lets the correctness check hand in an output poisoned with NaN.
TORCH_LIBRARY(kiln_cpu, m) {
  m.def(
      "attend_paged_cpu(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window=0, "
      "float logit_softcap=0., Tensor? kv_scale=None) -> Tensor");
  m.def(
      "attend_paged_cpu.out(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window=0, "
      "float logit_softcap=0., Tensor? kv_scale=None, *, Tensor(b!) out) -> Tensor(b!)");
  m.def("set_attention_lanes(int lanes) -> int", TORCH_FN(kiln::set_attention_lanes));
  m.def("max_attention_lanes() -> int", TORCH_FN(kiln::max_attention_lanes));
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("attend_paged_cpu", &kiln::attend_paged_cpu);
  m.impl("attend_paged_cpu.out", &kiln::attend_paged_cpu_out);
}

// Importing kiln._C runs the registrations above; the module itself has no attributes.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "kiln's C++ kernels, registered as torch.ops.kiln_cpu",
                               -1, nullptr};
  return PyModule_Create(&module);
}
