// The two-group Q8_0 gemm's inner structure (ggml_x8_kernels.inc, gemm2_q8_0) as a timing loop,
// to see what bounds it: four x rows' vpdpbusd chains side by side over a record's 8 weight
// registers, then each row's float update (convert, scale product, fused multiply-add into its
// accumulator in memory). Prints G vpdpbusd/s on one thread for:
//   regs          the weights already in registers (no loads): the structure's own ceiling
//   regs-noscale  the same with the update reduced to convert + add (what the scale product costs)
//   buffer MB     each record's weights loaded (and made unsigned and joined) from a buffer of
//                 that size, in order, as the kernel streams them: from L2, L3 or memory
//   ahead N       from memory (228 MB), each stream's records asked for N bytes ahead
//                 (prefetcht0; within a row's last N bytes, the same stream's next pair, as
//                 gemm2_q8_0's prefetch_pair), best of 5 rounds: the kernel's kAheadGemm
//
//   g++ -O3 -march=native benchmarks/q8_gemm_loop.cpp -o /tmp/q8_gemm_loop && /tmp/q8_gemm_loop
//
// Needs AVX512-VNNI. A zmm vpdpbusd is 64 multiply-adds: G/s x 64 = G multiply-adds/s.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int kRows = 32, kRec = 272, kNrec = 28;  // 32 x rows; Q8_0 records of 8 rows; K = 896
alignas(64) int8_t x[kNrec * kRows * 32];
alignas(64) int32_t start[kRows];
alignas(64) float xd[kRows];
alignas(64) float acc[kRows * 16];

inline __m512i bcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// the rows of one record against weights v, scale d
template <bool kScale>
inline void rows(const __m512i* v, __m512 d, const int8_t* xq) {
  for (int c = 0; c < kRows; c += 4) {
    __m512i dot[4];
    for (int i = 0; i < 4; ++i) dot[i] = _mm512_set1_epi32(start[c + i]);
    for (int q = 0; q < 8; ++q)
      for (int i = 0; i < 4; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], v[q], bcast(xq + 32 * (c + i) + 4 * q));
    for (int i = 0; i < 4; ++i) {
      float* a = acc + 16 * (c + i);
      const __m512 f = _mm512_cvtepi32_ps(dot[i]);
      _mm512_store_ps(a, kScale ? _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(xd[c + i])), _mm512_load_ps(a))
                                : _mm512_add_ps(f, _mm512_load_ps(a)));
    }
  }
}

template <bool kScale>
double in_registers(int64_t records) {
  __m512i v[8];
  for (int q = 0; q < 8; ++q) v[q] = _mm512_set1_epi32(0x01020304 + q);
  const __m512 d = _mm512_set1_ps(1.0001f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t b = 0; b < records; ++b) {
    for (int q = 0; q < 8; ++q) asm volatile("" : "+v"(v[q]));  // a new record, as far as the compiler knows
    rows<kScale>(v, d, x + kRows * 32 * (b % kNrec));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(records) * kRows * 8 / s / 1e9;
}

// pairs of 8-row groups (g, g + 1), each group a row of kNrec records, streamed in order
double from_buffer(const uint8_t* w, int64_t groups, int reps, int64_t ahead = 0) {
  const int64_t row = kNrec * kRec;
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  const auto load32 = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r)
    for (int64_t g = 0; g < groups; g += 2) {
      const uint8_t* w0 = w + g * row;
      const uint8_t* w1 = w0 + row;
      const uint8_t* const s0 = w0;
      const uint8_t* const s1 = w1;
      for (int64_t b = 0; b < kNrec; ++b, w0 += kRec, w1 += kRec) {
        if (ahead > 0) {
          const int64_t at = b * kRec + ahead;
          for (const uint8_t* s : {s0, s1}) {
            const uint8_t* p = at < row ? s + at : s + row + at;
            for (int64_t l = 0; l < kRec; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T0);
          }
        }
        const __m512 d = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(load32(w0)), load32(w1), 1));
        __m512i v[8];
        for (int q = 0; q < 8; ++q)
          v[q] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_xor_si256(load32(w0 + 16 + 32 * q), bias)),
                                    _mm256_xor_si256(load32(w1 + 16 + 32 * q), bias), 1);
        rows<true>(v, d, x + kRows * 32 * b);
      }
    }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(reps) * groups / 2 * kNrec * kRows * 8 / s / 1e9;
}

}  // namespace

int main() {
  for (int i = 0; i < kRows; ++i) xd[i] = 0.01f;
  std::printf("regs %.2f  regs-noscale %.2f G vpdpbusd/s\n", in_registers<true>(600000),
              in_registers<false>(600000));
  for (const int64_t groups : {16, 130, 1216, 30000}) {  // 0.1, 1, 9.3, 228 MB
    const size_t bytes = static_cast<size_t>(groups) * kNrec * kRec;
    auto* w = static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    std::memset(w, 0x3c, bytes);  // scales read as normal floats (0x3c3c3c3c: ~0.0115)
    const int reps = static_cast<int>(std::max<int64_t>(1, 40000000 / (groups * kNrec * kRows * 8)));
    std::printf("buffer %.1f MB %.2f G vpdpbusd/s\n", bytes / 1e6, from_buffer(w, groups, reps));
    if (groups == 30000) {
      const int64_t aheads[] = {0, 1024, 2048, 4096, 8192};
      double best[5] = {0, 0, 0, 0, 0};
      for (int r = 0; r < 5; ++r)
        for (int i = 0; i < 5; ++i) best[i] = std::max(best[i], from_buffer(w, groups, 1, aheads[i]));
      for (int i = 0; i < 5; ++i) std::printf("ahead %ld %.2f G vpdpbusd/s\n", static_cast<long>(aheads[i]), best[i]);
    }
    std::free(w);
  }
}
