// The LoRA delta of one projection (every shard of a fused one) in one call, each token row by
// its own adapter slot (vLLM's punica shrink and expand):
//
//   y_i[t] += (x[t] @ A[s, i R : i R + r]^T) @ Bt_i[s, :r]     s = slots[t], r = ranks[s, i]
//
// for each shard i, where A [S, shards x R, in] holds every shard's A of each slot stacked by the
// largest rank R, and Bt_i [S, R, out_i] is scale x B_i^T. A row whose slot is -1, and a shard
// whose rank is 0 in the row's slot, are left alone.
//
// Each row is computed alone, in an order fixed by its slot's rank (a dot product per rank, then
// the rank-weighted rows of Bt summed into a delta, then the delta added to y), so a row gets
// the same bits whatever else is in the step: a mixed batch equals each request run alone. The
// Python LoRALinear and the C++ decode stack both call this op, so the stack's numbers equal the
// layer loop's. With AVX2 and FMA (every x8 variant's ISA) the shrink runs up to eight ranks at
// once (independent FMA chains over one pass of the row) and the expand keeps each 8-wide delta
// in a register; elsewhere plain loops do the same sums. At SmolLM2's sizes, 16 rows and rank 8
// on all seven projections, the 30 layers' calls take ~1 ms a step (one op in place of the ~20
// dispatched PyTorch ops per projection it replaces).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace pagedllm_ops {

namespace {

void check_rows(const at::Tensor& t, const char* name, int64_t rows) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == rows &&
                  (t.size(1) <= 1 || t.stride(1) == 1),
              name, " must be a float32 CPU [", rows, ", n] tensor with contiguous rows, got ", t.sizes(),
              " of ", t.scalar_type());
}

#ifdef PAGEDLLM_AVX2
// h[k] = x . a_k for KN rows a_k of a (row stride n), each over 8-wide lanes, then summed
template <int KN>
inline void shrink(const float* x, const float* a, int64_t n, float* h) {
  __m256 acc[KN];
  for (int k = 0; k < KN; ++k) acc[k] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 xv = _mm256_loadu_ps(x + c);
    for (int k = 0; k < KN; ++k) acc[k] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(a + k * n + c), acc[k]);
  }
  for (int k = 0; k < KN; ++k) {
    float sum = pagedllm_simd::hsum(acc[k]);
    for (int64_t i = c; i < n; ++i) sum += x[i] * a[k * n + i];
    h[k] = sum;
  }
}

// y += sum_k h[k] b_k over R rows b_k of b (row stride n), 8 columns at a time
template <int R>
inline void expand(const float* h, const float* b, int64_t n, float* y) {
  __m256 hv[R];
  for (int k = 0; k < R; ++k) hv[k] = _mm256_set1_ps(h[k]);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 d = _mm256_mul_ps(hv[0], _mm256_loadu_ps(b + j));
    for (int k = 1; k < R; ++k) d = _mm256_fmadd_ps(hv[k], _mm256_loadu_ps(b + k * n + j), d);
    _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_loadu_ps(y + j), d));
  }
  for (; j < n; ++j) {
    float d = h[0] * b[j];
    for (int k = 1; k < R; ++k) d += h[k] * b[k * n + j];
    y[j] += d;
  }
}

using RankBlock = void (*)(const float*, const float*, int64_t, float*);  // shrink<K> or expand<K>
constexpr RankBlock kShrink[9] = {nullptr,   shrink<1>, shrink<2>, shrink<3>, shrink<4>,
                               shrink<5>, shrink<6>, shrink<7>, shrink<8>};
constexpr RankBlock kExpand[9] = {nullptr,   expand<1>, expand<2>, expand<3>, expand<4>,
                               expand<5>, expand<6>, expand<7>, expand<8>};

// one shard of one row: h = A x over the slot's r ranks, then y += h Bt, each eight ranks at a
// time (the expand adds each block's delta to y in turn)
void row_delta(const float* x, const float* a, const float* b, int64_t r, int64_t in, int64_t n, float* h,
               float* y) {
  for (int64_t k = 0; k < r; k += 8) kShrink[std::min<int64_t>(8, r - k)](x, a + k * in, in, h + k);
  for (int64_t k = 0; k < r; k += 8) kExpand[std::min<int64_t>(8, r - k)](h + k, b + k * n, n, y);
}
#else
void row_delta(const float* x, const float* a, const float* b, int64_t r, int64_t in, int64_t n, float* h,
               float* y) {
  for (int64_t k = 0; k < r; ++k) {
    float acc = 0.f;
    for (int64_t c = 0; c < in; ++c) acc += x[c] * a[k * in + c];
    h[k] = acc;
  }
  for (int64_t j = 0; j < n; ++j) {
    float d = h[0] * b[j];
    for (int64_t k = 1; k < r; ++k) d += h[k] * b[k * n + j];
    y[j] += d;
  }
}
#endif

}  // namespace

void lora_add_(at::TensorList ys, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a,
               at::TensorList bts, const at::Tensor& ranks) {
  const int64_t shards = static_cast<int64_t>(ys.size());
  TORCH_CHECK(shards > 0 && bts.size() == ys.size(), "ys and bts must be one tensor per shard, got ", ys.size(),
              " and ", bts.size());
  const int64_t t = x.size(0), in = x.size(1);
  check_rows(x, "x", t);
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == t,
              "slots must be a contiguous int64 CPU tensor with one slot (or -1) per row of x");
  check_f32(a, "a");
  TORCH_CHECK(a.dim() == 3 && a.size(2) == in && a.size(1) % shards == 0, "a must be [slots, shards x max_rank, ",
              in, "], got ", a.sizes());
  const int64_t num_slots = a.size(0), max_rank = a.size(1) / shards;
  TORCH_CHECK(ranks.device().is_cpu() && ranks.scalar_type() == at::kLong && ranks.is_contiguous() &&
                  ranks.dim() == 2 && ranks.size(0) == num_slots && ranks.size(1) == shards,
              "ranks must be a contiguous int64 [", num_slots, ", ", shards, "] tensor, got ", ranks.sizes());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* rp = ranks.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_slots * shards; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] <= max_rank, "ranks must be in [0, ", max_rank, "], got ", rp[i]);
  for (int64_t r = 0; r < t; ++r)
    TORCH_CHECK(sp[r] >= -1 && sp[r] < num_slots, "slots must be -1 or below ", num_slots, ", got ", sp[r]);
  std::vector<float*> yp(shards);
  std::vector<const float*> bp(shards);
  std::vector<int64_t> ystride(shards), width(shards);
  for (int64_t i = 0; i < shards; ++i) {
    check_rows(ys[i], "ys", t);
    check_f32(bts[i], "bts");
    width[i] = ys[i].size(1);
    TORCH_CHECK(bts[i].dim() == 3 && bts[i].size(0) == num_slots && bts[i].size(1) == max_rank &&
                    bts[i].size(2) == width[i],
                "bts[", i, "] must be [", num_slots, ", ", max_rank, ", ", width[i], "], got ", bts[i].sizes());
    yp[i] = ys[i].data_ptr<float>();
    bp[i] = bts[i].data_ptr<float>();
    ystride[i] = ys[i].stride(0);
  }
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const int64_t xstride = x.stride(0);
  at::parallel_for(0, t, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> h(static_cast<size_t>(max_rank));
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t s = sp[row];
      if (s < 0) continue;
      for (int64_t i = 0; i < shards; ++i) {
        const int64_t r = rp[s * shards + i];
        if (r == 0) continue;
        row_delta(xp + row * xstride, ap + (s * shards + i) * max_rank * in, bp[i] + s * max_rank * width[i], r,
                  in, width[i], h.data(), yp[i] + row * ystride[i]);
      }
    }
  });
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("lora_add_(Tensor(a!)[] ys, Tensor x, Tensor slots, Tensor a, Tensor[] bts, Tensor ranks) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("lora_add_", &pagedllm_ops::lora_add_); }
