// The ceiling of the int8 kernels' inner loop on this CPU: independent chains of
// broadcast + maddubs + 16-bit add, as the x8 gemm issues them.
//
//   g++ -O3 -march=native benchmarks/maddubs_peak.cpp -o /tmp/maddubs_peak
//   /tmp/maddubs_peak; (/tmp/maddubs_peak & /tmp/maddubs_peak; wait)   # one copy, then two at once
//
// On the project's 2-vCPU machine one copy ran 3.1-3.8 G maddubs/s, and two copies at once
// 1.2-1.9x that together, depending on the run (the vCPUs are sometimes two threads of one
// core). Each maddubs is 32 multiply-adds: ~245-410 G int8 ops/s for both threads.
//
// It then times the instructions alone (register operands, no loads): maddubs by itself, and
// maddubs interleaved one to one with 16-bit adds. On that machine maddubs alone ran ~6.2 G/s
// (two a cycle) and with an add each 3.5-4.4 G/s: the adds, broadcasts and float updates around
// the multiplies share the same vector pipes, which is what bounds the kernels.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

alignas(32) int8_t buf[4096];

// 8 independent instructions per loop on register operands; with_adds: 4 maddubs and 4 adds.
// Returns G maddubs per second.
#define TIMED_LOOP(INSTRUCTIONS)                                                                      \
  for (long i = 0; i < n; i++)                                                                        \
    __asm__ volatile(INSTRUCTIONS                                                                     \
                     : [r0] "=x"(r0), [r1] "=x"(r1), [r2] "=x"(r2), [r3] "=x"(r3), [r4] "=x"(r4),     \
                       [r5] "=x"(r5), [r6] "=x"(r6), [r7] "=x"(r7)                                    \
                     : [a] "x"(a0), [b] "x"(a1), [x] "x"(x0));
double alone(bool with_adds) {
  const __m256i a0 = _mm256_set1_epi8(1), a1 = _mm256_set1_epi8(2), x0 = _mm256_set1_epi8(3);
  __m256i r0, r1, r2, r3, r4, r5, r6, r7;
  const long n = 100000000;
  const auto t0 = std::chrono::steady_clock::now();
  if (with_adds) {
    TIMED_LOOP("vpmaddubsw %[x], %[a], %[r0]\n\tvpaddw %[x], %[b], %[r1]\n\t"
               "vpmaddubsw %[x], %[b], %[r2]\n\tvpaddw %[x], %[a], %[r3]\n\t"
               "vpmaddubsw %[a], %[b], %[r4]\n\tvpaddw %[a], %[b], %[r5]\n\t"
               "vpmaddubsw %[b], %[a], %[r6]\n\tvpaddw %[b], %[a], %[r7]\n\t")
  } else {
    TIMED_LOOP("vpmaddubsw %[x], %[a], %[r0]\n\tvpmaddubsw %[x], %[b], %[r1]\n\t"
               "vpmaddubsw %[a], %[b], %[r2]\n\tvpmaddubsw %[b], %[a], %[r3]\n\t"
               "vpmaddubsw %[x], %[a], %[r4]\n\tvpmaddubsw %[x], %[b], %[r5]\n\t"
               "vpmaddubsw %[a], %[b], %[r6]\n\tvpmaddubsw %[b], %[a], %[r7]\n\t")
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return n * (with_adds ? 4 : 8) / s / 1e9;
}

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
  std::printf("alone: %.2f G maddubs/s; one add each: %.2f G maddubs/s\n", alone(false), alone(true));
}
