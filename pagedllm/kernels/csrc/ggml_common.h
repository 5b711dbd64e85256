// Shared by the GGML block kernels: block formats, field readers, and (AVX2) the int8 helpers.
#pragma once

#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace pagedllm_ggml {

enum GgmlType : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23, kBF16 = 30,
  // pagedllm's own, not a GGUF type: Q8_0 blocks whose groups of kQ8GroupBlocks consecutive blocks
  // of a row share one scale (each block carries it; a row's last group may be shorter), against x
  // quantized alike (one scale per group of x values), so the kernels take one float update per
  // group, not per block. Its blocks are valid Q8_0 blocks: dequantization is Q8_0's.
  kQ8_0G4 = 1008,
};
constexpr int64_t kQ8GroupBlocks = 4;
// blocks per shared scale of a type's x8 kernels (1: every block its own)
inline int64_t group_blocks(int64_t t) { return t == kQ8_0G4 ? kQ8GroupBlocks : 1; }

struct Format {
  int64_t block;  // values per block
  int64_t bytes;  // bytes per block
};

inline Format format_of(int64_t t) {
  switch (t) {
    case kF32: return {1, 4};
    case kF16: return {1, 2};
    case kBF16: return {1, 2};
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0:
    case kQ8_0G4: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ2_K: return {256, 84};
    case kQ3_K: return {256, 110};
    case kQ6_K: return {256, 210};
    case kIQ4_NL: return {32, 18};
    case kIQ4_XS: return {256, 136};
  }
  TORCH_CHECK(false, "ggml type ", t, " has no pagedllm kernel");
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction instead of the portable bit manipulation
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 6-bit scale and min of group j (0..7) from the 12 packed bytes of a Q4_K/Q5_K block.
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Scale (d * sc) and minimum (dmin * m) of 32-value group g of the Q4_K/Q5_K block at p:
// the group's values are scale * q - min.
struct GroupScale {
  float scale, min;
};

inline GroupScale k_group(const uint8_t* p, int g) {
  int sc, m;
  scale_min_k4(g, p + 4, &sc, &m);
  return {half_at(p) * sc, half_at(p + 2) * m};
}

// Scale of 16-value group j (0..15) of a Q3_K block, minus 32 (-32..31), from the 12 packed bytes s:
// the low four bits are nibble j / 8 of byte j % 8, the high two bits 2 * (j / 4) of byte 8 + j % 4.
inline int q3k_scale(const uint8_t* s, int j) {
  return (((s[j % 8] >> (4 * (j / 8))) & 0xF) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
}

// Scale of 32-value group g (0..7) of an IQ4_XS block at p, minus 32: four bits of scales_l
// (byte 4 + g / 2) and two of scales_h (bits 2g of the u16 at byte 2).
inline int iq4xs_scale(const uint8_t* p, int g) {
  const int hi = ((p[2] | p[3] << 8) >> (2 * g)) & 3;
  return (((p[4 + g / 2] >> (4 * (g % 2))) & 0xF) | (hi << 4)) - 32;
}

// The 16 values of IQ4_NL / IQ4_XS's non-linear 4-bit codebook (ggml's kvalues_iq4nl).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Rows of the low-bit types, in the order ggml's dequantize_row_* writes them (ggml_quants_low.cpp).
void row_q2_k(const uint8_t* p, float* y, int64_t k);
void row_q3_k(const uint8_t* p, float* y, int64_t k);
void row_iq4_nl(const uint8_t* p, float* y, int64_t k);
void row_iq4_xs(const uint8_t* p, float* y, int64_t k);

// One row of k values of ggml type qtype to float32, exactly as ggml dequantizes it
// (ggml_quants.cpp).
void dequant_row(int64_t qtype, const uint8_t* src, float* dst, int64_t k);

#ifdef PAGEDLLM_AVX2
using pagedllm_simd::hsum;

// 16 packed bytes -> 32 nibbles: low nibbles first (values 0..15), then high (16..31).
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

// 0x10 in byte j where bit j of qh is set.
inline __m256i fifth_bits(uint32_t qh) {
  // byte j of the broadcast picks byte j / 8 of qh, then tests bit j % 8
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), pick);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// A row of x [K] float -> int8 per 32 values with scale dx and dx * sum(xq) per block; block b's
// values at xq + b * q_step, its dx, dx * sum at xd, xs [b * d_step], and (where xh is given)
// 32 x the sums of its values 0-15 and 16-31 at xh[2 * b * d_step] and the next int.
// group: blocks that share one scale, from the largest |x| over all of them (the grouped Q8_0's
// x, kQ8_0G4; a row's last group may be shorter); 1: each block its own, as ggml's Q8_0 x.
inline void quantize_x(const float* x, int64_t k, int8_t* xq, float* xd, float* xs, int32_t* xh = nullptr,
                       int64_t q_step = 32, int64_t d_step = 1, int64_t group = 1) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const int64_t nb = k / 32;
  for (int64_t g0 = 0; g0 < nb; g0 += group) {
    const int64_t g1 = g0 + group < nb ? g0 + group : nb;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < 4 * (g1 - g0); ++i)
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 32 * g0 + 8 * i)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.f;
    const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    for (int64_t b = g0; b < g1; ++b) {
      const float* xb = x + 32 * b;
      int8_t* qb = xq + b * q_step;
      __m256i i32[4];
      for (int i = 0; i < 4; ++i)
        i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), id),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // pack 32 int32 -> 32 int8 in order (packs interleave 128-bit lanes; permute fixes it)
      const __m256i s01 = _mm256_packs_epi32(i32[0], i32[1]);
      const __m256i s23 = _mm256_packs_epi32(i32[2], i32[3]);
      __m256i s8 = _mm256_packs_epi16(s01, s23);
      s8 = _mm256_permutevar8x32_epi32(s8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), s8);
      const __m256i lo = _mm256_add_epi32(i32[0], i32[1]), hi = _mm256_add_epi32(i32[2], i32[3]);
      const __m256i sum32 = _mm256_add_epi32(lo, hi);
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      xd[b * d_step] = d;
      xs[b * d_step] = d * static_cast<float>(_mm_cvtsi128_si32(t));
      if (xh != nullptr) {  // [lo0+lo1, lo2+lo3, hi0+hi1, hi2+hi3] per 128-bit half, then both halves
        const __m256i h = _mm256_hadd_epi32(lo, hi);
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        u = _mm_slli_epi32(_mm_hadd_epi32(u, u), 5);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(xh + 2 * b * d_step), u);
      }
    }
  }
}

#endif  // PAGEDLLM_AVX2

}  // namespace pagedllm_ggml
