// The ops that other kernels call directly, without the dispatcher (decode_stack.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace pagedllm_ops {  // cpu_ops.cpp
// uint8 [rows, cols] for regrouped weights: from 4 MiB on, 2 MiB-aligned and madvise'd for
// transparent huge pages (where THP is "madvise", the default of most distributions). A decode
// step streams every weight once: with 4 KiB pages it misses the TLB every 64 cache lines
// (measured on a Zen 4, 24 layers of a 0.5B model, bf16: 19.3 -> 16.7 ms a step at one row).
at::Tensor empty_weights(int64_t rows, int64_t cols);
// t must be a contiguous float32 CPU tensor (the error names it)
void check_f32(const at::Tensor& t, const char* name);
// t must be a contiguous float32 or bfloat16 CPU tensor, a KV cache's dtypes (the error names it)
void check_kv_cache(const at::Tensor& t, const char* name);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps);
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);
at::Tensor gelu_tanh_mul(const at::Tensor& gate, const at::Tensor& up);
void write_kv_(const at::Tensor& kv, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping);
// paged_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale, int64_t window = 0,
                                  double softcap = 0);
std::string paged_attention_path();  // "avx512", "avx2" or "scalar": which path the op runs now
// moe.cpp: a routed-experts feed-forward on x [T, H] (layers/moe.py's SparseMoeBlock): router
// [E, H] float32 (type -1) or x8; experts: gate, up, down of each of the E experts (x8) with their
// types; shared: [] or the shared expert's gate, up, down and its [1, H] gate, with 4 types
at::Tensor moe_forward(const at::Tensor& x, const at::Tensor& router, int64_t router_type, at::TensorList experts,
                       at::IntArrayRef expert_types, int64_t top_k, bool norm_topk_prob, at::TensorList shared,
                       at::IntArrayRef shared_types);
// lora_delta.cpp: y_i[t] += (x[t] @ A[s, i R : i R + r]^T) @ Bt_i[s, :r] for each shard i, s = slots[t]
// (-1: the row is left alone), r = ranks[s, i]
void lora_add_(at::TensorList ys, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a,
               at::TensorList bts, const at::Tensor& ranks);
}  // namespace pagedllm_ops

namespace pagedllm_ggml {
// ggml_quants.cpp: w must be a contiguous CPU uint8 [rows, row_bytes] of ggml type qtype, k wide
void check_weight(const at::Tensor& w, int64_t qtype, int64_t k);
// ggml_x8.cpp
std::vector<at::Tensor> linear_x8(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes, int64_t k);
// act(x @ gate^T) * (x @ up^T), ws = {gate, up} (act: silu, or gelu_tanh with gelu): linear_x8 then
// silu_mul / gelu_tanh_mul, the same bits; BF16 matrices in one pass that applies act as it stores,
// rounded to bf16 there with bf16_out (for a BF16 down matrix: linear_x8 takes the bf16 tensor)
at::Tensor gated_x8(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes, int64_t k, bool gelu,
                    bool bf16_out = false);
// x [M, K] float32 @ Wq^T for a Q8_0 x8 weight by the active variant's integer kernels (never the
// AMX-BF16 tiles) into out [M, N], and xt [M, K]: x as those kernels quantize it (d q per 32
// values, d float32), so that out is x~ @ Wq~^T up to the float updates' rounding. false where the
// variant has no integer kernels (the generic one, or a build without AVX2).
bool q8_int_linear(const at::Tensor& x, const at::Tensor& wq, int64_t k, at::Tensor& out, at::Tensor& xt);
}  // namespace pagedllm_ggml

namespace pagedllm_bf16 {  // x8_bf16.cpp: y_j = x @ W_j^T for bf16 x8 weights (ggml type BF16), by the active variant
std::vector<at::Tensor> linear_x8(const at::Tensor& x, at::TensorList ws, int64_t k);
// act(x @ gate^T) * (x @ up^T) [M, N] (act: silu, or gelu_tanh with gelu): the bits of linear_x8's
// two outputs through silu_mul / gelu_tanh_mul, in one pass over both matrices where the variant
// has blocks; there, with bf16_out, rounded to bf16 (a kBFloat16 tensor) for a next BF16 matrix
// (linear_x8 takes it as it is; the other paths give float32)
at::Tensor gated_x8(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, int64_t k, bool gelu,
                    bool bf16_out);
// Q8_0 x8 weights (ggml_x8_layout.h) on the AMX-BF16 tiles: outs[j] [M, N_j] (allocated) = bf16(x) @
// bf16(q d)^T, each record dequantized to bf16 once per call; the avx512amx_bf16 x8 variant's gemm
void amx_q8_linear(const at::Tensor& x, at::TensorList ws, int64_t k, std::vector<at::Tensor>& outs);
std::string amx_q8_missing();  // "" when this CPU and process can run amx_q8_linear, else what is missing
// x as the active variant multiplies it: float32 [M, K], rounded to bf16 for the vdpbf16ps
// variants, x itself for the FMA ones; alone: whether linear_x8 of max(M, call_rows) rows computes
// each row by itself with the bits group_logits gives (all but the AMX tiles from 8 rows on and
// the FMA variants' BLAS path from 64)
struct SeenX {
  at::Tensor x;
  std::string variant;  // the active variant when seen_x ran: group_logits takes the same
  bool alone;
};
SeenX seen_x(const at::Tensor& x, int64_t k, int64_t call_rows = 0);
// out[8 j + r] = row r of group groups[j] of w (bf16 x8, [N / 8, 16 k]) times row `row` of seen.x
void group_logits(const SeenX& seen, int64_t row, const at::Tensor& w, int64_t k, const int64_t* groups, int64_t n,
                  float* out);
// rows [g0 * 8, g1 * 8) of a bf16 x8 weight in float32, [rows, k] contiguous (exact)
at::Tensor widen_rows(const at::Tensor& wp, int64_t k, int64_t g0, int64_t g1);
}  // namespace pagedllm_bf16

namespace pagedllm_amx {  // x8_bf16.cpp: the AMX tile data permission, asked of the kernel once a
bool tile_permission();   // process (arch_prctl); true once granted. The bf16 and int8 tile kernels ask.
}  // namespace pagedllm_amx
