// The AVX2 variant of the x8 kernels (ggml_x8_isa.h): the baseline, AVX2 + FMA + F16C only.
// -march=native may have switched AVX-512 on for the whole build; it is off for this whole file,
// headers included (so that their intrinsics inline here), which makes this the code an AVX2-only
// CPU runs (VEX encodings, 16 ymm registers), also when forced on a newer one.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,no-avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,no-avx512f")
#endif

#include <immintrin.h>

#include <cstring>

#include "ggml_x8_isa.h"
#include "ggml_x8_layout.h"

namespace pagedllm_ggml::x8::isa_avx2 {
#include "ggml_x8_kernels.inc"
}  // namespace pagedllm_ggml::x8::isa_avx2

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
