// A routed-experts feed-forward (Qwen2-MoE, Qwen3-MoE) whose experts are x8 matrices: what
// layers/moe.py's SparseMoeBlock computes, in one call, for the layer loop and the C++ decode
// stack alike (both call this op, so their numbers are the same by construction).
//
//   router logits (float32 dot products, or an x8 matrix) -> softmax in float32 -> the top k
//   (ties: the lower expert) -> renormalised to sum 1 where norm_topk_prob -> each chosen
//   expert, in ascending order, on the rows that chose it: down(silu(gate x) * up x) -> each
//   row's output += weight * that (from zeros) -> (Qwen2-MoE) += sigmoid(gate . x) * shared(x)
//
// Every row's numbers are computed the same way whatever else is in the batch (the x8 kernels
// give a row the same bits in any batch, the dot products and the routing run row by row, and a
// row's sum runs over its experts in ascending order then the shared expert), so a sequence
// alone equals itself in a batch. At one row (a decode step of one sequence) the chosen
// experts' and the shared expert's gate/up matrices run in one linear_x8 call (one pass of the
// threads, x quantized once) and nothing is gathered.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace pagedllm_ops {
namespace {

// sum of a[i] * b[i]: 8 lanes of fused multiply-adds then their sum, then the tail, in one order
float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef PAGEDLLM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = pagedllm_simd::hsum(acc);
#endif
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// x [T, H] @ w^T: w float32 [N, H] (type -1; the dot above, row by row) or an x8 matrix
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  if (type >= 0) return pagedllm_ggml::linear_x8(x, {w}, {type}, x.size(1))[0];
  const int64_t t = x.size(0), n = w.size(0), h = x.size(1);
  at::Tensor y = at::empty({t, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, t * n, std::max<int64_t>(1, 65536 / h), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) yp[i] = dot(xp + (i / n) * h, wp + (i % n) * h, h);
  });
  return y;
}

void check_matrix(const at::Tensor& w, int64_t type, const char* name, int64_t rows, int64_t hidden) {
  if (type >= 0) return;  // linear_x8 checks its x8 matrices
  check_f32(w, name);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == hidden, name, " must be [", rows, ", ", hidden,
              "], got ", w.sizes());
}

struct Mlp {  // a gated MLP's x8 matrices: gate, up, down
  std::vector<at::Tensor> gate_up;
  std::vector<int64_t> gate_up_types;
  at::Tensor down;
  int64_t down_type;
};

// down(silu(gate x) * up x); gu: gate and up's outputs where they are already computed
at::Tensor mlp(const at::Tensor& x, const Mlp& m, std::vector<at::Tensor> gu = {}) {
  if (gu.empty()) gu = pagedllm_ggml::linear_x8(x, m.gate_up, m.gate_up_types, x.size(1));
  const at::Tensor act = silu_mul(gu[0], gu[1]);
  return pagedllm_ggml::linear_x8(act, {m.down}, {m.down_type}, act.size(1))[0];
}

// out[r] += w * y[i] over the hidden values (one row's weighted add)
void add_scaled(float* out, const float* y, float w, int64_t h) {
  for (int64_t j = 0; j < h; ++j) out[j] += w * y[j];
}

}  // namespace

at::Tensor moe_forward(const at::Tensor& x_in, const at::Tensor& router, int64_t router_type, at::TensorList experts,
                       at::IntArrayRef expert_types, int64_t top_k, bool norm_topk_prob, at::TensorList shared,
                       at::IntArrayRef shared_types) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [tokens, hidden], got ", x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK(!experts.empty() && experts.size() % 3 == 0 && expert_types.size() == experts.size(),
              "experts: gate, up, down of each expert, with one type each; got ", experts.size(), " tensors and ",
              expert_types.size(), " types");
  const int64_t ne = static_cast<int64_t>(experts.size()) / 3;
  TORCH_CHECK(top_k >= 1 && top_k <= ne, "top_k must be 1 to the ", ne, " experts, got ", top_k);
  check_matrix(router, router_type, "router", ne, h);
  TORCH_CHECK(shared.empty() || (shared.size() == 4 && shared_types.size() == 4),
              "shared: none, or the shared expert's gate, up, down and its gate, with 4 types");
  if (!shared.empty()) check_matrix(shared[3], shared_types[3], "shared expert gate", 1, h);
  std::vector<Mlp> mlps;
  for (int64_t e = 0; e < ne; ++e)
    mlps.push_back({{experts[3 * e], experts[3 * e + 1]}, {expert_types[3 * e], expert_types[3 * e + 1]},
                    experts[3 * e + 2], expert_types[3 * e + 2]});

  // routing, row by row: softmax, the top k (the lower expert on a tie), renormalised
  const at::Tensor logits = linear(x, router, router_type).contiguous();
  const float* lp = logits.data_ptr<float>();
  std::vector<int64_t> chosen(t * top_k);
  std::vector<float> weight(t * top_k), p(ne);
  std::vector<char> taken(ne);
  for (int64_t r = 0; r < t; ++r) {
    const float* l = lp + r * ne;
    float mx = l[0];
    for (int64_t e = 1; e < ne; ++e) mx = std::max(mx, l[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < ne; ++e) sum += (p[e] = std::exp(l[e] - mx));
    for (int64_t e = 0; e < ne; ++e) p[e] /= sum;
    float picked = 0.f;
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;  // (a NaN never compares greater: then the lowest expert not taken)
      for (int64_t e = 0; e < ne; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      chosen[r * top_k + j] = best;
      picked += (weight[r * top_k + j] = p[best]);
    }
    if (norm_topk_prob)
      for (int64_t j = 0; j < top_k; ++j) weight[r * top_k + j] /= picked;
  }
  // each expert's slots (row * k + choice), in ascending order
  std::vector<std::vector<int64_t>> slots(ne);
  for (int64_t s = 0; s < t * top_k; ++s) slots[chosen[s]].push_back(s);

  at::Tensor out = at::zeros({t, h}, x.options());
  float* op = out.data_ptr<float>();
  std::vector<at::Tensor> shared_gu;  // at one row, the shared expert's gate and up outputs
  if (t == 1) {
    std::vector<at::Tensor> ws;
    std::vector<int64_t> types;
    if (!shared.empty()) {
      ws = {shared[0], shared[1]};
      types = {shared_types[0], shared_types[1]};
    }
    for (int64_t e = 0; e < ne; ++e)
      if (!slots[e].empty()) {
        ws.insert(ws.end(), mlps[e].gate_up.begin(), mlps[e].gate_up.end());
        types.insert(types.end(), mlps[e].gate_up_types.begin(), mlps[e].gate_up_types.end());
      }
    const std::vector<at::Tensor> gu = pagedllm_ggml::linear_x8(x, ws, types, h);
    size_t next = 0;
    if (!shared.empty()) {
      shared_gu = {gu[0], gu[1]};
      next = 2;
    }
    for (int64_t e = 0; e < ne; ++e) {
      if (slots[e].empty()) continue;
      const at::Tensor y = mlp(x, mlps[e], {gu[next], gu[next + 1]});
      next += 2;
      add_scaled(op, y.data_ptr<float>(), weight[slots[e][0]], h);
    }
  } else {
    const float* xp = x.data_ptr<float>();
    for (int64_t e = 0; e < ne; ++e) {
      const std::vector<int64_t>& sl = slots[e];
      if (sl.empty()) continue;
      const int64_t n = static_cast<int64_t>(sl.size());
      at::Tensor rows = at::empty({n, h}, x.options());
      float* rp = rows.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) std::memcpy(rp + i * h, xp + (sl[i] / top_k) * h, h * sizeof(float));
      const at::Tensor y = mlp(rows, mlps[e]);
      const float* yp = y.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) add_scaled(op + (sl[i] / top_k) * h, yp + i * h, weight[sl[i]], h);
    }
  }
  if (!shared.empty()) {
    const Mlp sm{{shared[0], shared[1]}, {shared_types[0], shared_types[1]}, shared[2], shared_types[2]};
    const at::Tensor s = mlp(x, sm, std::move(shared_gu));
    const at::Tensor g = linear(x, shared[3], shared_types[3]).contiguous();
    const float* sp = s.data_ptr<float>();
    const float* gp = g.data_ptr<float>();
    for (int64_t r = 0; r < t; ++r) add_scaled(op + r * h, sp + r * h, 1.f / (1.f + std::exp(-gp[r])), h);
  }
  return out;
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("moe_forward(Tensor x, Tensor router, int router_type, Tensor[] experts, int[] expert_types, int top_k, "
        "bool norm_topk_prob, Tensor[] shared, int[] shared_types) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("moe_forward", &pagedllm_ops::moe_forward); }
