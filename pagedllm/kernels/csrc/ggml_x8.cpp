// GGML blocks regrouped eight rows at a time ("x8"), and the int8-activation matmuls on them:
// a streaming gemv for up to 7 x rows (decode) and a gemm from 8 on (prefill, large batches).
//
// The weights keep every bit of the GGUF blocks, only reordered (the same bytes, 2-3 % more for
// the unpacked 6-bit scales of Q4_K and Q5_K): blocks b of rows 8g..8g+7 form one record, whose scales are
// stored side by side (one fp16 load gives all eight rows' scales) and whose values are stored
// as quads: 32 bytes hold four consecutive values of each of the eight rows, so
//
//   maddubs(w, broadcast(x[4c..4c+3]))  ->  madd  ->  lane r = dot of row r with x's quad c
//
// Each output lane is one weight row: there is no horizontal sum, one FMA scales eight rows,
// and a 32-value block of eight rows costs ~6 instructions per row, against ~26 when each row is
// decoded alone (that kernel was compute-bound at 6-9 GB/s on a 2-core AVX2 machine).
//
// Records (per 8 rows; "nib" = 128 bytes, byte 32c + 4r + i = v[r][4c+i] | v[r][16+4c+i] << 4,
// c < 4: low nibbles are quads 0-3 and high nibbles quads 4-7 of the 32 values):
//   Q4_0  d[8] fp16, nib                                    (144 B = 8 x 18)
//   Q4_1  d[8], m[8], nib                                   (160 B = 8 x 20)
//   Q5_0  d[8], bits, nib   bits: byte 4r + i, bit c = fifth bit of v[r][4c+i]  (176 B)
//   Q5_1  d[8], m[8], bits, nib                             (192 B)
//   Q8_0  d[8], q: byte 32c + 4r + i = q[r][4c+i], c < 8     (272 B = 8 x 34)
//   Q4_K  d[8], dmin[8], sc[8][8], m[8][8] (group-major), nib x 8 groups   (1184 B, 8 x 144 + 32)
//   Q5_K  the same header, then per group: bits, nib         (1440 B, 8 x 176 + 32)
//   Q6_K  d[8], sc[16][8] i8, per 32-block: nib (low 4 bits), hi: byte 32h + 4r + i bits
//         2(c - 4h).. = high 2 bits of v[r][4c+i]           (1680 B = 8 x 210)
// A matrix of N rows (N a multiple of 8) is a uint8 tensor [N / 8, records * record bytes].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ggml_common.h"
#include "ggml_x8_layout.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using namespace pagedllm_ggml;
using namespace pagedllm_ggml::x8;

#ifdef PAGEDLLM_AVX2
// --- kernels: out[c * ldo + r] = dot(row r, x row c) for the 8 rows of a run of records -----
struct XRows {
  const int8_t* q;  // row c at q + c * k
  const float* d;   // row c at d + c * nb (x's scale per 32 values)
  const float* s;   // dx * sum(xq) per 32 values
  int64_t k, nb;
};

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// Ask for the weight bytes 1 KiB ahead (a thread streams its groups' records in order). Measured on
// 64 MB matrices at one x row, 2 threads: 17-21 GB/s without, 19.5-24 with (a plain torch.sum
// reads 25); 768-1536 bytes ahead are alike, 4096 is worse.
constexpr int64_t kAhead = 1024;
template <int64_t kBytes>
inline void prefetch_ahead(const uint8_t* p) {
  for (int64_t i = 0; i < kBytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + i), _MM_HINT_T0);
}
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// bit c of every byte, moved to bit 4 (0x10)
inline __m256i bit_to_16(__m256i bits, int c) {
  const __m256i v = c < 4 ? _mm256_slli_epi16(bits, 4 - c) : _mm256_srli_epi16(bits, c - 4);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

// Unsigned 4/5-bit values (nib [+ bits]) of one block, 8 rows, against C x rows:
// lane r of dots[c] = sum of q[r][j] * xq[c][j]. maddubs pairs stay < 2^15 summed over 4 quads
// of 4-bit or 2 quads of 5-bit values.
template <bool kFifth, int C>
inline void dot_unsigned(const uint8_t* nib, const uint8_t* bits, const XRows& x, int64_t b, __m256i* dots) {
  const __m256i m4 = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
  const __m256i hb = kFifth ? load32(bits) : _mm256_setzero_si256();
  __m256i p16[C];
  for (int c = 0; c < C; ++c) dots[c] = p16[c] = _mm256_setzero_si256();
  #pragma GCC unroll 8  // gcc left this loop rolled: shift counts in registers, a branch per quad
  for (int q = 0; q < 4; ++q) {
    const __m256i v = load32(nib + 32 * q);
    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (kFifth) {
      lo = _mm256_or_si256(lo, bit_to_16(hb, q));
      hi = _mm256_or_si256(hi, bit_to_16(hb, q + 4));
    }
    for (int c = 0; c < C; ++c) {
      const int8_t* xp = x.q + c * x.k + 32 * b;
      p16[c] = _mm256_add_epi16(p16[c], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xp + 4 * q)),
                                                          _mm256_maddubs_epi16(hi, bcast4(xp + 16 + 4 * q))));
      if (!kFifth && q == 3) dots[c] = _mm256_madd_epi16(p16[c], ones);
      if (kFifth && q % 2 == 1) {
        dots[c] = _mm256_add_epi32(dots[c], _mm256_madd_epi16(p16[c], ones));
        p16[c] = _mm256_setzero_si256();
      }
    }
  }
}

// Scale S and offset O (w = S * q + O) of block j of a record, one lane per row.
template <bool kHasMin, bool kFifth>
struct SmallScales {
  static constexpr int64_t kBlocks = 1;
  static void so(const uint8_t* rec, int, __m256* s, __m256* o) {
    *s = halves8(rec);
    *o = kHasMin ? halves8(rec + 16) : _mm256_mul_ps(*s, _mm256_set1_ps(kFifth ? -16.f : -8.f));
  }
  static const uint8_t* bits(const uint8_t* rec, int) { return rec + 16 + 16 * kHasMin; }
  static const uint8_t* nib(const uint8_t* rec, int) { return rec + Small<kHasMin, kFifth>::kRec - 128; }
  static constexpr int64_t kRec = Small<kHasMin, kFifth>::kRec;
  static constexpr bool kFifthBit = kFifth;
};

template <bool kFifth>
struct KScales {
  using Q = KQuant<kFifth>;
  static constexpr int64_t kBlocks = 8, kRec = Q::kRec;
  static constexpr bool kFifthBit = kFifth;
  static void so(const uint8_t* rec, int j, __m256* s, __m256* o) {
    *s = _mm256_mul_ps(halves8(rec), u8x8(rec + 32 + 8 * j));
    *o = _mm256_mul_ps(halves8(rec + 16), _mm256_sub_ps(_mm256_setzero_ps(), u8x8(rec + 96 + 8 * j)));
  }
  static const uint8_t* bits(const uint8_t* rec, int j) { return Q::bits_at(rec, j); }
  static const uint8_t* nib(const uint8_t* rec, int j) { return Q::nib_at(rec, j); }
};

template <class S, int C>
void gemv_unsigned(const uint8_t* w, int64_t nrec, const XRows& x, float* out, int64_t ldo) {
  __m256 acc[C], off[C];
  for (int c = 0; c < C; ++c) acc[c] = off[c] = _mm256_setzero_ps();
  for (int64_t rb = 0; rb < nrec; ++rb, w += S::kRec) {
    prefetch_ahead<S::kRec>(w);
    for (int j = 0; j < S::kBlocks; ++j) {
      const int64_t b = rb * S::kBlocks + j;
      __m256 scale, offset;
      S::so(w, j, &scale, &offset);
      __m256i dots[C];
      dot_unsigned<S::kFifthBit, C>(S::nib(w, j), S::bits(w, j), x, b, dots);
      for (int c = 0; c < C; ++c) {
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[c]), _mm256_mul_ps(scale, _mm256_set1_ps(x.d[c * x.nb + b])), acc[c]);
        off[c] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x.s[c * x.nb + b]), off[c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + c * ldo, _mm256_add_ps(acc[c], off[c]));
}

// --- many x rows: a block of eight weight rows is decoded once and applied to a chunk of x rows.
// (The gemv above decodes it again for every 4 x rows and keeps 16 accumulators, more than the
// 16 AVX2 registers, so it spills.) Per x row the arithmetic is the gemv's, in the same order:
// the integer dot of a block is exact however its sums are grouped, and the float updates run
// block by block as there, so a row's result is the same bit for bit whichever kernel runs.
struct XBlocks {  // x block-major: block b of x row c at q + 32 * (b * m + c); d, s at b * m + c
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* h;  // 32 x the sums of q over values 0-15 and 16-31 of a block at h[2 * (b * m + c)] (Q6_K)
  int64_t m;
};
constexpr int64_t kChunk = 64;  // x rows per pass over a weight group

template <bool kFifth>
inline void decode_unsigned(const uint8_t* nib, const uint8_t* bits, __m256i* v) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const __m256i hb = kFifth ? load32(bits) : _mm256_setzero_si256();
  #pragma GCC unroll 8  // gcc left this loop rolled: shift counts in registers, a branch per quad
  for (int q = 0; q < 4; ++q) {
    const __m256i t = load32(nib + 32 * q);
    v[q] = _mm256_and_si256(t, m4);
    v[q + 4] = _mm256_and_si256(_mm256_srli_epi16(t, 4), m4);
    if (kFifth) {
      v[q] = _mm256_or_si256(v[q], bit_to_16(hb, q));
      v[q + 4] = _mm256_or_si256(v[q + 4], bit_to_16(hb, q + 4));
    }
  }
}

// out[c * ldo + r] for x rows c0 <= c < c1 (c1 - c0 <= kChunk)
template <class S>
void gemm_unsigned(const uint8_t* w, int64_t nrec, const XBlocks& x, int64_t c0, int64_t c1, float* out,
                   int64_t ldo) {
  alignas(32) float acc[kChunk * 8], off[kChunk * 8];
  const int64_t n = c1 - c0;
  std::fill(acc, acc + 8 * n, 0.f);
  std::fill(off, off + 8 * n, 0.f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t rb = 0; rb < nrec; ++rb, w += S::kRec) {
    for (int j = 0; j < S::kBlocks; ++j) {
      const int64_t b = rb * S::kBlocks + j;
      __m256 scale, offset;
      S::so(w, j, &scale, &offset);
      __m256i v[8];
      decode_unsigned<S::kFifthBit>(S::nib(w, j), S::bits(w, j), v);
      const int8_t* xq = x.q + 32 * (b * x.m + c0);
      const float* xd = x.d + b * x.m + c0;
      const float* xs = x.s + b * x.m + c0;
      for (int64_t c = 0; c < n; ++c, xq += 32) {
        __m256i dot;
        if (S::kFifthBit) {  // four maddubs of 5-bit values stay < 2^15
          __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], bcast4(xq)), _mm256_maddubs_epi16(v[4], bcast4(xq + 16)));
          p = _mm256_add_epi16(p, _mm256_add_epi16(_mm256_maddubs_epi16(v[1], bcast4(xq + 4)),
                                                   _mm256_maddubs_epi16(v[5], bcast4(xq + 20))));
          __m256i p2 = _mm256_add_epi16(_mm256_maddubs_epi16(v[2], bcast4(xq + 8)), _mm256_maddubs_epi16(v[6], bcast4(xq + 24)));
          p2 = _mm256_add_epi16(p2, _mm256_add_epi16(_mm256_maddubs_epi16(v[3], bcast4(xq + 12)),
                                                     _mm256_maddubs_epi16(v[7], bcast4(xq + 28))));
          dot = _mm256_add_epi32(_mm256_madd_epi16(p, ones), _mm256_madd_epi16(p2, ones));
        } else {  // eight of 4-bit values do
          __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], bcast4(xq)), _mm256_maddubs_epi16(v[4], bcast4(xq + 16)));
          for (int q = 1; q < 4; ++q)
            p = _mm256_add_epi16(p, _mm256_add_epi16(_mm256_maddubs_epi16(v[q], bcast4(xq + 4 * q)),
                                                     _mm256_maddubs_epi16(v[q + 4], bcast4(xq + 16 + 4 * q))));
          dot = _mm256_madd_epi16(p, ones);
        }
        float* a = acc + 8 * c;
        float* o = off + 8 * c;
        _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(xd[c])),
                                           _mm256_load_ps(a)));
        _mm256_store_ps(o, _mm256_fmadd_ps(offset, _mm256_set1_ps(xs[c]), _mm256_load_ps(o)));
      }
    }
  }
  for (int64_t c = 0; c < n; ++c)
    _mm256_storeu_ps(out + (c0 + c) * ldo, _mm256_add_ps(_mm256_load_ps(acc + 8 * c), _mm256_load_ps(off + 8 * c)));
}

// signed values: |w| * (x with w's sign); a maddubs pair of int8 may reach 2^15, so each quad
// goes to int32 on its own
template <int C>
void gemv_q8_0(const uint8_t* w, int64_t nrec, const XRows& x, float* out, int64_t ldo) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nrec; ++b, w += Q8::kRec) {
    prefetch_ahead<Q8::kRec>(w);
    __m256i dots[C];
    for (int c = 0; c < C; ++c) dots[c] = _mm256_setzero_si256();
    #pragma GCC unroll 8  // gcc left this loop rolled: shift counts in registers, a branch per quad
    for (int q = 0; q < 8; ++q) {
      const __m256i v = load32(w + 16 + 32 * q), av = _mm256_sign_epi8(v, v);
      for (int c = 0; c < C; ++c) {
        const __m256i xv = _mm256_sign_epi8(bcast4(x.q + c * x.k + 32 * b + 4 * q), v);
        dots[c] = _mm256_add_epi32(dots[c], _mm256_madd_epi16(_mm256_maddubs_epi16(av, xv), ones));
      }
    }
    const __m256 d = halves8(w);
    for (int c = 0; c < C; ++c)
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[c]), _mm256_mul_ps(d, _mm256_set1_ps(x.d[c * x.nb + b])), acc[c]);
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + c * ldo, acc[c]);
}

// Q6_K: 6-bit values minus 32 (signed, |q| <= 32: four quads sum safely in int16); the first 16
// values of a block (quads 0-3, the low nibbles) and the last 16 have their own scales.
template <int C>
void gemv_q6_k(const uint8_t* w, int64_t nrec, const XRows& x, float* out, int64_t ldo) {
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nrec; ++sb, w += Q6K::kRec) {
    prefetch_ahead<Q6K::kRec>(w);
    const __m256 d = halves8(w);
    for (int j = 0; j < 8; ++j) {
      const int64_t b = 8 * sb + j;
      const uint8_t* blk = w + Q6K::kBlk + 192 * j;
      const __m256i h0 = load32(blk + 128), h1 = load32(blk + 160);
      __m256i pa[C], pb[C];
      for (int c = 0; c < C; ++c) pa[c] = pb[c] = _mm256_setzero_si256();
      #pragma GCC unroll 8  // gcc left this loop rolled: shift counts in registers, a branch per quad
      for (int q = 0; q < 4; ++q) {
        const __m256i v = load32(blk + 32 * q);
        // high two bits of quad q sit at bits 2q of h0, of quad q + 4 at bits 2q of h1
        const __m256i hl = _mm256_and_si256(q < 2 ? _mm256_slli_epi16(h0, 4 - 2 * q) : _mm256_srli_epi16(h0, 2 * q - 4), m2);
        const __m256i hh = _mm256_and_si256(q < 2 ? _mm256_slli_epi16(h1, 4 - 2 * q) : _mm256_srli_epi16(h1, 2 * q - 4), m2);
        const __m256i lo = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(v, m4), hl), off);
        const __m256i hi = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), hh), off);
        const __m256i alo = _mm256_sign_epi8(lo, lo), ahi = _mm256_sign_epi8(hi, hi);
        for (int c = 0; c < C; ++c) {
          const int8_t* xp = x.q + c * x.k + 32 * b;
          pa[c] = _mm256_add_epi16(pa[c], _mm256_maddubs_epi16(alo, _mm256_sign_epi8(bcast4(xp + 4 * q), lo)));
          pb[c] = _mm256_add_epi16(pb[c], _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(bcast4(xp + 16 + 4 * q), hi)));
        }
      }
      const __m256 sa = _mm256_mul_ps(d, i8x8(w + 16 + 8 * (2 * j))), sb2 = _mm256_mul_ps(d, i8x8(w + 16 + 8 * (2 * j + 1)));
      for (int c = 0; c < C; ++c) {
        const __m256 dx = _mm256_set1_ps(x.d[c * x.nb + b]);
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pa[c], ones)), _mm256_mul_ps(sa, dx), acc[c]);
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pb[c], ones)), _mm256_mul_ps(sb2, dx), acc[c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + c * ldo, acc[c]);
}

// Q6_K for many x rows: the 6-bit values stay unsigned (0-63) so that x needs no sign per row,
// and 32 * (sum of x over the half-block) comes off the integer dot: the same integers as the
// gemv's dot of (q - 32) with x, then the same float updates, so the same numbers per row.
// A maddubs pair of 6-bit values reaches 2 * 63 * 127: two of them sum safely in int16.
void gemm_q6_k(const uint8_t* w, int64_t nrec, const XBlocks& x, int64_t c0, int64_t c1, float* out, int64_t ldo) {
  alignas(32) float acc[kChunk * 8];
  const int64_t n = c1 - c0;
  std::fill(acc, acc + 8 * n, 0.f);
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  for (int64_t sb = 0; sb < nrec; ++sb, w += Q6K::kRec) {
    const __m256 d = halves8(w);
    for (int j = 0; j < 8; ++j) {
      const int64_t b = 8 * sb + j;
      const uint8_t* blk = w + Q6K::kBlk + 192 * j;
      const __m256i h0 = load32(blk + 128), h1 = load32(blk + 160);
      __m256i v[8];
      #pragma GCC unroll 8  // gcc left this loop rolled: shift counts in registers, a branch per quad
      for (int q = 0; q < 4; ++q) {
        const __m256i t = load32(blk + 32 * q);
        const __m256i hl = _mm256_and_si256(q < 2 ? _mm256_slli_epi16(h0, 4 - 2 * q) : _mm256_srli_epi16(h0, 2 * q - 4), m2);
        const __m256i hh = _mm256_and_si256(q < 2 ? _mm256_slli_epi16(h1, 4 - 2 * q) : _mm256_srli_epi16(h1, 2 * q - 4), m2);
        v[q] = _mm256_or_si256(_mm256_and_si256(t, m4), hl);
        v[q + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(t, 4), m4), hh);
      }
      const __m256 sa = _mm256_mul_ps(d, i8x8(w + 16 + 8 * (2 * j))), sb2 = _mm256_mul_ps(d, i8x8(w + 16 + 8 * (2 * j + 1)));
      const int8_t* xq = x.q + 32 * (b * x.m + c0);
      const float* xd = x.d + b * x.m + c0;
      const int32_t* xh = x.h + 2 * (b * x.m + c0);
      for (int64_t c = 0; c < n; ++c, xq += 32, xh += 2) {
        const __m256i a01 = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], bcast4(xq)), _mm256_maddubs_epi16(v[1], bcast4(xq + 4)));
        const __m256i a23 = _mm256_add_epi16(_mm256_maddubs_epi16(v[2], bcast4(xq + 8)), _mm256_maddubs_epi16(v[3], bcast4(xq + 12)));
        const __m256i b01 = _mm256_add_epi16(_mm256_maddubs_epi16(v[4], bcast4(xq + 16)), _mm256_maddubs_epi16(v[5], bcast4(xq + 20)));
        const __m256i b23 = _mm256_add_epi16(_mm256_maddubs_epi16(v[6], bcast4(xq + 24)), _mm256_maddubs_epi16(v[7], bcast4(xq + 28)));
        const __m256i da = _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(a01, ones), _mm256_madd_epi16(a23, ones)),
                                            _mm256_set1_epi32(xh[0]));
        const __m256i db = _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(b01, ones), _mm256_madd_epi16(b23, ones)),
                                            _mm256_set1_epi32(xh[1]));
        const __m256 dx = _mm256_set1_ps(xd[c]);
        float* a = acc + 8 * c;
        __m256 r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(da), _mm256_mul_ps(sa, dx), _mm256_load_ps(a));
        _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(db), _mm256_mul_ps(sb2, dx), r));
      }
    }
  }
  for (int64_t c = 0; c < n; ++c) _mm256_storeu_ps(out + (c0 + c) * ldo, _mm256_load_ps(acc + 8 * c));
}

using GemvFn = void (*)(const uint8_t*, int64_t, const XRows&, float*, int64_t);

template <int C>
GemvFn gemv_for(int64_t t) {
  switch (t) {
    case kQ4_0: return gemv_unsigned<SmallScales<false, false>, C>;
    case kQ4_1: return gemv_unsigned<SmallScales<true, false>, C>;
    case kQ5_0: return gemv_unsigned<SmallScales<false, true>, C>;
    case kQ5_1: return gemv_unsigned<SmallScales<true, true>, C>;
    case kQ8_0: return gemv_q8_0<C>;
    case kQ4_K: return gemv_unsigned<KScales<false>, C>;
    case kQ5_K: return gemv_unsigned<KScales<true>, C>;
    case kQ6_K: return gemv_q6_k<C>;
  }
  TORCH_CHECK(false, "ggml type ", t, " has no x8 kernel");
}

using GemmFn = void (*)(const uint8_t*, int64_t, const XBlocks&, int64_t, int64_t, float*, int64_t);
constexpr int64_t kGemmRows = 8;  // from this many x rows on, the gemm (where the type has one)

GemmFn gemm_for(int64_t t) {
  switch (t) {
    case kQ4_0: return gemm_unsigned<SmallScales<false, false>>;
    case kQ4_1: return gemm_unsigned<SmallScales<true, false>>;
    case kQ5_0: return gemm_unsigned<SmallScales<false, true>>;
    case kQ5_1: return gemm_unsigned<SmallScales<true, true>>;
    case kQ4_K: return gemm_unsigned<KScales<false>>;
    case kQ5_K: return gemm_unsigned<KScales<true>>;
    case kQ6_K: return gemm_q6_k;
  }
  return nullptr;
}
#endif

void check_packed(const at::Tensor& w, int64_t qtype, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "x8 weight must be a contiguous CPU uint8 tensor [rows / 8, bytes]");
  const X8Format f = format_x8(qtype);
  TORCH_CHECK(k % f.values == 0, "k=", k, " is not a multiple of ", f.values);
  TORCH_CHECK(w.size(1) == k / f.values * f.rec_bytes, "x8 row bytes ", w.size(1), " do not match k=", k);
}

at::Tensor ggml_pack_x8(const at::Tensor& w, int64_t qtype, int64_t k) {
  const X8Format f = format_x8(qtype);
  check_weight(w, qtype, k);
  TORCH_CHECK(w.size(0) % kRows == 0, "rows=", w.size(0), " is not a multiple of ", kRows);
  const int64_t groups = w.size(0) / kRows, nrec = k / f.values, rb = w.size(1);
  at::Tensor out = at::empty({groups, nrec * f.rec_bytes}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t i = 0; i < nrec; ++i) {
        const uint8_t* rows[kRows];
        for (int r = 0; r < kRows; ++r) rows[r] = src + (kRows * g + r) * rb + i * f.src_bytes;
        f.pack(rows, dst + (g * nrec + i) * f.rec_bytes);
      }
  });
  return out;
}

// back to the GGUF block layout [rows, row_bytes]
// The eight GGUF rows of record group g (its nrec records at src) into rows[r] = out + r * rb.
void unpack_group(const X8Format& f, const uint8_t* src, int64_t nrec, uint8_t* out, int64_t rb) {
  for (int64_t i = 0; i < nrec; ++i) {
    uint8_t* rows[kRows];
    for (int r = 0; r < kRows; ++r) rows[r] = out + r * rb + i * f.src_bytes;
    f.unpack(src + i * f.rec_bytes, rows);
  }
}

at::Tensor ggml_unpack_x8(const at::Tensor& wp, int64_t qtype, int64_t k) {
  check_packed(wp, qtype, k);
  const X8Format f = format_x8(qtype);
  const int64_t groups = wp.size(0), nrec = k / f.values, rb = nrec * f.src_bytes;
  at::Tensor out = at::empty({groups * kRows, rb}, wp.options());
  const uint8_t* src = wp.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) unpack_group(f, src + g * wp.size(1), nrec, dst + kRows * g * rb, rb);
  });
  return out;
}

// float32 [rows, k], the same values as dequantizing the GGUF blocks
at::Tensor ggml_dequant_x8(const at::Tensor& wp, int64_t qtype, int64_t k) {
  check_packed(wp, qtype, k);
  const X8Format f = format_x8(qtype);
  const int64_t groups = wp.size(0), nrec = k / f.values, rb = nrec * f.src_bytes;
  at::Tensor out = at::empty({groups * kRows, k}, wp.options().dtype(at::kFloat));
  const uint8_t* src = wp.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> buf(kRows * rb);
    for (int64_t g = g0; g < g1; ++g) {
      unpack_group(f, src + g * wp.size(1), nrec, buf.data(), rb);
      for (int r = 0; r < kRows; ++r) dequant_row(qtype, buf.data() + r * rb, dst + (kRows * g + r) * k, k);
    }
  });
  return out;
}

// float32 [T, k]: rows ids[t] of an x8 matrix (an embedding lookup), as ggml dequantizes them
at::Tensor ggml_embed_x8(const at::Tensor& wp, const at::Tensor& ids_in, int64_t qtype, int64_t k) {
  check_packed(wp, qtype, k);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous().view(-1);
  const X8Format f = format_x8(qtype);
  const int64_t nrec = k / f.values, rb = nrec * f.src_bytes, rows = wp.size(0) * kRows;
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < rows, "token id ", idp[t], " is outside the embedding's ", rows, " rows");
  at::Tensor out = at::empty({ids.numel(), k}, wp.options().dtype(at::kFloat));
  const uint8_t* src = wp.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, ids.numel(), 8, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> buf(kRows * rb);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = idp[t] / kRows, r = idp[t] % kRows;
      unpack_group(f, src + g * wp.size(1), nrec, buf.data(), rb);
      dequant_row(qtype, buf.data() + r * rb, dst + t * k, k);
    }
  });
  return out;
}

// y_j = x @ W_j^T for x8 weights W_j sharing one input x [M, K]: x is quantized to int8 once,
// and the 8-row groups of all matrices are split over the threads together.
std::vector<at::Tensor> ggml_linear_x8(const at::Tensor& x_in, at::TensorList ws, at::IntArrayRef qtypes, int64_t k) {
  TORCH_CHECK(ws.size() == qtypes.size() && !ws.empty(), "need one qtype per weight");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k && k % 32 == 0, "x must be [M, ", k, "]");
  for (size_t j = 0; j < ws.size(); ++j) check_packed(ws[j], qtypes[j], k);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), nb = k / 32;
  std::vector<at::Tensor> outs;
  for (const at::Tensor& w : ws) outs.push_back(at::empty({m, w.size(0) * kRows}, x.options()));
#ifdef PAGEDLLM_AVX2
  struct Kernels {  // per weight, looked up once: the gemm and the kernels for 4, 2 and 1 x rows
    GemmFn many;
    GemvFn c4, c2, c1;
    int64_t nrec;
  };
  std::vector<Kernels> kernels;
  bool gemv = false, gemm = false;  // which layouts of x the kernels read
  for (size_t j = 0; j < ws.size(); ++j) {
    kernels.push_back({m >= kGemmRows ? gemm_for(qtypes[j]) : nullptr, gemv_for<4>(qtypes[j]),
                       gemv_for<2>(qtypes[j]), gemv_for<1>(qtypes[j]), k / format_x8(qtypes[j]).values});
    (kernels.back().many ? gemm : gemv) = true;
  }
  // x quantized row-major for the gemv and block-major for the gemm (see XBlocks), in parallel:
  // at 512 rows of 4864 values this took ~10 % of a matmul on one thread
  const std::unique_ptr<int8_t[]> xq(new int8_t[gemv ? m * k : 0]), bq(new int8_t[gemm ? m * k : 0]);
  const std::unique_ptr<float[]> xd(new float[gemv ? 2 * m * nb : 0]), bd(new float[gemm ? 2 * m * nb : 0]);
  const std::unique_ptr<int32_t[]> bh(new int32_t[gemm ? 2 * m * nb : 0]);
  const XRows xr{xq.get(), xd.get(), xd.get() + m * nb, k, nb};
  const XBlocks xb{bq.get(), bd.get(), bd.get() + m * nb, bh.get(), m};
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, 65536 / k), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (gemv) quantize_x(xp + i * k, k, xq.get() + i * k, xd.get() + i * nb, xd.get() + m * nb + i * nb);
      if (gemm) quantize_x(xp + i * k, k, bq.get() + 32 * i, bd.get() + i, bd.get() + m * nb + i, bh.get() + 2 * i, 32 * m, m);
    }
  });
  struct Task {
    size_t w;
    int64_t group;
  };
  std::vector<Task> tasks;
  for (size_t j = 0; j < ws.size(); ++j)
    for (int64_t g = 0; g < ws[j].size(0); ++g) tasks.push_back({j, g});
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const int64_t grain = std::max<int64_t>(1, (ntasks + at::get_num_threads() - 1) / at::get_num_threads());
  // the gemm's chunks of x rows in the outer loop: a chunk (64 rows of up to ~5k values) stays in
  // the cache while a thread's weight groups stream past it
  const int64_t nchunks = gemm ? (m + kChunk - 1) / kChunk : 1;
  at::parallel_for(0, ntasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      for (int64_t ti = t0; ti < t1; ++ti) {
        const Task& task = tasks[ti];
        const at::Tensor& w = ws[task.w];
        const Kernels& kn = kernels[task.w];
        const int64_t n = w.size(0) * kRows;
        const uint8_t* rec = w.data_ptr<uint8_t>() + task.group * w.size(1);
        float* op = outs[task.w].data_ptr<float>() + task.group * kRows;
        if (kn.many) {
          kn.many(rec, kn.nrec, xb, ch * kChunk, std::min(m, (ch + 1) * kChunk), op, n);
          continue;
        }
        if (ch > 0) continue;  // the gemv took every row in the first pass
        for (int64_t i = 0; i < m;) {
          const int cols = m - i >= 4 ? 4 : (m - i >= 2 ? 2 : 1);
          const GemvFn fn = cols == 4 ? kn.c4 : (cols == 2 ? kn.c2 : kn.c1);
          fn(rec, kn.nrec, XRows{xr.q + i * k, xr.d + i * nb, xr.s + i * nb, k, nb}, op + i * n, n);
          i += cols;
        }
      }
    }
  });
#else
  for (size_t j = 0; j < ws.size(); ++j)
    outs[j] = at::matmul(x, ggml_dequant_x8(ws[j], qtypes[j], k).t());
#endif
  return outs;
}

}  // namespace

std::vector<at::Tensor> pagedllm_ggml::linear_x8(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes,
                                                 int64_t k) {
  return ggml_linear_x8(x, ws, qtypes, k);
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("ggml_pack_x8(Tensor w, int qtype, int k) -> Tensor");
  m.def("ggml_unpack_x8(Tensor w, int qtype, int k) -> Tensor");
  m.def("ggml_dequant_x8(Tensor w, int qtype, int k) -> Tensor");
  m.def("ggml_embed_x8(Tensor w, Tensor ids, int qtype, int k) -> Tensor");
  m.def("ggml_linear_x8(Tensor x, Tensor[] ws, int[] qtypes, int k) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("ggml_pack_x8", &ggml_pack_x8);
  m.impl("ggml_unpack_x8", &ggml_unpack_x8);
  m.impl("ggml_dequant_x8", &ggml_dequant_x8);
  m.impl("ggml_embed_x8", &ggml_embed_x8);
  m.impl("ggml_linear_x8", &ggml_linear_x8);
}
