// Paged decode attention over a float32 KV cache: one query token per sequence, each sequence's
// K/V rows read where they lie in the cache (no gathered copy), one task per (sequence, K/V
// head) so that the `group` query heads sharing a K/V head share every row read.
//
// The AVX-512 path computes the same numbers as the AVX2 one, bit for bit: each dot product is
// reduced in the AVX2 path's order (lanes j + j+8 of two 8-lane halves, then j + j+4, j + j+2,
// j + j+1), only 16 keys at once; each head's output sums its value rows in the same order.
//
// Soft-capped scores (softcap > 0, Gemma 2) go through tanh(s / cap) * cap before the softmax.
//
// A sliding window (window > 0) reads only each sequence's last `window` rows, as if they were
// its whole context: the same numbers as the windowless op over a cache holding just those rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ggml_x8_isa.h"
#include "kernels.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace pagedllm_ops {

#ifdef PAGEDLLM_AVX2
using pagedllm_simd::exp_nonpositive;
using pagedllm_simd::hsum;
#endif

// s[p] = exp(c(s[p]) - max) / sum for p < len, where c(s) = tanh(s / cap) * cap when cap > 0
// (Gemma 2's soft-capped scores, as transformers caps them before the mask), else s
void softmax_(float* s, int64_t len, float cap) {
  if (cap > 0.f)
    for (int64_t p = 0; p < len; ++p) s[p] = std::tanh(s[p] / cap) * cap;
  const float mx = *std::max_element(s, s + len);
  float sum = 0.f;
  int64_t p = 0;
#ifdef PAGEDLLM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; p + 8 <= len; p += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + p), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(s + p, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; p < len; ++p) {
    s[p] = std::exp(s[p] - mx);
    sum += s[p];
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < len; ++i) s[i] *= inv;
}

#ifdef PAGEDLLM_AVX2
// attend_group for head_dim = 8 * NV: each key/value row is NV vectors, the accumulators stay in
// registers
template <int NV, class RowOffset>
void attend_group_avx2(const float* q, const float* kc, const float* vc, RowOffset row_offset, int64_t len,
                       int64_t group, float scale, float cap, float* scores, float* out) {
  constexpr int64_t d = 8 * NV;
  for (int64_t p = 0; p < len; ++p) {
    const float* kr = kc + row_offset(p);
    __m256 k[NV];
    for (int v = 0; v < NV; ++v) k[v] = _mm256_loadu_ps(kr + 8 * v);
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = q + h * d;
      __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qh), k[0]), a1 = _mm256_setzero_ps();
      for (int v = 1; v < NV; ++v)
        (v % 2 ? a1 : a0) = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * v), k[v], v % 2 ? a1 : a0);
      scores[h * len + p] = hsum(_mm256_add_ps(a0, a1)) * scale;
    }
  }
  for (int64_t h = 0; h < group; ++h) softmax_(scores + h * len, len, cap);
  for (int64_t h = 0; h < group; ++h) {
    __m256 acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
    const float* sh = scores + h * len;
    for (int64_t p = 0; p < len; ++p) {
      const float* vr = vc + row_offset(p);
      const __m256 w = _mm256_set1_ps(sh[p]);
      for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * v), acc[v]);
    }
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + h * d + 8 * v, acc[v]);
  }
}
#endif

#ifdef __AVX512F__
// r[n] = the sum of the 16 lanes of a[n], for 16 vectors, in hsum's order over the two 8-lane
// halves of each: (j, j+8), then (j, j+4), (j, j+2), (j, j+1)
inline __m512 reduce16(const __m512* a) {
  __m512 s[8], u[4], z[2];
  for (int i = 0; i < 8; ++i)  // (j, j+8): keys 2i, 2i+1 -> 8 lanes each
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // (j, j+4): keys 4i..4i+3 -> one 128-bit lane each
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // (j, j+2) within each 128-bit lane
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4k + m of r holds key k + 4m
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// the cache lines of a row of 16 * NV floats, ahead of their use: rows of one K/V head are
// strided in the cache (the other heads' rows between them), blocks scattered
template <int NV>
inline void prefetch_row(const float* row) {
  for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(row + 16 * v), _MM_HINT_T0);
}

// out[h] (NH heads from h0) = sum over p of s[h][p] * V row p, p in order as the AVX2 path adds
template <int NV, int NH, class RowOffset>
void weigh_values_avx512(const float* vc, RowOffset row_offset, int64_t len, const float* scores, float* out) {
  __m512 acc[NH][NV];
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < len; ++p) {
    const float* vr = vc + row_offset(p);
    if (p + 16 < len) prefetch_row<NV>(vc + row_offset(p + 16));
    __m512 row[NV];
    for (int v = 0; v < NV; ++v) row[v] = _mm512_loadu_ps(vr + 16 * v);
    for (int h = 0; h < NH; ++h) {
      const __m512 w = _mm512_set1_ps(scores[h * len + p]);
      for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_fmadd_ps(w, row[v], acc[h][v]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + (h * NV + v) * 16, acc[h][v]);
}

// attend_group for head_dim = 16 * NV: the scores of 16 keys for one head are reduced together
// (the 16 key rows stay in L1 across the group's heads); the value rows are read once per
// 16 / NV heads instead of once per head
template <int NV, class RowOffset>
void attend_group_avx512(const float* q, const float* kc, const float* vc, RowOffset row_offset, int64_t len,
                         int64_t group, float scale, float cap, float* scores, float* out) {
  constexpr int64_t d = 16 * NV;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t p0 = 0; p0 < len; p0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - p0));
    const float* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = kc + row_offset(p0 + std::min(j, n - 1));
    for (int64_t p = p0 + 16; p < std::min(p0 + 32, len); ++p) prefetch_row<NV>(kc + row_offset(p));
    for (int64_t h = 0; h < group; ++h) {
      __m512 qh[NV];
      for (int v = 0; v < NV; ++v) qh[v] = _mm512_loadu_ps(q + h * d + 16 * v);
      __m512 acc[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_mul_ps(qh[0], _mm512_loadu_ps(rows[j]));
        for (int v = 1; v < NV; ++v) acc[j] = _mm512_fmadd_ps(qh[v], _mm512_loadu_ps(rows[j] + 16 * v), acc[j]);
      }
      _mm512_mask_storeu_ps(scores + h * len + p0, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(reduce16(acc), vscale));
    }
  }
  for (int64_t h = 0; h < group; ++h) softmax_(scores + h * len, len, cap);
  constexpr int kHeads = std::max(1, 16 / NV);  // accumulators in 16 of the 32 registers
  int64_t h = 0;
  for (; h + kHeads <= group; h += kHeads)
    weigh_values_avx512<NV, kHeads>(vc, row_offset, len, scores + h * len, out + h * d);
  for (; h < group; ++h) weigh_values_avx512<NV, 1>(vc, row_offset, len, scores + h * len, out + h * d);
}
#endif

// The AVX-512 path (in a build for an AVX-512 CPU) runs when the matmuls' kernel variant is an
// AVX-512 one: PAGEDLLM_KERNEL_ISA=avx2 (or set_kernel_isa) runs the AVX2 path, which is how the
// tests compare the two on an AVX-512 machine.
bool attention_avx512() {
#ifdef __AVX512F__
  return std::strncmp(pagedllm_ggml::x8::active_isa().name, "avx512", 6) == 0;
#else
  return false;
#endif
}

std::string paged_attention_path() {
  if (attention_avx512()) return "avx512";
#ifdef PAGEDLLM_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

// One sequence and one K/V head: the `group` query heads at q (each d values) over the len
// cached rows (row p at kc/vc + row_offset(p)); out gets group * d values.
template <class RowOffset>
void attend_group(const float* q, const float* kc, const float* vc, RowOffset row_offset, int64_t len,
                  int64_t group, int64_t d, float scale, float cap, float* scores, float* out, bool avx512) {
#ifdef __AVX512F__
  if (avx512 && d == 64) return attend_group_avx512<4>(q, kc, vc, row_offset, len, group, scale, cap, scores, out);
  if (avx512 && d == 128) return attend_group_avx512<8>(q, kc, vc, row_offset, len, group, scale, cap, scores, out);
  // Gemma 3's heads
  if (avx512 && d == 256) return attend_group_avx512<16>(q, kc, vc, row_offset, len, group, scale, cap, scores, out);
#endif
#ifdef PAGEDLLM_AVX2
  if (d == 64) return attend_group_avx2<8>(q, kc, vc, row_offset, len, group, scale, cap, scores, out);
  if (d == 128) return attend_group_avx2<16>(q, kc, vc, row_offset, len, group, scale, cap, scores, out);
  if (d == 256) return attend_group_avx2<32>(q, kc, vc, row_offset, len, group, scale, cap, scores, out);
#endif
  for (int64_t p = 0; p < len; ++p) {
    const float* kr = kc + row_offset(p);
    for (int64_t h = 0; h < group; ++h) {
      float s = 0.f;
      for (int64_t e = 0; e < d; ++e) s += q[h * d + e] * kr[e];
      scores[h * len + p] = s * scale;
    }
  }
  for (int64_t h = 0; h < group; ++h) softmax_(scores + h * len, len, cap);
  std::fill(out, out + group * d, 0.f);
  for (int64_t p = 0; p < len; ++p) {
    const float* vr = vc + row_offset(p);
    for (int64_t h = 0; h < group; ++h)
      for (int64_t e = 0; e < d; ++e) out[h * d + e] += scores[h * len + p] * vr[e];
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
  check_f32(q, "q");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  check_f32(kv, "kv_cache");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 2,
              "block_table must be a contiguous int64 [B, max_blocks] tensor");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(), "context_lens must be int64");
  // q [B, Hq, D]; kv [2, NB, BS, Hk, D]
  TORCH_CHECK(q.dim() == 3, "q must be [B, heads, head_dim], got ", q.sizes());
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2, "kv_cache must be [2, blocks, block_size, kv_heads, head_dim], got ",
              kv.sizes());
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t nblocks = kv.size(1), bs = kv.size(2), hk = kv.size(3);
  TORCH_CHECK(bs > 0 && hk > 0, "kv_cache needs block_size > 0 and kv_heads > 0, got ", kv.sizes());
  TORCH_CHECK(kv.size(4) == d && hq % hk == 0, "q and kv_cache shapes do not match");
  TORCH_CHECK(block_table.size(0) == b && context_lens.numel() == b, "block_table (", block_table.sizes(),
              ") and context_lens (", context_lens.numel(), " values) must have one row per sequence of q (", b, ")");
  const int64_t group = hq / hk, max_blocks = block_table.size(1);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(lens[i] > 0 && lens[i] <= max_blocks * bs, "context length ", lens[i], " out of range");
    for (int64_t j = 0; j < (lens[i] + bs - 1) / bs; ++j)
      TORCH_CHECK(table[i * max_blocks + j] >= 0 && table[i * max_blocks + j] < nblocks, "block id out of range");
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kc = kv.data_ptr<float>();
  const float* vc = kc + nblocks * bs * hk * d;
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const bool avx512 = attention_avx512();
  // one task per (sequence, kv head): its `group` query heads share every K/V row read
  at::parallel_for(0, b * hk, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t i = task / hk, g = task % hk;
      // the query at position lens[i] - 1 sees keys first..lens[i] - 1
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[i] - window) : 0, len = lens[i] - first;
      const int64_t* blocks = table + i * max_blocks;
      scores.resize(group * len);
      const auto row_offset = [&](int64_t p) {
        const int64_t pos = first + p;
        return ((blocks[pos / bs] * bs + pos % bs) * hk + g) * d;
      };
      attend_group(qp + (i * hq + g * group) * d, kc, vc, row_offset, len, group, d, sc,
                   cap, scores.data(), op + (i * hq + g * group) * d, avx512);
    }
  });
  return out;
}

}  // namespace pagedllm_ops
