// What the CPU kernels share about the instruction set: whether the AVX2/FMA paths are compiled
// (-march=native decides), and the small vector helpers they all use.
#pragma once

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

}  // namespace pagedllm_simd
