// One-row bfloat16 and float32 GEMVs on CPU: torch.ops.kiln_cpu.gemv_bf16 and gemv_f32 (built into kiln._C with
// paged_attention.cpp). Python side and when it runs: kiln/ops/cpu_linear.py; tests:
// tests/ops/test_cpu_linear.py; timing: python -m benchmarks.offline quant-cpu.
//
//   y[m, n] = sum_k x[m, k] * w[n, k]     x [M, K] bf16, w [N, K] bf16 (rows contiguous), y float32
//
// Batch-1 decode multiplies one activation row by every weight matrix: the step streams the
// weights once and does one multiply-add per weight element. torch's one-row bf16 paths (oneDNN's
// matmul through F.linear, its reduced-precision GEMV through torch.mv) convert each bfloat16 to
// float and reach about half the bytes per second float32's MKL GEMV does, so bf16 gained nothing.
// Here AVX512-BF16's dot product (vdpbf16ps: 32 bf16 pairs into 16 float lanes, float32 sums)
// takes the weight as stored, four rows at a time sharing each load of x, with a software
// prefetch kPrefetchRows rows ahead: the hardware prefetcher alone left a single core at about
// 60% of the bandwidth MKL's float32 GEMV reaches (measured on a 2-core Xeon with AMX-BF16).
// Rows are split over torch's threads in tiles of 16. Without AVX512-BF16, AVX2 + FMA widen each
// bfloat16 to float32 (exact) and multiply in float32; without either a portable loop computes the
// same sums in another order. Several rows of x (batched decode, short prefills) take register
// blocks of 3 rows of x by 4 weight rows (tile_avx2) on AVX2, in float32 and bfloat16 alike.

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/linear.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "error.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kiln {
namespace {

constexpr int kRows = 4;            // weight rows per inner step, sharing each load of x
constexpr int kPrefetchRows = 20;   // measured: 8 rows ahead gave 10% less, none 40% less
constexpr int64_t kTileRows = 16;   // rows per parallel work unit

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void rows_portable(const uint16_t* w, const uint16_t* x, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += bf16_to_float(w[n * K + k]) * bf16_to_float(x[k]);
    y[n] = acc;
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void rows_avx512bf16(const uint16_t* w, const uint16_t* x, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t kfull = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - kfull)) - 1);
  const int64_t last = N * K;  // prefetches stay inside the weight
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) {
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t ahead = std::min<int64_t>((n + kPrefetchRows) * K, last - 32);
    int64_t k = 0;
    for (; k < kfull; k += 32) {
      __m512i xv = _mm512_loadu_si512(x + k);
      for (int r = 0; r < kRows; ++r) {
        __m512i wv = _mm512_loadu_si512(w + (n + r) * K + k);
        _mm_prefetch(reinterpret_cast<const char*>(w + std::min(ahead + r * K + k, last - 1)), _MM_HINT_T0);
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)wv, (__m512bh)xv);
      }
    }
    if (tail) {
      __m512i xv = _mm512_maskz_loadu_epi16(tail, x + k);
      for (int r = 0; r < kRows; ++r) {
        __m512i wv = _mm512_maskz_loadu_epi16(tail, w + (n + r) * K + k);
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)wv, (__m512bh)xv);
      }
    }
    for (int r = 0; r < kRows; ++r) y[n + r] = _mm512_reduce_add_ps(acc[r]);
  }
  for (; n < n1; ++n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < kfull; k += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + n * K + k), (__m512bh)_mm512_loadu_si512(x + k));
    if (tail)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, w + n * K + k),
                             (__m512bh)_mm512_maskz_loadu_epi16(tail, x + k));
    y[n] = _mm512_reduce_add_ps(acc);
  }
}

// Float32 rows with AVX2 + FMA: two 8-float accumulators a row over 16 columns a step, four rows
// sharing each load of x, and the same software prefetch, kF32PrefetchRows rows ahead. MKL's one-row
// sgemv (what F.linear and Inductor's extern mm call) read 5.6-7.8 GB/s on a 2-vCPU AMD EPYC whose
// memory gives 14 GB/s; this loop read 11-14 GB/s there (python -m benchmarks.kernels cpu-gemv).
// Bfloat16 rows without AVX512-BF16 (AVX2 CPUs such as AMD's Zen 3) take the same loop, each
// bfloat16 widened to float32 exactly (a 16-bit shift): half the bytes at the same memory speed.
constexpr int64_t kF32GemvRows = 64;  // linear_f32's rows through the GEMV off Intel (see there)
constexpr int64_t kF32PrefetchRows = 16;  // measured on the EPYC: none 10-14 GB/s, 16 and 32 11-14, 64 9-13

__attribute__((target("avx2,fma")))
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

__attribute__((target("avx2,fma")))
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

__attribute__((target("avx2,fma")))
inline float hsum8(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_to_float(v); }

template <typename T>
__attribute__((target("avx2,fma")))
void rows_avx2(const T* w, const T* x, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements of one 64-byte line: one prefetch each
  const int64_t prefetch_rows = sizeof(T) == 4 ? kF32PrefetchRows : kPrefetchRows;
  const int64_t k16 = K / 16 * 16;
  const int64_t last = N * K;
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) {
    __m256 a0[kRows], a1[kRows];
    for (int r = 0; r < kRows; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    const int64_t ahead = (n + prefetch_rows) * K;
    int64_t k = 0;
    for (; k < k16; k += 16) {
      const __m256 x0 = load8(x + k), x1 = load8(x + k + 8);
      for (int r = 0; r < kRows; ++r) {
        const T* wr = w + (n + r) * K + k;
        if (k % kLine == 0)
          _mm_prefetch(reinterpret_cast<const char*>(w + std::min(ahead + r * K + k, last - 1)), _MM_HINT_T0);
        a0[r] = _mm256_fmadd_ps(load8(wr), x0, a0[r]);
        a1[r] = _mm256_fmadd_ps(load8(wr + 8), x1, a1[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      float acc = hsum8(_mm256_add_ps(a0[r], a1[r]));
      for (int64_t c = k; c < K; ++c) acc += to_float(w[(n + r) * K + c]) * to_float(x[c]);
      y[n + r] = acc;
    }
  }
  for (; n < n1; ++n) {
    float acc = 0.f;
    for (int64_t c = 0; c < K; ++c) acc += to_float(w[n * K + c]) * to_float(x[c]);
    y[n] = acc;
  }
}

// Several rows of x: rows_avx2 per row of x does one FMA per two loads (a weight vector and x's),
// about 30 GFLOP/s from the cache on a Zen 3 core, so from 2 rows on the linears were bound by
// that loop, not by memory (16 rows: a SmolLM2 layer's linears 4.5 ms). A register block of MR
// rows of x by kRows weight rows keeps MR x kRows 8-float accumulators (12 of AVX2's 16 registers
// at MR = 3) and gives each weight load MR FMAs. x is float32 (bfloat16 callers widen it once).
// prefetch_from >= 0: prefetch that element's rows (kRows of them) in step, as rows_avx2 does.
template <typename T, int MR>
__attribute__((target("avx2,fma")))
void block_avx2(const T* w, const float* x, float* y, int64_t N, int64_t K, int64_t n, int64_t m,
                int64_t prefetch_from) {
  constexpr int64_t kLine = 64 / sizeof(T);
  const int64_t k8 = K / 8 * 8;
  const int64_t last = N * K - 1;
  __m256 acc[MR][kRows];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < kRows; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k8; k += 8) {
    if (prefetch_from >= 0 && k % kLine == 0)
      for (int r = 0; r < kRows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + std::min(prefetch_from + r * K + k, last)), _MM_HINT_T0);
    __m256 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + (m + i) * K + k);
    for (int r = 0; r < kRows; ++r) {
      const __m256 wv = load8(w + (n + r) * K + k);
      for (int i = 0; i < MR; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < kRows; ++r) {
      float s = hsum8(acc[i][r]);
      for (int64_t c = k8; c < K; ++c) s += to_float(w[(n + r) * K + c]) * x[(m + i) * K + c];
      y[(m + i) * N + n + r] = s;
    }
}

constexpr int kBlockM = 3;  // rows of x a block (measured on one Zen 3 core, 15 rows x SmolLM2's o
                            // projection from the cache: 3 rows 49-64 GFLOP/s, 2 rows 40-43, 1 row 33-37)

// y[m, n0:n1] for every row m of x (float32 [M, K]), kRows weight rows at a time, every block of
// x's rows against them while they sit in the L1; the first block prefetches rows ahead.
template <typename T>
__attribute__((target("avx2,fma")))
void tile_avx2(const T* w, const float* x, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t prefetch_rows = sizeof(T) == 4 ? kF32PrefetchRows : kPrefetchRows;
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) {
    const int64_t ahead = (n + prefetch_rows) * K;
    int64_t m = 0;
    for (; m + kBlockM <= M; m += kBlockM) block_avx2<T, kBlockM>(w, x, y, N, K, n, m, m == 0 ? ahead : -1);
    if (M - m == 2) block_avx2<T, 2>(w, x, y, N, K, n, m, m == 0 ? ahead : -1);
    else if (M - m == 1) block_avx2<T, 1>(w, x, y, N, K, n, m, m == 0 ? ahead : -1);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t c = 0; c < K; ++c) acc += to_float(w[n * K + c]) * x[m * K + c];
      y[m * N + n] = acc;
    }
}

bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

bool has_avx512bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}
#endif

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_bf16: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bfloat16 inputs");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv_bf16: CPU tensors");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options().dtype(at::kFloat));
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  float* yp = y.data_ptr<float>();
  auto rows = rows_portable;
#if defined(__x86_64__)
  if (has_avx512bf16()) rows = rows_avx512bf16;
  else if (has_avx2_fma()) rows = rows_avx2<uint16_t>;
#endif
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
#if defined(__x86_64__)
  if (M > 1 && !has_avx512bf16() && has_avx2_fma()) {  // x widened once; blocks of x's rows (tile_avx2)
    const at::Tensor xf = xc.to(at::kFloat);
    const float* xfp = xf.data_ptr<float>();
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        tile_avx2<uint16_t>(wp, xfp, yp, M, N, K, t * kTileRows, std::min(N, (t + 1) * kTileRows));
    });
    return y;
  }
#endif
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {  // a tile read once for all rows of x
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m = 0; m < M; ++m)
        rows(wp, xp + m * K, yp + m * N, N, K, t * kTileRows, std::min(N, (t + 1) * kTileRows));
  });
  return y;
}

// gemv_f32: y [M, N] = x [M, K] @ w [N, K].T in float32, through rows_avx2;
// at::linear where the CPU lacks AVX2 + FMA (a scalar loop would be slower than MKL).
at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_f32: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "gemv_f32: float32 inputs");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv_f32: CPU tensors");
#if defined(__x86_64__)
  if (has_avx2_fma()) {
    const at::Tensor xc = x.contiguous(), wc = w.contiguous();
    const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
    at::Tensor y = at::empty({M, N}, xc.options());
    const float* wp = wc.data_ptr<float>();
    const float* xp = xc.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t tiles = (N + kTileRows - 1) / kTileRows;
    // A tile of weight rows comes from memory once, for every row of x.
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kTileRows, n1 = std::min(N, (t + 1) * kTileRows);
        if (M == 1) rows_avx2<float>(wp, xp, yp, N, K, n0, n1);
        else tile_avx2<float>(wp, xp, yp, M, N, K, n0, n1);
      }
    });
    return y;
  }
#endif
  return at::linear(x, w);
}

using GemvFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&);

// F.linear(x, w, bias) in x's dtype for a weight of `dtype`: up to `gemv_rows` rows of x through
// `gemv`, more through at::linear. `name` is the op's, for its errors.
at::Tensor linear_by_rows(const char* name, const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& bias, at::ScalarType dtype, int64_t gemv_rows,
                          GemvFn gemv) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == dtype, kiln::message(name, ": a ", dtype, " weight [N, K]"));
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.size(-1) == K, kiln::message(name, ": x's last dim must be the weight's K"));
  const int64_t rows = K ? x.numel() / K : 0;
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  at::Tensor y;
  if (rows >= 1 && rows <= gemv_rows) {
    y = gemv(x.reshape({rows, K}).to(dtype), w);
    if (bias.has_value() && bias->defined()) y.add_(*bias);
    y = y.to(x.scalar_type());
  } else {
    y = at::linear(x.to(dtype), w, bias).to(x.scalar_type());
  }
  return y.reshape(out_shape);
}

// linear_f32: F.linear(x, w, bias) for a float32 weight, in x's dtype: one row through gemv_f32 (on
// an Intel Xeon with 2 threads as fast as MKL's GEMV, the LM head 9% faster; on an AMD EPYC twice
// as fast), and off Intel up to kF32GemvRows rows (tile_avx2's register blocks), where MKL's GEMMs
// at these shapes are slow; more rows through at::linear (MKL's GEMM). A SmolLM2 layer's four
// linears at 1 / 2 / 4 / 8 / 16 / 32 / 64 rows, us, gemv_f32 against MKL (python -m benchmarks.kernels cpu-gemv
// --rows, weights read from memory): EPYC 995 / 1103 / 1271 / 1517 / 1957 / 3102 / 5684 against
// 1881 / 3804 / 4093 / 3775 / 4474 / 5102 / 7990, the LM head at 64 rows 46.5 against 87.1 ms
// (at 256 rows MKL's is faster); Xeon, before the register blocks, 706 / 925 / 1322 / 2471 / 4364
// against MKL's 705 / 750 / 1294 / 1456 / 1754.
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
#if defined(__x86_64__)
  static const int64_t gemv_rows = __builtin_cpu_is("intel") ? 1 : kF32GemvRows;
#else
  const int64_t gemv_rows = 1;
#endif
  return linear_by_rows("linear_f32", x, w, bias, at::kFloat, gemv_rows, &gemv_f32);
}

// linear_bf16: F.linear(x, w, bias) for a bfloat16 weight, in x's dtype. One dispatcher call from
// Python in eager mode and an opaque op in compiled graphs, so both get the GEMV at decode. With
// AVX512-BF16 (and AMX) one row takes the GEMV: oneDNN wins from a few rows on. On AVX2 alone its
// bfloat16 matmul is several times slower than the GEMV at every row count measured, so every row
// takes it (EPYC, a SmolLM2 layer's linears: 1781 against 7782 us at 16 rows, 24.3 against 131.6 ms
// at 256).
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
#if defined(__x86_64__)
  const int64_t gemv_rows = has_avx512bf16() ? 1 : has_avx2_fma() ? INT64_MAX : 1;
#else
  const int64_t gemv_rows = 1;
#endif
  return linear_by_rows("linear_bf16", x, w, bias, at::kBFloat16, gemv_rows, &gemv_bf16);
}

#if defined(__x86_64__)
// Scales and zero points of 8 output rows from a group's (s, z) bfloat16 pairs: s, and z - 8 s
// (so that (q - 8) s + z = q s + (z - 8 s)).
__attribute__((target("avx2,fma")))
inline void int4_scales(const uint16_t* pairs_of_8, __m256* s, __m256* z8) {
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256 a = _mm256_permutevar8x32_ps(load8(pairs_of_8), order);      // s0..s3 z0..z3
  const __m256 b = _mm256_permutevar8x32_ps(load8(pairs_of_8 + 8), order);  // s4..s7 z4..z7
  *s = _mm256_permute2f128_ps(a, b, 0x20);
  *z8 = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), *s, _mm256_permute2f128_ps(a, b, 0x31));
}

// One row of x against torch's int4 weights as _convert_weight_to_int4pack_for_cpu packs them on
// an AVX2 CPU: blocks of 32 output rows, [N / 32][K][16] bytes, byte d of column k holding row d
// in its low nibble and row 16 + d in its high one; scales_zeros [K / g, N, 2] bfloat16 (s, z),
// w = (q - 8) s + z. Per group of g columns the block sums t = x . q without scales (an integer op
// and a convert per nibble, one FMA per 8 weights), then adds s t + (z - 8 s) sum(x), where torch's
// kernel dequantizes every weight and rounds x and y to bfloat16 (python -m benchmarks.kernels cpu-int4).
__attribute__((target("avx2,fma")))
void int4_block_avx2(const uint8_t* w, const uint16_t* sz, const float* x, const float* xsums, float* y, int64_t N,
                     int64_t K, int64_t group, int64_t n0) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  __m256 acc[4];
  for (int v = 0; v < 4; ++v) acc[v] = _mm256_setzero_ps();
  const uint8_t* block = w + n0 * K / 2;
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    __m256 t[2][4];  // even and odd columns: two chains of FMAs a row, not one
    for (int u = 0; u < 2; ++u)
      for (int v = 0; v < 4; ++v) t[u][v] = _mm256_setzero_ps();
    for (int64_t k = g0; k < g0 + group; k += 2) {
      for (int u = 0; u < 2; ++u) {
        const uint8_t* col = block + (k + u) * 16;  // each half widened as it loads (vpmovzxbd)
        const __m256i e0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(col)));      // rows 0-7 | 16-23
        const __m256i e1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(col + 8)));  // rows 8-15 | 24-31
        const __m256 xk = _mm256_broadcast_ss(x + k + u);
        t[u][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(e0, low4)), xk, t[u][0]);
        t[u][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(e1, low4)), xk, t[u][1]);
        t[u][2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(e0, 4)), xk, t[u][2]);
        t[u][3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(e1, 4)), xk, t[u][3]);
      }
    }
    const __m256 xsum = _mm256_set1_ps(xsums[g0 / group]);
    const uint16_t* gsz = sz + ((g0 / group) * N + n0) * 2;
    for (int v = 0; v < 4; ++v) {
      __m256 s, z8;
      int4_scales(gsz + 16 * v, &s, &z8);
      acc[v] = _mm256_fmadd_ps(z8, xsum, _mm256_fmadd_ps(s, _mm256_add_ps(t[0][v], t[1][v]), acc[v]));
    }
  }
  for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + n0 + 8 * v, acc[v]);
}
// Two rows of x against a whole 32-row block: each nibble converted once for both, the group's
// sums added into y (zeroed by the caller) instead of held in registers. int4_all_rows_avx2's
// passes of exactly two rows.
__attribute__((target("avx2,fma")))
void int4_block2_avx2(const uint8_t* w, const uint16_t* sz, const float* x, const float* xsums, float* y, int64_t N,
                      int64_t K, int64_t group, int64_t n0, int64_t m0) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  const uint8_t* block = w + n0 * K / 2;
  const float* x0 = x + m0 * K;
  const float* x1 = x0 + K;
  const int64_t groups = K / group;
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    __m256 t[2][4];
    for (int u = 0; u < 2; ++u)
      for (int v = 0; v < 4; ++v) t[u][v] = _mm256_setzero_ps();
    for (int64_t k = g0; k < g0 + group; ++k) {
      const uint8_t* col = block + k * 16;
      const __m256i e0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(col)));
      const __m256i e1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(col + 8)));
      const __m256 a = _mm256_broadcast_ss(x0 + k), b = _mm256_broadcast_ss(x1 + k);
      __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(e0, low4));
      t[0][0] = _mm256_fmadd_ps(q, a, t[0][0]);
      t[1][0] = _mm256_fmadd_ps(q, b, t[1][0]);
      q = _mm256_cvtepi32_ps(_mm256_and_si256(e1, low4));
      t[0][1] = _mm256_fmadd_ps(q, a, t[0][1]);
      t[1][1] = _mm256_fmadd_ps(q, b, t[1][1]);
      q = _mm256_cvtepi32_ps(_mm256_srli_epi32(e0, 4));
      t[0][2] = _mm256_fmadd_ps(q, a, t[0][2]);
      t[1][2] = _mm256_fmadd_ps(q, b, t[1][2]);
      q = _mm256_cvtepi32_ps(_mm256_srli_epi32(e1, 4));
      t[0][3] = _mm256_fmadd_ps(q, a, t[0][3]);
      t[1][3] = _mm256_fmadd_ps(q, b, t[1][3]);
    }
    const int64_t gi = g0 / group;
    const uint16_t* gsz = sz + (gi * N + n0) * 2;
    for (int v = 0; v < 4; ++v) {
      __m256 sc, z8;
      int4_scales(gsz + 16 * v, &sc, &z8);
      for (int u = 0; u < 2; ++u) {
        float* out = y + (m0 + u) * N + n0 + 8 * v;
        const __m256 xs = _mm256_set1_ps(xsums[(m0 + u) * groups + gi]);
        _mm256_storeu_ps(out, _mm256_fmadd_ps(z8, xs, _mm256_fmadd_ps(sc, t[u][v], _mm256_loadu_ps(out))));
      }
    }
  }
}

// R rows of x against one half of a 32-row block: kHalf 0 takes rows 0-15 (the low nibbles), 1
// rows 16-31 (the high ones). Each nibble is converted once for all R rows: at R = 6 a column costs
// 6 integer/convert ops for 12 FMAs, against 10 for 8 in int4_block2_avx2. Accumulators: R x 2
// vectors, t without scales per group as above, added into y (zeroed by the caller).
template <int R, int kHalf>
__attribute__((target("avx2,fma")))
void int4_half_avx2(const uint8_t* w, const uint16_t* sz, const float* x, const float* xsums, float* y, int64_t N,
                    int64_t K, int64_t group, int64_t n0, int64_t m0) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  const uint8_t* block = w + n0 * K / 2;
  const float* xr = x + m0 * K;
  const int64_t groups = K / group;
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    __m256 t[R][2];
    for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
    for (int64_t k = g0; k < g0 + group; ++k) {
      const uint8_t* col = block + k * 16;
      const __m256i e0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(col)));
      const __m256i e1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(col + 8)));
      const __m256 q0 = _mm256_cvtepi32_ps(kHalf == 0 ? _mm256_and_si256(e0, low4) : _mm256_srli_epi32(e0, 4));
      const __m256 q1 = _mm256_cvtepi32_ps(kHalf == 0 ? _mm256_and_si256(e1, low4) : _mm256_srli_epi32(e1, 4));
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(xr + r * K + k);
        t[r][0] = _mm256_fmadd_ps(q0, a, t[r][0]);
        t[r][1] = _mm256_fmadd_ps(q1, a, t[r][1]);
      }
    }
    const int64_t gi = g0 / group;
    const uint16_t* gsz = sz + (gi * N + n0) * 2;
    for (int v = 0; v < 2; ++v) {
      __m256 sc, z8;
      int4_scales(gsz + 16 * (2 * kHalf + v), &sc, &z8);
      for (int r = 0; r < R; ++r) {
        float* out = y + (m0 + r) * N + n0 + 8 * (2 * kHalf + v);
        const __m256 xs = _mm256_set1_ps(xsums[(m0 + r) * groups + gi]);
        _mm256_storeu_ps(out, _mm256_fmadd_ps(z8, xs, _mm256_fmadd_ps(sc, t[r][v], _mm256_loadu_ps(out))));
      }
    }
  }
}

template <int R>
void int4_rows_avx2(const uint8_t* w, const uint16_t* sz, const float* x, const float* xsums, float* y, int64_t N,
                    int64_t K, int64_t group, int64_t n0, int64_t m0) {
  int4_half_avx2<R, 0>(w, sz, x, xsums, y, N, K, group, n0, m0);
  int4_half_avx2<R, 1>(w, sz, x, xsums, y, N, K, group, n0, m0);
}

// Every row of x (M >= 2) against block n0: passes of at most kInt4Rows rows, as even as they come
// (16 rows: 6 + 5 + 5; never fewer than 2), since a pass converts each nibble once whatever its row
// count. A pass of exactly 2 rows keeps int4_block2_avx2, faster there than two halves.
constexpr int64_t kInt4Rows = 6;  // 12 accumulators, 2 weight vectors and a broadcast: 15 registers

void int4_all_rows_avx2(const uint8_t* w, const uint16_t* sz, const float* x, const float* xsums, float* y,
                        int64_t M, int64_t N, int64_t K, int64_t group, int64_t n0) {
  const int64_t passes = (M + kInt4Rows - 1) / kInt4Rows;
  for (int64_t i = 0, m = 0; i < passes; ++i) {
    const int64_t rows = M / passes + (i < M % passes ? 1 : 0);
    switch (rows) {
      case 6: int4_rows_avx2<6>(w, sz, x, xsums, y, N, K, group, n0, m); break;
      case 5: int4_rows_avx2<5>(w, sz, x, xsums, y, N, K, group, n0, m); break;
      case 4: int4_rows_avx2<4>(w, sz, x, xsums, y, N, K, group, n0, m); break;
      case 3: int4_rows_avx2<3>(w, sz, x, xsums, y, N, K, group, n0, m); break;
      default: int4_block2_avx2(w, sz, x, xsums, y, N, K, group, n0, m); break;
    }
    m += rows;
  }
}

// The same products where torch packs for AVX512: blocks of 64 output rows, [N / 64][K][32] bytes,
// byte d of column k holding row d in its low nibble and row 32 + d in its high one. Each 16-byte
// half of a column widens to 16 int32 lanes; a nibble becomes its float q - 8 through a 16-entry
// table (vpermps reads an index's low 4 bits, so the low nibble needs no mask), so w = q' s + z
// and a group adds s t + z sum(x), t = x . q' without scales. R rows of x share each converted
// nibble: 4R accumulators, 4 weight vectors and a broadcast fit the 32 registers up to R = 6.
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void int4_scales16(const uint16_t* pairs_of_16, __m512* s, __m512* z) {
  const __m512i v = _mm512_loadu_si512(pairs_of_16);  // 16 (s, z) pairs, s in the low half of each dword
  *s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  *z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// One row of x against block n0: two chains of FMAs per vector (even and odd columns), the
// block's 64 sums held in registers across groups.
__attribute__((target("avx512f,avx512bw,avx512vl")))
void int4_block_avx512(const uint8_t* w, const uint16_t* sz, const float* x, const float* xsums, float* y, int64_t N,
                       int64_t K, int64_t group, int64_t n0) {
  const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const uint8_t* block = w + n0 * K / 2;
  // The next block's bytes and scales are prefetched while this one runs: its scales lie one
  // 256-byte run per group, N * 4 bytes apart, which the hardware prefetcher does not follow.
  const int64_t next = std::min(n0 + 64, N - 64);
  const uint8_t* ahead = w + next * K / 2;
  __m512 acc[4];
  for (int v = 0; v < 4; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    const char* next_sz = reinterpret_cast<const char*>(sz + ((g0 / group) * N + next) * 2);
    for (int line = 0; line < 4; ++line) _mm_prefetch(next_sz + 64 * line, _MM_HINT_T0);
    __m512 t[2][4];
    for (int u = 0; u < 2; ++u)
      for (int v = 0; v < 4; ++v) t[u][v] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g0 + group; k += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + k * 32), _MM_HINT_T0);
      for (int u = 0; u < 2; ++u) {
        const uint8_t* col = block + (k + u) * 32;
        const __m512i e0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col)));       // rows 0-15 | 32-47
        const __m512i e1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col + 16)));  // rows 16-31 | 48-63
        const __m512 a = _mm512_set1_ps(x[k + u]);
        t[u][0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(e0, lut), a, t[u][0]);
        t[u][1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(e1, lut), a, t[u][1]);
        t[u][2] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(e0, 4), lut), a, t[u][2]);
        t[u][3] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(e1, 4), lut), a, t[u][3]);
      }
    }
    const int64_t gi = g0 / group;
    const __m512 xsum = _mm512_set1_ps(xsums[gi]);
    const uint16_t* gsz = sz + (gi * N + n0) * 2;
    for (int v = 0; v < 4; ++v) {
      __m512 sc, z;
      int4_scales16(gsz + 32 * v, &sc, &z);
      acc[v] = _mm512_fmadd_ps(z, xsum, _mm512_fmadd_ps(sc, _mm512_add_ps(t[0][v], t[1][v]), acc[v]));
    }
  }
  for (int v = 0; v < 4; ++v) _mm512_storeu_ps(y + n0 + 16 * v, acc[v]);
}

// R rows of x (2 to 6) against block n0, each group's sums added into y (zeroed by the caller).
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void int4_rows_avx512(const uint8_t* w, const uint16_t* sz, const float* x, const float* xsums, float* y, int64_t N,
                      int64_t K, int64_t group, int64_t n0, int64_t m0) {
  const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const uint8_t* block = w + n0 * K / 2;
  const float* xr = x + m0 * K;
  const int64_t groups = K / group;
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    __m512 t[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) t[r][v] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g0 + group; ++k) {
      const uint8_t* col = block + k * 32;
      const __m512i e0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col)));
      const __m512i e1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col + 16)));
      const __m512 q0 = _mm512_permutexvar_ps(e0, lut);
      const __m512 q1 = _mm512_permutexvar_ps(e1, lut);
      const __m512 q2 = _mm512_permutexvar_ps(_mm512_srli_epi32(e0, 4), lut);
      const __m512 q3 = _mm512_permutexvar_ps(_mm512_srli_epi32(e1, 4), lut);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(xr[r * K + k]);
        t[r][0] = _mm512_fmadd_ps(q0, a, t[r][0]);
        t[r][1] = _mm512_fmadd_ps(q1, a, t[r][1]);
        t[r][2] = _mm512_fmadd_ps(q2, a, t[r][2]);
        t[r][3] = _mm512_fmadd_ps(q3, a, t[r][3]);
      }
    }
    const int64_t gi = g0 / group;
    const uint16_t* gsz = sz + (gi * N + n0) * 2;
    for (int v = 0; v < 4; ++v) {
      __m512 sc, z;
      int4_scales16(gsz + 32 * v, &sc, &z);
      for (int r = 0; r < R; ++r) {
        float* out = y + (m0 + r) * N + n0 + 16 * v;
        const __m512 xs = _mm512_set1_ps(xsums[(m0 + r) * groups + gi]);
        _mm512_storeu_ps(out, _mm512_fmadd_ps(z, xs, _mm512_fmadd_ps(sc, t[r][v], _mm512_loadu_ps(out))));
      }
    }
  }
}

// Group g0 of block n0's q' as float32, [group][64] (8 KiB for a group of 32, in L1): rows of x
// beyond one pass read it instead of converting each nibble once per pass.
__attribute__((target("avx512f,avx512bw,avx512vl")))
void int4_group_f32_avx512(const uint8_t* block, float* out, int64_t g0, int64_t group) {
  const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t k = g0; k < g0 + group; ++k) {
    const uint8_t* col = block + k * 32;
    const __m512i e0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col)));
    const __m512i e1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col + 16)));
    float* dst = out + (k - g0) * 64;
    _mm512_storeu_ps(dst, _mm512_permutexvar_ps(e0, lut));
    _mm512_storeu_ps(dst + 16, _mm512_permutexvar_ps(e1, lut));
    _mm512_storeu_ps(dst + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(e0, 4), lut));
    _mm512_storeu_ps(dst + 48, _mm512_permutexvar_ps(_mm512_srli_epi32(e1, 4), lut));
  }
}

// int4_rows_avx512's products and sums for one group, q' read from int4_group_f32_avx512's buffer.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void int4_group_rows_avx512(const float* q, const uint16_t* sz, const float* x, const float* xsums, float* y,
                            int64_t N, int64_t K, int64_t group, int64_t n0, int64_t m0, int64_t g0) {
  const float* xr = x + m0 * K;
  const int64_t groups = K / group, gi = g0 / group;
  __m512 t[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) t[r][v] = _mm512_setzero_ps();
  for (int64_t k = g0; k < g0 + group; ++k) {
    const float* qk = q + (k - g0) * 64;
    const __m512 q0 = _mm512_loadu_ps(qk), q1 = _mm512_loadu_ps(qk + 16);
    const __m512 q2 = _mm512_loadu_ps(qk + 32), q3 = _mm512_loadu_ps(qk + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(xr[r * K + k]);
      t[r][0] = _mm512_fmadd_ps(q0, a, t[r][0]);
      t[r][1] = _mm512_fmadd_ps(q1, a, t[r][1]);
      t[r][2] = _mm512_fmadd_ps(q2, a, t[r][2]);
      t[r][3] = _mm512_fmadd_ps(q3, a, t[r][3]);
    }
  }
  const uint16_t* gsz = sz + (gi * N + n0) * 2;
  for (int v = 0; v < 4; ++v) {
    __m512 sc, z;
    int4_scales16(gsz + 32 * v, &sc, &z);
    for (int r = 0; r < R; ++r) {
      float* out = y + (m0 + r) * N + n0 + 16 * v;
      const __m512 xs = _mm512_set1_ps(xsums[(m0 + r) * groups + gi]);
      _mm512_storeu_ps(out, _mm512_fmadd_ps(z, xs, _mm512_fmadd_ps(sc, t[r][v], _mm512_loadu_ps(out))));
    }
  }
}

// Every row of x against block n0 (64 rows): passes of at most kInt4Rows512 rows, as even as they
// come. One pass converts the nibbles as it goes (int4_rows_avx512); with more, each group's q' is
// converted once into a float32 buffer the passes read. Both sum each row, group and lane in the
// same order, so a row's result does not depend on the passes.
constexpr int64_t kInt4Rows512 = 6;

void int4_all_rows_avx512(const uint8_t* w, const uint16_t* sz, const float* x, const float* xsums, float* y,
                          int64_t M, int64_t N, int64_t K, int64_t group, int64_t n0) {
  const int64_t passes = (M + kInt4Rows512 - 1) / kInt4Rows512;
  auto rows_of = [&](int64_t i) { return M / passes + (i < M % passes ? 1 : 0); };
  if (passes == 1) {
    switch (M) {
      case 6: int4_rows_avx512<6>(w, sz, x, xsums, y, N, K, group, n0, 0); break;
      case 5: int4_rows_avx512<5>(w, sz, x, xsums, y, N, K, group, n0, 0); break;
      case 4: int4_rows_avx512<4>(w, sz, x, xsums, y, N, K, group, n0, 0); break;
      case 3: int4_rows_avx512<3>(w, sz, x, xsums, y, N, K, group, n0, 0); break;
      default: int4_rows_avx512<2>(w, sz, x, xsums, y, N, K, group, n0, 0); break;
    }
    return;
  }
  static thread_local std::vector<float> q;
  if (q.size() < size_t(group * 64)) q.resize(group * 64);
  const uint8_t* block = w + n0 * K / 2;
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    int4_group_f32_avx512(block, q.data(), g0, group);
    for (int64_t i = 0, m = 0; i < passes; ++i) {
      const int64_t rows = rows_of(i);
      switch (rows) {  // passes of 3 to 6 rows (M > 6)
        case 6: int4_group_rows_avx512<6>(q.data(), sz, x, xsums, y, N, K, group, n0, m, g0); break;
        case 5: int4_group_rows_avx512<5>(q.data(), sz, x, xsums, y, N, K, group, n0, m, g0); break;
        case 4: int4_group_rows_avx512<4>(q.data(), sz, x, xsums, y, N, K, group, n0, m, g0); break;
        default: int4_group_rows_avx512<3>(q.data(), sz, x, xsums, y, N, K, group, n0, m, g0); break;
      }
      m += rows;
    }
  }
}

bool has_avx512bw() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

// Block n0 (64 rows) of torch's AVX512 packing ([N / 64][K][32], scales [K / g, N, 2]) dequantized
// to bfloat16 in the VNNI layout oneDNN's brgemm takes for B = W^T: [K / 2][64][2], the pair
// (k, k + 1) of each row side by side.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void int4_dequant_vnni_avx512(const uint8_t* w, const uint16_t* sz, uint16_t* out, int64_t N, int64_t K,
                              int64_t group, int64_t n0) {
  const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // 0, 16, 1, 17, ...
  const uint8_t* block = w + n0 * K / 2;
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    const uint16_t* gsz = sz + ((g0 / group) * N + n0) * 2;
    __m512 sc[4], z[4];
    for (int v = 0; v < 4; ++v) int4_scales16(gsz + 32 * v, &sc[v], &z[v]);
    for (int64_t k = g0; k < g0 + group; k += 2) {
      __m512 q[2][4];
      for (int u = 0; u < 2; ++u) {
        const uint8_t* col = block + (k + u) * 32;
        const __m512i e0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col)));
        const __m512i e1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col + 16)));
        q[u][0] = _mm512_permutexvar_ps(e0, lut);                          // rows 0-15
        q[u][1] = _mm512_permutexvar_ps(e1, lut);                          // rows 16-31
        q[u][2] = _mm512_permutexvar_ps(_mm512_srli_epi32(e0, 4), lut);    // rows 32-47
        q[u][3] = _mm512_permutexvar_ps(_mm512_srli_epi32(e1, 4), lut);    // rows 48-63
      }
      uint16_t* dst = out + (k / 2) * 128;
      for (int v = 0; v < 4; ++v) {  // rows 16v..16v+15: (k, k + 1) pairs, interleaved
        const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(q[1][v], sc[v], z[v]),
                                                  _mm512_fmadd_ps(q[0][v], sc[v], z[v]));
        _mm512_storeu_si512(dst + 32 * v, _mm512_permutexvar_epi16(pairs, reinterpret_cast<const __m512i&>(both)));
      }
    }
  }
}

#endif

// linear_int4: torch's packed int4 weight-only GEMM (aten::_weight_int4pack_mm_for_cpu, fast with
// bfloat16 activations and scales only) for activations of any float dtype, in x's dtype: the
// casts and reshapes kiln/ops/quant.py's _linear_int4_cpu does, without its Python. Where torch
// packed for AVX2 or AVX512 (its kernels' layout depends on the CPU capability it dispatches to)
// and N is whole blocks (32 or 64 rows), kiln's float32 kernels run instead: one row in registers
// (int4_block_avx2 / _avx512), more in passes of up to 6 rows (on AVX512, beyond one pass, from a
// float32 copy of each group's nibbles converted once), and on AVX512 from int4_gemm_rows
// rows on (where oneDNN has a bfloat16 brgemm) the weight dequantized per block for brgemm. A
// SmolLM2 layer's four linears, weights read from memory (python -m benchmarks.kernels cpu-int4
// --rows): AMD EPYC, AVX2, 1.50x / 1.48x torch's kernel at 1 / 2 rows, 1.45-1.63x at 16 / 32; Intel
// Xeon with AMX, one thread, 1.18x at 1 row; brgemm against the row kernels 1.1-1.6x at 8 rows,
// 2.0x at 16, 5-9x at 512. Below kInt4MinWeights the fixed costs win.
constexpr int64_t kInt4MinWeights = int64_t(1) << 17;

// From this many rows of x, where oneDNN has a bfloat16 brgemm (AMX, AVX512-BF16) and torch packs
// for AVX512, the weight is dequantized to bfloat16 per block and multiplied by brgemm (x and w
// rounded to bfloat16, float32 sums); fewer rows take the float32 row kernels. It pays from 8 rows
// (1.6x there, 5-9x at 512), but its rounding is bfloat16's: with it from 8 or 32 rows, a batched
// 4-prompt prefill and the same prompts' later steps disagreed with speculative decoding's by a
// greedy near-tie (0.03 in logprob). From 256 rows only long prefill chunks take it, and the rows of
// shorter steps are float32 sums whatever their batch. kiln_cpu::int4_gemm_rows sets it.
std::atomic<int64_t> int4_gemm_rows{256};

int64_t set_int4_gemm_rows(int64_t rows) { return int4_gemm_rows.exchange(rows); }

#if defined(__x86_64__)
// Per 64-row block: dequantize into a 72 KiB (K = 576) VNNI buffer that stays in the core's cache,
// then oneDNN's brgemm (AMX where the CPU has it) over x's rows in tiles of 32, float32 sums and
// output. Blocks are split over torch's threads.
at::Tensor int4_brgemm(const at::Tensor& xf, const at::Tensor& w, const at::Tensor& scales_zeros, int64_t group_size,
                       int64_t M, int64_t N, int64_t K) {
  const auto* wp = w.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr());
  const at::Tensor xb = xf.to(at::kBFloat16).contiguous();
  const auto* xp = reinterpret_cast<const at::BFloat16*>(xb.data_ptr());
  at::Tensor y = at::empty({M, N}, xf.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 64, 1, [&](int64_t b0, int64_t b1) {
    static thread_local std::vector<uint16_t> buf;
    if (buf.size() < size_t(K * 64)) buf.resize(K * 64);
    const auto* bp = reinterpret_cast<const at::BFloat16*>(buf.data());
    for (int64_t b = b0; b < b1; ++b) {  // one block per call: 4 blocks (N = 256) a call measured slower
      int4_dequant_vnni_avx512(wp, szp, buf.data(), N, K, group_size, b * 64);
      for (int64_t m0 = 0; m0 < M; m0 += 32)
        at::native::cpublas::brgemm(std::min<int64_t>(32, M - m0), 64, K, K, 64, N, false, xp + m0 * K, bp,
                                    yp + m0 * N + b * 64, true);
    }
    at::native::cpublas::brgemm_release(true);
  });
  return y;
}

bool brgemm_bf16() {  // oneDNN's brgemm ukernel for bfloat16 (AMX or AVX512-BF16)
  static const bool yes = has_avx512bf16() && at::native::cpublas::could_pack(at::kBFloat16);
  return yes;
}
#endif

// Which of torch's packings kiln's int4 kernels read here: 1 AVX2's, 2 AVX512's, 0 neither (torch's
// own kernel runs).
int64_t int4_layout() {
#if defined(__x86_64__)
  static const std::string capability = at::get_cpu_capability();
  static const int64_t layout = has_avx2_fma() && capability == "AVX2" ? 1 : has_avx512bw() && capability == "AVX512" ? 2 : 0;
  return layout;
#else
  return 0;
#endif
}

// Whether rows of x from int4_gemm_rows on take the dequantize + brgemm path.
bool int4_gemm_available() {
#if defined(__x86_64__)
  return int4_layout() == 2 && brgemm_bf16();
#else
  return false;
#endif
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales_zeros, int64_t group_size) {
  const int64_t K = x.size(-1), N = scales_zeros.size(1);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
#if defined(__x86_64__)
  static const bool avx2_layout = int4_layout() == 1;
  static const bool avx512_layout = int4_layout() == 2;
  const int64_t block = avx512_layout ? 64 : 32;  // output rows per block of torch's packing
  const int64_t M = K ? x.numel() / K : 0;
  if ((avx2_layout || avx512_layout) && M >= 1 && N * K >= kInt4MinWeights && N % block == 0 &&
      group_size % 2 == 0 && K % group_size == 0 && scales_zeros.scalar_type() == at::kBFloat16 &&
      scales_zeros.is_contiguous() && w.is_contiguous() && w.scalar_type() == at::kByte && w.numel() * 2 == N * K) {
    const at::Tensor xf = x.reshape({M, K}).to(at::kFloat).contiguous();
    if (avx512_layout && M >= int4_gemm_rows.load(std::memory_order_relaxed) && brgemm_bf16())
      return int4_brgemm(xf, w, scales_zeros, group_size, M, N, K).to(x.scalar_type()).reshape(out_shape);
    at::Tensor y = M == 1 ? at::empty({M, N}, xf.options()) : at::zeros({M, N}, xf.options());
    const auto* wp = w.data_ptr<uint8_t>();
    const auto* szp = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr());
    const float* xp = xf.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t groups = K / group_size;
    std::vector<float> xsums(M * groups, 0.f);  // each row's and group's sum of x, for the zero points
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        float sum = 0.f;
        for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) sum += xp[m * K + k];
        xsums[m * groups + g] = sum;
      }
    at::parallel_for(0, N / block, avx512_layout ? 2 : 4, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        if (avx512_layout) {
          if (M == 1) int4_block_avx512(wp, szp, xp, xsums.data(), yp, N, K, group_size, b * 64);
          else int4_all_rows_avx512(wp, szp, xp, xsums.data(), yp, M, N, K, group_size, b * 64);
        } else if (M == 1) {
          int4_block_avx2(wp, szp, xp, xsums.data(), yp, N, K, group_size, b * 32);
        } else {
          int4_all_rows_avx2(wp, szp, xp, xsums.data(), yp, M, N, K, group_size, b * 32);
        }
      }
    });
    return y.to(x.scalar_type()).reshape(out_shape);
  }
#endif
  const at::Tensor x2 = x.reshape({-1, K}).to(scales_zeros.scalar_type()).contiguous();
  return at::_weight_int4pack_mm_for_cpu(x2, w, group_size, scales_zeros).to(x.scalar_type()).reshape(out_shape);
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("gemv_f32(Tensor x, Tensor w) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("linear_int4_packed(Tensor x, Tensor w, Tensor scales_zeros, int group_size) -> Tensor");
  m.def("int4_gemm_rows(int rows) -> int", &kiln::set_int4_gemm_rows);
  m.def("int4_gemm_available() -> bool", &kiln::int4_gemm_available);
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("gemv_bf16", &kiln::gemv_bf16);
  m.impl("linear_bf16", &kiln::linear_bf16);
  m.impl("gemv_f32", &kiln::gemv_f32);
  m.impl("linear_f32", &kiln::linear_f32);
  m.impl("linear_int4_packed", &kiln::linear_int4);
}
