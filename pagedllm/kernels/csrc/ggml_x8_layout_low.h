// The x8 records of the low-bit types, Q2_K, Q3_K, IQ4_NL and IQ4_XS (the layout: ggml_x8.cpp). Included
// by ggml_x8_layout.h before its format table; uses its value planes (put_bits, put_nib).
//
// Per 8 rows and 256-value super-block; the 2-bit planes hold the low bits of the values of a
// 32-value block j, the 1-bit plane Q3_K's third bit:
//   Q2_K   d[8], dmin[8] fp16; sc[8][16]: byte 16j + 2r + h = scales[2j + h] of row r (the
//          source byte: scale | min << 4 of values 16h..16h+15 of block j); per block j: a
//          2-bit plane (64 B)                                       (672 B = 8 x 84)
//   Q3_K   d[8]; sc[8][16] i8 (scale - 32) in Q2_K's order; per block j: a 2-bit plane, then a
//          1-bit plane of bit 2 (32 B)                               (912 B = 8 x 110 + 32)
//   IQ4_XS d[8]; sc[8][8] i8: byte 8j + r = scale - 32 of block j; per block j: nib (the
//          source qs bytes as they are, as Q4_0's)                    (1104 B = 8 x 136 + 16)
//   IQ4_NL per 8 rows and 32-value block: Q4_0's record, d[8] then nib (144 B = 8 x 18): the
//          same bytes (half d; qs[16]), the nibbles indexing the codebook instead of q - 8
#pragma once

#include <cstdint>
#include <cstring>

#include "ggml_common.h"

namespace pagedllm_ggml {
namespace x8 {

// Block j (0..7) of a Q2_K / Q3_K super-block's 2-bit values at qs (64 bytes), [+ Q3_K's third
// bits from hmask], of row r into v[r].
inline void low_values(const uint8_t* qs, const uint8_t* hmask, int j, int r, Values& v) {
  for (int l = 0; l < 32; ++l) {
    v[r][l] = static_cast<uint8_t>((qs[32 * (j / 4) + l] >> (2 * (j % 4))) & 3);
    if (hmask != nullptr) v[r][l] |= static_cast<uint8_t>(((hmask[l] >> j) & 1) << 2);
  }
}

// ... and back: or-ed into qs and hmask (zeroed by the caller)
inline void put_low_values(const Values& v, int j, int r, uint8_t* qs, uint8_t* hmask) {
  for (int l = 0; l < 32; ++l) {
    qs[32 * (j / 4) + l] |= static_cast<uint8_t>((v[r][l] & 3) << (2 * (j % 4)));
    if (hmask != nullptr) hmask[l] |= static_cast<uint8_t>(((v[r][l] >> 2) & 1) << j);
  }
}

// Q2_K (kThird false) and Q3_K: values of block j at rec + kValues + kBlock * j
template <bool kThird>
struct LowK {
  static constexpr int64_t kSrc = kThird ? 110 : 84, kD = kThird ? 108 : 80, kQs = kThird ? 32 : 16;
  static constexpr int64_t kScales = kThird ? 16 : 32, kValues = kScales + 128;
  static constexpr int64_t kBlock = kThird ? 96 : 64, kRec = kValues + 8 * kBlock;
  static const uint8_t* values_at(const uint8_t* rec, int j) { return rec + kValues + kBlock * j; }

  static void pack(const uint8_t* const* src, uint8_t* rec) {
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(rec + 2 * r, src[r] + kD, 2);
      if (!kThird) std::memcpy(rec + 16 + 2 * r, src[r] + kD + 2, 2);
      for (int j = 0; j < 8; ++j)
        for (int h = 0; h < 2; ++h)
          rec[kScales + 16 * j + 2 * r + h] = kThird ? static_cast<uint8_t>(q3k_scale(src[r] + 96, 2 * j + h))
                                                     : src[r][2 * j + h];
    }
    for (int j = 0; j < 8; ++j) {
      Values v;
      for (int r = 0; r < kRows; ++r) low_values(src[r] + kQs, kThird ? src[r] : nullptr, j, r, v);
      uint8_t* out = rec + kValues + kBlock * j;
      put_bits<2>(v, 0, out);
      if (kThird) put_bits<1>(v, 2, out + 64);
    }
  }

  static void unpack(const uint8_t* rec, uint8_t* const* dst) {
    for (int r = 0; r < kRows; ++r) {
      std::memset(dst[r], 0, kSrc);
      std::memcpy(dst[r] + kD, rec + 2 * r, 2);
      if (!kThird) std::memcpy(dst[r] + kD + 2, rec + 16 + 2 * r, 2);
      for (int j = 0; j < 8; ++j)
        for (int h = 0; h < 2; ++h) {
          const uint8_t s = rec[kScales + 16 * j + 2 * r + h];
          if (!kThird) {
            dst[r][2 * j + h] = s;
            continue;
          }
          const int g = 2 * j + h, u = static_cast<int8_t>(s) + 32;  // inverse of q3k_scale
          dst[r][96 + g % 8] |= static_cast<uint8_t>((u & 0xF) << (4 * (g / 8)));
          dst[r][104 + g % 4] |= static_cast<uint8_t>((u >> 4) << (2 * (g / 4)));
        }
    }
    for (int j = 0; j < 8; ++j) {
      Values v = {};
      get_bits<2>(values_at(rec, j), 0, v);
      if (kThird) get_bits<1>(values_at(rec, j) + 64, 2, v);
      for (int r = 0; r < kRows; ++r) put_low_values(v, j, r, dst[r] + kQs, kThird ? dst[r] : nullptr);
    }
  }
};
using Q2K = LowK<false>;
using Q3K = LowK<true>;

// IQ4_NL: its block is Q4_0's bytes, so it packs as Q4_0 does; nib at rec + kNib
struct IQ4NL : Small<false, false> {
  static constexpr int64_t kNib = kRec - 128;
};

struct IQ4XS {
  static constexpr int64_t kScales = 16, kNib = 80, kRec = kNib + 8 * 128;
  static const uint8_t* nib_at(const uint8_t* rec, int j) { return rec + kNib + 128 * j; }

  static void pack(const uint8_t* const* src, uint8_t* rec) {
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(rec + 2 * r, src[r], 2);
      for (int j = 0; j < 8; ++j) {
        rec[kScales + 8 * j + r] = static_cast<uint8_t>(iq4xs_scale(src[r], j));
        for (int c = 0; c < 4; ++c) std::memcpy(rec + kNib + 128 * j + 32 * c + 4 * r, src[r] + 8 + 16 * j + 4 * c, 4);
      }
    }
  }

  static void unpack(const uint8_t* rec, uint8_t* const* dst) {
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(dst[r], rec + 2 * r, 2);
      std::memset(dst[r] + 2, 0, 6);
      uint32_t high = 0;
      for (int j = 0; j < 8; ++j) {
        const int u = static_cast<int8_t>(rec[kScales + 8 * j + r]) + 32;  // inverse of iq4xs_scale
        dst[r][4 + j / 2] |= static_cast<uint8_t>((u & 0xF) << (4 * (j % 2)));
        high |= static_cast<uint32_t>(u >> 4) << (2 * j);
        for (int c = 0; c < 4; ++c) std::memcpy(dst[r] + 8 + 16 * j + 4 * c, rec + kNib + 128 * j + 32 * c + 4 * r, 4);
      }
      dst[r][2] = static_cast<uint8_t>(high);
      dst[r][3] = static_cast<uint8_t>(high >> 8);
    }
  }
};

}  // namespace x8
}  // namespace pagedllm_ggml
