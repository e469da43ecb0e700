// One-row Q8_0 GEMV on CPU: torch.ops.kiln_cpu.gemv_q8_0 (built into kiln._C with gemv.cpp).
// Python side, packing and the pure-torch reference: kiln/ops/cpu_linear.py; tests:
// tests/ops/test_cpu_linear.py; timing: python -m benchmarks.offline quant-cpu.
//
//   y[m, n] = sum_b d[n, b] * sum_{k in block b} q[n, k] * x[m, k]
//
// The weight is Q8_0 as llama.cpp stores it: int8 values q with one scale d per block of 32 along
// K. The activation stays float32: llama.cpp quantizes it to Q8_0 too, which moves SmolLM2's
// logits by up to ~0.1, enough to flip a near-tie of greedy decoding (its answer to "What is the
// capital of France?"). At batch-1 decode the LM head is the largest read of a step and is bound by
// its bytes (1 per weight plus 2 of scale per 32, half of bfloat16's), so float products cost no
// time there (measured on a 2-core AMD EPYC: the same 8 ms for SmolLM2's head as integer dots).
//
// Packed weight, one row (K padded to Kp, a multiple of 64, with zero blocks):
//
//   qweight [N, Kp] uint8, per 64-byte chunk c the bytes of blocks 2c (A) and 2c+1 (B):
//     | A0..A3 | B0..B3 | A4..A7 | B4..B7 | ... | A28..A31 | B28..B31 |   (each byte q + 128)
//   scales  [N, Kp/32] float16, block order.
//
// The activation row is laid out once per call in the same order (float32), so each 8-byte piece
// of a chunk widens to 8 float lanes (A's 4 then B's 4) multiplied by x's 8 floats at that offset;
// a chunk's sums are scaled once by (dA x4, dB x4). Rows are split over torch's threads in tiles
// of 16, two rows per inner step sharing each load of x (AVX-512: four, 16 lanes, each row's
// chunk prefetched kPrefetchRows ahead). Without AVX2 a portable loop does it.

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
constexpr int kChunk = 64;          // two blocks, interleaved
constexpr int kPrefetchRows = 16;   // rows ahead
constexpr int64_t kTileRows = 16;   // rows per parallel work unit

// Byte offset of block b's byte i inside a packed row.
inline int64_t packed_offset(int64_t b, int64_t i) {
  return (b / 2) * kChunk + (i / 4) * 8 + (b % 2) * 4 + i % 4;
}

#if defined(__x86_64__)
bool has_avx2_f16c() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return yes;
}
#endif

void layout_row(const float* x, int64_t K, int64_t Kp, std::vector<float>& out) {
  out.assign(Kp, 0.f);
  for (int64_t b = 0; b < K / kBlock; ++b)
    for (int i = 0; i < kBlock; ++i) out[packed_offset(b, i)] = x[b * kBlock + i];
}

void rows_portable(const uint8_t* w, const c10::Half* s, const float* x, float* y, int64_t Kp, int64_t n0,
                   int64_t n1) {
  const int64_t nb = Kp / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    float acc = 0.f;
    for (int64_t lane = 0; lane < Kp / 4; ++lane) {
      float dot = 0.f;
      for (int i = 0; i < 4; ++i) dot += float(int32_t(w[n * Kp + lane * 4 + i]) - 128) * x[lane * 4 + i];
      const int64_t b = (lane / 16) * 2 + lane % 2;
      acc += dot * float(s[n * nb + b]);
    }
    y[n] = acc;
  }
}

#if defined(__x86_64__)
// Each 8-byte piece of a chunk is 4 weights of block A then 4 of block B: widened to 8 float lanes,
// multiplied by x's 8 floats at the same offsets; lanes 0-3 carry A's sums and 4-7 B's, scaled once
// per chunk by (dA x4, dB x4).
__attribute__((target("avx2,fma,f16c")))
void rows_avx2(const uint8_t* w, const c10::Half* s, const float* x, float* y, int64_t Kp, int64_t n0,
               int64_t n1) {
  const int64_t nb = Kp / kBlock, nc = Kp / kChunk, N_end = n1;
  const auto* sp = reinterpret_cast<const uint16_t*>(s);
  const __m256i offset = _mm256_set1_epi32(128);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {  // two rows share each load of x
    const uint8_t* w0 = w + n * Kp;
    const uint8_t* w1 = w0 + Kp;
    const int64_t ahead = std::min<int64_t>(n + kPrefetchRows, N_end - 1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + ahead * Kp + c * kChunk), _MM_HINT_T0);
      __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
      for (int j = 0; j < 8; ++j) {
        const int64_t at = c * kChunk + j * 8;
        const __m256 xv = _mm256_loadu_ps(x + at);
        const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w0 + at)));
        const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w1 + at)));
        c0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q0, offset)), xv, c0);
        c1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q1, offset)), xv, c1);
      }
      uint32_t p0, p1;
      std::memcpy(&p0, sp + n * nb + 2 * c, sizeof p0);
      std::memcpy(&p1, sp + (n + 1) * nb + 2 * c, sizeof p1);
      const __m256 s0 = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(p0))), spread);
      const __m256 s1 = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(p1))), spread);
      acc0 = _mm256_fmadd_ps(c0, s0, acc0);
      acc1 = _mm256_fmadd_ps(c1, s1, acc1);
    }
    for (int r = 0; r < 2; ++r) {
      const __m256 acc = r ? acc1 : acc0;
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      y[n + r] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
  }
  if (n < n1) rows_portable(w, s, x, y, Kp, n, n1);
}

// AVX-512: each 16-byte quarter of a chunk widens to 16 float lanes (A, B, A, B in groups of 4),
// scaled per chunk by (dA x4, dB x4, dA x4, dB x4). The bytes' +128 comes off once per chunk:
// sum (q - 128) x = sum q x - 128 sum x, with the lane sums of x (xsum, laid out per chunk) made
// once per call. R rows share each load of x.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
void rows_avx512_r(const uint8_t* w, const uint16_t* sp, const float* x, const float* xsum, float* y, int64_t Kp,
                   int64_t n, int64_t ahead_row, int64_t last_row) {
  const int64_t nb = Kp / kBlock, nc = Kp / kChunk;
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  const __m512 k128 = _mm512_set1_ps(128.f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nc; ++c) {
    for (int r = 0; r < R; ++r)  // the chunk of each row kPrefetchRows ahead
      _mm_prefetch(reinterpret_cast<const char*>(w + std::min(ahead_row + r, last_row) * Kp + c * kChunk), _MM_HINT_T0);
    __m512 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const int64_t at = c * kChunk + j * 16;
      const __m512 xv = _mm512_loadu_ps(x + at);
      for (int r = 0; r < R; ++r) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + r) * Kp + at)));
        part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), xv, part[r]);
      }
    }
    const __m512 xs = _mm512_loadu_ps(xsum + c * 16);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, sp + (n + r) * nb + 2 * c, sizeof pair);
      const __m512 sc = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(pair)))));
      acc[r] = _mm512_fmadd_ps(_mm512_fnmadd_ps(k128, xs, part[r]), sc, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[n + r] = _mm512_reduce_add_ps(acc[r]);
}

__attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
void rows_avx512(const uint8_t* w, const c10::Half* s, const float* x, const float* xsum, float* y, int64_t Kp,
                 int64_t n0, int64_t n1, int64_t n_end) {
  const auto* sp = reinterpret_cast<const uint16_t*>(s);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) rows_avx512_r<4>(w, sp, x, xsum, y, Kp, n, n + kPrefetchRows, n_end - 1);
  for (; n < n1; ++n) rows_avx512_r<1>(w, sp, x, xsum, y, Kp, n, n + kPrefetchRows, n_end - 1);
}

// A chunk's (dA x4, dB x4, dA x4, dB x4) from its two float16 scales.
__attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
inline __m512 chunk_scales(const uint16_t* pair_at, __m512i spread) {
  uint32_t pair;
  std::memcpy(&pair, pair_at, sizeof pair);
  return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(pair)))));
}

// 16 stored bytes (q + 128) -> float (q) times their scales.
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m512 widen_scaled(const uint8_t* at, __m512 sc, __m128i flip) {
  const __m128i b = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)), flip);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), sc);
}

// M rows of x (2 to kMaxRows) against weight rows n0..n1, two weight rows at a time, each weight
// loaded and widened once for all M rows (batched decode reads the head once a step, not once per
// sequence): bytes back to q - 128 (xor 0x80, sign-extended), scaled per block as they widen, so a
// row of x costs one FMA per 16 weights and no per-chunk sums.
template <int M>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
void rows_avx512_multi(const uint8_t* w, const c10::Half* s, const float* x, float* y, int64_t N, int64_t Kp,
                       int64_t n0, int64_t n1) {
  const auto* sp = reinterpret_cast<const uint16_t*>(s);
  const int64_t nb = Kp / kBlock, nc = Kp / kChunk;
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  const __m128i flip = _mm_set1_epi8(char(0x80));
  auto scales = [&](int64_t row, int64_t c) { return chunk_scales(sp + row * nb + 2 * c, spread); };
  auto widen = [&](const uint8_t* at, __m512 sc) { return widen_scaled(at, sc, flip); };
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const uint8_t* w0 = w + n * Kp;
    const uint8_t* w1 = w0 + Kp;
    const uint8_t* ahead = w + std::min(n + 4, n1 - 2) * Kp;
    __m512 acc[2][M];
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + c * kChunk), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + Kp + c * kChunk), _MM_HINT_T0);
      const __m512 s0 = scales(n, c), s1 = scales(n + 1, c);
      for (int j = 0; j < 4; ++j) {
        const int64_t at = c * kChunk + j * 16;
        const __m512 q0 = widen(w0 + at, s0), q1 = widen(w1 + at, s1);
        for (int m = 0; m < M; ++m) {
          const __m512 xv = _mm512_loadu_ps(x + m * Kp + at);
          acc[0][m] = _mm512_fmadd_ps(q0, xv, acc[0][m]);
          acc[1][m] = _mm512_fmadd_ps(q1, xv, acc[1][m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      y[m * N + n] = _mm512_reduce_add_ps(acc[0][m]);
      y[m * N + n + 1] = _mm512_reduce_add_ps(acc[1][m]);
    }
  }
  for (; n < n1; ++n) {
    const uint8_t* w0 = w + n * Kp;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      const __m512 s0 = scales(n, c);
      for (int j = 0; j < 4; ++j) {
        const int64_t at = c * kChunk + j * 16;
        const __m512 q0 = widen(w0 + at, s0);
        for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(q0, _mm512_loadu_ps(x + m * Kp + at), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]);
  }
}

constexpr int64_t kMaxRows = 8;

void rows_avx512_batch(int64_t M, const uint8_t* w, const c10::Half* s, const float* x, float* y, int64_t N, int64_t Kp,
                       int64_t n0, int64_t n1) {
  switch (M) {
    case 2: rows_avx512_multi<2>(w, s, x, y, N, Kp, n0, n1); break;
    case 3: rows_avx512_multi<3>(w, s, x, y, N, Kp, n0, n1); break;
    case 4: rows_avx512_multi<4>(w, s, x, y, N, Kp, n0, n1); break;
    case 5: rows_avx512_multi<5>(w, s, x, y, N, Kp, n0, n1); break;
    case 6: rows_avx512_multi<6>(w, s, x, y, N, Kp, n0, n1); break;
    case 7: rows_avx512_multi<7>(w, s, x, y, N, Kp, n0, n1); break;
    default: rows_avx512_multi<8>(w, s, x, y, N, Kp, n0, n1); break;
  }
}

bool has_avx512_f16c() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
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
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu() && scales.device().is_cpu(),
              "gemv_q8_0: CPU tensors");
  const at::Tensor xc = x.to(at::kFloat).contiguous(), wc = qweight.contiguous(), sc = scales.contiguous();
  at::Tensor y = at::empty({M, N}, xc.options());
  const auto* wp = wc.data_ptr<uint8_t>();
  const auto* sp = sc.data_ptr<c10::Half>();
  float* yp = y.data_ptr<float>();
  auto rows = rows_portable;
#if defined(__x86_64__)
  const bool avx512 = has_avx512_f16c();
  if (has_avx2_f16c()) rows = rows_avx2;
#endif
  std::vector<float> row;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
#if defined(__x86_64__)
  if (avx512) {  // passes of up to kMaxRows rows of x, each reading the weight once
    const int64_t nc = Kp / kChunk;
    std::vector<float> rows_x(kMaxRows * Kp), xsum(nc * 16);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t mr = std::min(kMaxRows, M - m0);
      for (int64_t m = 0; m < mr; ++m) {
        layout_row(xc.data_ptr<float>() + (m0 + m) * K, K, Kp, row);
        std::copy(row.begin(), row.end(), rows_x.begin() + m * Kp);
      }
      if (mr == 1) {  // per chunk, lane l: the sum of x over the chunk's quarters at l
        std::fill(xsum.begin(), xsum.end(), 0.f);
        for (int64_t i = 0; i < Kp; ++i) xsum[(i / kChunk) * 16 + i % 16] += row[i];
      }
      at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
        const int64_t n0 = t0 * kTileRows, n1 = std::min(N, t1 * kTileRows);
        if (mr == 1) rows_avx512(wp, sp, rows_x.data(), xsum.data(), yp + m0 * N, Kp, n0, n1, N);
        else rows_avx512_batch(mr, wp, sp, rows_x.data(), yp + m0 * N, N, Kp, n0, n1);
      });
    }
    return y;
  }
#endif
  for (int64_t m = 0; m < M; ++m) {
    layout_row(xc.data_ptr<float>() + m * K, K, Kp, row);
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
      rows(wp, sp, row.data(), yp + m * N, Kp, t0 * kTileRows, std::min(N, t1 * kTileRows));
    });
  }
  return y;
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) { m.def("gemv_q8_0(Tensor x, Tensor qweight, Tensor scales) -> Tensor"); }

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("gemv_q8_0", &kiln::gemv_q8_0); }
