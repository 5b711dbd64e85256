// GGML blocks regrouped eight rows at a time ("x8"), and the int8-activation matmuls on them:
// a streaming gemv for up to 7 x rows (decode) and a gemm from 8 on (prefill, large batches).
//
// The weights keep every bit of the GGUF blocks, only reordered (the same bytes, 2-3 % more for
// the unpacked 6-bit scales of Q4_K and Q5_K): blocks b of rows 8g..8g+7 form one record, whose scales are
// stored side by side (one fp16 load gives all eight rows' scales) and whose values are stored
// as quads: 32 bytes hold four consecutive values of each of the eight rows, so
//
//   maddubs(w, broadcast(x[4c..4c+3]))  ->  madd  ->  lane r = dot of row r with x's quad c
//
// Each output lane is one weight row: there is no horizontal sum, one FMA scales eight rows,
// and a 32-value block of eight rows costs ~6 instructions per row, against ~26 when each row is
// decoded alone (that kernel was compute-bound at 6-9 GB/s on a 2-core AVX2 machine).
//
// Records (per 8 rows; "nib" = 128 bytes, byte 32c + 4r + i = v[r][4c+i] | v[r][16+4c+i] << 4,
// c < 4: low nibbles are quads 0-3 and high nibbles quads 4-7 of the 32 values):
//   Q4_0  d[8] fp16, nib                                    (144 B = 8 x 18)
//   Q4_1  d[8], m[8], nib                                   (160 B = 8 x 20)
//   Q5_0  d[8], bits, nib   bits: byte 4r + i, bit c = fifth bit of v[r][4c+i]  (176 B)
//   Q5_1  d[8], m[8], bits, nib                             (192 B)
//   Q8_0  d[8], q: byte 32c + 4r + i = q[r][4c+i], c < 8     (272 B = 8 x 34)
//   Q4_K  d[8], dmin[8], sc[8][8], m[8][8] (group-major), nib x 8 groups   (1184 B, 8 x 144 + 32)
//   Q5_K  the same header, then per group: bits, nib         (1440 B, 8 x 176 + 32)
//   Q6_K  d[8], sc[16][8] i8, per 32-block: nib (low 4 bits), hi: byte 32h + 4r + i bits
//         2(c - 4h).. = high 2 bits of v[r][4c+i]           (1680 B = 8 x 210)
//   Q2_K, Q3_K, IQ4_XS: ggml_x8_layout_low.h
// A matrix of N rows (N a multiple of 8) is a uint8 tensor [N / 8, records * record bytes].
// The kernels are in ggml_x8_kernels.inc, built once per instruction set (ggml_x8_isa.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ggml_common.h"
#include "ggml_x8_isa.h"
#include "ggml_x8_layout.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using namespace pagedllm_ggml;
using namespace pagedllm_ggml::x8;

void check_packed(const at::Tensor& w, int64_t qtype, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "x8 weight must be a contiguous CPU uint8 tensor [rows / 8, bytes]");
  const X8Format f = format_x8(qtype);
  TORCH_CHECK(k % f.values == 0, "k=", k, " is not a multiple of ", f.values);
  TORCH_CHECK(w.size(1) == k / f.values * f.rec_bytes, "x8 row bytes ", w.size(1), " do not match k=", k);
}

at::Tensor ggml_pack_x8(const at::Tensor& w, int64_t qtype, int64_t k) {
  const X8Format f = format_x8(qtype);
  check_weight(w, qtype, k);
  TORCH_CHECK(w.size(0) % kRows == 0, "rows=", w.size(0), " is not a multiple of ", kRows);
  const int64_t groups = w.size(0) / kRows, nrec = k / f.values, rb = w.size(1);
  at::Tensor out = pagedllm_ops::empty_weights(groups, nrec * f.rec_bytes);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t i = 0; i < nrec; ++i) {
        const uint8_t* rows[kRows];
        for (int r = 0; r < kRows; ++r) rows[r] = src + (kRows * g + r) * rb + i * f.src_bytes;
        f.pack(rows, dst + (g * nrec + i) * f.rec_bytes);
      }
  });
  return out;
}

// back to the GGUF block layout [rows, row_bytes]
// The eight GGUF rows of record group g (its nrec records at src) into rows[r] = out + r * rb.
void unpack_group(const X8Format& f, const uint8_t* src, int64_t nrec, uint8_t* out, int64_t rb) {
  for (int64_t i = 0; i < nrec; ++i) {
    uint8_t* rows[kRows];
    for (int r = 0; r < kRows; ++r) rows[r] = out + r * rb + i * f.src_bytes;
    f.unpack(src + i * f.rec_bytes, rows);
  }
}

at::Tensor ggml_unpack_x8(const at::Tensor& wp, int64_t qtype, int64_t k) {
  check_packed(wp, qtype, k);
  const X8Format f = format_x8(qtype);
  const int64_t groups = wp.size(0), nrec = k / f.values, rb = nrec * f.src_bytes;
  at::Tensor out = at::empty({groups * kRows, rb}, wp.options());
  const uint8_t* src = wp.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) unpack_group(f, src + g * wp.size(1), nrec, dst + kRows * g * rb, rb);
  });
  return out;
}

// float32 [rows, k], the same values as dequantizing the GGUF blocks
at::Tensor ggml_dequant_x8(const at::Tensor& wp, int64_t qtype, int64_t k) {
  check_packed(wp, qtype, k);
  const X8Format f = format_x8(qtype);
  const int64_t groups = wp.size(0), nrec = k / f.values, rb = nrec * f.src_bytes;
  at::Tensor out = at::empty({groups * kRows, k}, wp.options().dtype(at::kFloat));
  const uint8_t* src = wp.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> buf(kRows * rb);
    for (int64_t g = g0; g < g1; ++g) {
      unpack_group(f, src + g * wp.size(1), nrec, buf.data(), rb);
      for (int r = 0; r < kRows; ++r) dequant_row(qtype, buf.data() + r * rb, dst + (kRows * g + r) * k, k);
    }
  });
  return out;
}

// float32 [T, k]: rows ids[t] of an x8 matrix (an embedding lookup), as ggml dequantizes them
at::Tensor ggml_embed_x8(const at::Tensor& wp, const at::Tensor& ids_in, int64_t qtype, int64_t k) {
  check_packed(wp, qtype, k);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous().view(-1);
  const X8Format f = format_x8(qtype);
  const int64_t nrec = k / f.values, rb = nrec * f.src_bytes, rows = wp.size(0) * kRows;
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < rows, "token id ", idp[t], " is outside the embedding's ", rows, " rows");
  at::Tensor out = at::empty({ids.numel(), k}, wp.options().dtype(at::kFloat));
  const uint8_t* src = wp.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, ids.numel(), 8, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> buf(kRows * rb);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = idp[t] / kRows, r = idp[t] % kRows;
      unpack_group(f, src + g * wp.size(1), nrec, buf.data(), rb);
      dequant_row(qtype, buf.data() + r * rb, dst + t * k, k);
    }
  });
  return out;
}

#ifdef PAGEDLLM_AVX2  // quantize_x needs it (a CPU without AVX2 runs the generic variant anyway)
// outs[j] = x @ W_j^T with one variant's kernels: x is quantized to int8 once, and the 8-row
// groups of all matrices are split over the threads together.
void linear_simd(const IsaVariant& isa, const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes, int64_t k,
                 std::vector<at::Tensor>& outs) {
  const int64_t m = x.size(0), nb = k / 32;
  struct Kernels {  // per weight, looked up once: the gemm and the kernels for 4, 2 and 1 x rows
    TypeKernels fns;
    int64_t nrec;
  };
  std::vector<Kernels> kernels;
  bool gemv = false, gemm = false;  // which layouts of x the kernels read
  // blocks per x scale: one quantized x serves the call, so its weights agree (ggml_common.h)
  const int64_t group = group_blocks(qtypes[0]);
  for (size_t j = 0; j < ws.size(); ++j) {
    TORCH_CHECK(group_blocks(qtypes[j]) == group, "ggml type ", qtypes[j], " cannot share an x8 call with type ",
                qtypes[0], ": their x is quantized with other groups of scales");
    TypeKernels fns = isa.kernels_for(qtypes[j]);
    TORCH_CHECK(fns.c1 != nullptr, "ggml type ", qtypes[j], " has no x8 kernel");
    if (m < kGemmRows) fns.many = nullptr;
    kernels.push_back({fns, k / format_x8(qtypes[j]).values});
    (fns.many ? gemm : gemv) = true;
  }
  // x quantized row-major for the gemv and block-major for the gemm (see XBlocks), in parallel:
  // at 512 rows of 4864 values this took ~10 % of a matmul on one thread
  // bq has 512 bytes of zeros after x and bd 16 floats after the scales: the AMX gemm reads whole
  // 16-row tiles of a block and their rows' scales, past the last row (ggml_x8_kernels.inc)
  const std::unique_ptr<int8_t[]> xq(new int8_t[gemv ? m * k : 0]), bq(new int8_t[gemm ? m * k + 512 : 0]);
  if (gemm) std::memset(bq.get() + m * k, 0, 512);
  const std::unique_ptr<float[]> xd(new float[gemv ? 2 * m * nb : 0]), bd(new float[gemm ? 2 * m * nb + 16 : 0]);
  const std::unique_ptr<int32_t[]> bh(new int32_t[gemm ? 2 * m * nb : 0]), xh(new int32_t[gemv ? 2 * m * nb : 0]);
  const XRows xr{xq.get(), xd.get(), xd.get() + m * nb, k, nb, xh.get()};
  const XBlocks xb{bq.get(), bd.get(), bd.get() + m * nb, bh.get(), m};
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, 65536 / k), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (gemv)
        quantize_x(xp + i * k, k, xq.get() + i * k, xd.get() + i * nb, xd.get() + m * nb + i * nb, xh.get() + 2 * i * nb,
                   32, 1, group);
      if (gemm)
        quantize_x(xp + i * k, k, bq.get() + 32 * i, bd.get() + i, bd.get() + m * nb + i, bh.get() + 2 * i, 32 * m, m,
                   group);
    }
  });
  struct Task {
    size_t w;
    int64_t group;
  };
  std::vector<Task> tasks;
  for (size_t j = 0; j < ws.size(); ++j)
    for (int64_t g = 0; g < ws[j].size(0); ++g) tasks.push_back({j, g});
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const int64_t grain = std::max<int64_t>(1, (ntasks + at::get_num_threads() - 1) / at::get_num_threads());
  // the gemm's chunks of x rows in the outer loop: a chunk (64 rows of up to ~5k values) stays in
  // the cache while a thread's weight groups stream past it
  const int64_t nchunks = gemm ? (m + kChunk - 1) / kChunk : 1;
  at::parallel_for(0, ntasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      for (int64_t ti = t0; ti < t1; ++ti) {
        const Task& task = tasks[ti];
        const at::Tensor& w = ws[task.w];
        const Kernels& kn = kernels[task.w];
        const int64_t n = w.size(0) * kRows;
        const uint8_t* rec = w.data_ptr<uint8_t>() + task.group * w.size(1);
        float* op = outs[task.w].data_ptr<float>() + task.group * kRows;
        const int64_t c0 = ch * kChunk, c1 = std::min(m, (ch + 1) * kChunk);
        // the next group of the same weight, in this thread's range: both in one pass
        if (kn.fns.many && kn.fns.many2 && ti + 1 < t1 && tasks[ti + 1].w == task.w) {
          kn.fns.many2(rec, rec + w.size(1), kn.nrec, xb, c0, c1, op, n);
          ++ti;
          continue;
        }
        if (kn.fns.many) {
          kn.fns.many(rec, kn.nrec, xb, c0, c1, op, n);
          continue;
        }
        if (ch > 0) continue;  // the gemv took every row in the first pass
        for (int64_t i = 0; i < m;) {
          const int cols = m - i >= 4 ? 4 : (m - i >= 2 ? 2 : 1);
          const GemvFn fn = cols == 4 ? kn.fns.c4 : (cols == 2 ? kn.fns.c2 : kn.fns.c1);
          fn(rec, kn.nrec, XRows{xr.q + i * k, xr.d + i * nb, xr.s + i * nb, k, nb, xr.h + 2 * i * nb}, op + i * n, n);
          i += cols;
        }
      }
    }
  });
}
#endif

// y_j = x @ W_j^T for x8 weights W_j sharing one input x [M, K], by the variant this process runs
std::vector<at::Tensor> ggml_linear_x8(const at::Tensor& x_in, at::TensorList ws, at::IntArrayRef qtypes, int64_t k) {
  TORCH_CHECK(ws.size() == qtypes.size() && !ws.empty(), "need one qtype per weight");
  if (qtypes[0] == kBF16) {  // a float checkpoint's matrices (x8_bf16.cpp): all of one call are BF16
    for (int64_t t : qtypes) TORCH_CHECK(t == kBF16, "BF16 x8 weights cannot share a call with ggml type ", t);
    return pagedllm_bf16::linear_x8(x_in, ws, k);
  }
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k && k % 32 == 0, "x must be [M, ", k, "]");
  for (size_t j = 0; j < ws.size(); ++j) check_packed(ws[j], qtypes[j], k);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  std::vector<at::Tensor> outs;
  for (const at::Tensor& w : ws) outs.push_back(at::empty({x.size(0), w.size(0) * kRows}, x.options()));
  const IsaVariant& isa = active_isa();  // one variant for the whole call (see ggml_x8_isa.h)
#ifdef PAGEDLLM_AVX2
  if (isa.q8_bf16_tiles && x.size(0) >= kQ8TileRows) {  // Q8_0 on the bf16 tiles, the rest as avx512amx
    std::vector<at::Tensor> tw, to, iw, io;
    std::vector<int64_t> it;
    for (size_t j = 0; j < ws.size(); ++j) {
      const bool tile = qtypes[j] == kQ8_0;
      (tile ? tw : iw).push_back(ws[j]);
      (tile ? to : io).push_back(outs[j]);
      if (!tile) it.push_back(qtypes[j]);
    }
    if (!tw.empty()) pagedllm_bf16::amx_q8_linear(x, tw, k, to);
    if (!iw.empty()) linear_simd(isa, x, iw, it, k, io);
    return outs;
  }
  if (isa.kernels_for != nullptr) {
    linear_simd(isa, x, ws, qtypes, k, outs);
    return outs;
  }
#endif
  for (size_t j = 0; j < ws.size(); ++j) outs[j] = at::matmul(x, ggml_dequant_x8(ws[j], qtypes[j], k).t());
  return outs;
}

// act(x @ W_0^T) * (x @ W_1^T) for a gate and an up matrix (act: silu, or gelu_tanh with gelu): BF16
// ones in one pass (pagedllm_bf16::gated_x8), the block types through linear_x8 and the op; the
// same bits either way
at::Tensor ggml_gated_x8(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes, int64_t k, bool gelu,
                         bool bf16_out) {
  TORCH_CHECK(ws.size() == 2 && qtypes.size() == 2, "need a gate and an up weight, each with its qtype");
  if (qtypes[0] == kBF16 && qtypes[1] == kBF16) return pagedllm_bf16::gated_x8(x, ws[0], ws[1], k, gelu, bf16_out);
  const std::vector<at::Tensor> gu = ggml_linear_x8(x, ws, qtypes, k);
  return gelu ? pagedllm_ops::gelu_tanh_mul(gu[0], gu[1]) : pagedllm_ops::silu_mul(gu[0], gu[1]);
}

}  // namespace

at::Tensor pagedllm_ggml::gated_x8(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes, int64_t k,
                                   bool gelu, bool bf16_out) {
  return ggml_gated_x8(x, ws, qtypes, k, gelu, bf16_out);
}

std::vector<at::Tensor> pagedllm_ggml::linear_x8(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes,
                                                 int64_t k) {
  return ggml_linear_x8(x, ws, qtypes, k);
}

bool pagedllm_ggml::q8_int_linear(const at::Tensor& x, const at::Tensor& wq, int64_t k, at::Tensor& out,
                                  at::Tensor& xt) {
#ifdef PAGEDLLM_AVX2
  const IsaVariant& isa = active_isa();
  if (isa.kernels_for == nullptr) return false;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == k && k % 32 == 0,
              "x must be a contiguous float32 [M, ", k, "] with k a multiple of 32");
  check_packed(wq, kQ8_0, k);
  const int64_t m = x.size(0), nb = k / 32;
  std::vector<at::Tensor> outs{at::empty({m, wq.size(0) * kRows}, x.options())};
  linear_simd(isa, x, {wq}, {kQ8_0}, k, outs);
  out = outs[0];
  // x as linear_simd's quantize_x made it (the same call here): d q per 32 values
  xt = at::empty({m, k}, x.options());
  const float* xp = x.data_ptr<float>();
  float* tp = xt.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int8_t> q(k);
    std::vector<float> d(nb), s(nb);
    for (int64_t i = i0; i < i1; ++i) {
      quantize_x(xp + i * k, k, q.data(), d.data(), s.data(), nullptr, 32, 1, 1);
      for (int64_t j = 0; j < k; ++j) tp[i * k + j] = d[j / 32] * static_cast<float>(q[j]);
    }
  });
  return true;
#else
  (void)x, (void)wq, (void)k, (void)out, (void)xt;
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("ggml_pack_x8(Tensor w, int qtype, int k) -> Tensor");
  m.def("ggml_unpack_x8(Tensor w, int qtype, int k) -> Tensor");
  m.def("ggml_dequant_x8(Tensor w, int qtype, int k) -> Tensor");
  m.def("ggml_embed_x8(Tensor w, Tensor ids, int qtype, int k) -> Tensor");
  m.def("ggml_linear_x8(Tensor x, Tensor[] ws, int[] qtypes, int k) -> Tensor[]");
  m.def("ggml_gated_x8(Tensor x, Tensor[] ws, int[] qtypes, int k, bool gelu, bool bf16_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("ggml_pack_x8", &ggml_pack_x8);
  m.impl("ggml_unpack_x8", &ggml_unpack_x8);
  m.impl("ggml_dequant_x8", &ggml_dequant_x8);
  m.impl("ggml_embed_x8", &ggml_embed_x8);
  m.impl("ggml_linear_x8", &ggml_linear_x8);
  m.impl("ggml_gated_x8", &ggml_gated_x8);
}
