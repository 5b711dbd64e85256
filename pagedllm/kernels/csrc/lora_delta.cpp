// The LoRA delta of one projection (every shard of a fused one) in one call, each token row by
// its own adapter slot (vLLM's punica shrink and expand):
//
//   y_i[t] += (x[t] @ A[s, i R : i R + r]^T) @ Bt_i[s, :r]     s = slots[t], r = ranks[s, i]
//
// for each shard i, where A [S, shards x R, in] holds every shard's A of each slot stacked by the
// largest rank R, and Bt_i [S, R, out_i] is scale x B_i^T. A row whose slot is -1, and a shard
// whose rank is 0 in the row's slot, are left alone.
//
// Each row is computed alone, in a fixed order (a dot product per rank, then the rank-weighted
// rows of Bt summed into a delta, then the delta added to y), so a row gets the same bits
// whatever else is in the step: a mixed batch equals each request run alone. The Python
// LoRALinear and the C++ decode stack both call this op, so the stack's numbers equal the layer
// loop's. At decode sizes (16 rows, rank 8) a call is microseconds: one op in place of the ~20
// dispatched PyTorch ops the same delta takes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace pagedllm_ops {

namespace {

void check_rows(const at::Tensor& t, const char* name, int64_t rows) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == rows &&
                  (t.size(1) <= 1 || t.stride(1) == 1),
              name, " must be a float32 CPU [", rows, ", n] tensor with contiguous rows, got ", t.sizes(),
              " of ", t.scalar_type());
}

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
  int64_t widest = 0;
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
    widest = std::max(widest, width[i]);
  }
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const int64_t xstride = x.stride(0);
  at::parallel_for(0, t, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> h(static_cast<size_t>(max_rank)), delta(static_cast<size_t>(widest));
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t s = sp[row];
      if (s < 0) continue;
      const float* xr = xp + row * xstride;
      for (int64_t i = 0; i < shards; ++i) {
        const int64_t r = rp[s * shards + i], n = width[i];
        if (r == 0) continue;
        const float* ai = ap + (s * shards + i) * max_rank * in;
        for (int64_t k = 0; k < r; ++k) {  // shrink: h = A x
          const float* ak = ai + k * in;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t c = 0; c < in; ++c) acc += xr[c] * ak[c];
          h[k] = acc;
        }
        const float* b = bp[i] + s * max_rank * n;  // expand: delta = h Bt
        float* d = delta.data();
        for (int64_t j = 0; j < n; ++j) d[j] = h[0] * b[j];
        for (int64_t k = 1; k < r; ++k) {
          const float hk = h[k];
          const float* bk = b + k * n;
          for (int64_t j = 0; j < n; ++j) d[j] += hk * bk[j];
        }
        float* y = yp[i] + row * ystride[i];
        for (int64_t j = 0; j < n; ++j) y[j] += d[j];
      }
    }
  });
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("lora_add_(Tensor(a!)[] ys, Tensor x, Tensor slots, Tensor a, Tensor[] bts, Tensor ranks) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("lora_add_", &pagedllm_ops::lora_add_); }
