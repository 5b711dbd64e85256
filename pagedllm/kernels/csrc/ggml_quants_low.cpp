// Rows of the low-bit GGML types to float32, exactly as ggml's dequantize_row_q2_K / q3_K / iq4_nl /
// iq4_xs
// write them: every product below is exact in float32 (an fp16 scale times a 4-6 bit scale times
// a value of at most 8 bits), so only Q2_K's "- min" rounds, as in ggml.
//
// Block layouts (ggml-common.h; 256 values, "half" is IEEE fp16):
//   Q2_K    84 B: u8 scales[16] (scale | min << 4 per 16 values); u8 qs[64]; half d, dmin
//           value 128n + 32j + l (l < 32): bits 2j of qs[32n + l]; group (128n + 32j + l) / 16
//           w = d * scale * q - dmin * min
//   Q3_K   110 B: u8 hmask[32]; u8 qs[64]; u8 scales[12] (6-bit, q3k_scale); half d
//           value 128n + 32j + l: low bits as Q2_K, third bit: bit 4n + j of hmask[l]
//           w = d * (scale - 32) * (q - 4)
//   IQ4_XS 136 B: half d; u16 scales_h; u8 scales_l[4] (6-bit, iq4xs_scale); u8 qs[128]
//           value 32g + l: nibble of qs[16g + l % 16] (low for l < 16), through kIq4Values
//           w = d * (scale - 32) * kIq4Values[q]
//   IQ4_NL  18 B (32 values): half d; u8 qs[16]; value l: nibble of qs[l % 16] (low for l < 16)
//           w = d * kIq4Values[q] (llama.cpp's IQ4_XS fallback for rows not a multiple of 256)
#include "ggml_common.h"

namespace pagedllm_ggml {

// 2-bit value 32 * j + l of a 128-value half of Q2_K / Q3_K (j < 4, l < 32)
inline int low2(const uint8_t* qs, int j, int l) { return (qs[l] >> (2 * j)) & 3; }

void row_q2_k(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 256; ++b, p += 84) {
    const float d = half_at(p + 80), dmin = half_at(p + 82);
    for (int n = 0; n < 2; ++n) {
      const uint8_t* qs = p + 16 + 32 * n;
      for (int j = 0; j < 4; ++j, y += 32)
        for (int h = 0; h < 2; ++h) {
          const uint8_t sc = p[8 * n + 2 * j + h];
          const float dl = d * static_cast<float>(sc & 0xF), ml = dmin * static_cast<float>(sc >> 4);
          for (int l = 16 * h; l < 16 * h + 16; ++l) y[l] = dl * static_cast<float>(low2(qs, j, l)) - ml;
        }
    }
  }
}

void row_q3_k(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 256; ++b, p += 110) {
    const float d = half_at(p + 108);
    for (int n = 0; n < 2; ++n) {
      const uint8_t* qs = p + 32 + 32 * n;
      for (int j = 0; j < 4; ++j, y += 32)
        for (int h = 0; h < 2; ++h) {
          const float dl = d * static_cast<float>(q3k_scale(p + 96, 8 * n + 2 * j + h));
          for (int l = 16 * h; l < 16 * h + 16; ++l) {
            const int high = (p[l] >> (4 * n + j)) & 1;
            y[l] = dl * static_cast<float>(low2(qs, j, l) + 4 * high - 4);
          }
        }
    }
  }
}

void row_iq4_nl(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 32; ++b, p += 18, y += 32) {
    const float d = half_at(p);
    for (int l = 0; l < 16; ++l) {
      y[l] = d * static_cast<float>(kIq4Values[p[2 + l] & 0xF]);
      y[l + 16] = d * static_cast<float>(kIq4Values[p[2 + l] >> 4]);
    }
  }
}

void row_iq4_xs(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 256; ++b, p += 136) {
    const float d = half_at(p);
    const uint8_t* qs = p + 8;
    for (int g = 0; g < 8; ++g, qs += 16, y += 32) {
      const float dl = d * static_cast<float>(iq4xs_scale(p, g));
      for (int l = 0; l < 16; ++l) {
        y[l] = dl * static_cast<float>(kIq4Values[qs[l] & 0xF]);
        y[l + 16] = dl * static_cast<float>(kIq4Values[qs[l] >> 4]);
      }
    }
  }
}

}  // namespace pagedllm_ggml
