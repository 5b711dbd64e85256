// The AVX512-VNNI variant of the x8 kernels (ggml_x8_isa.h): vpdpbusd on ymm registers (EVEX,
// AVX512VL), one instruction per quad for AVX2's maddubs + madd + add, and 32 ymm registers.
#include <immintrin.h>

#include <cstring>

#include "ggml_x8_isa.h"
#include "ggml_x8_layout.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#endif
#define PAGEDLLM_X8_DPBUSD(acc, u8, i8) _mm256_dpbusd_epi32(acc, u8, i8)
#define PAGEDLLM_X8_ZMM 1  // and zmm kernels that take two weight groups at once

namespace pagedllm_ggml::x8::isa_avx512vnni {
#include "ggml_x8_kernels.inc"
}  // namespace pagedllm_ggml::x8::isa_avx512vnni

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
