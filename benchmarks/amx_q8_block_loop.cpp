// The inner loop of the AMX Q8_0 gemm (ggml_x8_kernels.inc, amx_q8_0) alone, everything in L1,
// in the order it had until 2026-12-06 and in two others (the kernel now takes `early32`'s):
// per 32-value block, x tiles of 16 rows, a 16-row weight tile (8 x 64 bytes), tilezero +
// tdpbssd, tilestored, then each x row's float update fma(float(sum), d * dx, acc). Times, per
// 16 x 16 x 32 unit (8192 multiply-adds), the tiles alone, the update alone and both, for 16 and
// 32 x rows a weight tile; and 16 or 32 rows with two blocks in flight (block b + 1's tiles
// issued before block b's update, into a second set of tiles), and 32 rows with one set, block
// b + 1 issued right after block b's sums are stored. Then, for a question of format rather than
// order, int8 formats with fewer scales than Q8_0 (groups of 64 or 128 values, in early32's
// order): their tiles take 64 values a tdpbssd and their update comes once a group (and, for
// comparison, groups of 128 summed by K = 32 tiles on Q8_0's layout). Skips, saying so, where the
// CPU lacks AMX-INT8 or the kernel refuses the tile data permission. One thread.
//
//   g++ -O3 -march=native -mamx-tile -mamx-int8 benchmarks/amx_q8_block_loop.cpp -o /tmp/amx_q8_loop
//   /tmp/amx_q8_loop
//
// 2-vCPU Intel Xeon with AMX (family 6 model 207; firecracker), 2026-12-05: see docs/performance.md.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

struct alignas(64) Cfg {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
alignas(64) int8_t xq[64 * 1024];
alignas(64) uint8_t panel[64 * 1024];
alignas(64) float scales[64 * 16], xd[64 * 32];
alignas(64) int32_t sums[4][256];
volatile float sink;
constexpr int kBlocks = 28;  // K = 896, the default model's hidden size

#define UPDATE(ACC, S, D, XB)                                                                            \
  for (int r = 0; r < 16; ++r)                                                                          \
    ACC[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((S) + 16 * r)),                      \
                             _mm512_mul_ps(D, _mm512_set1_ps((XB)[r])), ACC[r]);

// kRows x rows (16 or 32) by one weight tile, block after block; kTiles / kUpdate: which half runs
template <int kRows, bool kTiles, bool kUpdate>
__attribute__((noinline)) void blocks(int reps) {
  __m512 a0[16], a1[16];
  for (int r = 0; r < 16; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int rep = 0; rep < reps; ++rep)
    for (int b = 0; b < kBlocks; ++b) {
      asm volatile("" ::: "memory");
      if (kTiles) {
        _tile_loadd(2, panel + 512 * b, 64);
        _tile_loadd(0, xq + 1024 * b, 32);
        _tile_zero(4);
        _tile_dpbssd(4, 0, 2);
        if (kRows == 32) {
          _tile_loadd(1, xq + 1024 * b + 512, 32);
          _tile_zero(5);
          _tile_dpbssd(5, 1, 2);
        }
        _tile_stored(4, sums[0], 64);
        if (kRows == 32) _tile_stored(5, sums[1], 64);
      }
      asm volatile("" ::: "memory");
      if (kUpdate) {
        const __m512 d = _mm512_load_ps(scales + 16 * b);
        UPDATE(a0, sums[0], d, xd + 32 * b)
        if (kRows == 32) { UPDATE(a1, sums[1], d, xd + 32 * b + 16) }
      }
    }
  float s = 0;
  for (int r = 0; r < 16; ++r) s += _mm512_reduce_add_ps(a0[r]) + _mm512_reduce_add_ps(a1[r]);
  sink = s;
}

// 16 x rows, two blocks in flight: tiles 0, 2, 4 serve even blocks, 1, 3, 5 odd ones
__attribute__((noinline)) void pipelined(int reps) {
  __m512 a0[16];
  for (int r = 0; r < 16; ++r) a0[r] = _mm512_setzero_ps();
#define TILES(B, A, W, C, S)                                                                  \
  _tile_loadd(W, panel + 512 * (B), 64); _tile_loadd(A, xq + 1024 * (B), 32); _tile_zero(C); \
  _tile_dpbssd(C, A, W); _tile_stored(C, S, 64);
  for (int rep = 0; rep < reps; ++rep) {
    TILES(0, 0, 2, 4, sums[0])
    for (int b = 0; b < kBlocks; b += 2) {
      TILES(b + 1, 1, 3, 5, sums[1])
      asm volatile("" ::: "memory");
      { const __m512 d = _mm512_load_ps(scales + 16 * b); UPDATE(a0, sums[0], d, xd + 32 * b) }
      asm volatile("" ::: "memory");
      if (b + 2 < kBlocks) { TILES(b + 2, 0, 2, 4, sums[0]) }
      asm volatile("" ::: "memory");
      { const __m512 d = _mm512_load_ps(scales + 16 * b + 16); UPDATE(a0, sums[1], d, xd + 32 * b + 32) }
      asm volatile("" ::: "memory");
    }
  }
  float s = 0;
  for (int r = 0; r < 16; ++r) s += _mm512_reduce_add_ps(a0[r]);
  sink = s;
}

// 32 x rows, two blocks in flight: even blocks sum into tiles 4-5 (weights in 2), odd into 6-7
// (weights in 3); x in 0-1 for both. Block b + 1's tiles are issued before block b's update.
__attribute__((noinline)) void pipelined32(int reps) {
  __m512 a0[16], a1[16];
  for (int r = 0; r < 16; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
#define TILES32(B, W, C0, C1)                                                                 \
  _tile_loadd(W, panel + 512 * (B), 64); _tile_loadd(0, xq + 1024 * (B), 32); _tile_zero(C0); \
  _tile_dpbssd(C0, 0, W); _tile_loadd(1, xq + 1024 * (B) + 512, 32); _tile_zero(C1);         \
  _tile_dpbssd(C1, 1, W);
  for (int rep = 0; rep < reps; ++rep) {
    TILES32(0, 2, 4, 5)
    for (int b = 0; b < kBlocks; b += 2) {
      _tile_stored(4, sums[0], 64); _tile_stored(5, sums[1], 64);
      TILES32(b + 1, 3, 6, 7)
      asm volatile("" ::: "memory");
      { const __m512 d = _mm512_load_ps(scales + 16 * b); UPDATE(a0, sums[0], d, xd + 32 * b) UPDATE(a1, sums[1], d, xd + 32 * b + 16) }
      asm volatile("" ::: "memory");
      _tile_stored(6, sums[2], 64); _tile_stored(7, sums[3], 64);
      if (b + 2 < kBlocks) { TILES32(b + 2, 2, 4, 5) }
      asm volatile("" ::: "memory");
      { const __m512 d = _mm512_load_ps(scales + 16 * b + 16); UPDATE(a0, sums[2], d, xd + 32 * b + 32) UPDATE(a1, sums[3], d, xd + 32 * b + 48) }
      asm volatile("" ::: "memory");
    }
  }
  float s = 0;
  for (int r = 0; r < 16; ++r) s += _mm512_reduce_add_ps(a0[r]) + _mm512_reduce_add_ps(a1[r]);
  sink = s;
}

// the same order with one set of tiles: block b's sums stored, block b + 1 issued, then b's update
__attribute__((noinline)) void early32(int reps) {
  __m512 a0[16], a1[16];
  for (int r = 0; r < 16; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int rep = 0; rep < reps; ++rep) {
    TILES32(0, 2, 4, 5)
    for (int b = 0; b < kBlocks; ++b) {
      _tile_stored(4, sums[0], 64); _tile_stored(5, sums[1], 64);
      if (b + 1 < kBlocks) { TILES32(b + 1, 2, 4, 5) }
      asm volatile("" ::: "memory");
      { const __m512 d = _mm512_load_ps(scales + 16 * b); UPDATE(a0, sums[0], d, xd + 32 * b) UPDATE(a1, sums[1], d, xd + 32 * b + 16) }
      asm volatile("" ::: "memory");
    }
  }
  float s = 0;
  for (int r = 0; r < 16; ++r) s += _mm512_reduce_add_ps(a0[r]) + _mm512_reduce_add_ps(a1[r]);
  sink = s;
}

// Formats with fewer scales (not Q8_0: a question for the format, benchmarks/int8_format_study.py):
// kG = 64 or 128 values a group, kG / 64 K = 64 tdpbssd per x tile into the same sums (tiles 0-1
// x, 2 weights with 16 rows of 64 bytes, 4-5 sums), then one update a group. kWScale: the weight
// rows keep a scale per group, fma(float(sum), d * dx, acc) as Q8_0's; without, one per row,
// fma(float(sum), dx, acc) and the row's scale once at the end. Block b + 1's tiles go before
// block b's update, as the kernel's early32 order.
template <int kG>
inline void tiles_group(int g) {
  _tile_zero(4);
  _tile_zero(5);
  for (int h = 0; h < kG / 64; ++h) {
    _tile_loadd(2, panel + 16 * kG * g + 1024 * h, 64);
    _tile_loadd(0, xq + 32 * kG * g + 2048 * h, 64);
    _tile_dpbssd(4, 0, 2);
    _tile_loadd(1, xq + 32 * kG * g + 2048 * h + 1024, 64);
    _tile_dpbssd(5, 1, 2);
  }
}
template <int kG, bool kWScale>
__attribute__((noinline)) void grouped(int reps) {
  __m512 a0[16], a1[16];
  for (int r = 0; r < 16; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  constexpr int kGroups = 32 * kBlocks / kG;
  for (int rep = 0; rep < reps; ++rep) {
    tiles_group<kG>(0);
    for (int g = 0; g < kGroups; ++g) {
      _tile_stored(4, sums[0], 64); _tile_stored(5, sums[1], 64);
      if (g + 1 < kGroups) tiles_group<kG>(g + 1);
      asm volatile("" ::: "memory");
      if (kWScale) {
        const __m512 d = _mm512_load_ps(scales + 16 * g);
        UPDATE(a0, sums[0], d, xd + 32 * g) UPDATE(a1, sums[1], d, xd + 32 * g + 16)
      } else {
        for (int r = 0; r < 16; ++r) {
          a0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[0] + 16 * r)), _mm512_set1_ps(xd[32 * g + r]), a0[r]);
          a1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[1] + 16 * r)), _mm512_set1_ps(xd[32 * g + 16 + r]), a1[r]);
        }
      }
      asm volatile("" ::: "memory");
    }
    if (!kWScale) {
      const __m512 d = _mm512_load_ps(scales);
      for (int r = 0; r < 16; ++r) { a0[r] = _mm512_mul_ps(a0[r], d); a1[r] = _mm512_mul_ps(a1[r], d); }
    }
  }
  float s = 0;
  for (int r = 0; r < 16; ++r) s += _mm512_reduce_add_ps(a0[r]) + _mm512_reduce_add_ps(a1[r]);
  sink = s;
}

// The same groups (kN blocks of 32: 64 or 128 values) on Q8_0's own tiles and layout (x tiles of
// 32 values, weight tiles of 8 rows): kN K = 32 tdpbssd per x tile into the same sums, then one
// update, with the group's weight scale
template <int kN>
__attribute__((noinline)) void grouped_q8(int reps) {
  __m512 a0[16], a1[16];
  for (int r = 0; r < 16; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  constexpr int kGroups = kBlocks / kN;
  const auto issue = [](int g) {
    _tile_zero(4);
    _tile_zero(5);
    for (int b = kN * g; b < kN * g + kN; ++b) {
      _tile_loadd(2, panel + 512 * b, 64);
      _tile_loadd(0, xq + 1024 * b, 32);
      _tile_dpbssd(4, 0, 2);
      _tile_loadd(1, xq + 1024 * b + 512, 32);
      _tile_dpbssd(5, 1, 2);
    }
  };
  for (int rep = 0; rep < reps; ++rep) {
    issue(0);
    for (int g = 0; g < kGroups; ++g) {
      _tile_stored(4, sums[0], 64); _tile_stored(5, sums[1], 64);
      if (g + 1 < kGroups) issue(g + 1);
      asm volatile("" ::: "memory");
      const __m512 d = _mm512_load_ps(scales + 16 * g);
      UPDATE(a0, sums[0], d, xd + 32 * g) UPDATE(a1, sums[1], d, xd + 32 * g + 16)
      asm volatile("" ::: "memory");
    }
  }
  float s = 0;
  for (int r = 0; r < 16; ++r) s += _mm512_reduce_add_ps(a0[r]) + _mm512_reduce_add_ps(a1[r]);
  sink = s;
}

template <class F>
void timed(const char* name, int units_per_block, F run) {
  const int reps = 100000;
  double best = 1e30;
  for (int round = 0; round < 3; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    run(reps);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double units = double(units_per_block) * kBlocks * reps;
  std::printf("%-34s %6.2f ns per 16x16x32  %5.0f G multiply-adds/s\n", name, best / units * 1e9,
              8192.0 * units / best / 1e9);
}

int main() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) {
    std::printf("skipped: this CPU lacks amx_tile or amx_int8\n");
    return 0;
  }
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::printf("skipped: the kernel refused the tile data permission\n");
    return 0;
  }
  Cfg cfg, cfg128;  // cfg128: x tiles of 64 values, weight tiles of 16 rows (grouped)
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = (t == 2 || t == 3) ? 8 : 16;
    cfg.colsb[t] = t < 2 ? 32 : 64;
    cfg128.rows[t] = 16;
    cfg128.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  std::memset(xq, 1, sizeof xq);
  std::memset(panel, 1, sizeof panel);
  for (float& v : scales) v = 1e-3f;
  for (float& v : xd) v = 1e-3f;
  timed("16 rows: tiles only", 1, blocks<16, true, false>);
  timed("16 rows: update only", 1, blocks<16, false, true>);
  timed("16 rows: both", 1, blocks<16, true, true>);
  timed("16 rows, two blocks in flight", 1, pipelined);
  timed("32 rows: tiles only", 2, blocks<32, true, false>);
  timed("32 rows: update only", 2, blocks<32, false, true>);
  for (int turn = 0; turn < 2; ++turn) {  // twice, in turns: the machine's speed drifts
    timed("32 rows: both (the kernel's until 2026-12-06)", 2, blocks<32, true, true>);
    timed("32 rows, two blocks in flight", 2, pipelined32);
    timed("32 rows, next block issued early", 2, early32);
    timed("32 rows, groups of 64 on Q8_0's tiles", 2, grouped_q8<2>);
    timed("32 rows, groups of 128 on Q8_0's tiles", 2, grouped_q8<4>);
    _tile_loadconfig(&cfg128);
    timed("32 rows, groups of 64, weight scale a group", 2, grouped<64, true>);
    timed("32 rows, groups of 128, weight scale a group", 2, grouped<128, true>);
    timed("32 rows, groups of 128, weight scale a row", 2, grouped<128, false>);
    _tile_loadconfig(&cfg);
  }
  _tile_release();
}
