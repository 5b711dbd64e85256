// A decode step through every decoder layer of a model in one call, for steps where each
// sequence adds one token and every weight is an x8 block matrix on the CPU: the Llama layer
// (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3), Gemma 2/3's, and the Llama layer with routed
// experts in place of its MLP (Qwen2-MoE, Qwen3-MoE: set_moe).
//
// It runs the very ops the Python layers run (the same kernels, in the same order, so the
// numbers are identical); what it removes is the Python between them: at one token a step, the
// ~25 dispatched ops and module calls of a layer cost ~0.35 ms, a third of the layer.
//
//   x, residual -> add_rms_norm_ -> q, k, v (+ bias) (-> per-head q/k rms_norm) -> rope_ (the
//   layer's table; none on a NoPE layer) -> K/V into the cache ->
//   paged_decode_attention (the layer's window and soft-cap) -> o_proj (-> rms_norm, Gemma) ->
//   add_rms_norm_ -> gate, up -> silu(gate) * up or gelu_tanh(gate) * up -> down (-> rms_norm,
//   Gemma)
//
// A routed-experts layer's feed-forward is moe.cpp's op, the one layers/moe.py's SparseMoeBlock
// calls for x8 experts.
//
// Gemma's (1 + w) norms arrive with the 1 added (the Python layers add it the same way before
// calling the same op).
//
// LoRA: set_lora() hands a layer's projection (q/k/v, o, gate/up, down) the slot tensors of its
// Python LoRALinear (shared, so loading an adapter into a slot needs no call here); a step given
// a slot per row then adds each projection's delta after its output (and bias) with lora_add_,
// as the Python LoRALinear does after its base.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

// A routed-experts feed-forward: moe_forward's arguments after x (moe.cpp)
struct MoEWeights {
  at::Tensor router;
  int64_t router_type;
  std::vector<at::Tensor> experts;
  std::vector<int64_t> expert_types;
  int64_t top_k;
  bool norm_topk_prob;
  std::vector<at::Tensor> shared;
  std::vector<int64_t> shared_types;
};

struct LayerWeights {
  std::vector<at::Tensor> qkv, gate_up;
  std::vector<int64_t> qkv_types, gate_up_types;
  at::Tensor o, down;
  int64_t o_type, down_type;
  std::vector<at::Tensor> qkv_bias;  // empty, or q, k, v biases
  std::vector<at::Tensor> qk_norm;   // empty, or the q and k head norms [head_dim] (Qwen3, Gemma 3)
  at::Tensor norm1, norm2;
  at::Tensor attn_out_norm, ffn_out_norm;  // undefined, or Gemma's post-attention / post-FFN norms
  int64_t rope;                            // index into the rope tables, or -1: no RoPE (NoPE layer)
  int64_t window;                          // sliding window, or 0
  double softcap;                          // attention soft-cap, or 0
  bool gelu;                               // GeGLU (Gemma) rather than SwiGLU
  std::shared_ptr<const MoEWeights> moe;   // routed experts in place of gate_up / down, or null
};

// One projection's LoRA slots (lora_add_'s a, bts and ranks); a undefined: no LoRA there.
struct LoRAWeights {
  at::Tensor a;
  std::vector<at::Tensor> bts;
  at::Tensor ranks;
};

enum Projection : int64_t { kQKV = 0, kO = 1, kGateUp = 2, kDown = 3, kProjections = 4 };

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              at::Tensor cos, at::Tensor sin)
      : hq_(num_heads), hk_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(hq_ > 0 && hk_ > 0 && hq_ % hk_ == 0, "num_heads (", hq_, ") must be a positive multiple of ",
                "num_kv_heads (", hk_, ")");
    TORCH_CHECK(d_ > 0 && d_ % 2 == 0, "head_dim must be positive and even, got ", d_);
    add_rope(std::move(cos), std::move(sin));
  }

  // Another [positions, rotary_dim] cos/sin table pair (Gemma 3's local layers); returns its
  // index for add_layer (the constructor's pair is 0).
  int64_t add_rope(at::Tensor cos, at::Tensor sin) {
    TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) % 2 == 0 && cos.size(1) > 0 &&
                    cos.size(1) <= d_,
                "cos and sin must be [positions, rotary_dim] tables of the same shape, rotary_dim even and at "
                "most head_dim, got cos ", cos.sizes(), " and sin ", sin.sizes());
    pagedllm_ops::check_f32(cos, "cos");
    pagedllm_ops::check_f32(sin, "sin");
    cos_.push_back(std::move(cos));
    sin_.push_back(std::move(sin));
    return static_cast<int64_t>(cos_.size()) - 1;
  }

  // weights: q, k, v, o, gate, up, down (x8 matrices) with their ggml types; qkv_bias: [] or 3;
  // qk_norm: [] or the q and k head-norm weights, each [head_dim]; norms: the two pre-norms
  // (attention, feed-forward), or those and Gemma's two post-norms (attention, feed-forward);
  // rope: a table index or -1 (none); window, softcap: 0 for none; gelu: GeGLU, else SwiGLU.
  // A routed-experts layer gives q k v o only, then its experts with set_moe.
  void add_layer(std::vector<at::Tensor> weights, std::vector<int64_t> qtypes, std::vector<at::Tensor> qkv_bias,
                 std::vector<at::Tensor> qk_norm, std::vector<at::Tensor> norms, int64_t rope, int64_t window,
                 double softcap, bool gelu) {
    TORCH_CHECK((weights.size() == 7 || weights.size() == 4) && qtypes.size() == weights.size(),
                "a layer has 7 weights (q k v o gate up down) or, with routed experts, 4 (q k v o), with one "
                "qtype each; got ", weights.size(), " weights and ", qtypes.size(), " qtypes");
    TORCH_CHECK(qkv_bias.empty() || qkv_bias.size() == 3, "qkv_bias: none or q, k, v");
    TORCH_CHECK(qk_norm.empty() || qk_norm.size() == 2, "qk_norm: none or q, k");
    TORCH_CHECK(norms.size() == 2 || norms.size() == 4, "norms: the 2 pre-norms, or those and the 2 post-norms, "
                "got ", norms.size());
    for (const at::Tensor& w : norms) pagedllm_ops::check_f32(w, "norms");
    TORCH_CHECK(rope >= -1 && rope < static_cast<int64_t>(cos_.size()), "rope must be -1 (none) or a table index "
                "below ", cos_.size(), ", got ", rope);
    TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
    for (const at::Tensor& w : qk_norm) {
      pagedllm_ops::check_f32(w, "qk_norm");
      TORCH_CHECK(w.dim() == 1 && w.numel() == d_, "qk_norm weights must be [head_dim] = [", d_, "], got ",
                  w.sizes());
    }
    const bool post = norms.size() == 4, dense = weights.size() == 7;
    layers_.push_back({{weights[0], weights[1], weights[2]},
                       dense ? std::vector<at::Tensor>{weights[4], weights[5]} : std::vector<at::Tensor>{},
                       {qtypes[0], qtypes[1], qtypes[2]},
                       dense ? std::vector<int64_t>{qtypes[4], qtypes[5]} : std::vector<int64_t>{},
                       weights[3], dense ? weights[6] : at::Tensor(), qtypes[3], dense ? qtypes[6] : -1,
                       std::move(qkv_bias), std::move(qk_norm), norms[0], norms[1],
                       post ? norms[2] : at::Tensor(), post ? norms[3] : at::Tensor(), rope, window, softcap, gelu,
                       nullptr});
    lora_.emplace_back(kProjections);
  }

  // The routed experts of layer `layer` (added with 4 weights): moe_forward's arguments after x
  // (moe.cpp), checked there at the first step
  void set_moe(int64_t layer, at::Tensor router, int64_t router_type, std::vector<at::Tensor> experts,
               std::vector<int64_t> expert_types, int64_t top_k, bool norm_topk_prob, std::vector<at::Tensor> shared,
               std::vector<int64_t> shared_types) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "layer must be below ", layers_.size(),
                ", got ", layer);
    LayerWeights& lw = layers_[layer];
    TORCH_CHECK(lw.gate_up.empty(), "layer ", layer, " was added with a dense MLP (7 weights)");
    lw.moe = std::make_shared<MoEWeights>(MoEWeights{std::move(router), router_type, std::move(experts),
                                                     std::move(expert_types), top_k, norm_topk_prob,
                                                     std::move(shared), std::move(shared_types)});
  }

  // The LoRA slots of a layer's projection: 0 q/k/v, 1 o, 2 gate/up, 3 down (bts: one per shard).
  void set_lora(int64_t layer, int64_t projection, at::Tensor a, std::vector<at::Tensor> bts, at::Tensor ranks) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "layer must be below ", layers_.size(),
                ", got ", layer);
    TORCH_CHECK(projection >= 0 && projection < kProjections, "projection must be 0 (q/k/v), 1 (o), 2 (gate/up) "
                "or 3 (down), got ", projection);
    const size_t shards = projection == kQKV ? 3 : projection == kGateUp ? 2 : 1;
    TORCH_CHECK(bts.size() == shards, "projection ", projection, " has ", shards, " shards, got ", bts.size(),
                " bts");
    TORCH_CHECK(projection < kGateUp || !layers_[layer].gate_up.empty(), "layer ", layer,
                " has routed experts, which carry no LoRA");
    lora_[layer][projection] = {std::move(a), std::move(bts), std::move(ranks)};
  }

  // x, residual [T, H] float32 (x is overwritten); kv_caches [L, 2, NB, BS, Hk, D]; lora_slots
  // None, or each row's LoRA slot (-1: none). Returns the last layer's output and the residual
  // stream before it is added, as the Python layers do.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor residual, const at::Tensor& positions,
                                             const at::Tensor& kv_caches, const at::Tensor& slot_mapping,
                                             const at::Tensor& block_table, const at::Tensor& context_lens,
                                             const c10::optional<at::Tensor>& lora_slots) {
    TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual must be [T, hidden] of the same shape, "
                "got x ", x.sizes(), " and residual ", residual.sizes());
    TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(1) == 2, "kv_caches must be [layers, 2, blocks, block_size, "
                "kv_heads, head_dim], got ", kv_caches.sizes());
    pagedllm_ops::check_kv_cache(kv_caches, "kv_caches");
    TORCH_CHECK(kv_caches.size(0) >= static_cast<int64_t>(layers_.size()) &&
                    kv_caches.size(4) * kv_caches.size(5) == hk_ * d_,
                "kv_caches must be [layers, 2, blocks, block_size, kv_heads, head_dim] for this model, got ",
                kv_caches.sizes());
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == x.size(0),
                "slot_mapping must be a contiguous int64 tensor with one slot per token");
    const int64_t t = x.size(0), hidden = x.size(1);
    const at::Tensor* slots = lora_slots.has_value() ? &*lora_slots : nullptr;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      const std::vector<LoRAWeights>& lora = lora_[l];
      pagedllm_ops::add_rms_norm_(x, residual, w.norm1, eps_);
      std::vector<at::Tensor> qkv = pagedllm_ggml::linear_x8(x, w.qkv, w.qkv_types, hidden);
      for (size_t i = 0; i < w.qkv_bias.size(); ++i) add_rows_(qkv[i], w.qkv_bias[i]);
      add_lora_(qkv, x, slots, lora[kQKV]);
      at::Tensor q = qkv[0].view({t, hq_, d_}), k = qkv[1].view({t, hk_, d_}), v = qkv[2].view({t, hk_, d_});
      if (!w.qk_norm.empty()) {
        q = pagedllm_ops::rms_norm(q, w.qk_norm[0], eps_);
        k = pagedllm_ops::rms_norm(k, w.qk_norm[1], eps_);
      }
      if (w.rope >= 0) {
        // the Python layer's rope_ takes contiguous q and k (q/k norms give them already)
        q = q.contiguous();
        k = k.contiguous();
        pagedllm_ops::rope_(q, k, positions, cos_[w.rope], sin_[w.rope]);
      }
      const at::Tensor kv = kv_caches[static_cast<int64_t>(l)];  // [2, NB, BS, Hk, D]
      pagedllm_ops::write_kv_(kv, k, v, slot_mapping);
      const at::Tensor o = pagedllm_ops::paged_decode_attention(q.contiguous(), kv, block_table, context_lens,
                                                                scale_, w.window, w.softcap);
      const at::Tensor o2 = o.view({t, hq_ * d_});
      at::Tensor h = pagedllm_ggml::linear_x8(o2, {w.o}, {w.o_type}, hq_ * d_)[0];
      add_lora_(h, o2, slots, lora[kO]);
      if (w.attn_out_norm.defined()) h = pagedllm_ops::rms_norm(h, w.attn_out_norm, eps_);
      pagedllm_ops::add_rms_norm_(h, residual, w.norm2, eps_);
      if (w.moe) {
        const MoEWeights& m = *w.moe;
        x = pagedllm_ops::moe_forward(h, m.router, m.router_type, m.experts, m.expert_types, m.top_k,
                                      m.norm_topk_prob, m.shared, m.shared_types);
        continue;
      }
      TORCH_CHECK(!w.gate_up.empty(), "layer ", l, " has neither an MLP nor routed experts (set_moe)");
      at::Tensor act;
      if (slots != nullptr && lora[kGateUp].a.defined()) {  // the deltas go between the matmuls and act
        std::vector<at::Tensor> gu = pagedllm_ggml::linear_x8(h, w.gate_up, w.gate_up_types, hidden);
        add_lora_(gu, h, slots, lora[kGateUp]);
        act = w.gelu ? pagedllm_ops::gelu_tanh_mul(gu[0], gu[1]) : pagedllm_ops::silu_mul(gu[0], gu[1]);
      } else {
        // bf16 for a BF16 down matrix whose x is not also a LoRA delta's (the delta takes float32)
        constexpr int64_t kBF16 = 30;  // ggml_common.h
        const bool bf16_act = w.down_type == kBF16 && !(slots != nullptr && lora[kDown].a.defined());
        act = pagedllm_ggml::gated_x8(h, w.gate_up, w.gate_up_types, hidden, w.gelu, bf16_act);
      }
      x = pagedllm_ggml::linear_x8(act, {w.down}, {w.down_type}, act.size(1))[0];
      add_lora_(x, act, slots, lora[kDown]);
      if (w.ffn_out_norm.defined()) x = pagedllm_ops::rms_norm(x, w.ffn_out_norm, eps_);
    }
    return {x, residual};
  }

 private:
  // a projection's LoRA deltas, where the step has slots and the projection LoRA weights
  static void add_lora_(std::vector<at::Tensor>& ys, const at::Tensor& x, const at::Tensor* slots,
                        const LoRAWeights& lora) {
    if (slots != nullptr && lora.a.defined()) pagedllm_ops::lora_add_(ys, x, *slots, lora.a, lora.bts, lora.ranks);
  }
  static void add_lora_(at::Tensor& y, const at::Tensor& x, const at::Tensor* slots, const LoRAWeights& lora) {
    if (slots != nullptr && lora.a.defined()) pagedllm_ops::lora_add_({y}, x, *slots, lora.a, lora.bts, lora.ranks);
  }

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
  std::vector<at::Tensor> cos_, sin_;  // RoPE tables, [positions, rotary_dim] each
  std::vector<LayerWeights> layers_;
  std::vector<std::vector<LoRAWeights>> lora_;  // per layer, per Projection
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor>())
      .def("add_rope", &DecodeStack::add_rope)
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_moe", &DecodeStack::set_moe)
      .def("set_lora", &DecodeStack::set_lora)
      .def("forward", &DecodeStack::forward);
}
