// The x8 layout of GGML blocks (see ggml_x8.cpp): packing eight rows' blocks into one record and
// back, losslessly. Load-time code, scalar on purpose; the kernels read the records.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>

#include "ggml_common.h"

namespace pagedllm_ggml {
namespace x8 {

constexpr int kRows = 8;  // weight rows per record

using Values = uint8_t[kRows][32];  // one 32-value block of each row, as small unsigned ints

// --- value planes ------------------------------------------------------------------------
inline void put_nib(const Values& v, uint8_t* out) {
  for (int c = 0; c < 4; ++c)
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i)
        out[32 * c + 4 * r + i] = static_cast<uint8_t>((v[r][4 * c + i] & 0xF) | (v[r][16 + 4 * c + i] & 0xF) << 4);
}

inline void get_nib(const uint8_t* in, Values& v) {
  for (int c = 0; c < 4; ++c)
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i) {
        v[r][4 * c + i] = in[32 * c + 4 * r + i] & 0xF;
        v[r][16 + 4 * c + i] = in[32 * c + 4 * r + i] >> 4;
      }
}

// width bits of each value from bit `shift`, width * 8 quads packed into 32 * width bytes
template <int width>
inline void put_bits(const Values& v, int shift, uint8_t* out) {
  std::memset(out, 0, 32 * width);
  constexpr int per_byte = 8 / width, mask = (1 << width) - 1;
  for (int c = 0; c < 8; ++c)
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i)
        out[32 * (c / per_byte) + 4 * r + i] |= static_cast<uint8_t>(((v[r][4 * c + i] >> shift) & mask) << (width * (c % per_byte)));
}

template <int width>
inline void get_bits(const uint8_t* in, int shift, Values& v) {
  constexpr int per_byte = 8 / width, mask = (1 << width) - 1;
  for (int c = 0; c < 8; ++c)
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i)
        v[r][4 * c + i] |= static_cast<uint8_t>(((in[32 * (c / per_byte) + 4 * r + i] >> (width * (c % per_byte))) & mask) << shift);
}

// bits 0, 4, 8, ..., 28 of x as one byte (bit c = bit 4c), in three shift-and-merge steps
inline uint8_t every_fourth_bit(uint32_t x) {
  x &= 0x11111111u;
  x = (x | x >> 3) & 0x03030303u;   // each byte: bits 0-1
  x = (x | x >> 6) & 0x000F000Fu;   // each half: bits 0-3
  return static_cast<uint8_t>(x | x >> 12);
}

// --- per-type records: pack 8 source blocks (src[r]) into one record, and back -------------
// 32-value types with 4 or 5 bits: [d][m?][qh?][qs16] -> [d x8][m x8?][bits?][nib]
template <bool kHasMin, bool kFifth>
struct Small {
  static constexpr int64_t kSrc = 18 + 2 * kHasMin + 4 * kFifth, kRec = 8 * kSrc;
  static constexpr int64_t kQh = 2 + 2 * kHasMin, kQs = kQh + 4 * kFifth;

  // The nib byte of quad c's value i (low nibble: value 4c + i, high: 16 + 4c + i) is the source
  // qs byte 4c + i as it is, so the values move as 4-byte copies; only the fifth bits regroup:
  // bits byte 4r + i collects bits i, i + 4, ..., i + 28 of the row's qh.
  static void pack(const uint8_t* const* src, uint8_t* rec) {
    uint8_t* bits = rec + 16 + 16 * kHasMin;
    uint8_t* nib = rec + kRec - 128;
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(rec + 2 * r, src[r], 2);
      if (kHasMin) std::memcpy(rec + 16 + 2 * r, src[r] + 2, 2);
      for (int c = 0; c < 4; ++c) std::memcpy(nib + 32 * c + 4 * r, src[r] + kQs + 4 * c, 4);
      if (kFifth) {
        const uint32_t qh = u32_at(src[r] + kQh);
        for (int i = 0; i < 4; ++i) bits[4 * r + i] = every_fourth_bit(qh >> i);
      }
    }
  }

  static void unpack(const uint8_t* rec, uint8_t* const* dst) {
    const uint8_t* bits = rec + 16 + 16 * kHasMin;
    const uint8_t* nib = rec + kRec - 128;
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(dst[r], rec + 2 * r, 2);
      if (kHasMin) std::memcpy(dst[r] + 2, rec + 16 + 2 * r, 2);
      for (int c = 0; c < 4; ++c) std::memcpy(dst[r] + kQs + 4 * c, nib + 32 * c + 4 * r, 4);
      if (kFifth) {
        uint32_t qh = 0;
        for (int i = 0; i < 4; ++i)
          for (int c = 0; c < 8; ++c) qh |= static_cast<uint32_t>((bits[4 * r + i] >> c) & 1) << (4 * c + i);
        std::memcpy(dst[r] + kQh, &qh, 4);
      }
    }
  }
};

struct Q8 {
  static constexpr int64_t kRec = 272;  // 8 x 34
  static void pack(const uint8_t* const* src, uint8_t* rec) {
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(rec + 2 * r, src[r], 2);
      for (int q = 0; q < 8; ++q) std::memcpy(rec + 16 + 32 * q + 4 * r, src[r] + 2 + 4 * q, 4);
    }
  }
  static void unpack(const uint8_t* rec, uint8_t* const* dst) {
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(dst[r], rec + 2 * r, 2);
      for (int q = 0; q < 8; ++q) std::memcpy(dst[r] + 2 + 4 * q, rec + 16 + 32 * q + 4 * r, 4);
    }
  }
};

// Q4_K / Q5_K header: d, dmin, and the 6-bit scale and minimum of each 32-value group, unpacked
// to one byte each and stored group-major (8 rows side by side): 160 bytes per 8 rows.
struct KHeader {
  static void pack(const uint8_t* const* src, uint8_t* rec) {
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(rec + 2 * r, src[r], 2);
      std::memcpy(rec + 16 + 2 * r, src[r] + 2, 2);
      for (int g = 0; g < 8; ++g) {
        int sc, m;
        scale_min_k4(g, src[r] + 4, &sc, &m);
        rec[32 + 8 * g + r] = static_cast<uint8_t>(sc);
        rec[96 + 8 * g + r] = static_cast<uint8_t>(m);
      }
    }
  }
  static void unpack(const uint8_t* rec, uint8_t* const* dst) {
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(dst[r], rec + 2 * r, 2);
      std::memcpy(dst[r] + 2, rec + 16 + 2 * r, 2);
      uint8_t* s = dst[r] + 4;  // inverse of scale_min_k4
      for (int j = 0; j < 4; ++j) {
        const int sc = rec[32 + 8 * j + r], m = rec[96 + 8 * j + r];
        const int sc4 = rec[32 + 8 * (j + 4) + r], m4 = rec[96 + 8 * (j + 4) + r];
        s[j] = static_cast<uint8_t>(sc | (sc4 >> 4) << 6);
        s[j + 4] = static_cast<uint8_t>(m | (m4 >> 4) << 6);
        s[j + 8] = static_cast<uint8_t>((sc4 & 0xF) | (m4 & 0xF) << 4);
      }
    }
  }
};

// Q4_K (kFifth false) and Q5_K: the header, then per 32-value group g its [bits] and nib.
// Source: d, dmin, scales[12], [qh[32]: bit g of qh[l] is the fifth bit of group g's value l],
// qs[128]: groups 2i and 2i + 1 are the low and high nibbles of qs[32i .. 32i + 31].
template <bool kFifth>
struct KQuant {
  static constexpr int64_t kGroup = kFifth ? 160 : 128;
  static constexpr int64_t kHeader = 160, kRec = kHeader + 8 * kGroup, kQs = kFifth ? 48 : 16;
  static const uint8_t* bits_at(const uint8_t* rec, int g) { return rec + kHeader + kGroup * g; }
  static const uint8_t* nib_at(const uint8_t* rec, int g) { return rec + kHeader + kGroup * g + kGroup - 128; }

  // put_nib and put_bits<1> of each group's values, computed straight from the source bytes
  // (the records are the same; this runs ~5x faster than going through Values)
  static void pack(const uint8_t* const* src, uint8_t* rec) {
    KHeader::pack(src, rec);
    for (int g = 0; g < 8; ++g) {
      uint8_t* out = rec + kHeader + kGroup * g;
      uint8_t* nib = out + kGroup - 128;
      const int shift = 4 * (g % 2);
      for (int r = 0; r < kRows; ++r) {
        const uint8_t* q = src[r] + kQs + 32 * (g / 2);
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < 4; ++i)
            nib[32 * c + 4 * r + i] = static_cast<uint8_t>(((q[4 * c + i] >> shift) & 0xF) |
                                                           ((q[16 + 4 * c + i] >> shift) & 0xF) << 4);
        if (kFifth) {  // byte 4r + i, bit c: bit g of qh[4c + i]
          uint32_t acc = 0;
          for (int c = 0; c < 8; ++c) acc |= ((u32_at(src[r] + 16 + 4 * c) >> g) & 0x01010101u) << c;
          std::memcpy(out + 4 * r, &acc, 4);
        }
      }
    }
  }
  static void unpack(const uint8_t* rec, uint8_t* const* dst) {
    KHeader::unpack(rec, dst);
    if (kFifth)
      for (int r = 0; r < kRows; ++r) std::memset(dst[r] + 16, 0, 32);
    for (int g = 0; g < 8; g += 2) {
      Values lo, hi;
      get_nib(nib_at(rec, g), lo);
      get_nib(nib_at(rec, g + 1), hi);
      if (kFifth) {
        get_bits<1>(bits_at(rec, g), 4, lo);
        get_bits<1>(bits_at(rec, g + 1), 4, hi);
      }
      for (int r = 0; r < kRows; ++r)
        for (int l = 0; l < 32; ++l) {
          dst[r][kQs + 16 * g + l] = static_cast<uint8_t>((lo[r][l] & 0xF) | (hi[r][l] & 0xF) << 4);
          if (kFifth) dst[r][16 + l] |= static_cast<uint8_t>((lo[r][l] >> 4) << g | (hi[r][l] >> 4) << (g + 1));
        }
    }
  }
};
using Q4K = KQuant<false>;
using Q5K = KQuant<true>;

struct Q6K {
  static constexpr int64_t kRec = 1680, kBlk = 144;  // 8 x 210
  // value 32 * j + l of a super-block: a nibble of ql and two bits of qh (ggml's order)
  static int ql_at(int j, int l) { return 64 * (j / 4) + 32 * (j % 2) + l; }
  static int qh_at(int j, int l) { return 128 + 32 * (j / 4) + l; }
  static void pack(const uint8_t* const* src, uint8_t* rec) {
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(rec + 2 * r, src[r] + 208, 2);
      for (int i = 0; i < 16; ++i) rec[16 + 8 * i + r] = src[r][192 + i];
    }
    // put_nib and put_bits<2> of each 32-value block, straight from ql and qh
    for (int j = 0; j < 8; ++j) {
      uint8_t* nib = rec + kBlk + 192 * j;
      uint8_t* bits = nib + 128;
      const int lo_shift = 4 * ((j % 4) / 2), hi_shift = 2 * (j % 4);
      for (int r = 0; r < kRows; ++r) {
        const uint8_t* ql = src[r] + ql_at(j, 0);
        const uint8_t* qh = src[r] + qh_at(j, 0);
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < 4; ++i)
            nib[32 * c + 4 * r + i] = static_cast<uint8_t>(((ql[4 * c + i] >> lo_shift) & 0xF) |
                                                           ((ql[16 + 4 * c + i] >> lo_shift) & 0xF) << 4);
        for (int half = 0; half < 2; ++half) {  // byte 32h + 4r + i, bits 2(c - 4h): qh[4c + i]
          uint32_t acc = 0;
          for (int c = 4 * half; c < 4 * half + 4; ++c)
            acc |= ((u32_at(qh + 4 * c) >> hi_shift) & 0x03030303u) << (2 * (c - 4 * half));
          std::memcpy(bits + 32 * half + 4 * r, &acc, 4);
        }
      }
    }
  }
  static void unpack(const uint8_t* rec, uint8_t* const* dst) {
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(dst[r] + 208, rec + 2 * r, 2);
      for (int i = 0; i < 16; ++i) dst[r][192 + i] = rec[16 + 8 * i + r];
      std::memset(dst[r], 0, 192);
    }
    for (int j = 0; j < 8; ++j) {
      Values v;
      get_nib(rec + kBlk + 192 * j, v);
      get_bits<2>(rec + kBlk + 192 * j + 128, 4, v);
      for (int r = 0; r < kRows; ++r)
        for (int l = 0; l < 32; ++l) {
          dst[r][ql_at(j, l)] |= static_cast<uint8_t>((v[r][l] & 0xF) << (4 * ((j % 4) / 2)));
          dst[r][qh_at(j, l)] |= static_cast<uint8_t>((v[r][l] >> 4) << (2 * (j % 4)));
        }
    }
  }
};

}  // namespace x8
}  // namespace pagedllm_ggml

#include "ggml_x8_layout_low.h"  // Q2_K, Q3_K, IQ4_NL, IQ4_XS

namespace pagedllm_ggml {
namespace x8 {

// --- formats --------------------------------------------------------------------------------
using PackFn = void (*)(const uint8_t* const*, uint8_t*);
using UnpackRecFn = void (*)(const uint8_t*, uint8_t* const*);

struct X8Format {
  int64_t values;     // values of one row per record: the GGUF block, or super-block
  int64_t src_bytes;  // the bytes of those values in the GGUF layout
  int64_t rec_bytes;  // the bytes of one record (eight rows)
  PackFn pack;
  UnpackRecFn unpack;
};

template <class Layout>
X8Format x8_format(int64_t t) {
  const Format f = format_of(t);
  return {f.block, f.bytes, Layout::kRec, Layout::pack, Layout::unpack};
}

inline X8Format format_x8(int64_t t) {
  switch (t) {
    case kQ4_0: return x8_format<Small<false, false>>(t);
    case kQ4_1: return x8_format<Small<true, false>>(t);
    case kQ5_0: return x8_format<Small<false, true>>(t);
    case kQ5_1: return x8_format<Small<true, true>>(t);
    case kQ8_0:
    case kQ8_0G4: return x8_format<Q8>(t);
    case kQ4_K: return x8_format<Q4K>(t);
    case kQ5_K: return x8_format<Q5K>(t);
    case kQ6_K: return x8_format<Q6K>(t);
    case kQ2_K: return x8_format<Q2K>(t);
    case kQ3_K: return x8_format<Q3K>(t);
    case kIQ4_NL: return x8_format<IQ4NL>(t);
    case kIQ4_XS: return x8_format<IQ4XS>(t);
  }
  TORCH_CHECK(false, "ggml type ", t, " has no x8 layout");
}

}  // namespace x8
}  // namespace pagedllm_ggml
