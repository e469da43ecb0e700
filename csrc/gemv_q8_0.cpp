// One-row Q8_0 GEMV on CPU: torch.ops.kiln_cpu.gemv_q8_0 (built into kiln._C with gemv.cpp).
// Python side, packing and the pure-torch reference: kiln/ops/cpu_linear.py; tests:
// tests/ops/test_cpu_linear.py; timing: python -m benchmarks.offline quant-cpu.
//
//   y[m, n] = sum_b d[n, b] * dx[m, b] * sum_{k in block b} q[n, k] * qx[m, k]
//
// The weight is Q8_0 as llama.cpp stores it: int8 values q with one scale d per block of 32 along
// K. As llama.cpp does, each activation row is quantized the same way once per call (dx = absmax /
// 127, qx = round(x / dx)), so a block's product is one integer dot product: AVX512-VNNI's
// vpdpbusd multiplies 64 unsigned by 64 signed bytes into 16 int32 lanes of 4 products each. The
// weight is the unsigned side, stored as u = q + 128; the 128 * sum(qx) that adds is the same for
// every row, so it is subtracted once per call (the accumulator starts at -128 * the lane's qx sum).
// At batch-1 decode the LM head is the largest read of a step: 1 byte a weight plus 2 bytes of
// scale per 32, half of bfloat16's bytes (measured on a 2-core Xeon with AMX: about half the
// time of csrc/gemv.cpp's bfloat16 GEMV).
//
// Packed weight, one row (K padded to Kp, a multiple of 64, with zero blocks):
//
//   qweight [N, Kp] uint8, per 64-byte chunk c the bytes of blocks 2c (A) and 2c+1 (B):
//     | A0..A3 | B0..B3 | A4..A7 | B4..B7 | ... | A28..A31 | B28..B31 |   (each byte q + 128)
//     int32 lane 2j sums block A's bytes 4j..4j+3, lane 2j+1 block B's
//   scales  [N, Kp/32] float16, block order: one 32-bit load of (d[2c], d[2c+1]) broadcast to
//     the 16 lanes and widened gives d[2c], d[2c+1], d[2c], ... which is the lanes' block order.
//
// The activation row is packed the same way (int8, no offset). Rows are split over torch's
// threads in tiles of 16; four rows per inner step share each load of the activation. Without
// AVX512-VNNI, AVX2 computes the same integer sums from 32-byte halves (rows_avx2), and without
// either a portable loop does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kiln {
namespace {

constexpr int kBlock = 32;
constexpr int kChunk = 64;          // two blocks, one 512-bit load
constexpr int kRows = 4;            // weight rows per inner step, sharing each load of x
constexpr int kPrefetchRows = 16;   // rows ahead
constexpr int64_t kTileRows = 16;   // rows per parallel work unit

// One activation row, quantized and laid out like a weight row.
struct QuantRow {
  std::vector<int8_t> q;       // [Kp], interleaved as the weight
  std::vector<int32_t> corr;   // [Kp / 4]: -128 * the sum of each int32 lane's 4 values
  std::vector<float> dx;       // [Kp / 4]: each lane's block scale
};

// Byte offset of block b's byte i inside a packed row.
inline int64_t packed_offset(int64_t b, int64_t i) {
  return (b / 2) * kChunk + (i / 4) * 8 + (b % 2) * 4 + i % 4;
}

void quantize_row(const float* x, int64_t K, int64_t Kp, QuantRow& out) {
  out.q.assign(Kp, 0);
  out.corr.assign(Kp / 4, 0);
  out.dx.assign(Kp / 4, 0.f);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    for (int i = 0; i < kBlock; ++i) {
      const int64_t at = packed_offset(b, i);
      const int8_t v = static_cast<int8_t>(std::nearbyint(xb[i] * id));  // |x * id| <= 127
      out.q[at] = v;
      out.corr[at / 4] -= 128 * v;
      out.dx[at / 4] = d;
    }
  }
}

void rows_portable(const uint8_t* w, const c10::Half* s, const QuantRow& x, float* y, int64_t Kp,
                   int64_t n0, int64_t n1) {
  const int64_t nb = Kp / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    float acc = 0.f;
    for (int64_t lane = 0; lane < Kp / 4; ++lane) {
      int32_t dot = x.corr[lane];
      for (int i = 0; i < 4; ++i) dot += int32_t(w[n * Kp + lane * 4 + i]) * x.q[lane * 4 + i];
      const int64_t b = (lane / 16) * 2 + lane % 2;
      acc += float(dot) * x.dx[lane] * float(s[n * nb + b]);
    }
    y[n] = acc;
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void rows_avx512vnni(const uint8_t* w, const c10::Half* s, const QuantRow& x, float* y, int64_t Kp,
                     int64_t n0, int64_t n1) {
  const int64_t nb = Kp / kBlock, nc = Kp / kChunk, N_end = n1;
  const auto* sp = reinterpret_cast<const uint16_t*>(s);
  const int8_t* xq = x.q.data();
  const int32_t* xc = x.corr.data();
  const float* xd = x.dx.data();
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) {
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t ahead = std::min<int64_t>(n + kPrefetchRows, N_end - 1);
    for (int64_t c = 0; c < nc; ++c) {
      const __m512i xv = _mm512_loadu_si512(xq + c * kChunk);
      const __m512i cv = _mm512_loadu_si512(xc + c * 16);
      const __m512 dv = _mm512_loadu_ps(xd + c * 16);
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = n + r;
        _mm_prefetch(reinterpret_cast<const char*>(w + std::min(ahead + r, N_end - 1) * Kp + c * kChunk), _MM_HINT_T0);
        const __m512i dot = _mm512_dpbusd_epi32(cv, _mm512_loadu_si512(w + row * Kp + c * kChunk), xv);
        uint32_t pair;
        std::memcpy(&pair, sp + row * nb + 2 * c, sizeof pair);
        const __m512 sv = _mm512_cvtph_ps(_mm256_set1_epi32(static_cast<int>(pair)));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), dv), sv, acc[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) y[n + r] = _mm512_reduce_add_ps(acc[r]);
  }
  if (n < n1) rows_portable(w, s, x, y, Kp, n, n1);
}

// AVX2 (no VNNI, e.g. AMD's Zen 3): the same lanes from 32-byte halves of a chunk. maddubs multiplies
// unsigned by signed bytes into saturating 16-bit pairs, so the weight's offset comes off first (its
// signed q, one xor) and the signs move onto x: |q| * sign(x, q) pairs stay within 2 * 128 * 127.
// That gives sum(q x) per lane directly (no corr term); the float products are as above.
__attribute__((target("avx2,fma,f16c")))
void rows_avx2(const uint8_t* w, const c10::Half* s, const QuantRow& x, float* y, int64_t Kp, int64_t n0,
               int64_t n1) {
  const int64_t nb = Kp / kBlock, nc = Kp / kChunk, N_end = n1;
  const auto* sp = reinterpret_cast<const uint16_t*>(s);
  const int8_t* xq = x.q.data();
  const float* xd = x.dx.data();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * Kp;
    const int64_t ahead = std::min<int64_t>(n + kPrefetchRows, N_end - 1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + ahead * Kp + c * kChunk), _MM_HINT_T0);
      uint32_t pair;
      std::memcpy(&pair, sp + n * nb + 2 * c, sizeof pair);
      const __m256 sv = _mm256_cvtph_ps(_mm_set1_epi32(static_cast<int>(pair)));  // sA, sB, sA, ...
      for (int h = 0; h < 2; ++h) {
        const int64_t at = c * kChunk + h * 32;
        const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + at)), flip);
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + at));
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q));
        const __m256i dot = _mm256_madd_epi16(pairs, ones);
        const __m256 dv = _mm256_loadu_ps(xd + c * 16 + h * 8);
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), dv), sv, acc);
      }
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    y[n] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
}

bool has_avx2_f16c() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return yes;
}

bool has_avx512vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}
#endif

at::Tensor gemv_q8_0(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && scales.dim() == 2, "gemv_q8_0: x [M, K], qweight [N, Kp], "
              "scales [N, Kp / 32]");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf,
              "gemv_q8_0: uint8 qweight, float16 scales");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), Kp = qweight.size(1);
  TORCH_CHECK(K % kBlock == 0 && Kp % kChunk == 0 && K <= Kp && Kp < K + kChunk,
              "gemv_q8_0: K must be a multiple of 32 and Kp K rounded up to 64");
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == Kp / kBlock, "gemv_q8_0: scales [N, Kp / 32]");
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu() && scales.device().is_cpu(), "gemv_q8_0: CPU tensors");
  const at::Tensor xc = x.to(at::kFloat).contiguous(), wc = qweight.contiguous(), sc = scales.contiguous();
  at::Tensor y = at::empty({M, N}, xc.options());
  const auto* wp = wc.data_ptr<uint8_t>();
  const auto* sp = sc.data_ptr<c10::Half>();
  float* yp = y.data_ptr<float>();
  auto rows = rows_portable;
#if defined(__x86_64__)
  if (has_avx512vnni()) rows = rows_avx512vnni;
  else if (has_avx2_f16c()) rows = rows_avx2;
#endif
  QuantRow row;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(xc.data_ptr<float>() + m * K, K, Kp, row);
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
      rows(wp, sp, row, yp + m * N, Kp, t0 * kTileRows, std::min(N, t1 * kTileRows));
    });
  }
  return y;
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) { m.def("gemv_q8_0(Tensor x, Tensor qweight, Tensor scales) -> Tensor"); }

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("gemv_q8_0", &kiln::gemv_q8_0); }
