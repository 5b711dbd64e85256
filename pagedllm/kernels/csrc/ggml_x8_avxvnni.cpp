// The AVX-VNNI variant of the x8 kernels (ggml_x8_isa.h): the VEX vpdpbusd of Alder Lake and later
// Intel cores and of Zen 5, for CPUs with AVX-VNNI but not AVX-512 (16 ymm registers). Compilers
// know it from gcc 11 and clang 12; with an older one the variant is left out of the build.
// The target adds to -march=native (the headers' intrinsics carry its flags): built on a CPU with
// AVX-512 this variant may use EVEX encodings too, which is right because a build serves one CPU
// (its key holds the CPU flags), and a CPU lacking AVX-VNNI never runs it.
#include <immintrin.h>

#include <cstring>

#include "ggml_x8_isa.h"
#include "ggml_x8_layout.h"

#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif
#define PAGEDLLM_X8_DPBUSD(acc, u8, i8) _mm256_dpbusd_avx_epi32(acc, u8, i8)

namespace pagedllm_ggml::x8::isa_avxvnni {
#include "ggml_x8_kernels.inc"
bool compiled() { return true; }
}  // namespace pagedllm_ggml::x8::isa_avxvnni

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // the compiler cannot emit AVX-VNNI
namespace pagedllm_ggml::x8::isa_avxvnni {
TypeKernels kernels_for(int64_t) { return {}; }
bool compiled() { return false; }
}  // namespace pagedllm_ggml::x8::isa_avxvnni
#endif
