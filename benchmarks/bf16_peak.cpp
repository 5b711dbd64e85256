// The bf16 dot-product ceiling of this CPU: independent chains of vdpbf16ps zmm (AVX512-BF16:
// 32 bf16 pairs multiplied and summed into 16 float32 lanes) on register operands, on 1 thread
// and then 2 at once. Skips, saying so, where the CPU lacks AVX512-BF16.
//
//   g++ -O3 -mavx512f -mavx512bf16 -pthread benchmarks/bf16_peak.cpp -o /tmp/bf16_peak
//   /tmp/bf16_peak                # G vdpbf16ps/s and GFLOP/s (64 per instruction), 1 then 2 threads
//
// The flags only let the compiler emit the instruction; the program checks the CPU first
// (exit status 0 and a "skipped" line without AVX512-BF16, so scripts can run it anywhere).
//
// 2-vCPU AMD EPYC Zen 4 (AVX-512 BF16, no AMX), quiet, best of 3, 2026-12-02: 3.60 G/s (230 GFLOP/s)
// on 1 thread, 7.06 G/s (452 GFLOP/s) on 2; busy, 2 threads got as little as 1.74 G/s
#include <immintrin.h>

#include <chrono>
#include <cstdio>

#include "peak_driver.h"

constexpr int kChains = 16;  // more than latency x throughput of the instruction on any core
constexpr long kIters = 100000000;

// One thread's run; returns its vdpbf16ps per second.
static double run_one(float seed, float* sink) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; i++) acc[i] = _mm512_set1_ps(seed + i);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3380);  // bf16 ~6e-8
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; n++) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float r = 0;
  for (int i = 0; i < kChains; i++) r += _mm512_cvtss_f32(acc[i]);
  *sink = r;
  return kIters * kChains / s;
}

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::printf("skipped: this CPU has no AVX512-BF16 (vdpbf16ps)\n");
    return 0;
  }
  for (int threads : {1, 2}) {
    const double rate = run_threads(threads, run_one);
    std::printf("%d thread(s): %.2f G vdpbf16ps/s = %.0f GFLOP/s (32 multiply-adds each)\n",
                threads, rate / 1e9, rate * 64 / 1e9);
  }
}
