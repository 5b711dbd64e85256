// The ceiling of the int8 kernels' inner loop on this CPU: independent chains of
// broadcast + maddubs + 16-bit add, as the x8 gemm issues them.
//
//   g++ -O3 -march=native benchmarks/maddubs_peak.cpp -o /tmp/maddubs_peak
//   /tmp/maddubs_peak; (/tmp/maddubs_peak & /tmp/maddubs_peak; wait)   # one copy, then two at once
//
// On the project's 2-vCPU machine one copy ran 3.1-3.8 G maddubs/s, and two copies at once
// 1.2-1.9x that together, depending on the run (the vCPUs are sometimes two threads of one
// core). Each maddubs is 32 multiply-adds: ~245-410 G int8 ops/s for both threads.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

alignas(32) int8_t buf[4096];

int main(int argc, char**) {
  for (int i = 0; i < 4096; i++) buf[i] = static_cast<int8_t>(i * 7 + argc);
  __m256i acc[8];
  for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
  const long n_iter = 20000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < n_iter; n++) {
    const int8_t* p = buf + (n & 63) * 32;
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32));
    const int32_t* x32 = reinterpret_cast<const int32_t*>(buf);
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
      acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(i & 1 ? w1 : w0, _mm256_set1_epi32(x32[i + (n & 7)])));
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
      acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(i & 1 ? w0 : w1, _mm256_set1_epi32(x32[i + 8 + (n & 7)])));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m256i r = acc[0];
  for (int i = 1; i < 8; i++) r = _mm256_add_epi16(r, acc[i]);
  std::printf("%.2f G maddubs/s (checksum %d)\n", n_iter * 16 / s / 1e9, _mm256_extract_epi16(r, 0));
}
