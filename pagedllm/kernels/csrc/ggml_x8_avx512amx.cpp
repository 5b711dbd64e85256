// The AVX512-AMX variant of the x8 kernels (ggml_x8_isa.h): the avx512vnni kernels, with Q8_0's
// gemm (chunks of 32 x rows and more) on the AMX-INT8 tiles (tdpbssd; Sapphire Rapids and later). A tile's
// int32 sums are the vpdpbusd kernels' integers, so the numbers are avx512vnni's bit for bit.
// Q8_0 is the format of `quantization="int8"` and of Q8_0 GGUFs; the other types keep their
// vpdpbusd kernels here. Compilers know the tile instructions from gcc 11 and clang 12; with an
// older one the variant is left out of the build. The process asks the kernel for the tile data
// permission (arch_prctl) before the variant counts as runnable.
#include <immintrin.h>

#include <cstring>
#include <string>

#include "ggml_x8_isa.h"
#include "ggml_x8_layout.h"
#include "kernels.h"

#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define PAGEDLLM_X8_AMX_BUILT 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")
#endif
#define PAGEDLLM_X8_DPBUSD(acc, u8, i8) _mm256_dpbusd_epi32(acc, u8, i8)
#define PAGEDLLM_X8_ZMM 1
#define PAGEDLLM_X8_AMX 1

namespace pagedllm_ggml::x8::isa_avx512amx {
#include "ggml_x8_kernels.inc"
}  // namespace pagedllm_ggml::x8::isa_avx512amx

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else  // the compiler cannot emit the tile instructions
namespace pagedllm_ggml::x8::isa_avx512amx {
TypeKernels kernels_for(int64_t) { return {}; }
}  // namespace pagedllm_ggml::x8::isa_avx512amx
#endif

namespace pagedllm_ggml::x8::isa_avx512amx {

std::string missing() {
#ifndef PAGEDLLM_X8_AMX_BUILT
  return "a compiler that emits AMX (gcc 11 or clang 12 and later)";
#else
  return pagedllm_amx::tile_permission() ? "" : "amx_tile (the kernel refused the tile data permission)";
#endif
}

}  // namespace pagedllm_ggml::x8::isa_avx512amx
