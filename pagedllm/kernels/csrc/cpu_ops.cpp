// Fused float32 CPU ops for the decoder's small, frequent steps: each replaces several ATen ops
// (and their per-op dispatch cost, which dominates at one token per step).
//   rms_norm(x, w, eps)                   y = x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm_(x, residual, w, eps)    residual += x; x = rms_norm(residual)   (in place)
//   rope_(q, k, positions, cos, sin)      rotate-half RoPE on q [T, Hq, D], k [T, Hk, D] in place,
//                                         over the first R values of each head (tables [P, R])
//   paged_decode_attention(...)           registered here, written in paged_attention.cpp
//   silu_mul(gate, up)                    silu(gate) * up
//   gelu_tanh_mul(gate, up)               gelu(gate, approximate="tanh") * up (Gemma's GeGLU)
//   argmax_rows(x)                        torch.argmax(x, dim=-1) for [N, V] (greedy sampling)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"
#include "simd.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace pagedllm_ops {

at::Tensor empty_weights(int64_t rows, int64_t cols) {
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t bytes = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  if (bytes < 2 * kHuge) return at::empty({rows, cols}, at::TensorOptions().dtype(at::kByte));
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, kHuge, bytes) == 0, "out of memory allocating ", bytes, " bytes of weights");
  // whole huge pages only: a tail rounded up would be resident in full
  madvise(p, bytes / kHuge * kHuge, MADV_HUGEPAGE);  // a hint: where THP is off it changes nothing
  return at::from_blob(p, {rows, cols}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
}

#ifdef PAGEDLLM_AVX2
using pagedllm_simd::exp_nonpositive;
using pagedllm_simd::gelu_tanh_mul8;
using pagedllm_simd::silu_mul8;
#endif
using pagedllm_simd::exp_nonpositive1;
using pagedllm_simd::gelu_tanh_mul1;
using pagedllm_simd::silu_mul1;

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

void check_kv_cache(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.is_contiguous(),
              name, " must be a contiguous float32 or bfloat16 CPU tensor");
}

// x [..., H] for a weight w [H], H > 0 (so that t = x.numel() / H rows are whole rows of x)
void check_norm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 1 && w.numel() > 0, "weight must be a non-empty 1-D tensor, got ", w.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.numel(), "x must be [..., ", w.numel(),
              "] to match the weight, got ", x.sizes());
}

inline void norm_row(const float* x, const float* w, float* y, int64_t h, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) y[i] = w[i] * (x[i] * r);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "weight");
  check_norm(x, w);
  const int64_t h = w.numel(), t = x.numel() / h;
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * h, wp, yp + r * h, h, static_cast<float>(eps));
  });
  return y;
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(residual, "residual");
  check_f32(w, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have the same shape");
  check_norm(x, w);
  const int64_t h = w.numel(), t = x.numel() / h;
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* xr = xp + r * h;
      float* rr = rp + r * h;
      for (int64_t i = 0; i < h; ++i) rr[i] += xr[i];
      norm_row(rr, wp, xr, h, static_cast<float>(eps));
    }
  });
}

// rotates the first `rot` values of each head of d (rot == d but for partial-rotary models)
void rope_heads(float* x, int64_t heads, int64_t d, int64_t rot, const float* c, const float* s) {
  const int64_t half = rot / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    float* v = x + hd * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * c[i] - b * s[i];
      v[i + half] = b * c[i + half] + a * s[i + half];
    }
  }
}

void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "q and k must be [T, heads, head_dim], got q ", q.sizes(),
              " and k ", k.sizes());
  const int64_t t = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  TORCH_CHECK(k.size(0) == t && k.size(2) == d, "k must have q's tokens and head_dim, got q ", q.sizes(),
              " and k ", k.sizes());
  TORCH_CHECK(d % 2 == 0, "head_dim must be even (rotate-half RoPE), got ", d);
  TORCH_CHECK(positions.numel() == t, "positions must hold one position per token: ", t, " tokens, ",
              positions.numel(), " positions");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) % 2 == 0 && cos.size(1) > 0 &&
                  cos.size(1) <= d,
              "cos and sin must be [positions, rotary_dim] tables of the same shape, rotary_dim even and "
              "at most head_dim, got cos ", cos.sizes(), " and sin ", sin.sizes(), " for head_dim ", d);
  const int64_t rot = cos.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "position ", pos[i], " is outside the RoPE table");
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, t, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      rope_heads(qp + r * hq * d, hq, d, rot, cp + pos[r] * rot, sp + pos[r] * rot);
      rope_heads(kp + r * hk * d, hk, d, rot, cp + pos[r] * rot, sp + pos[r] * rot);
    }
  });
}


// token i's keys and values [Hk, D] into slot slot_mapping[i] of a layer's cache kv [2, NB, BS, Hk, D],
// float32 or bf16 (rounded to nearest even, as torch's .to(torch.bfloat16)) (what index_copy_
// does, without its per-row dispatch: 0.6 ms for 512 tokens, or 48 of them a decode step)
void write_kv_(const at::Tensor& kv, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& slot_mapping) {
  check_kv_cache(kv, "kv");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2, "kv must be a [2, blocks, block_size, kv_heads, head_dim] tensor");
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  check_f32(k, "k");
  check_f32(v, "v");
  const int64_t row = kv.size(3) * kv.size(4), slots = kv.size(1) * kv.size(2), t = slot_mapping.numel();
  TORCH_CHECK(k.numel() == t * row && v.numel() == t * row, "k and v must hold kv_heads * head_dim values per slot");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 tensor");
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < slots, "slot ", sp[i], " is outside the KV cache's ", slots, " slots");
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  if (kv.scalar_type() == at::kBFloat16) {
    at::BFloat16* kc = kv.data_ptr<at::BFloat16>();
    at::BFloat16* vc = kc + slots * row;
    at::parallel_for(0, t, std::max<int64_t>(1, 16384 / row), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = 0; j < row; ++j) {
          kc[sp[i] * row + j] = at::BFloat16(kp[i * row + j]);
          vc[sp[i] * row + j] = at::BFloat16(vp[i * row + j]);
        }
    });
    return;
  }
  float* kc = kv.data_ptr<float>();
  float* vc = kc + slots * row;
  for (int64_t i = 0; i < t; ++i) {
    std::memcpy(kc + sp[i] * row, kp + i * row, row * sizeof(float));
    std::memcpy(vc + sp[i] * row, vp + i * row, row * sizeof(float));
  }
}

// The skeleton of a gated activation, act(gate) * up: checks, output, the split over threads.
// `body(g, u, o, i0, i1)` covers [i0, i1) with vectors as far as it can and returns where it
// stopped; `one(g, u)` does a single element, the tail.
template <typename Body, typename One>
at::Tensor gated_mul(const at::Tensor& gate, const at::Tensor& up, Body body, One one) {
  check_f32(gate, "gate");
  check_f32(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have the same shape");
  at::Tensor out = at::empty_like(gate);
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, gate.numel(), 16384, [&](int64_t i0, int64_t i1) {
    for (int64_t i = body(g, u, o, i0, i1); i < i1; ++i) o[i] = one(g[i], u[i]);
  });
  return out;
}

// silu(gate) * up (simd.h's silu_mul8 / silu_mul1: the same bits in vectors and tail)
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  auto body = [](const float* g, const float* u, float* o, int64_t i, int64_t i1) {
#ifdef PAGEDLLM_AVX2
    for (; i + 8 <= i1; i += 8)
      _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#else
    (void)g, (void)u, (void)o, (void)i1;
#endif
    return i;
  };
  return gated_mul(gate, up, body, [](float x, float u) { return silu_mul1(x, u); });
}

// gelu_tanh(gate) * up, as F.gelu(approximate="tanh") (simd.h's gelu_tanh_mul8 / gelu_tanh_mul1,
// with the exp of silu_mul). std::tanh took ~15 ns a value: Gemma 3 270M's 2,048 a layer, ~30 us,
// on one thread inside the decode step.
at::Tensor gelu_tanh_mul(const at::Tensor& gate, const at::Tensor& up) {
  auto body = [](const float* g, const float* u, float* o, int64_t i, int64_t i1) {
#ifdef PAGEDLLM_AVX2
    for (; i + 8 <= i1; i += 8)
      _mm256_storeu_ps(o + i, gelu_tanh_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#else
    (void)g, (void)u, (void)o, (void)i1;
#endif
    return i;
  };
  return gated_mul(gate, up, body, [](float x, float u) { return gelu_tanh_mul1(x, u); });
}

// The first index of each row's maximum, as torch.argmax; rows with a NaN go to torch (which
// returns the NaN's index).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be [N, V] with V > 0");
  const int64_t rows = x.size(0), v = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  // rows in parallel: at 32 rows of a 152k vocabulary the loop read 19 MB on one thread
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* p = xp + r * v;
      bool nan;
      const float best = pagedllm_simd::row_max<false>(p, v, 1.f, nan);
      if (nan) {
        op[r] = x.select(0, r).argmax().item<int64_t>();
        continue;
      }
      op[r] = std::find(p, p + v, best) - p;
    }
  });
  return out;
}

}  // namespace pagedllm_ops

using namespace pagedllm_ops;

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor w, float eps) -> ()");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("paged_decode_attention(Tensor q, Tensor kv, Tensor block_table, Tensor context_lens, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("write_kv_(Tensor(a!) kv, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("paged_attention_path() -> str", &pagedllm_ops::paged_attention_path);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_", &rope_);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("write_kv_", &write_kv_);
}
