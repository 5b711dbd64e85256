// A decode step through every decoder layer of a Llama/Qwen2/Qwen3 model in one call, for steps
// where each sequence adds one token and every weight is an x8 block matrix on the CPU.
//
// It runs the very ops the Python layers run (the same kernels, in the same order, so the
// numbers are identical); what it removes is the Python between them: at one token a step, the
// ~25 dispatched ops and module calls of a layer cost ~0.35 ms, a third of the layer.
//
//   x, residual -> add_rms_norm_ -> q, k, v (+ bias) (-> per-head q/k rms_norm, Qwen3) -> rope_ ->
//   K/V into the cache ->
//   paged_decode_attention -> o_proj -> add_rms_norm_ -> gate, up -> silu(gate) * up -> down
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

struct LayerWeights {
  std::vector<at::Tensor> qkv, gate_up;
  std::vector<int64_t> qkv_types, gate_up_types;
  at::Tensor o, down;
  int64_t o_type, down_type;
  std::vector<at::Tensor> qkv_bias;  // empty, or q, k, v biases
  std::vector<at::Tensor> qk_norm;   // empty, or the q and k head norms [head_dim] (Qwen3)
  at::Tensor norm1, norm2;
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              at::Tensor cos, at::Tensor sin)
      : hq_(num_heads), hk_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale),
        cos_(std::move(cos)), sin_(std::move(sin)) {
    TORCH_CHECK(hq_ > 0 && hk_ > 0 && hq_ % hk_ == 0, "num_heads (", hq_, ") must be a positive multiple of ",
                "num_kv_heads (", hk_, ")");
    TORCH_CHECK(d_ > 0 && d_ % 2 == 0, "head_dim must be positive and even, got ", d_);
    TORCH_CHECK(cos_.dim() == 2 && sin_.sizes() == cos_.sizes() && cos_.size(1) % 2 == 0 && cos_.size(1) > 0 &&
                    cos_.size(1) <= d_,
                "cos and sin must be [positions, rotary_dim] tables of the same shape, rotary_dim even and at "
                "most head_dim, got cos ", cos_.sizes(), " and sin ", sin_.sizes());
  }

  // weights: q, k, v, o, gate, up, down (x8 matrices) with their ggml types; qkv_bias: [] or 3;
  // qk_norm: [] or the q and k head-norm weights, each [head_dim].
  void add_layer(std::vector<at::Tensor> weights, std::vector<int64_t> qtypes, std::vector<at::Tensor> qkv_bias,
                 std::vector<at::Tensor> qk_norm, at::Tensor norm1, at::Tensor norm2) {
    TORCH_CHECK(weights.size() == 7 && qtypes.size() == 7, "a layer has 7 weights: q k v o gate up down");
    TORCH_CHECK(qkv_bias.empty() || qkv_bias.size() == 3, "qkv_bias: none or q, k, v");
    TORCH_CHECK(qk_norm.empty() || qk_norm.size() == 2, "qk_norm: none or q, k");
    for (const at::Tensor& w : qk_norm) {
      pagedllm_ops::check_f32(w, "qk_norm");
      TORCH_CHECK(w.dim() == 1 && w.numel() == d_, "qk_norm weights must be [head_dim] = [", d_, "], got ",
                  w.sizes());
    }
    layers_.push_back({{weights[0], weights[1], weights[2]}, {weights[4], weights[5]},
                       {qtypes[0], qtypes[1], qtypes[2]}, {qtypes[4], qtypes[5]},
                       weights[3], weights[6], qtypes[3], qtypes[6], std::move(qkv_bias),
                       std::move(qk_norm), std::move(norm1), std::move(norm2)});
  }

  // x, residual [T, H] float32 (x is overwritten); kv_caches [L, 2, NB, BS, Hk, D]. Returns the
  // last layer's output and the residual stream before it is added, as the Python layers do.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor residual, const at::Tensor& positions,
                                             const at::Tensor& kv_caches, const at::Tensor& slot_mapping,
                                             const at::Tensor& block_table, const at::Tensor& context_lens) {
    TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual must be [T, hidden] of the same shape, "
                "got x ", x.sizes(), " and residual ", residual.sizes());
    TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(1) == 2, "kv_caches must be [layers, 2, blocks, block_size, "
                "kv_heads, head_dim], got ", kv_caches.sizes());
    TORCH_CHECK(kv_caches.size(0) >= static_cast<int64_t>(layers_.size()) && kv_caches.is_contiguous() &&
                    kv_caches.scalar_type() == at::kFloat && kv_caches.size(4) * kv_caches.size(5) == hk_ * d_,
                "kv_caches must be a contiguous float32 [layers, 2, blocks, block_size, kv_heads, head_dim] tensor");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == x.size(0),
                "slot_mapping must be a contiguous int64 tensor with one slot per token");
    const int64_t t = x.size(0), hidden = x.size(1);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      pagedllm_ops::add_rms_norm_(x, residual, w.norm1, eps_);
      std::vector<at::Tensor> qkv = pagedllm_ggml::linear_x8(x, w.qkv, w.qkv_types, hidden);
      for (size_t i = 0; i < w.qkv_bias.size(); ++i) add_rows_(qkv[i], w.qkv_bias[i]);
      at::Tensor q = qkv[0].view({t, hq_, d_}), k = qkv[1].view({t, hk_, d_}), v = qkv[2].view({t, hk_, d_});
      if (!w.qk_norm.empty()) {
        q = pagedllm_ops::rms_norm(q, w.qk_norm[0], eps_);
        k = pagedllm_ops::rms_norm(k, w.qk_norm[1], eps_);
      }
      pagedllm_ops::rope_(q, k, positions, cos_, sin_);
      const at::Tensor kv = kv_caches[static_cast<int64_t>(l)];  // [2, NB, BS, Hk, D]
      pagedllm_ops::write_kv_(kv, k, v, slot_mapping);
      const at::Tensor o = pagedllm_ops::paged_decode_attention(q, kv, block_table, context_lens, scale_);
      at::Tensor h = pagedllm_ggml::linear_x8(o.view({t, hq_ * d_}), {w.o}, {w.o_type}, hq_ * d_)[0];
      pagedllm_ops::add_rms_norm_(h, residual, w.norm2, eps_);
      std::vector<at::Tensor> gu = pagedllm_ggml::linear_x8(h, w.gate_up, w.gate_up_types, hidden);
      at::Tensor act = pagedllm_ops::silu_mul(gu[0], gu[1]);
      x = pagedllm_ggml::linear_x8(act, {w.down}, {w.down_type}, act.size(1))[0];
    }
    return {x, residual};
  }

 private:
  // y[r] += b for every row r of y [T, N] (the same float adds as y.add_(b))
  static void add_rows_(at::Tensor& y, const at::Tensor& b) {
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.numel() == y.size(1), "bias shape");
    float* yp = y.data_ptr<float>();
    const float* bp = b.data_ptr<float>();
    const int64_t n = y.size(1);
    for (int64_t r = 0; r < y.size(0); ++r)
      for (int64_t i = 0; i < n; ++i) yp[r * n + i] += bp[i];
  }

  int64_t hq_, hk_, d_;
  double eps_, scale_;
  at::Tensor cos_, sin_;
  std::vector<LayerWeights> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward);
}
