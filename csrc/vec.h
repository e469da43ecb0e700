// Vector building blocks for the CPU kernels in csrc/: always inlined, so each caller compiled
// for an instruction set (a function with a target attribute) gets them in that set.
//
// Vec<L>::f is a GCC/Clang generic vector of L floats. A kernel is a template over L and each
// instruction set instantiates the width of its registers: 16 on x86-64-v4 (one zmm), 8 on v3 (one
// ymm), 4 on the baseline (one xmm). Written this way the compiler keeps accumulators in registers,
// which it does not do for `omp simd` loops with a runtime trip count. A width wider than the
// registers (16 floats on AVX2, two ymm each) compiles but spills: GCC 12 kept the paged-attention
// kernel's vectors on the stack, 3.5-6x slower than 8 lanes on a Zen 3 core.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

// Vectors wider than the baseline's registers change the ABI of non-inlined calls; every function
// here is inlined into its caller, so none is ever called across that boundary.
#pragma GCC diagnostic ignored "-Wpsabi"

#define KILN_INLINE inline __attribute__((always_inline))

namespace kiln {

template <int L>
struct Vec {
  typedef float f __attribute__((vector_size(4 * L)));
  typedef int32_t i __attribute__((vector_size(4 * L)));
};
constexpr int kMaxLanes = 16;  // the widest Vec a kernel instantiates
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <int L>
KILN_INLINE typename Vec<L>::f splat(float x) { return typename Vec<L>::f{} + x; }

template <int L>
KILN_INLINE typename Vec<L>::f load(const float* p) {
  typename Vec<L>::f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int L>
KILN_INLINE void store(float* p, typename Vec<L>::f v) { std::memcpy(p, &v, sizeof v); }

// Lanes summed pairwise: halves added until one 4-lane vector is left.
template <int L>
KILN_INLINE float hsum(typename Vec<L>::f v) {
  if constexpr (L > 4) {
    typename Vec<L / 2>::f a, b;
    std::memcpy(&a, &v, sizeof a);
    std::memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof a, sizeof b);
    return hsum<L / 2>(a + b);
  } else {
    return (v[0] + v[2]) + (v[1] + v[3]);
  }
}

template <int L>
KILN_INLINE float hmax(typename Vec<L>::f v) {
  float m = v[0];
  for (int i = 1; i < L; ++i) m = std::max(m, v[i]);
  return m;
}

// 2^x for x <= 0, relative error ~1e-7, exactly 0 below -126 (never a denormal, and -inf gives 0).
// Plain arithmetic and bit casts, so it stays in vector registers where exp2f is a libm call.
template <int L>
KILN_INLINE typename Vec<L>::f exp2_nonpositive(typename Vec<L>::f x) {
  using vfloat = typename Vec<L>::f;
  using vint = typename Vec<L>::i;
  const vfloat magic = splat<L>(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const vfloat xc = x < splat<L>(-126.f) ? splat<L>(-126.f) : x;
  const vfloat t = xc + magic;
  const vint n = (vint)t - (vint)magic;
  const vfloat y = (xc - (t - magic)) * 0.6931471805599453f;  // 2^f = e^y, f in [-0.5, 0.5]: Taylor, degree 7
  vfloat e = splat<L>(1.f / 5040.f);
  e = e * y + 1.f / 720.f;
  e = e * y + 1.f / 120.f;
  e = e * y + 1.f / 24.f;
  e = e * y + 1.f / 6.f;
  e = e * y + 0.5f;
  e = e * y + 1.f;
  e = e * y + 1.f;
  const vfloat r = e * (vfloat)((n + 127) << 23);
  return x < splat<L>(-126.f) ? splat<L>(0.f) : r;
}

KILN_INLINE float bf16_to_float(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Row of `n` elements to float: bfloat16 is the high half of a float32.
KILN_INLINE void row_to_float(const char* src, bool bf16, float* __restrict dst, int n) {
  if (bf16) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(bits[i]);
  } else {
    std::memcpy(dst, src, sizeof(float) * n);
  }
}

// float8_e4m3fn (bias 7, no infinities) to float, exactly: a normal e4m3 value's exponent and
// mantissa shift into float's with the bias moved by 120; a subnormal is m * 2^-9; 0x7f is NaN.
// Bit masks, not branches or selects, so the row loop vectorizes.
KILN_INLINE float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t em = b & 0x7fu;
  const uint32_t normal = (em << 20) + (120u << 23);
  const uint32_t sub = __builtin_bit_cast(uint32_t, float(int32_t(em)) * 0.001953125f);  // 2^-9
  const uint32_t is_normal = 0u - uint32_t(em >= 8), is_nan = 0u - uint32_t(em == 0x7fu);
  uint32_t bits = (normal & is_normal) | (sub & ~is_normal);
  bits = (bits & ~is_nan) | (0x7fc00000u & is_nan);
  return __builtin_bit_cast(float, bits | (uint32_t(b & 0x80u) << 24));
}

KILN_INLINE void fp8_row_to_float(const char* src, float* __restrict dst, int n) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = fp8_e4m3_to_float(bytes[i]);
}

}  // namespace kiln
