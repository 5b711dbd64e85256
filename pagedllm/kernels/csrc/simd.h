// What the CPU kernels share about the instruction set: whether the AVX2/FMA paths are compiled
// (-march=native decides), and the small vector helpers they all use.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedllm_simd {

#ifdef PAGEDLLM_AVX2
// the sum of the 8 lanes
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#ifdef PAGEDLLM_AVX2
// exp(x) for x <= 0 (softmax after the max is subtracted), to ~2 ulp: x = n ln2 + r with
// |r| <= ln2 / 2, a degree-6 polynomial for exp(r), and 2^n put into the exponent bits.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // below: exp underflows to (near) zero anyway
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 split in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// exp_nonpositive for one value, the same operations in the same order: bit for bit the same
// result, so a value does not depend on whether it fell in a vector or in a tail.
inline float exp_nonpositive1(float x) {
  x = std::max(x, -87.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-n, 0.693359375f, x);
  r = std::fma(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.f);
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

// The max of a row's p[i] / t (kScaled) or p[i], and whether any of them is NaN (-inf for no
// values): the greedy argmax's and the sampler's first pass
template <bool kScaled>
inline float row_max(const float* p, int64_t v, float t, bool& nan) {
  float best = -std::numeric_limits<float>::infinity();
  nan = false;
  int64_t i = 0;
#ifdef PAGEDLLM_AVX2
  const __m256 tv = _mm256_set1_ps(t);
  __m256 m = _mm256_set1_ps(best), bad = _mm256_setzero_ps();
  for (; i + 8 <= v; i += 8) {
    __m256 z = _mm256_loadu_ps(p + i);
    if constexpr (kScaled) z = _mm256_div_ps(z, tv);
    m = _mm256_max_ps(m, z);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(z, z, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  best = *std::max_element(lanes, lanes + 8);
  nan = _mm256_movemask_ps(bad) != 0;
#endif
  for (; i < v; ++i) {
    const float z = kScaled ? p[i] / t : p[i];
    nan |= std::isnan(z);
    best = std::max(best, z);
  }
  return best;
}

// The gated activations' elementwise step, act(x) * u, shared by silu_mul / gelu_tanh_mul
// (cpu_ops.cpp) and the bf16 gate/up matmul that applies it as it stores (x8_bf16.cpp), so that
// both give the same bits. The vector and one-value forms do the same operations in the same order.
// silu(x) = x / (1 + e^-x); with e = exp(-|x|) <= 1 that is x / (1 + e) for x >= 0 and x e / (1 + e)
// below, so the exp never overflows.
inline float silu_mul1(float x, float u) {
  const float e = exp_nonpositive1(-std::fabs(x));
  return (std::signbit(x) ? x * e : x) / (1.f + e) * u;
}

// gelu_tanh(g) = 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), as
// F.gelu(approximate="tanh"), computed as g sigmoid(2 y) (the same function: 1 + tanh(y) =
// 2 / (1 + e^-2y)); sigmoid(z) = 1 / (1 + e) for z >= 0 and e / (1 + e) below, e = exp(-|z|) <= 1
constexpr float kGeluC0 = 1.5957691216057308f, kGeluC1 = 0.07135481627260025f;  // 2 sqrt(2 / pi), times 0.044715
inline float gelu_tanh_mul1(float x, float u) {
  const float z = x * std::fma(kGeluC1, x * x, kGeluC0);
  const float e = exp_nonpositive1(-std::fabs(z));
  return x * ((std::signbit(z) ? e : 1.f) / (1.f + e)) * u;
}

#ifdef PAGEDLLM_AVX2
inline __m256 silu_mul8(__m256 x, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  const __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));
  const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), x);  // x < 0: x e
  return _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), u);
}

inline __m256 gelu_tanh_mul8(__m256 x, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  const __m256 z = _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_set1_ps(kGeluC1), _mm256_mul_ps(x, x),
                                                    _mm256_set1_ps(kGeluC0)));
  const __m256 e = exp_nonpositive(_mm256_or_ps(z, sign));
  const __m256 num = _mm256_blendv_ps(one, e, z);  // z < 0: e
  const __m256 s = _mm256_div_ps(num, _mm256_add_ps(one, e));
  return _mm256_mul_ps(_mm256_mul_ps(x, s), u);
}
#endif

}  // namespace pagedllm_simd
