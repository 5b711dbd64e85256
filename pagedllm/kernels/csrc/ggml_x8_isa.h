// The x8 matmul kernels come in one variant per instruction set, all in one build; which one runs
// is chosen when the process first multiplies (ggml_x8_isa.cpp), from the CPU's own features or
// PAGEDLLM_KERNEL_ISA. Every variant computes the same int32 dot per block and makes the same
// float updates in the same order, so each output row is the same bit for bit whichever runs.
//
//   variant      translation unit          inner integer dot of a quad (4 u8 x 4 i8 -> i32)
//   avx2         ggml_x8_avx2.cpp           maddubs (i16 pairs, summed in i16) -> madd -> add
//   avx512vnni   ggml_x8_avx512vnni.cpp     vpdpbusd ymm (EVEX: AVX512-VNNI + VL), 32 ymm registers
//   avx512bw     ggml_x8_avx512bw.cpp       AVX2's maddubs; for many x rows 512-bit maddubs on two groups
//   avxvnni      ggml_x8_avxvnni.cpp        vpdpbusd ymm (VEX: AVX-VNNI, Alder Lake, Zen 5)
//   avx512amx    ggml_x8_avx512amx.cpp      avx512vnni's; Q8_0's gemm from 32 rows on the AMX-INT8 tiles
//
// One variant leaves the integers: avx512amx_bf16 runs avx512amx's kernels, except Q8_0 from
// kQ8TileRows x rows on, which goes to the AMX-BF16 tiles with x rounded to bf16 (q8_bf16_tiles).
// Its Q8_0 numbers are those of bf16(x) times bf16(q d) in float32 sums, not avx2's.
//   generic      -                          none: dequantize to float32, then at::matmul
#pragma once

#include <cstdint>
#include <string>

namespace pagedllm_ggml {
namespace x8 {

struct XRows {  // x row-major, for the gemv
  const int8_t* q;  // row c at q + c * k
  const float* d;   // row c at d + c * nb (x's scale per 32 values)
  const float* s;   // dx * sum(xq) per 32 values
  int64_t k, nb;
  const int32_t* h;  // 32 x the sums of q over values 0-15 and 16-31 of block b of row c at
                     // h[2 * (c * nb + b)] and the next int (Q2_K, Q3_K, IQ4_NL, IQ4_XS)
};

struct XBlocks {  // x block-major, for the gemm: block b of x row c at q + 32 * (b * m + c); d, s at b * m + c
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* h;  // 32 x the sums of q over values 0-15 and 16-31 of a block at h[2 * (b * m + c)] (Q6_K)
  int64_t m;
};

constexpr int64_t kChunk = 64;    // x rows per pass of the gemm over a weight group
constexpr int64_t kGemmRows = 8;  // from this many x rows on, the gemm (where the type has one)

// out[c * ldo + r] = dot(weight row r, x row c) for the 8 rows of nrec records at w
using GemvFn = void (*)(const uint8_t* w, int64_t nrec, const XRows& x, float* out, int64_t ldo);
// the same for x rows c0 <= c < c1 (c1 - c0 <= kChunk)
using GemmFn = void (*)(const uint8_t* w, int64_t nrec, const XBlocks& x, int64_t c0, int64_t c1, float* out,
                        int64_t ldo);

// the gemm of two weight groups at once (records at w0 and w1; out: their 16 columns)
using GemmPairFn = void (*)(const uint8_t* w0, const uint8_t* w1, int64_t nrec, const XBlocks& x, int64_t c0,
                            int64_t c1, float* out, int64_t ldo);

struct TypeKernels {  // one ggml type's kernels in one variant; null where it has none
  GemmFn many;        // kGemmRows x rows and more
  GemvFn c4, c2, c1;  // 4, 2 and 1 x rows
  GemmPairFn many2;   // many for two adjacent groups at once (AVX-512 variants)
};

// Each variant's translation unit defines its namespace's kernels_for (null kernels for a type
// without x8 kernels).
namespace isa_avx2 { TypeKernels kernels_for(int64_t qtype); }
namespace isa_avx512vnni { TypeKernels kernels_for(int64_t qtype); }
namespace isa_avx512bw { TypeKernels kernels_for(int64_t qtype); }
namespace isa_avx512amx {
TypeKernels kernels_for(int64_t qtype);
std::string missing();  // past the CPU features (the variant's needs): "" when the build and the tile permission allow it
}  // namespace isa_avx512amx
namespace isa_avxvnni {
TypeKernels kernels_for(int64_t qtype);
bool compiled();  // false where the compiler cannot emit AVX-VNNI
}  // namespace isa_avxvnni

struct IsaVariant {
  const char* name;
  const char* needs;  // the CPU features it executes, as /proc/cpuinfo spells them
  TypeKernels (*kernels_for)(int64_t qtype);  // null: the generic fallback
  // Q8_0 from kQ8TileRows x rows on: on the AMX-BF16 tiles, x rounded to bf16 and each block
  // dequantized to bf16 (pagedllm_bf16::amx_q8_linear), not the integer dot and float update
  bool q8_bf16_tiles = false;
};

constexpr int64_t kQ8TileRows = 16;

// The variant this process runs (chosen once, on first use; a forced one the CPU cannot execute
// is an error naming the missing feature).
const IsaVariant& active_isa();

}  // namespace x8
}  // namespace pagedllm_ggml
