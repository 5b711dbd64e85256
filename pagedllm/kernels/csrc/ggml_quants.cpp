// CPU kernels over GGML quantized blocks exactly as a GGUF file stores them: dequantize rows,
// and y = x @ W^T with W left in its block format (the weights stay compact in memory).
//
// A weight matrix W [N, K] is a uint8 tensor [N, row_bytes]: each row is K / block_size blocks.
// Block layouts (ggml-common.h; "half" is IEEE fp16, little-endian):
//   Q4_0  32 values, 18 B: half d; u8 qs[16]                    w = d * (q - 8)
//   Q4_1  32 values, 20 B: half d, m; u8 qs[16]                 w = d * q + m
//   Q5_0  32 values, 22 B: half d; u32 qh; u8 qs[16]            w = d * (q - 16), q 5-bit
//   Q5_1  32 values, 24 B: half d, m; u32 qh; u8 qs[16]         w = d * q + m
//   Q8_0  32 values, 34 B: half d; i8 qs[32]                    w = d * q
//   Q4_K 256 values, 144 B: half d, dmin; u8 scales[12]; u8 qs[128]   8 groups of 32, 6-bit sc/m
//   Q5_K 256 values, 176 B: half d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]
//   Q6_K 256 values, 210 B: u8 ql[128]; u8 qh[64]; i8 scales[16]; half d   16 groups of 16
//   Q2_K, Q3_K, IQ4_NL, IQ4_XS: ggml_quants_low.cpp
// Dequantization is exact (the float32 values ggml itself produces); ggml_linear accumulates in
// float32 with FMA. The fast matmuls read the eight-row (x8) layout: ggml_x8.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ggml_common.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
namespace {

using namespace pagedllm_ggml;

void row_q4_0(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 32; ++b, p += 18, y += 32) {
    const float d = half_at(p);
    const uint8_t* qs = p + 2;
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>((qs[j] & 0xF) - 8);
      y[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  }
}

void row_q4_1(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 32; ++b, p += 20, y += 32) {
    const float d = half_at(p), m = half_at(p + 2);
    const uint8_t* qs = p + 4;
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>(qs[j] & 0xF) + m;
      y[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
}

// The fifth bit of value j (j < 16) is bit j of qh, of value j + 16 bit j + 16.
inline void q5_values(uint32_t qh, const uint8_t* qs, int* q) {
  for (int j = 0; j < 16; ++j) {
    q[j] = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
    q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
  }
}

void row_q5_0(const uint8_t* p, float* y, int64_t k) {
  int q[32];
  for (int64_t b = 0; b < k / 32; ++b, p += 22, y += 32) {
    const float d = half_at(p);
    q5_values(u32_at(p + 2), p + 6, q);
    for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q[j] - 16);
  }
}

void row_q5_1(const uint8_t* p, float* y, int64_t k) {
  int q[32];
  for (int64_t b = 0; b < k / 32; ++b, p += 24, y += 32) {
    const float d = half_at(p), m = half_at(p + 2);
    q5_values(u32_at(p + 4), p + 8, q);
    for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q[j]) + m;
  }
}

void row_q8_0(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 32; ++b, p += 34, y += 32) {
    const float d = half_at(p);
    const int8_t* qs = reinterpret_cast<const int8_t*>(p + 2);
    for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(qs[j]);
  }
}


void row_q4_k(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 256; ++b, p += 144) {
    const uint8_t* q = p + 16;
    for (int g = 0; g < 8; g += 2, q += 32, y += 64) {
      const GroupScale lo = k_group(p, g), hi = k_group(p, g + 1);
      for (int l = 0; l < 32; ++l) y[l] = lo.scale * static_cast<float>(q[l] & 0xF) - lo.min;
      for (int l = 0; l < 32; ++l) y[l + 32] = hi.scale * static_cast<float>(q[l] >> 4) - hi.min;
    }
  }
}

void row_q5_k(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 256; ++b, p += 176) {
    const uint8_t* qh = p + 16;
    const uint8_t* ql = p + 48;
    for (int g = 0; g < 8; g += 2, ql += 32, y += 64) {
      const GroupScale lo = k_group(p, g), hi = k_group(p, g + 1);
      // the fifth bit of group g's value l is bit g of qh[l]
      for (int l = 0; l < 32; ++l)
        y[l] = lo.scale * static_cast<float>((ql[l] & 0xF) + (((qh[l] >> g) & 1) << 4)) - lo.min;
      for (int l = 0; l < 32; ++l)
        y[l + 32] = hi.scale * static_cast<float>((ql[l] >> 4) + (((qh[l] >> (g + 1)) & 1) << 4)) - hi.min;
    }
  }
}

void row_q6_k(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 256; ++b, p += 210) {
    const float d = half_at(p + 208);
    const uint8_t* ql = p;
    const uint8_t* qh = p + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = static_cast<int>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = static_cast<int>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = static_cast<int>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = static_cast<int>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
    }
  }
}

void row_f16(const uint8_t* p, float* y, int64_t k) {
  for (int64_t j = 0; j < k; ++j) y[j] = half_at(p + 2 * j);
}

void row_bf16(const uint8_t* p, float* y, int64_t k) {
  for (int64_t j = 0; j < k; ++j) {
    uint16_t h;
    std::memcpy(&h, p + 2 * j, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    std::memcpy(y + j, &bits, 4);
  }
}

void row_f32(const uint8_t* p, float* y, int64_t k) { std::memcpy(y, p, 4 * k); }


#ifdef PAGEDLLM_AVX2
// --- AVX2 versions of the row dequantizers for the common types ---------------------------
// Each turns 32 (or 16) signed bytes into float32 values scaled by d (plus an offset).

// y[0..7] .. y[24..31] = d * q + m for 32 int8 values q.
inline void put32(__m256i q, float d, float m, float* y) {
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; ++i) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i]));
    _mm256_storeu_ps(y + 8 * i, _mm256_fmadd_ps(f, dv, mv));
  }
}

// 16 int8 values (one 128-bit lane) times d.
inline void put16(__m128i q, float d, float* y) {
  const __m256 dv = _mm256_set1_ps(d);
  _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), dv));
  _mm256_storeu_ps(y + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), dv));
}


void row_q4_0_avx2(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 32; ++b, p += 18, y += 32)
    put32(_mm256_sub_epi8(nibbles32(p + 2), _mm256_set1_epi8(8)), half_at(p), 0.f, y);
}

void row_q4_1_avx2(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 32; ++b, p += 20, y += 32)
    put32(nibbles32(p + 4), half_at(p), half_at(p + 2), y);
}

void row_q5_0_avx2(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 32; ++b, p += 22, y += 32) {
    const __m256i q = _mm256_or_si256(nibbles32(p + 6), fifth_bits(u32_at(p + 2)));
    put32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), half_at(p), 0.f, y);
  }
}

void row_q5_1_avx2(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 32; ++b, p += 24, y += 32)
    put32(_mm256_or_si256(nibbles32(p + 8), fifth_bits(u32_at(p + 4))), half_at(p), half_at(p + 2), y);
}

void row_q8_0_avx2(const uint8_t* p, float* y, int64_t k) {
  for (int64_t b = 0; b < k / 32; ++b, p += 34, y += 32)
    put32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)), half_at(p), 0.f, y);
}

void row_q4_k_avx2(const uint8_t* p, float* y, int64_t k) {
  const __m256i mask = _mm256_set1_epi8(0xF);
  for (int64_t b = 0; b < k / 256; ++b, p += 144) {
    const uint8_t* q = p + 16;
    for (int g = 0; g < 8; g += 2, q += 32, y += 64) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      const GroupScale lo = k_group(p, g), hi = k_group(p, g + 1);
      put32(_mm256_and_si256(v, mask), lo.scale, -lo.min, y);
      put32(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask), hi.scale, -hi.min, y + 32);
    }
  }
}

void row_q6_k_avx2(const uint8_t* p, float* y, int64_t k) {
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
  for (int64_t b = 0; b < k / 256; ++b, p += 210) {
    const float d = half_at(p + 208);
    const uint8_t* ql = p;
    const uint8_t* qh = p + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
      // value l + 32 * i: low/high nibble of ql, two bits of qh at 2 * i, minus 32
      const __m256i lows[4] = {_mm256_and_si256(a, m4), _mm256_and_si256(c, m4),
                               _mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(c, 4), m4)};
      for (int i = 0; i < 4; ++i) {
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, 2 * i), m2);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lows[i], _mm256_slli_epi16(hb, 4)), off);
        put16(_mm256_castsi256_si128(q), d * sc[2 * i], y + 32 * i);
        put16(_mm256_extracti128_si256(q, 1), d * sc[2 * i + 1], y + 32 * i + 16);
      }
    }
  }
}
#endif  // PAGEDLLM_AVX2

using RowFn = void (*)(const uint8_t*, float*, int64_t);
RowFn row_fn_scalar(int64_t t);

RowFn row_fn(int64_t t) {
#ifdef PAGEDLLM_AVX2
  switch (t) {
    case kQ4_0: return row_q4_0_avx2;
    case kQ4_1: return row_q4_1_avx2;
    case kQ5_0: return row_q5_0_avx2;
    case kQ5_1: return row_q5_1_avx2;
    case kQ8_0:
    case kQ8_0G4: return row_q8_0_avx2;
    case kQ4_K: return row_q4_k_avx2;
    case kQ6_K: return row_q6_k_avx2;
    default: break;
  }
#endif
  return row_fn_scalar(t);
}

RowFn row_fn_scalar(int64_t t) {
  switch (t) {
    case kF32: return row_f32;
    case kF16: return row_f16;
    case kBF16: return row_bf16;
    case kQ4_0: return row_q4_0;
    case kQ4_1: return row_q4_1;
    case kQ5_0: return row_q5_0;
    case kQ5_1: return row_q5_1;
    case kQ8_0:
    case kQ8_0G4: return row_q8_0;
    case kQ4_K: return row_q4_k;
    case kQ5_K: return row_q5_k;
    case kQ6_K: return row_q6_k;
    case kQ2_K: return row_q2_k;
    case kQ3_K: return row_q3_k;
    case kIQ4_NL: return row_iq4_nl;
    case kIQ4_XS: return row_iq4_xs;
  }
  TORCH_CHECK(false, "ggml type ", t, " has no pagedllm kernel");
}

// out[r] = dot(w + r * k, x) for r < R rows of dequantized weights (k is a multiple of 8).
template <int R>
inline void dot_rows(const float* w, const float* x, int64_t k, float* out) {
#ifdef PAGEDLLM_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * k + i), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    float s = 0.f;
    for (int64_t i = 0; i < k; ++i) s += w[r * k + i] * x[i];
    out[r] = s;
  }
#endif
}

at::Tensor ggml_dequant(const at::Tensor& w, int64_t qtype, int64_t k) {
  check_weight(w, qtype, k);
  const int64_t n = w.size(0), rb = w.size(1);
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kFloat));
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const RowFn fn = row_fn(qtype);
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(src + r * rb, dst + r * k, k);
  });
  return out;
}

constexpr int kTile = 4;  // weight rows dequantized together, sharing each load of x

// y = x @ W^T in float32 from rows dequantized kTile at a time (the weights' own layout; the
// kernels for the x8 layout are in ggml_x8.cpp).
at::Tensor ggml_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t k) {
  check_weight(w, qtype, k);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "x must be [M, ", k, "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), n = w.size(0), rb = w.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const RowFn fn = row_fn(qtype);
  // split the rows evenly over the threads, in whole tiles
  const int64_t grain = std::max<int64_t>(kTile, (n / at::get_num_threads() + kTile - 1) / kTile * kTile);
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(kTile * k);
    float res[kTile];
    for (int64_t r = r0; r < r1; r += kTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kTile, r1 - r));
      for (int t = 0; t < rows; ++t) fn(src + (r + t) * rb, buf.data() + t * k, k);
      for (int64_t i = 0; i < m; ++i) {
        if (rows == kTile) {
          dot_rows<kTile>(buf.data(), xp + i * k, k, res);
        } else {
          for (int t = 0; t < rows; ++t) dot_rows<1>(buf.data() + t * k, xp + i * k, k, res + t);
        }
        for (int t = 0; t < rows; ++t) op[i * n + r + t] = res[t];
      }
    }
  });
  return out;
}

}  // namespace

void pagedllm_ggml::check_weight(const at::Tensor& w, int64_t qtype, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "ggml weight must be a contiguous CPU uint8 tensor [rows, row_bytes]");
  const Format f = format_of(qtype);
  TORCH_CHECK(k % f.block == 0 && k % 8 == 0, "k=", k, " is not a multiple of the block size ", f.block);
  TORCH_CHECK(w.size(1) == k / f.block * f.bytes, "row_bytes ", w.size(1), " does not match k=", k,
              " for ggml type ", qtype);
}

void pagedllm_ggml::dequant_row(int64_t qtype, const uint8_t* src, float* dst, int64_t k) {
  row_fn(qtype)(src, dst, k);
}

TORCH_LIBRARY(pagedllm, m) {
  m.def("ggml_dequant(Tensor w, int qtype, int k) -> Tensor");
  m.def("ggml_linear(Tensor x, Tensor w, int qtype, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("ggml_dequant", &ggml_dequant);
  m.impl("ggml_linear", &ggml_linear);
}
