// One-row bfloat16 GEMV on CPU: torch.ops.kiln_cpu.gemv_bf16 (built into kiln._C with
// paged_attention.cpp). Python side and when it runs: kiln/ops/cpu_linear.py; tests:
// tests/test_cpu_linear.py; timing: benchmarks/quant_cpu.py.
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
// Rows are split over torch's threads in tiles of 16. Without AVX512-BF16 a portable loop computes
// the same sums (bf16 -> float is exact) in another order.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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
#endif
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  for (int64_t m = 0; m < M; ++m) {
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
      rows(wp, xp + m * K, yp + m * N, N, K, t0 * kTileRows, std::min(N, t1 * kTileRows));
    });
  }
  return y;
}

// linear_bf16: F.linear(x, w, bias) for a bfloat16 weight, in x's dtype: one row through the GEMV,
// more rows through at::linear (oneDNN's AMX kernels from a few rows on). One dispatcher call from
// Python in eager mode and an opaque op in compiled graphs, so both get the GEMV at decode.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "linear_bf16: a bfloat16 weight [N, K]");
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.size(-1) == K, "linear_bf16: x's last dim must be the weight's K");
  const int64_t rows = K ? x.numel() / K : 0;
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  at::Tensor y;
  if (rows == 1) {
    y = gemv_bf16(x.reshape({1, K}).to(at::kBFloat16), w);
    if (bias.has_value() && bias->defined()) y.add_(*bias);
    y = y.to(x.scalar_type());
  } else {
    y = at::linear(x.to(at::kBFloat16), w, bias).to(x.scalar_type());
  }
  return y.reshape(out_shape);
}

// linear_int4: torch's packed int4 weight-only GEMM (aten::_weight_int4pack_mm_for_cpu, fast with
// bfloat16 activations and scales only) for activations of any float dtype, in x's dtype: the
// casts and reshapes kiln/ops/quant.py's _linear_int4_cpu does, without its Python.
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales_zeros, int64_t group_size) {
  const int64_t K = x.size(-1), N = scales_zeros.size(1);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({-1, K}).to(scales_zeros.scalar_type()).contiguous();
  return at::_weight_int4pack_mm_for_cpu(x2, w, group_size, scales_zeros).to(x.scalar_type()).reshape(out_shape);
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("linear_int4_packed(Tensor x, Tensor w, Tensor scales_zeros, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("gemv_bf16", &kiln::gemv_bf16);
  m.impl("linear_bf16", &kiln::linear_bf16);
  m.impl("linear_int4_packed", &kiln::linear_int4);
}
