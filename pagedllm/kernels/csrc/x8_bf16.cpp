// bf16 weight matrices regrouped eight rows at a time, and their float32-activation matmuls:
// ggml type BF16 (30) in the x8 family. ggml_linear_x8 and the decode stack dispatch a BF16
// weight here (pagedllm_bf16::linear_x8), with the variant chosen once per process from the CPU's
// features, or forced by PAGEDLLM_BF16_KERNEL / the set_bf16_kernel op; one this CPU cannot run
// is an error naming the missing feature.
//
// Record of a quad q (4 values) of 8 rows, 64 bytes: byte 64q + 8r + 2v = bf16 w[r][4q + v].
// As 16 dwords, dword 2r + j is the pair (w[r][4q + 2j], w[r][4q + 2j + 1]), which is what
// vdpbf16ps multiplies by a broadcast 64-bit x quad: lane (r, j) accumulates
//   acc += w_odd * x_odd; acc += w_even * x_even       (odd element first, as the SDM says)
// and out[r] = lane (r, 0) + lane (r, 1). The FMA variants widen the same dwords (high half:
// and 0xffff0000, low half: << 16) and do the same two steps with fmadd in the same order, so
// the variants differ only in x: vdpbf16ps takes x rounded to bf16 (RNE, once per call) and
// flushes denormals; the FMA variants keep x in float32.
//
//   variant      needs                         per quad and x row
//   amx          avx512bf16 + amx_bf16 and     below kAmxMinRows x rows: avx512bf16; from there on
//                the kernel's leave to use      tiles: 32 x rows by 32 weight rows a pass (2 x 2
//                the tile registers             tdpbf16ps), the weights regrouped per tile on the fly
//   avx512bf16   avx512f avx512_bf16           1 vdpbf16ps zmm
//   avx512f      avx512f                       2 widenings, 2 vfmadd zmm
//   avx2         avx2 fma                      4 widenings, 4 vfmadd ymm (rows 0-3, 4-7); compiled
//                                              for the build's -march=native (may be EVEX-encoded here)
//   scalar       -                             the model of each of the above, std::fma
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ggml_x8_layout.h"
#include "kernels.h"
#include "simd.h"

namespace {

constexpr int kRows = 8;
constexpr int kMaxCols = 4;  // x rows sharing one pass over a weight group

inline uint16_t bf16_rne(float f) {  // float -> bf16, round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float widen(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// x prepared once per call: bf16 rows (dp) or float32 rows with each quad as x0 x2 x1 x3 (FMA:
// the low pair at 4q, the high pair at 4q + 2, each one 64-bit broadcast). In tensors from
// at::empty, every value written before it is read: a std::vector's resize zeroed them first
// (a memset of the whole x, 17 % of a 32-row call on 64 weight rows, ~10 MB a prompt's down
// projection)
struct XPrep {
  at::Tensor buf;
  const uint16_t* bf = nullptr;
  const float* perm = nullptr;
};

// n values of x as the FMA variants read them (XPrep::perm): each quad as x0 x2 x1 x3
inline void fma_quads(const float* x, float* out, int64_t n) {
  static const int kPerm[4] = {0, 2, 1, 3};
  for (int64_t i = 0; i < n; i += 4)
    for (int e = 0; e < 4; ++e) out[i + e] = x[i + kPerm[e]];
}

using GroupFn = void (*)(const uint8_t* rec, int64_t nq, const XPrep& x, int64_t k, int64_t c0, int64_t cols,
                         float* out, int64_t ldo);

// --- scalar models ------------------------------------------------------------------------
// x values as the variant sees them: bf16-rounded (dp model) or float32 (FMA model)
template <bool kBf16X>
void group_scalar(const uint8_t* rec, int64_t nq, const XPrep& x, int64_t k, int64_t c0, int64_t cols, float* out,
                  int64_t ldo) {
  for (int64_t c = c0; c < c0 + cols; ++c)
    for (int r = 0; r < kRows; ++r) {
      float acc[2] = {0.f, 0.f};
      for (int64_t q = 0; q < nq; ++q)
        for (int j = 0; j < 2; ++j) {
          uint16_t w[2];
          std::memcpy(w, rec + 64 * q + 8 * r + 4 * j, 4);
          for (int e = 1; e >= 0; --e) {  // odd element first
            const int64_t i = 4 * q + 2 * j + e;
            const float xv = kBf16X ? widen(x.bf[c * k + i]) : x.perm[c * k + 4 * q + 2 * e + j];
            acc[j] = std::fma(widen(w[e]), xv, acc[j]);
          }
        }
      out[c * ldo + r] = acc[0] + acc[1];
    }
}

inline void store_pairs(const float* lanes, float* out) {  // 16 lanes (r, j) -> 8 rows
  for (int r = 0; r < kRows; ++r) out[r] = lanes[2 * r] + lanes[2 * r + 1];
}

// --- AVX-512 BF16 ------------------------------------------------------------------------
// Blocks of G groups (8 G weight rows) by C x rows: lane (r, j) of each (group, row) adds its
// quads in order by vdpbf16ps, then lane 0 + lane 1 is row r (as store_pairs adds), so a row's
// bits are scalar_dp's whatever block or batch it is in. G C independent accumulators hide
// vdpbf16ps's latency (a lone chain waits ~6 cycles a step); each weight record loaded serves C
// rows and each x broadcast G groups.
constexpr int kBlockGroups = 4, kBlockCols = 6;  // 24 accumulators + 4 weights + 1 x of 32 zmm

// A prefetch span: lines [first, first + count) from base, `per` of them each quad (into L2)
struct Ahead {
  const uint8_t* base = nullptr;
  int64_t first = 0, count = 0, per = 0;
};

// What a block stores: its 8 G rows' sums (kNone), or for a gate/up pair act(gate) * up: the
// block's groups [0, G/2) are rows of the gate matrix, [G/2, G) the same rows of up, and it
// stores simd.h's silu_mul8 (kSilu) or gelu_tanh_mul8 (kGelu) of the sums it would have stored,
// 4 G values a row (the bits of silu_mul / gelu_tanh_mul on linear_x8's gate and up), as float32
// or (O = uint16_t) rounded to bf16 as bf16_rne rounds them: what the next matmul's vdpbf16ps
// takes, so that it need not round a float32 copy
enum Act { kNone = 0, kSilu = 1, kGelu = 2 };

template <int A, typename O>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store_act(O* out, __m256 gate, __m256 up) {
#ifdef PAGEDLLM_AVX2
  const __m256 act = A == kSilu ? pagedllm_simd::silu_mul8(gate, up) : pagedllm_simd::gelu_tanh_mul8(gate, up);
  if constexpr (std::is_same_v<O, float>) {
    _mm256_storeu_ps(out, act);
  } else {  // bf16_rne on 8 lanes: (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    const __m256i u = _mm256_castps_si256(act);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtepi32_epi16(r));
  }
#else
  alignas(32) float g[kRows], u[kRows];
  _mm256_store_ps(g, gate);
  _mm256_store_ps(u, up);
  for (int r = 0; r < kRows; ++r) {
    const float a = A == kSilu ? pagedllm_simd::silu_mul1(g[r], u[r]) : pagedllm_simd::gelu_tanh_mul1(g[r], u[r]);
    if constexpr (std::is_same_v<O, float>)
      out[r] = a;
    else
      out[r] = bf16_rne(a);
  }
#endif
}

// rec: the records of groups [0, G) (kNone) or of the gate's [0, G/2); rec2: the up matrix's
// records of the same rows (kSilu, kGelu), else unused
template <int G, int C, int A, typename O>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void dp_block(const uint8_t* rec, const uint8_t* rec2,
                                                                               int64_t gstride, int64_t nq,
                                                                               const uint16_t* xb, int64_t k,
                                                                               O* out, int64_t ldo,
                                                                               const Ahead& ahead) {
  static_assert(A != kNone || std::is_same_v<O, float>, "sums are stored as float32");
  static_assert(A == kNone || G % 2 == 0, "a gate/up block pairs its groups");
  constexpr int kOutGroups = A == kNone ? G : G / 2;
  const uint8_t* base[G];
  for (int g = 0; g < G; ++g) base[g] = A != kNone && g >= G / 2 ? rec2 + (g - G / 2) * gstride : rec + g * gstride;
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  // the lines this block stores at its end, asked for now with intent to write: a large output
  // (a prompt's gate, 1,536 x 4,864 floats; the head's logits at 32 rows, 19 MB) is in no cache,
  // and the stores' misses at the end would each wait on memory (Zen 4, 2 threads: that gate
  // 371-388 -> 386-422 GFLOP/s; the head in the B=32 decode step 25.0-25.3 -> 21.5-21.8 ms)
  for (int c = 0; c < C; ++c)
    for (int g = 0; g < kOutGroups; ++g) __builtin_prefetch(out + c * ldo + kRows * g, 1, 3);
  const auto quad = [&](int64_t q) __attribute__((always_inline)) {
    __m512i w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm512_loadu_si512(base[g] + 64 * q);
    for (int c = 0; c < C; ++c) {
      int64_t xq;
      std::memcpy(&xq, xb + c * k + 4 * q, 8);
      const __m512bh xv = (__m512bh)_mm512_set1_epi64(xq);
      for (int g = 0; g < G; ++g) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)w[g], xv);
    }
  };
  // the span's lines, `per` a quad over its first quads, then the quads with none: no bounds
  // test per line in the loop (the last prefetching quad may ask for up to per - 1 lines past
  // the span, which a prefetch may: they fault nothing)
  const char* line = reinterpret_cast<const char*>(ahead.base + 64 * ahead.first);
  const int64_t fetching = ahead.per > 0 ? std::min(nq, (ahead.count + ahead.per - 1) / ahead.per) : 0;
  int64_t q = 0;
  if (ahead.per == 1) {
    for (; q < fetching; ++q, line += 64) {
      _mm_prefetch(line, _MM_HINT_T1);
      quad(q);
    }
  } else {
    for (; q < fetching; ++q) {
      for (int64_t i = 0; i < ahead.per; ++i, line += 64) _mm_prefetch(line, _MM_HINT_T1);
      quad(q);
    }
  }
  for (; q < nq; ++q) quad(q);
  // lane 2r + lane 2r + 1 -> row r (the add as store_pairs does it)
  const auto rows = [&](int g, int c) __attribute__((always_inline)) {
    const __m512 sum = _mm512_add_ps(acc[g][c], _mm512_permute_ps(acc[g][c], 0xB1));
    return _mm512_castps512_ps256(_mm512_maskz_compress_ps(0x5555, sum));
  };
  for (int c = 0; c < C; ++c)
    for (int g = 0; g < kOutGroups; ++g) {
      if constexpr (A == kNone) {
        _mm256_storeu_ps(out + c * ldo + kRows * g, rows(g, c));
      } else {
        store_act<A, O>(out + c * ldo + kRows * g, rows(g, c), rows(g + G / 2, c));
      }
    }
}

// The records a thread takes next, to prefetch into L2 while it works on this block: `lines`
// cache lines from `base` (a gate/up block has two such spans, the gate's and the up's)
struct Span {
  const uint8_t* base = nullptr;
  int64_t lines = 0;
};

// All m rows by chunks of kBlockCols. With more than one chunk, the chunks also prefetch the
// next block's weights into L2, each chunk its share (of a second span, the later chunks): the
// first chunk of a block would otherwise wait on memory for every record (24 layers of a 0.5B
// model at 32 rows, one thread, Zen 4: 120 against 128 ms a step, the head 46 against 50.5).
template <int G, int A, typename O = float>
void dp_block_rows(const uint8_t* rec, const uint8_t* rec2, int64_t gstride, int64_t nq, const uint16_t* xb,
                   int64_t k, int64_t m, O* out, int64_t ldo, Span next, Span next2) {
  // the rows split as evenly as the chunks allow (32 = 5 + 6 + 5 + 5 + 6 + 5, not 5 x 6 + 2):
  // a chunk of 2 rows keeps only 2 G dot chains in flight, too few to fill the pipes
  const int64_t chunks = (m + kBlockCols - 1) / kBlockCols;
  const bool fetch = next.base != nullptr && chunks > 1;
  // chunks [0, split) fetch the first span, [split, chunks) the second
  const int64_t split = next2.base != nullptr && next2.lines > 0 ? chunks / 2 : chunks;
  for (int64_t i = 0, c = 0; i < chunks; ++i) {
    const int64_t rows = m * (i + 1) / chunks - c;
    Ahead ahead;
    if (fetch) {
      const bool second = i >= split;
      const Span& s = second ? next2 : next;
      const int64_t j = second ? i - split : i, n = second ? chunks - split : split;
      ahead.base = s.base;
      ahead.first = s.lines * j / n;
      ahead.count = s.lines * (j + 1) / n - ahead.first;
      ahead.per = (ahead.count + nq - 1) / nq;
    }
    const uint16_t* xc = xb + c * k;
    O* oc = out + c * ldo;
    c += rows;
    switch (rows) {
      case 6: dp_block<G, 6, A, O>(rec, rec2, gstride, nq, xc, k, oc, ldo, ahead); break;
      case 5: dp_block<G, 5, A, O>(rec, rec2, gstride, nq, xc, k, oc, ldo, ahead); break;
      case 4: dp_block<G, 4, A, O>(rec, rec2, gstride, nq, xc, k, oc, ldo, ahead); break;
      case 3: dp_block<G, 3, A, O>(rec, rec2, gstride, nq, xc, k, oc, ldo, ahead); break;
      case 2: dp_block<G, 2, A, O>(rec, rec2, gstride, nq, xc, k, oc, ldo, ahead); break;
      default: dp_block<G, 1, A, O>(rec, rec2, gstride, nq, xc, k, oc, ldo, ahead);
    }
  }
}

// groups [g0, g0 + groups) (groups <= kBlockGroups) of one weight by all m x rows; next: the
// records of the block this thread takes next (nullptr: none), next_groups of them
void dp_blocked(const uint8_t* w, int64_t g0, int64_t groups, int64_t k, const uint16_t* xb, int64_t m, float* out,
                int64_t ldo, const uint8_t* next, int64_t next_groups) {
  static_assert(kBlockCols == 6, "dp_block_rows' switch");
  const uint8_t* rec = w + g0 * 16 * k;
  float* o = out + g0 * kRows;
  const int64_t nq = k / 4, gstride = 16 * k;
  const Span ahead{next, next_groups * nq}, none;
  switch (groups) {
    case 4: dp_block_rows<4, kNone>(rec, nullptr, gstride, nq, xb, k, m, o, ldo, ahead, none); break;
    case 3: dp_block_rows<3, kNone>(rec, nullptr, gstride, nq, xb, k, m, o, ldo, ahead, none); break;
    case 2: dp_block_rows<2, kNone>(rec, nullptr, gstride, nq, xb, k, m, o, ldo, ahead, none); break;
    default: dp_block_rows<1, kNone>(rec, nullptr, gstride, nq, xb, k, m, o, ldo, ahead, none);
  }
}

// groups [g0, g0 + groups) (groups <= kBlockGroups / 2) of a gate and an up matrix by all m x
// rows, act(gate) * up into out (float32, or bf16 bits with O = uint16_t); next_gate / next_up:
// the records of the thread's next block
template <int A, typename O>
void dp_blocked_gated(const uint8_t* gate, const uint8_t* up, int64_t g0, int64_t groups, int64_t k,
                      const uint16_t* xb, int64_t m, O* out, int64_t ldo, const uint8_t* next_gate,
                      const uint8_t* next_up, int64_t next_groups) {
  static_assert(kBlockGroups == 4, "dp_blocked_gated's switch");
  const int64_t nq = k / 4, gstride = 16 * k;
  const Span ahead{next_gate, next_groups * nq}, ahead2{next_up, next_groups * nq};
  O* o = out + g0 * kRows;
  if (groups == 2)
    dp_block_rows<4, A, O>(gate + g0 * gstride, up + g0 * gstride, gstride, nq, xb, k, m, o, ldo, ahead, ahead2);
  else
    dp_block_rows<2, A, O>(gate + g0 * gstride, up + g0 * gstride, gstride, nq, xb, k, m, o, ldo, ahead, ahead2);
}

// --- AVX-512F FMA ------------------------------------------------------------------------
template <int C>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void fma512_cols(const uint8_t* rec, int64_t nq,
                                                                          const float* xp, int64_t k, float* out,
                                                                          int64_t ldo) {
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t q = 0; q < nq; ++q) {
    const __m512i w = _mm512_loadu_si512(rec + 64 * q);
    const __m512 whi = _mm512_castsi512_ps(_mm512_and_si512(w, hi_mask));
    const __m512 wlo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    for (int c = 0; c < C; ++c) {
      double lo, hi;
      std::memcpy(&lo, xp + c * k + 4 * q, 8);
      std::memcpy(&hi, xp + c * k + 4 * q + 2, 8);
      acc[c] = _mm512_fmadd_ps(whi, _mm512_castpd_ps(_mm512_set1_pd(hi)), acc[c]);
      acc[c] = _mm512_fmadd_ps(wlo, _mm512_castpd_ps(_mm512_set1_pd(lo)), acc[c]);
    }
  }
  alignas(64) float lanes[16];
  for (int c = 0; c < C; ++c) {
    _mm512_store_ps(lanes, acc[c]);
    store_pairs(lanes, out + c * ldo);
  }
}

// --- AVX2 FMA ----------------------------------------------------------------------------
template <int C>
__attribute__((target("avx2,fma"))) void fma256_cols(const uint8_t* rec, int64_t nq, const float* xp,
                                                                 int64_t k, float* out, int64_t ldo) {
  __m256 acc[C][2];
  for (int c = 0; c < C; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t q = 0; q < nq; ++q) {
    __m256 whi[2], wlo[2];
    for (int h = 0; h < 2; ++h) {  // rows 0-3, then rows 4-7
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * q + 32 * h));
      whi[h] = _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask));
      wlo[h] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    for (int c = 0; c < C; ++c) {
      double lo, hi;
      std::memcpy(&lo, xp + c * k + 4 * q, 8);
      std::memcpy(&hi, xp + c * k + 4 * q + 2, 8);
      const __m256 xhi = _mm256_castpd_ps(_mm256_set1_pd(hi)), xlo = _mm256_castpd_ps(_mm256_set1_pd(lo));
      for (int h = 0; h < 2; ++h) {
        acc[c][h] = _mm256_fmadd_ps(whi[h], xhi, acc[c][h]);
        acc[c][h] = _mm256_fmadd_ps(wlo[h], xlo, acc[c][h]);
      }
    }
  }
  alignas(32) float lanes[16];
  for (int c = 0; c < C; ++c) {
    _mm256_store_ps(lanes, acc[c][0]);
    _mm256_store_ps(lanes + 8, acc[c][1]);
    store_pairs(lanes, out + c * ldo);
  }
}

// one group, x rows c0 .. c0 + cols (cols <= kMaxCols), by C-specialised kernels
template <template <int> class K>
void by_cols(const uint8_t* rec, int64_t nq, const XPrep& x, int64_t k, int64_t c0, int64_t cols, float* out,
             int64_t ldo) {
  switch (cols) {
    case 4: K<4>::run(rec, nq, x, k, c0, out, ldo); break;
    case 3: K<3>::run(rec, nq, x, k, c0, out, ldo); break;
    case 2: K<2>::run(rec, nq, x, k, c0, out, ldo); break;
    default: K<1>::run(rec, nq, x, k, c0, out, ldo);
  }
}

template <int C>
struct Fma512 {
  static void run(const uint8_t* rec, int64_t nq, const XPrep& x, int64_t k, int64_t c0, float* out, int64_t ldo) {
    fma512_cols<C>(rec, nq, x.perm + c0 * k, k, out + c0 * ldo, ldo);
  }
};
template <int C>
struct Fma256 {
  static void run(const uint8_t* rec, int64_t nq, const XPrep& x, int64_t k, int64_t c0, float* out, int64_t ldo) {
    fma256_cols<C>(rec, nq, x.perm + c0 * k, k, out + c0 * ldo, ldo);
  }
};

// --- AMX-BF16 ----------------------------------------------------------------------------
// C[m][n] += sum over pairs p of x[m][2p] w[n][2p] + x[m][2p + 1] w[n][2p + 1], by tdpbf16ps on
// 16 x 16 tiles: float32 sums of 32 x rows by 32 weight rows in four tiles, x blocks of 16 rows
// by 32 bf16 (x rounded to bf16 as vdpbf16ps takes it), weight blocks of 16 pairs by 16 rows.
// The weight tile of 16 rows (two x8 groups) and 32 values is regrouped from the 8 records that
// hold them: B row 2i + j is dword j of every row's pair in record i (one vpermt2d each), so the
// x8 layout serves the tiles as it is, with no second copy of the weights.
// x is padded with zeros to whole tiles (16 rows, 32 values), and so are the weights past k.
constexpr int64_t kAmxMinRows = 8;  // below: the vdpbf16ps kernels (weight reads bound there)
constexpr int64_t kAmxRowsPerPass = 32;  // x rows sharing one pass over the weights (2 tiles)

// "" when this process may use AMX-BF16 tiles, else what is missing, as /proc/cpuinfo spells it
std::string amx_missing() {
  static const std::string missing = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return std::string("amx_tile");
    if (!(d & (1u << 24))) return std::string("amx_tile");
    if (!(d & (1u << 22))) return std::string("amx_bf16");
    if (!pagedllm_amx::tile_permission()) return std::string("amx_tile (the kernel refused the tile data permission)");
    return std::string();
  }();
  return missing;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg / tilerelease are inline functions needing the amx-tile target (the rest of the
// tile intrinsics are asm macros), so that this file builds for CPUs without AMX too
__attribute__((target("amx-tile"))) void amx_configure(const TileConfig& cfg) { _tile_loadconfig(&cfg); }
__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void amx_regroup(const uint8_t* g0, const uint8_t* g1,
                                                                             int64_t q0, int64_t nq, uint8_t* tile) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int i = 0; i < 8; ++i) {
    const int64_t q = q0 + i;
    __m512i r0 = _mm512_setzero_si512(), r1 = _mm512_setzero_si512();
    if (q < nq) {
      r0 = _mm512_loadu_si512(g0 + 64 * q);
      if (g1 != nullptr) r1 = _mm512_loadu_si512(g1 + 64 * q);
    }
    _mm512_store_si512(tile + 128 * i, _mm512_permutex2var_epi32(r0, even, r1));
    _mm512_store_si512(tile + 128 * i + 64, _mm512_permutex2var_epi32(r0, odd, r1));
  }
}

// Q8_0 weights on the same tiles (amx_q8_linear: the avx512amx_bf16 variant of the x8 kernels):
// a record of ggml_x8_layout.h's Q8 (8 rows x 32 values: the rows' fp16 scales in bytes 0-15,
// then byte 16 + 32q + 4r + i = row r's int8 value 4q + i) becomes a 1 KiB bf16 weight tile of
// bf16(q d), the int8 value times its block's scale rounded once to bf16 (RNE, by
// vcvtne2ps2bf16; q d itself is exact in float32). x is rounded to bf16 as for bf16 weights, and
// there is no float update per block: the 32 values of a record are one tile's depth.
constexpr int64_t kQ8Rec = pagedllm_ggml::x8::Q8::kRec;  // 272 bytes

// the B tile of 16 rows (records r0 and r1, r1 nullptr: zeros) and their 32 values: each quad's 4
// rows x 4 values widened to float32 and scaled (lane 4 row + value), then pairs of lanes packed
// to bf16 dwords (row, pair), and B row 2q + pair joined from both records as amx_regroup joins
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c"))) inline void amx_dequant_q8(const uint8_t* r0,
                                                                                                const uint8_t* r1,
                                                                                                uint8_t* tile) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i lo4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i hi4 = _mm512_add_epi32(lo4, _mm512_set1_epi32(4));
  const uint8_t* const recs[2] = {r0, r1};
  __m512 scale[2][2];  // [record][rows 0-3, 4-7]: each row's scale in its 4 lanes
  for (int h = 0; h < 2; ++h) {
    const __m256 d8 = recs[h] != nullptr
                          ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(recs[h])))
                          : _mm256_setzero_ps();
    const __m512 d = _mm512_castps256_ps512(d8);
    scale[h][0] = _mm512_permutexvar_ps(lo4, d);
    scale[h][1] = _mm512_permutexvar_ps(hi4, d);
  }
  for (int q = 0; q < 8; ++q) {
    __m512i packed[2];
    for (int h = 0; h < 2; ++h) {
      if (recs[h] == nullptr) {
        packed[h] = _mm512_setzero_si512();
        continue;
      }
      const uint8_t* v = recs[h] + 16 + 32 * q;
      const __m512 a = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)))), scale[h][0]);
      const __m512 b = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16)))),
          scale[h][1]);
      packed[h] = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // dword 2r + j: row r's values 4q + 2j, 4q + 2j + 1
    }
    _mm512_store_si512(tile + 128 * q, _mm512_permutex2var_epi32(packed[0], even, packed[1]));
    _mm512_store_si512(tile + 128 * q + 64, _mm512_permutex2var_epi32(packed[0], odd, packed[1]));
  }
}

// Where a pass finds its weight tiles. Already regrouped (src == nullptr): block nb's kc tiles
// of 1 KiB at panel[nb]. Or regrouped during the pass from the x8 groups src[2 nb], src[2 nb + 1]
// (the second may be nullptr: zeros) into the same panel slots: tile t + 1 while tile t is on the
// tiles, with the groups' records kAmxPrefetch tiles ahead asked for, so that the task's weights
// stream from memory while the tiles work (1.3-1.45x the rate of a panel regrouped whole first;
// benchmarks/amx_bf16_regroup_loop.cpp) and its later passes find the panel as built.
struct AmxWeights {
  uint8_t* const* panel;           // [2]: block nb's tiles
  const uint8_t* const* src;       // [4] x8 groups to regroup from in this pass, or nullptr
  int64_t nq;                      // quads a group row holds (k / 4)
  bool q8;                         // the groups are Q8_0 records (amx_dequant_q8), else bf16
  int64_t row_bytes;               // bytes of a group's row of records
  int64_t tile_bytes() const { return q8 ? kQ8Rec : 512; }  // of a group's row per tile
};
constexpr int64_t kAmxPrefetch = 4;  // tiles ahead (4 x 512 bytes of each group)

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c"))) inline void amx_regroup_tile(
    const AmxWeights& w, int nblocks, int64_t t) {
  for (int nb = 0; nb < nblocks; ++nb) {
    if (w.q8) {
      const uint8_t* g1 = w.src[2 * nb + 1];
      amx_dequant_q8(w.src[2 * nb] + kQ8Rec * t, g1 != nullptr ? g1 + kQ8Rec * t : nullptr, w.panel[nb] + 1024 * t);
    } else {
      amx_regroup(w.src[2 * nb], w.src[2 * nb + 1], 8 * t, w.nq, w.panel[nb] + 1024 * t);
    }
  }
}

// Where a pass's 16 x 16 float32 sums go: block (mb, nb) = 2 mb + nb to dst[i] with a row stride
// of ld[i] floats (out itself for a whole block: 16 rows, 16 columns, so that the tile store writes
// it there; else a scratch block that amx_store_part copies the rows and columns of out from).
struct AmxOut {
  float* dst[4];
  int64_t ld[4];
};

// c[mb][nb] (16 x 16 float32 each, mb < mblocks <= 2, nb < nblocks <= 2) = x row blocks mb (16
// rows, k32 values: kc whole 1 KiB tiles at xb + 16 ldx mb, as amx_linear lays them) @ the weight
// tiles of nblocks 16-row blocks (kc tiles, see AmxWeights), stored as o says. Sums in tmm0-3 (mb,
// nb) = 2 mb + nb; x blocks in tmm4 and tmm6, weight blocks in tmm5 and tmm7: each tile loaded
// serves two tdpbf16ps.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c"))) void amx_block(
    const uint16_t* xb, int64_t ldx, int mblocks, int nblocks, const AmxWeights& w, int64_t kc, const AmxOut& o) {
  const bool m2 = mblocks > 1, n2 = nblocks > 1;
  const bool regroup = w.src != nullptr;
  if (regroup) amx_regroup_tile(w, nblocks, 0);
  _tile_zero(0);
  if (n2) _tile_zero(1);
  if (m2) _tile_zero(2);
  if (m2 && n2) _tile_zero(3);
  for (int64_t t = 0; t < kc; ++t) {
    if (regroup) {
      const int64_t tile_bytes = w.tile_bytes();
      const int64_t ahead = tile_bytes * (t + kAmxPrefetch);  // byte offset in each group's row of records
      for (int g = 0; g < 2 * nblocks; ++g)
        if (w.src[g] != nullptr && ahead < w.row_bytes)
          for (int64_t line = 0; line < tile_bytes; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(w.src[g] + ahead + line), _MM_HINT_T0);
      if (t + 1 < kc) amx_regroup_tile(w, nblocks, t + 1);
    }
    asm volatile("" ::: "memory");  // the regrouped tiles are read by tileloadd, which the compiler cannot see
    const uint16_t* xt = xb + 512 * t;  // x tiles lie whole (see amx_linear)
    _tile_loadd(4, xt, 64);
    _tile_loadd(5, w.panel[0] + 1024 * t, 64);
    if (n2) _tile_loadd(7, w.panel[1] + 1024 * t, 64);
    if (m2) _tile_loadd(6, xt + 16 * ldx, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (n2) _tile_dpbf16ps(1, 4, 7);
    if (m2) _tile_dpbf16ps(2, 6, 5);
    if (m2 && n2) _tile_dpbf16ps(3, 6, 7);
  }
  _tile_stored(0, o.dst[0], 4 * o.ld[0]);
  if (n2) _tile_stored(1, o.dst[1], 4 * o.ld[1]);
  if (m2) _tile_stored(2, o.dst[2], 4 * o.ld[2]);
  if (m2 && n2) _tile_stored(3, o.dst[3], 4 * o.ld[3]);
  asm volatile("" ::: "memory");
}

// rows x cols of a scratch block (16 x 16, row stride 16) into out (row stride ld): one masked
// store a row (a memcpy of 32 or 64 bytes a row compiled to rep movsq: ~8 % of a decode step's
// matmul time in perf, for the 64-byte rows every whole block wrote that way before)
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void amx_store_part(const float* c, int rows, int cols,
                                                                                float* out, int64_t ld) {
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(out + r * ld, keep, _mm512_load_ps(c + 16 * r));
}

// outs[j] [m, n_j] = x [m, k] @ W_j^T on the AMX tiles, in 32-row passes of x over 32 weight rows
// at a time. The tiles' sums are not those of a scalar model in any order tried (their internal
// precision is not documented): tests hold them to the float64 product of the bf16-rounded x,
// and to giving each x row the same bits in any batch. q8: the weights are Q8_0 x8 records, each
// dequantized to bf16 as its tile is built (amx_dequant_q8; amx_q8_linear).
void amx_linear(const at::Tensor& x, at::TensorList ws, int64_t k, std::vector<at::Tensor>& outs, bool q8 = false) {
  const int64_t m = x.size(0), nq = k / 4, kc = (k + 31) / 32, k32 = 32 * kc;
  const int64_t m16 = (m + 15) / 16 * 16;
  // x in bf16, 64-byte aligned, zeros past m and k, tile by tile: 16 rows by 32 values (1 KiB, row
  // after row) of one row block at xb + 512 (kc rb + t), so that a tile load reads 1 KiB in a row
  const at::Tensor xbuf = at::empty({m16 * k32 + 32}, x.options().dtype(at::kShort));
  uint16_t* xb = reinterpret_cast<uint16_t*>(
      (reinterpret_cast<uintptr_t>(xbuf.data_ptr<int16_t>()) + 63) & ~uintptr_t(63));
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m16, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* row = xb + (r & ~int64_t(15)) * k32 + 32 * (r & 15);  // row r's 64 bytes in its block's tile 0
      for (int64_t i0 = 0; i0 < k32; i0 += 32) {
        const int64_t n = r < m ? std::clamp<int64_t>(k - i0, 0, 32) : 0;  // the rest of the 32: zeros
        uint16_t* d = row + 16 * i0;
        for (int64_t i = 0; i < n; ++i) d[i] = bf16_rne(xp[r * k + i0 + i]);
        for (int64_t i = n; i < 32; ++i) d[i] = 0;
      }
    }
  });
  // a task: 32 weight rows (4 x8 groups) of one weight over a group of passes, whose x rows stay
  // in L2 (~1 MiB of bf16) while the task's regrouped weight panels serve each pass
  struct Task { int64_t pass0, pass1; size_t j; int64_t quad; };
  std::vector<Task> tasks;
  const int64_t passes = (m16 + kAmxRowsPerPass - 1) / kAmxRowsPerPass;
  const int64_t per_group = std::clamp<int64_t>((1 << 20) / (kAmxRowsPerPass * k32 * 2), 1, 16);
  for (int64_t p = 0; p < passes; p += per_group)
    for (size_t j = 0; j < ws.size(); ++j)
      for (int64_t g = 0; g < ws[j].size(0); g += 4) tasks.push_back({p, std::min(passes, p + per_group), j, g / 4});
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const int64_t grain = std::max<int64_t>(1, (ntasks + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, ntasks, grain, [&](int64_t t0, int64_t t1) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    amx_configure(cfg);
    // a thread's panel, kept from call to call (grown as k needs) and not cleared: a task's first
    // pass writes each tile before it reads it
    static thread_local std::vector<uint8_t> raw;
    if (raw.size() < static_cast<size_t>(2048 * kc + 64)) raw.resize(2048 * kc + 64);
    uint8_t* tiles = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t(63));
    uint8_t* const panel[2] = {tiles, tiles + 1024 * kc};
    alignas(64) float c[4 * 256];
    for (int64_t t = t0; t < t1; ++t) {
      const Task& task = tasks[t];
      const at::Tensor& w = ws[task.j];
      const int64_t groups = w.size(0), n = groups * kRows, g = 4 * task.quad;
      const int64_t have = std::min<int64_t>(4, groups - g);  // x8 groups in this task: 1-4
      const int64_t row_bytes = w.size(1);  // a group's records: 16 k bytes (bf16), 8.5 k (Q8_0)
      const uint8_t* base = w.data_ptr<uint8_t>() + g * row_bytes;
      const uint8_t* src[4] = {};
      for (int64_t i = 0; i < have; ++i) src[i] = base + i * row_bytes;
      const int nblocks = static_cast<int>((have + 1) / 2);
      float* out = outs[task.j].data_ptr<float>();
      for (int64_t pass = task.pass0; pass < task.pass1; ++pass) {
        const int64_t row0 = pass * kAmxRowsPerPass;
        const int mblocks = static_cast<int>(std::min<int64_t>(2, (m16 - row0) / 16));
        // the first pass regroups the weights as it goes; the later ones read its panel
        const AmxWeights weights{panel, pass == task.pass0 ? src : nullptr, nq, q8, row_bytes};
        // whole blocks straight into out; a block with rows past m or a lone group's 8 columns
        // into c, then its part into out
        AmxOut o;
        for (int i = 0; i < 4; ++i) {
          const int64_t r = row0 + 16 * (i / 2);
          const bool whole = r + 16 <= m && 2 * (i % 2) + 1 < have;
          o.dst[i] = whole ? out + r * n + 32 * task.quad + 16 * (i % 2) : c + 256 * i;
          o.ld[i] = whole ? n : 16;
        }
        amx_block(xb + row0 * k32, k32, mblocks, nblocks, weights, kc, o);
        for (int mb = 0; mb < mblocks; ++mb)
          for (int nb = 0; nb < nblocks; ++nb) {
            const int i = 2 * mb + nb;
            if (o.dst[i] != c + 256 * i) continue;  // whole: stored in place
            const int64_t r = row0 + 16 * mb;  // < m: a block starts below m16, and m16 - 16 < m
            amx_store_part(c + 256 * i, static_cast<int>(std::min<int64_t>(16, m - r)), 2 * nb + 1 < have ? 16 : 8,
                           out + r * n + 32 * task.quad + 16 * nb, n);
          }
      }
    }
    amx_release();
  });
}

struct Variant {
  GroupFn fn;  // one group by up to kMaxCols rows; nullptr: dp_blocked at every row count
  bool bf16_x;  // x rounded to bf16 (else permuted float32)
  bool amx = false;  // from kAmxMinRows x rows on, the AMX tiles
};

// what a variant needs, as /proc/cpuinfo spells it ("" when it can run here)
std::string missing_feature(const std::string& name) {
  __builtin_cpu_init();
  if (name == "amx") {
    const std::string lacks = missing_feature("avx512bf16");
    if (!lacks.empty()) return lacks;
    return amx_missing();
  }
  if (name == "avx512bf16") {
    if (!__builtin_cpu_supports("avx512f")) return "avx512f";
    if (!__builtin_cpu_supports("avx512bf16")) return "avx512_bf16";
    return "";
  }
  if (name == "avx512f") return __builtin_cpu_supports("avx512f") ? "" : "avx512f";
  if (name == "avx2") {
    if (!__builtin_cpu_supports("avx2")) return "avx2";
    return __builtin_cpu_supports("fma") ? "" : "fma";
  }
  return "";
}

// Best first; "auto" takes the first this CPU runs. "scalar" is the FMA model (float32 x), so a
// CPU without AVX2 computes the same numbers as the avx2 and avx512f variants.
const char* const kChoices[] = {"amx", "avx512bf16", "avx512f", "avx2", "scalar"};

// name -> kernels; a variant this CPU cannot execute is an error naming the missing feature
Variant variant_of(const std::string& name) {
  const std::string lacks = missing_feature(name);
  TORCH_CHECK(lacks.empty(), "variant '", name, "': this CPU lacks ", lacks);
  if (name == "amx") return {nullptr, true, true};
  if (name == "avx512bf16") return {nullptr, true};
  if (name == "avx512f") return {by_cols<Fma512>, false};
  if (name == "avx2") return {by_cols<Fma256>, false};
  if (name == "scalar_dp") return {group_scalar<true>, true};
  if (name == "scalar_fma" || name == "scalar") return {group_scalar<false>, false};
  TORCH_CHECK(false, "variant: unknown '", name, "' (one of: amx, avx512bf16, avx512f, avx2, scalar, scalar_dp, scalar_fma)");
}

std::vector<std::string> runnable() {
  std::vector<std::string> out;
  for (const char* c : kChoices)
    if (missing_feature(c).empty()) out.push_back(c);
  return out;
}

struct Active {
  std::string name, reason;
  Variant v;
};

std::mutex g_mutex;
Active* g_active = nullptr;  // set once (first use) and by set_bf16_kernel; guarded by g_mutex

Active resolve(const std::string& name, const std::string& asked) {
  if (name == "auto") {
    for (const char* c : kChoices)
      if (missing_feature(c).empty())
        return {c, std::string(c) == "scalar" ? asked + ": the CPU lacks avx2 or fma" : asked + ": the CPU has " + c,
                variant_of(c)};
  }
  bool known = false;
  for (const char* c : kChoices) known = known || name == c;
  std::string can;
  for (const std::string& r : runnable()) can += (can.empty() ? "" : ", ") + r;
  TORCH_CHECK(known, asked, ": unknown bf16 kernel variant '", name, "' (one of: auto, amx, avx512bf16, avx512f, avx2, scalar)");
  const std::string lacks = missing_feature(name);
  TORCH_CHECK(lacks.empty(), asked, " asks for the ", name, " bf16 kernels, but this machine lacks ", lacks,
              " (it can run: ", can, ")");
  return {name, asked, variant_of(name)};
}

Active active() {  // a copy: a set_bf16_kernel meanwhile does not change a call in flight
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_active == nullptr) {  // first use: read the environment once
    const char* env = std::getenv("PAGEDLLM_BF16_KERNEL");
    const bool set = env != nullptr && *env;
    g_active = new Active(resolve(set ? env : "auto", set ? std::string("PAGEDLLM_BF16_KERNEL=") + env : "auto"));
  }
  return *g_active;
}

std::tuple<std::string, std::string> bf16_kernel() {
  const Active a = active();
  return {a.name, a.reason};
}

std::vector<std::string> bf16_kernels() { return runnable(); }

std::string set_bf16_kernel(const std::string& name) {
  Active a = resolve(name, "set_bf16_kernel('" + name + "')");
  active();
  std::lock_guard<std::mutex> lock(g_mutex);
  *g_active = a;
  return a.name;
}

void check_packed(const at::Tensor& wp, int64_t k) {
  TORCH_CHECK(wp.device().is_cpu() && wp.scalar_type() == at::kByte && wp.dim() == 2 && wp.is_contiguous(),
              "bf16 x8 weight must be a contiguous CPU uint8 tensor [rows / 8, 16 * k]");
  TORCH_CHECK(k % 4 == 0 && wp.size(1) == 16 * k, "bf16 x8 row bytes ", wp.size(1), " do not match k=", k);
}

// bf16 [N, K] (N % 8 == 0, K % 4 == 0) -> the x8 records [N / 8, 16 K]
at::Tensor bf16_pack_x8(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.size(0) % kRows == 0 && w_in.size(1) % 4 == 0,
              "w must be [N, K] with N a multiple of 8 and K of 4");
  const at::Tensor w = w_in.to(at::kBFloat16).contiguous();
  const int64_t n = w.size(0), k = w.size(1), nq = k / 4;
  at::Tensor out = pagedllm_ops::empty_weights(n / kRows, 16 * k);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kRows, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t q = 0; q < nq; ++q)
        for (int r = 0; r < kRows; ++r)
          std::memcpy(dst + g * 16 * k + 64 * q + 8 * r, src + (kRows * g + r) * k + 4 * q, 8);
  });
  return out;
}

// From this many x rows on, the FMA variants (float32 x) take chunks of W widened to float32 and
// a BLAS GEMM (prefill): their gemm here does at most 4 rows a pass over W, where BLAS blocks for
// the cache. The vdpbf16ps variants keep their blocks (dp_blocked) at every row count.
constexpr int64_t kDenseRows = 64;
constexpr int64_t kDenseChunkValues = 2 * 1024 * 1024;  // 8 MiB of float32 per chunk

// rows [g0 * 8, g1 * 8) of W in float32, [rows, k] (the exact values: bf16 widens exactly)
at::Tensor widen_groups(const at::Tensor& wp, int64_t k, int64_t g0, int64_t g1) {
  const at::Tensor bf = wp.narrow(0, g0, g1 - g0).view(at::kBFloat16).view({g1 - g0, k / 4, kRows, 4});
  return bf.permute({0, 2, 1, 3}).reshape({(g1 - g0) * kRows, k}).to(at::kFloat);
}

// x [m, k] float32 rounded to bf16 (RNE), as vdpbf16ps takes it
XPrep bf16_rows(const at::Tensor& x) {
  XPrep prep;
  const float* xp = x.data_ptr<float>();
  const int64_t n = x.numel();
  prep.buf = at::empty({n}, x.options().dtype(at::kShort));
  uint16_t* bf = reinterpret_cast<uint16_t*>(prep.buf.data_ptr<int16_t>());
  at::parallel_for(0, n, 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) bf[i] = bf16_rne(xp[i]);
  });
  prep.bf = bf;
  return prep;
}

// outs[j] = x (bf16, [m, k]) @ W_j^T by dp_blocked: blocks of kBlockGroups groups of every
// matrix split over the threads together, each block taking all m rows
void blocked_linear(const uint16_t* xb, int64_t m, at::TensorList ws, int64_t k, std::vector<at::Tensor>& outs) {
  std::vector<std::pair<size_t, int64_t>> tasks;  // (weight, first group of the block)
  for (size_t j = 0; j < ws.size(); ++j)
    for (int64_t g = 0; g < ws[j].size(0); g += kBlockGroups) tasks.emplace_back(j, g);
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const int64_t grain = std::max<int64_t>(1, (ntasks + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, ntasks, grain, [&](int64_t t0, int64_t t1) {
    const auto block = [&](int64_t t) {  // (first record, groups) of task t's block
      const auto [j, g] = tasks[t];
      return std::make_pair(ws[j].data_ptr<uint8_t>() + g * 16 * k, std::min<int64_t>(kBlockGroups, ws[j].size(0) - g));
    };
    for (int64_t t = t0; t < t1; ++t) {
      const auto [j, g] = tasks[t];
      const auto [next, next_groups] = t + 1 < t1 ? block(t + 1) : std::make_pair<const uint8_t*, int64_t>(nullptr, 0);
      dp_blocked(ws[j].data_ptr<uint8_t>(), g, block(t).second, k, xb, m, outs[j].data_ptr<float>(),
                 ws[j].size(0) * kRows, next, next_groups);
    }
  });
}

// y_j = x [M, K] float32 @ W_j^T for bf16 x8 weights W_j sharing x, by variant v: x prepared once,
// the 8-row groups of every matrix split over the threads together
std::vector<at::Tensor> linear_with(const at::Tensor& x_in, at::TensorList ws, int64_t k, const Variant& v) {
  TORCH_CHECK(!ws.empty(), "need at least one weight");
  for (const at::Tensor& w : ws) check_packed(w, k);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "x must be [M, ", k, "]");
  const int64_t m = x_in.size(0), nq = k / 4;
  if (x_in.scalar_type() == at::kBFloat16 && v.fn == nullptr && !(v.amx && m >= kAmxMinRows)) {
    // bf16 x (gated_with's bf16_out) for the vdpbf16ps blocks: its bits are what they would have
    // rounded a float32 x to
    const at::Tensor xb = x_in.contiguous();
    std::vector<at::Tensor> outs;
    for (const at::Tensor& w : ws) outs.push_back(at::empty({m, w.size(0) * kRows}, xb.options().dtype(at::kFloat)));
    blocked_linear(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), m, ws, k, outs);
    return outs;
  }
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  std::vector<at::Tensor> outs;
  for (const at::Tensor& w : ws) outs.push_back(at::empty({m, w.size(0) * kRows}, x.options()));
  if (v.amx && m >= kAmxMinRows) {
    amx_linear(x, ws, k, outs);
    return outs;
  }
  if (m >= kDenseRows && !v.bf16_x) {
    for (size_t j = 0; j < ws.size(); ++j) {
      const int64_t groups = ws[j].size(0), step = std::max<int64_t>(1, kDenseChunkValues / (kRows * k));
      for (int64_t g0 = 0; g0 < groups; g0 += step) {
        const int64_t g1 = std::min(groups, g0 + step);
        outs[j].narrow(1, g0 * kRows, (g1 - g0) * kRows).copy_(at::mm(x, widen_groups(ws[j], k, g0, g1).t()));
      }
    }
    return outs;
  }
  XPrep prep;
  const float* xp = x.data_ptr<float>();
  if (v.bf16_x) {
    prep = bf16_rows(x);
  } else {
    prep.buf = at::empty({m * k}, x.options());
    float* perm = prep.buf.data_ptr<float>();
    fma_quads(xp, perm, m * k);
    prep.perm = perm;
  }
  if (v.fn == nullptr) {
    blocked_linear(prep.bf, m, ws, k, outs);
    return outs;
  }
  std::vector<std::pair<size_t, int64_t>> tasks;  // (weight, group)
  for (size_t j = 0; j < ws.size(); ++j)
    for (int64_t g = 0; g < ws[j].size(0); ++g) tasks.emplace_back(j, g);
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const int64_t grain = std::max<int64_t>(1, (ntasks + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, ntasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto [j, g] = tasks[t];
      const int64_t n = ws[j].size(0) * kRows;
      const uint8_t* rec = ws[j].data_ptr<uint8_t>() + g * 16 * k;
      float* op = outs[j].data_ptr<float>() + g * kRows;
      for (int64_t c = 0; c < m; c += kMaxCols) v.fn(rec, nq, prep, k, c, std::min<int64_t>(kMaxCols, m - c), op, n);
    }
  });
  return outs;
}

// act(x @ G^T) * (x @ U^T) for bf16 x8 gate and up matrices of the same shape (act: silu, or
// gelu_tanh with gelu), [M, N] float32: the bits of linear_with's two outputs through silu_mul /
// gelu_tanh_mul. The vdpbf16ps blocks (dp_blocked) apply it as they store, each block a pair of
// gate and up groups: no [M, 2 N] gate/up outputs written and read back, no pass of its own.
// The other variants (and the AMX tiles) take linear_with, then the op. bf16_out: the blocks
// store the values rounded to bf16 (a kBFloat16 tensor: what linear_with's vdpbf16ps variants
// would round them to, so that they need not; the caller's next matrix must be one of those);
// the other paths return float32 whatever it asks.
at::Tensor gated_with(const at::Tensor& x_in, const at::Tensor& gate, const at::Tensor& up, int64_t k, bool gelu,
                      bool bf16_out, const Variant& v) {
  check_packed(gate, k);
  check_packed(up, k);
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have the same shape, got ", gate.sizes(), " and ",
              up.sizes());
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "x must be [M, ", k, "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0);
  if (v.fn != nullptr || (v.amx && m >= kAmxMinRows)) {
    const std::vector<at::Tensor> gu = linear_with(x, {gate, up}, k, v);
    return gelu ? pagedllm_ops::gelu_tanh_mul(gu[0], gu[1]) : pagedllm_ops::silu_mul(gu[0], gu[1]);
  }
  const int64_t groups = gate.size(0), n = groups * kRows;
  at::Tensor out = at::empty({m, n}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const XPrep prep = bf16_rows(x);
  const uint8_t* gp = gate.data_ptr<uint8_t>();
  const uint8_t* upp = up.data_ptr<uint8_t>();
  float* op = bf16_out ? nullptr : out.data_ptr<float>();
  uint16_t* ob = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  constexpr int64_t kPair = kBlockGroups / 2;  // groups of each matrix a block takes
  const int64_t ntasks = (groups + kPair - 1) / kPair, gstride = 16 * k;
  const int64_t grain = std::max<int64_t>(1, (ntasks + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, ntasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t * kPair, count = std::min(kPair, groups - g);
      const bool more = t + 1 < t1;
      const int64_t next_count = more ? std::min(kPair, groups - g - kPair) : 0;
      const uint8_t* ng = more ? gp + (g + kPair) * gstride : nullptr;
      const uint8_t* nu = more ? upp + (g + kPair) * gstride : nullptr;
      if (bf16_out && gelu)
        dp_blocked_gated<kGelu>(gp, upp, g, count, k, prep.bf, m, ob, n, ng, nu, next_count);
      else if (bf16_out)
        dp_blocked_gated<kSilu>(gp, upp, g, count, k, prep.bf, m, ob, n, ng, nu, next_count);
      else if (gelu)
        dp_blocked_gated<kGelu>(gp, upp, g, count, k, prep.bf, m, op, n, ng, nu, next_count);
      else
        dp_blocked_gated<kSilu>(gp, upp, g, count, k, prep.bf, m, op, n, ng, nu, next_count);
    }
  });
  return out;
}

at::Tensor bf16_gated_x8(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, int64_t k, bool gelu,
                         bool bf16_out, const std::string& variant) {
  return gated_with(x, gate, up, k, gelu, bf16_out, variant_of(variant));
}

// x [M, K] float32 @ W^T -> [M, N] float32 by the named variant (tests and benchmarks)
at::Tensor bf16_linear_x8(const at::Tensor& x_in, const at::Tensor& wp, int64_t k, const std::string& variant) {
  return linear_with(x_in, {wp}, k, variant_of(variant))[0];
}

// bf16 x8 [N / 8, 16 K] -> bf16 [N, K] (the checkpoint's layout back)
at::Tensor bf16_unpack_x8(const at::Tensor& wp, int64_t k) {
  check_packed(wp, k);
  return wp.view(at::kBFloat16).view({wp.size(0), k / 4, kRows, 4}).permute({0, 2, 1, 3}).reshape({wp.size(0) * kRows, k});
}

// float32 [T, k]: rows ids[t] of a bf16 x8 matrix (an embedding lookup)
at::Tensor bf16_embed_x8(const at::Tensor& wp, const at::Tensor& ids_in, int64_t k) {
  check_packed(wp, k);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous().view(-1);
  const int64_t rows = wp.size(0) * kRows, t = ids.numel(), nq = k / 4;
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < rows, "token id ", idp[i], " is outside the embedding's ", rows, " rows");
  at::Tensor out = at::empty({t, k}, wp.options().dtype(at::kFloat));
  const uint8_t* src = wp.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, t, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* rec = src + (idp[i] / kRows) * 16 * k + 8 * (idp[i] % kRows);
      for (int64_t q = 0; q < nq; ++q)
        for (int v = 0; v < 4; ++v) {
          uint16_t h;
          std::memcpy(&h, rec + 64 * q + 2 * v, 2);
          dst[i * k + 4 * q + v] = widen(h);
        }
    }
  });
  return out;
}

}  // namespace

bool pagedllm_amx::tile_permission() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

std::vector<at::Tensor> pagedllm_bf16::linear_x8(const at::Tensor& x, at::TensorList ws, int64_t k) {
  const Variant v = active().v;  // one variant for the whole call
  return linear_with(x, ws, k, v);
}

at::Tensor pagedllm_bf16::gated_x8(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, int64_t k,
                                   bool gelu, bool bf16_out) {
  return gated_with(x, gate, up, k, gelu, bf16_out, active().v);
}

pagedllm_bf16::SeenX pagedllm_bf16::seen_x(const at::Tensor& x_in, int64_t k, int64_t call_rows) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "x must be [M, ", k, "]");
  const Active a = active();
  const Variant& v = a.v;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m = std::max(x.size(0), call_rows);
  SeenX seen{x, a.name, !(v.amx && m >= kAmxMinRows) && !(m >= kDenseRows && !v.bf16_x)};
  if (v.bf16_x) {  // what bf16_rows hands the vdpbf16ps blocks, widened back (exact)
    seen.x = at::empty_like(x);
    const float* xp = x.data_ptr<float>();
    float* sp = seen.x.data_ptr<float>();
    at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) sp[i] = widen(bf16_rne(xp[i]));
    });
  }
  return seen;
}

void pagedllm_bf16::group_logits(const SeenX& seen, int64_t row, const at::Tensor& w, int64_t k,
                                 const int64_t* groups, int64_t n, float* out) {
  check_packed(w, k);
  const Variant v = variant_of(seen.variant);
  const float* xr = seen.x.data_ptr<float>() + row * k;
  std::vector<uint16_t> bf(v.bf16_x ? k : 0);
  std::vector<float> perm(v.bf16_x ? 0 : k);
  XPrep prep;  // this row alone, as bf16_rows or linear_with's permutation prepares it
  if (v.bf16_x) {
    for (int64_t i = 0; i < k; ++i) bf[i] = bf16_rne(xr[i]);  // exact: the values are bf16 already
    prep.bf = bf.data();
  } else {
    fma_quads(xr, perm.data(), k);
    prep.perm = perm.data();
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(groups[j] >= 0 && groups[j] < w.size(0), "group ", groups[j], " is outside the weight's ", w.size(0));
    const uint8_t* rec = wp + groups[j] * 16 * k;
    if (v.fn != nullptr)
      v.fn(rec, k / 4, prep, k, 0, 1, out + kRows * j, 0);
    else
      dp_blocked(rec, 0, 1, k, prep.bf, 1, out + kRows * j, kRows, nullptr, 0);
  }
}

at::Tensor pagedllm_bf16::widen_rows(const at::Tensor& wp, int64_t k, int64_t g0, int64_t g1) {
  check_packed(wp, k);
  return widen_groups(wp, k, g0, g1).contiguous();
}

std::string pagedllm_bf16::amx_q8_missing() { return missing_feature("amx"); }

void pagedllm_bf16::amx_q8_linear(const at::Tensor& x, at::TensorList ws, int64_t k, std::vector<at::Tensor>& outs) {
  const std::string lacks = missing_feature("amx");
  TORCH_CHECK(lacks.empty(), "Q8_0 on the AMX-BF16 tiles: this CPU lacks ", lacks);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == k && k % 32 == 0,
              "x must be a contiguous float32 [M, ", k, "] with k a multiple of 32");
  TORCH_CHECK(outs.size() == ws.size(), "need one output per weight");
  for (size_t j = 0; j < ws.size(); ++j)
    TORCH_CHECK(ws[j].size(1) == k / 32 * kQ8Rec && outs[j].size(0) == x.size(0) &&
                    outs[j].size(1) == ws[j].size(0) * kRows,
                "Q8_0 x8 weight ", j, " does not match k=", k, " or its output");
  amx_linear(x, ws, k, outs, true);
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("bf16_pack_x8(Tensor w) -> Tensor");
  m.def("bf16_unpack_x8(Tensor w, int k) -> Tensor");
  m.def("bf16_embed_x8(Tensor w, Tensor ids, int k) -> Tensor");
  m.def("bf16_linear_x8(Tensor x, Tensor w, int k, str variant) -> Tensor");
  m.def("bf16_gated_x8(Tensor x, Tensor gate, Tensor up, int k, bool gelu, bool bf16_out, str variant) -> Tensor");
  // the variant BF16 weights run in ggml_linear_x8 and the decode stack, and why; the variants
  // this CPU runs, best first; force one
  m.def("bf16_kernel() -> (str, str)", &bf16_kernel);
  m.def("bf16_kernels() -> str[]", &bf16_kernels);
  m.def("set_bf16_kernel(str name) -> str", &set_bf16_kernel);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("bf16_pack_x8", &bf16_pack_x8);
  m.impl("bf16_unpack_x8", &bf16_unpack_x8);
  m.impl("bf16_embed_x8", &bf16_embed_x8);
  m.impl("bf16_linear_x8", &bf16_linear_x8);
  m.impl("bf16_gated_x8", &bf16_gated_x8);
}
