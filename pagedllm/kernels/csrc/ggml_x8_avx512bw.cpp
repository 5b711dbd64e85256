// The AVX-512BW variant of the x8 kernels (ggml_x8_isa.h), for AVX-512 CPUs without VNNI
// (Skylake-SP, the first cloud AVX-512 Xeons): AVX2's maddubs -> madd on ymm registers for a few
// x rows, and for many the zmm kernels that take two weight groups at once with 512-bit maddubs
// (ggml_x8_kernels.inc, PAGEDLLM_X8_ZMM without PAGEDLLM_X8_DPBUSD). The same integers as avx2.
#include <immintrin.h>

#include <cstring>

#include "ggml_x8_isa.h"
#include "ggml_x8_layout.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")
#endif
#define PAGEDLLM_X8_ZMM 1  // zmm kernels that take two weight groups at once

namespace pagedllm_ggml::x8::isa_avx512bw {
#include "ggml_x8_kernels.inc"
}  // namespace pagedllm_ggml::x8::isa_avx512bw

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
