// The float32 FMA ceiling of this CPU: independent chains of 512-bit (else 256-bit) vfmadd on
// register operands, on 1 thread and then on 2 threads at once.
//
//   g++ -O3 -march=native -pthread benchmarks/fp32_fma_peak.cpp -o /tmp/fp32_fma_peak
//   /tmp/fp32_fma_peak            # G FMA instructions/s and GFLOP/s (2 per lane), 1 then 2 threads
//
// 2-vCPU AMD EPYC Zen 4 (AVX-512 BF16, no AMX), quiet, best of 3, 2026-12-02: 3.53 G FMA/s (113 GFLOP/s)
// on 1 thread, 7.12 G/s (228 GFLOP/s) on 2 (docs/performance.md)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "peak_driver.h"

#if defined(__AVX512F__)
using vec = __m512;
constexpr int kLanes = 16;
static inline vec splat(float x) { return _mm512_set1_ps(x); }
static inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float first(vec v) { return _mm512_cvtss_f32(v); }
#else
using vec = __m256;
constexpr int kLanes = 8;
static inline vec splat(float x) { return _mm256_set1_ps(x); }
static inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float first(vec v) { return _mm256_cvtss_f32(v); }
#endif

constexpr int kChains = 12;  // > latency (4) x pipes (2): every FMA pipe stays busy
constexpr long kIters = 200000000;

// One thread's run; returns its FMA instructions per second.
static double run_one(float seed, float* sink) {
  vec acc[kChains];
  for (int i = 0; i < kChains; i++) acc[i] = splat(seed + i);
  const vec a = splat(0.999999f), b = splat(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; n++) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; i++) acc[i] = fma(acc[i], a, b);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float r = 0;
  for (int i = 0; i < kChains; i++) r += first(acc[i]);
  *sink = r;
  return kIters * kChains / s;
}

int main() {
  for (int threads : {1, 2}) {
    const double rate = run_threads(threads, run_one);
    std::printf("%d thread(s): %.2f G fp32 FMA/s (%d lanes) = %.0f GFLOP/s\n", threads,
                rate / 1e9, kLanes, rate * kLanes * 2 / 1e9);
  }
}
