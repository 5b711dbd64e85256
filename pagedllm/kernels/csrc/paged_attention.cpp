// Paged decode attention over the KV cache (float32 or bf16 rows, below): one query token per
// sequence, each sequence's K/V rows read where they lie in the cache (no gathered copy). The
// `group` query heads sharing a K/V head share every row read; one task takes a sequence's K/V
// heads together (their rows are adjacent, so it reads each cache block as one stream) where the
// batch fills the threads, one K/V head of it where it does not (one stream).
//
// The AVX-512 path computes the same numbers as the AVX2 one, bit for bit: each dot product is
// reduced in the AVX2 path's order (lanes j + j+8 of two 8-lane halves, then j + j+4, j + j+2,
// j + j+1), only 16 keys at once; each head's output sums its value rows in the same order.
//
// The cache holds float32 or bf16 rows (kv_cache_dtype "bfloat16": half the bytes a step reads);
// a bf16 row widens to float32 exactly on its load, so a bf16 cache gives the numbers of a float32
// cache holding the same rounded values, bit for bit, on every path. kv_cache_dtype "auto" keeps
// it in bf16 under a bf16 checkpoint's bf16 matrices (config_builder.kv_cache_torch_dtype).
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
#include <type_traits>
#include <vector>

namespace pagedllm_ops {

// a cached value as float32: bf16 (stored as uint16_t) is the float's upper half
inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// value rows [p0, p1) and key rows [max(p0, keys_from), p1) into L2 (row p at kc / vc +
// row_offset(p), row_bytes long). Always inlined: called out of line (GCC's choice for the
// template), 24 layers of 32 x 164 bf16 rows took 7.1-8.7 ms against 5.6-6.3 inline
template <class T, class RowOffset>
__attribute__((always_inline)) inline void prefetch_kv_rows_l2(const T* kc, const T* vc, RowOffset row_offset,
                                                               int64_t p0, int64_t p1, int64_t keys_from,
                                                               int64_t row_bytes) {
  for (int64_t p = p0; p < p1; ++p) {
    const char* kr = reinterpret_cast<const char*>(kc + row_offset(p));
    const char* vr = reinterpret_cast<const char*>(vc + row_offset(p));
    for (int64_t c = 0; c < row_bytes; c += 64) {
      if (p >= keys_from) _mm_prefetch(kr + c, _MM_HINT_T1);
      _mm_prefetch(vr + c, _MM_HINT_T1);
    }
  }
}

#ifdef PAGEDLLM_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#ifdef PAGEDLLM_AVX2
using pagedllm_simd::exp_nonpositive;
using pagedllm_simd::hsum;
#endif

// s[p] = exp(c(s[p]) - max) / sum for p < len, where c(s) = tanh(s / cap) * cap when cap > 0
// (Gemma 2's soft-capped scores, as transformers caps them before the mask), else s
void softmax_(float* s, int64_t len, float cap) {
  if (cap > 0.f)
    for (int64_t p = 0; p < len; ++p) s[p] = std::tanh(s[p] / cap) * cap;
  float mx = s[0];
  int64_t p = 0;
#ifdef PAGEDLLM_AVX2
  // the maximum 8 lanes at a time (the same value in any order)
  if (len >= 8) {
    __m256 m = _mm256_loadu_ps(s);
    for (p = 8; p + 8 <= len; p += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + p));
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    mx = _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
#endif
  for (; p < len; ++p) mx = std::max(mx, s[p]);
  float sum = 0.f;
  p = 0;
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
template <int NV, class T, class RowOffset>
void attend_group_avx2(const float* q, const T* kc, const T* vc, RowOffset row_offset, int64_t len,
                       int64_t group, float scale, float cap, float* scores, float* out) {
  constexpr int64_t d = 8 * NV;
  for (int64_t p = 0; p < len; ++p) {
    const T* kr = kc + row_offset(p);
    __m256 k[NV];
    for (int v = 0; v < NV; ++v) k[v] = load8(kr + 8 * v);
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
      const T* vr = vc + row_offset(p);
      const __m256 w = _mm256_set1_ps(sh[p]);
      for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(w, load8(vr + 8 * v), acc[v]);
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
template <int NV, class T>
inline void prefetch_row(const T* row) {
  for (int64_t b = 0; b < 16 * NV * static_cast<int64_t>(sizeof(T)); b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// out[h] (NH heads from h0) = sum over p of s[h][p] * V row p, p in order as the AVX2 path adds
template <int NV, int NH, class T, class RowOffset>
void weigh_values_avx512(const T* vc, RowOffset row_offset, int64_t len, const float* scores, float* out) {
  __m512 acc[NH][NV];
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < len; ++p) {
    const T* vr = vc + row_offset(p);
    if (p + 16 < len) prefetch_row<NV>(vc + row_offset(p + 16));
    __m512 row[NV];
    for (int v = 0; v < NV; ++v) row[v] = load16(vr + 16 * v);
    for (int h = 0; h < NH; ++h) {
      const __m512 w = _mm512_set1_ps(scores[h * len + p]);
      for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_fmadd_ps(w, row[v], acc[h][v]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + (h * NV + v) * 16, acc[h][v]);
}

// the V rows weighed for NH heads at once, NH chosen at run time (1..kMax): a group of 7 heads
// takes two passes over the rows (4 + 3) instead of 4 + 1 + 1 + 1
template <int NV, int kMax, class T, class RowOffset>
void weigh_values_n(int nh, const T* vc, RowOffset row_offset, int64_t len, const float* scores, float* out) {
  if constexpr (kMax > 1) {
    if (nh == kMax) return weigh_values_avx512<NV, kMax>(vc, row_offset, len, scores, out);
    return weigh_values_n<NV, kMax - 1>(nh, vc, row_offset, len, scores, out);
  } else {
    return weigh_values_avx512<NV, 1>(vc, row_offset, len, scores, out);
  }
}

// attend_heads for head_dim = 16 * NV: per 16 keys, the scores of every query head of the nkv
// K/V heads (their rows lie side by side in the cache, so the task reads each cache block as one
// stream, and the 16 key rows stay in L1 across the heads); then the value rows of each K/V head
// weighed for up to 16 / NV of its query heads a pass, in as few passes as there can be
constexpr int64_t kFarKeys = 64;  // rows a task asks for into L2 ahead of the block it computes

template <int NV, class T, class RowOffset>
void attend_heads_avx512(const float* q, const T* kc, const T* vc, RowOffset row_offset, int64_t len,
                         int64_t nkv, int64_t group, float scale, float cap, float* scores, float* out) {
  constexpr int64_t d = 16 * NV;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t p0 = 0; p0 < len; p0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - p0));
    const T* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = kc + row_offset(p0 + std::min(j, n - 1));
    for (int64_t p = p0 + 16; p < std::min(p0 + 32, len); ++p) {
      const T* next = kc + row_offset(p);
      for (int64_t g = 0; g < nkv; ++g) prefetch_row<NV>(next + g * d);
    }
    // key and value rows kFarKeys ahead into L2 while the scores are computed (at the first block:
    // every row up to there): the value passes that follow, and the key blocks after this one,
    // find them there, not in memory (one block ahead alone left each block's loads waiting on
    // memory: 24 layers of 32 sequences of 164 rows from a cold cache, Zen 4, with the next
    // task's first rows asked for too: float32 12.2 -> 8.5-8.9 ms, bf16 9.4 -> 6.5-7.1; in the
    // B=32 decode step of the default model's bf16 export, 9.9-10.4 -> 8.2 ms)
    const int64_t far0 = p0 == 0 ? 0 : p0 + kFarKeys, far1 = std::min(len, p0 + kFarKeys + 16);
    // (key rows below 32: the first block's, loaded now, and the next one's, asked for above)
    prefetch_kv_rows_l2(kc, vc, row_offset, far0, far1, 32, nkv * d * static_cast<int64_t>(sizeof(T)));
    for (int64_t g = 0; g < nkv; ++g) {
      // bf16 key rows widened once into float32 for all the group's heads (widened per head, the
      // loads' conversions outnumbered the multiplies; the same values either way)
      alignas(64) float widened[std::is_same_v<T, float> ? 1 : 16 * d];
      const float* krows[16];
      for (int j = 0; j < 16; ++j) {
        if constexpr (std::is_same_v<T, float>) {
          krows[j] = rows[j] + g * d;
        } else {
          for (int v = 0; v < NV; ++v) _mm512_store_ps(widened + j * d + 16 * v, load16(rows[j] + g * d + 16 * v));
          krows[j] = widened + j * d;
        }
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        __m512 qh[NV];
        for (int v = 0; v < NV; ++v) qh[v] = _mm512_loadu_ps(q + h * d + 16 * v);
        __m512 acc[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          const float* kr = krows[j];
          acc[j] = _mm512_mul_ps(qh[0], load16(kr));
          for (int v = 1; v < NV; ++v) acc[j] = _mm512_fmadd_ps(qh[v], load16(kr + 16 * v), acc[j]);
        }
        _mm512_mask_storeu_ps(scores + h * len + p0, static_cast<__mmask16>((1u << n) - 1),
                              _mm512_mul_ps(reduce16(acc), vscale));
      }
    }
  }
  for (int64_t h = 0; h < nkv * group; ++h) softmax_(scores + h * len, len, cap);
  constexpr int kMax = std::max(1, 16 / NV);  // accumulators in 16 of the 32 registers
  const int64_t passes = (group + kMax - 1) / kMax;
  for (int64_t g = 0; g < nkv; ++g) {
    const auto v_offset = [&](int64_t p) { return row_offset(p) + g * d; };
    for (int64_t k = 0, h = g * group; k < passes; ++k) {
      // the group's heads split as evenly as the passes allow: 7 = 4 + 3
      const int64_t nh = (group - (h - g * group) + (passes - k) - 1) / (passes - k);
      weigh_values_n<NV, kMax>(static_cast<int>(nh), vc, v_offset, len, scores + h * len, out + h * d);
      h += nh;
    }
  }
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

// One sequence's K/V heads g0 .. g0 + nkv - 1: their nkv * group query heads at q (each d
// values) over the len cached rows (head g0's row p at kc/vc + row_offset(p), the next heads' d
// values after it); out gets nkv * group * d values.
template <class T, class RowOffset>
void attend_heads(const float* q, const T* kc, const T* vc, RowOffset row_offset, int64_t len,
                  int64_t nkv, int64_t group, int64_t d, float scale, float cap, float* scores, float* out,
                  bool avx512) {
#ifdef __AVX512F__
  if (avx512 && d == 64)
    return attend_heads_avx512<4>(q, kc, vc, row_offset, len, nkv, group, scale, cap, scores, out);
  if (avx512 && d == 128)
    return attend_heads_avx512<8>(q, kc, vc, row_offset, len, nkv, group, scale, cap, scores, out);
  if (avx512 && d == 256)  // Gemma 3's heads
    return attend_heads_avx512<16>(q, kc, vc, row_offset, len, nkv, group, scale, cap, scores, out);
#endif
  for (int64_t g = 0; g < nkv; ++g) {
    const auto head_offset = [&](int64_t p) { return row_offset(p) + g * d; };
    const float* qg = q + g * group * d;
    float* og = out + g * group * d;
#ifdef PAGEDLLM_AVX2
    if (d == 64) { attend_group_avx2<8>(qg, kc, vc, head_offset, len, group, scale, cap, scores, og); continue; }
    if (d == 128) { attend_group_avx2<16>(qg, kc, vc, head_offset, len, group, scale, cap, scores, og); continue; }
    if (d == 256) { attend_group_avx2<32>(qg, kc, vc, head_offset, len, group, scale, cap, scores, og); continue; }
#endif
    for (int64_t p = 0; p < len; ++p) {
      const T* kr = kc + head_offset(p);
      for (int64_t h = 0; h < group; ++h) {
        float s = 0.f;
        for (int64_t e = 0; e < d; ++e) s += qg[h * d + e] * to_f32(kr[e]);
        scores[h * len + p] = s * scale;
      }
    }
    for (int64_t h = 0; h < group; ++h) softmax_(scores + h * len, len, cap);
    std::fill(og, og + group * d, 0.f);
    for (int64_t p = 0; p < len; ++p) {
      const T* vr = vc + head_offset(p);
      for (int64_t h = 0; h < group; ++h)
        for (int64_t e = 0; e < d; ++e) og[h * d + e] += scores[h * len + p] * to_f32(vr[e]);
    }
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
  check_f32(q, "q");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  check_kv_cache(kv, "kv_cache");
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
  // the rows sequence i reads: the query at position lens[i] - 1 sees keys lens[i] - rows .. lens[i] - 1
  const auto rows_read = [&](int64_t i) { return window > 0 ? std::min(lens[i], window) : lens[i]; };
  int64_t longest = 0;  // the most rows a sequence reads
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(lens[i] > 0 && lens[i] <= max_blocks * bs, "context length ", lens[i], " out of range");
    longest = std::max(longest, rows_read(i));
    for (int64_t j = 0; j < (lens[i] + bs - 1) / bs; ++j)
      TORCH_CHECK(table[i * max_blocks + j] >= 0 && table[i * max_blocks + j] < nblocks, "block id out of range");
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const bool avx512 = attention_avx512();
  // one task per sequence, its K/V heads together (their rows are adjacent in the cache), when the
  // batch alone keeps the threads busy; else one per (sequence, K/V head), as one stream needs;
  // and where even those are fewer than the threads (one stream of Gemma 3 270M: one K/V head),
  // each K/V head's query heads split too (each head's numbers are computed alone either way),
  // while a K/V head's rows fit kSharedBytes: every task of the head then reads all of them, which
  // from the cache is cheap and from memory would cost more than one thread reading them once
  constexpr int64_t kSharedBytes = int64_t(1) << 20;  // one K/V head's keys and values
  const bool pow2 = (bs & (bs - 1)) == 0;
  const int shift = pow2 ? __builtin_ctzll(static_cast<unsigned long long>(bs)) : 0;
  const int64_t threads = at::get_num_threads();
  const int64_t split = b >= 2 * threads ? 1 : hk, nkv = hk / split;
  const bool shared = longest * d * 2 * kv.element_size() <= kSharedBytes;
  const int64_t hsplit =
      nkv == 1 && b * hk < threads && shared ? std::min(group, (threads + b * hk - 1) / (b * hk)) : 1;
  const int64_t per = (group + hsplit - 1) / hsplit;  // query heads of a task (nkv == 1 when hsplit > 1)
  // the cache's rows as float32 or bf16 (uint16_t: attend_heads widens them on their loads)
  const auto run = [&](const auto* kc) {
    const auto* vc = kc + nblocks * bs * hk * d;
    // each thread a contiguous run of tasks with an equal share of the rows they read (a prompt's
    // rows grow one by one: split by count, the last thread would take ~3x the first's time)
    const int64_t ntasks = b * split * hsplit;
    const auto task_rows_read = [&](int64_t task) { return rows_read(task / (split * hsplit)); };
    int64_t total = 0;
    for (int64_t task = 0; task < ntasks; ++task) total += task_rows_read(task);
    std::vector<int64_t> bounds(threads + 1, ntasks);  // thread r takes tasks bounds[r] .. bounds[r + 1] - 1
    bounds[0] = 0;
    for (int64_t task = 0, done = 0, r = 1; task < ntasks && r < threads; ++task) {
      done += task_rows_read(task);
      while (r < threads && done * threads >= total * r) bounds[r++] = task + 1;
    }
    at::parallel_for(0, threads, 1, [&](int64_t r0, int64_t r1) {
      const int64_t t0 = bounds[r0], t1 = bounds[r1];
      std::vector<float> scores;
      // task's sequence, its first K/V head, and where its row p lies in either half of the cache
      const auto task_rows = [&](int64_t task) {
        const int64_t i = task / (split * hsplit), g0 = task / hsplit % split * nkv;
        const int64_t len = rows_read(i), first = lens[i] - len;
        const int64_t* blocks = table + i * max_blocks;
        const auto row_offset = [=](int64_t p) {
          const int64_t pos = first + p;  // a shift, not a division, for the usual block sizes
          const int64_t blk = pow2 ? pos >> shift : pos / bs, off = pow2 ? pos & (bs - 1) : pos % bs;
          return ((blocks[blk] * bs + off) * hk + g0) * d;
        };
        return std::make_tuple(i, g0, len, row_offset);
      };
      for (int64_t task = t0; task < t1; ++task) {
        const auto [i, g0, len, row_offset] = task_rows(task);
        const int64_t h0 = task % hsplit * per, nh = std::min(group - h0, per);  // group, h0 = 0 unsplit
        if (nh <= 0) continue;
        if (task + 1 < t1) {  // the next task's first rows into L2 meanwhile (its start waits on them)
          const auto [i1, g1, len1, next_offset] = task_rows(task + 1);
          prefetch_kv_rows_l2(kc, vc, next_offset, 0, std::min<int64_t>(len1, 32), 0,
                              nkv * d * static_cast<int64_t>(sizeof(*kc)));
        }
        scores.resize(nkv * nh * len);
        const int64_t head = i * hq + g0 * group + h0;  // the task's first query head
        attend_heads(qp + head * d, kc, vc, row_offset, len, nkv, nh, d, sc, cap, scores.data(), op + head * d,
                     avx512);
      }
    });
  };
  if (kv.scalar_type() == at::kBFloat16)
    run(reinterpret_cast<const uint16_t*>(kv.data_ptr()));
  else
    run(kv.data_ptr<float>());
  return out;
}

}  // namespace pagedllm_ops
