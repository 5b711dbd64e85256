// The AMX-BF16 matmul's pass over 32 weight rows (csrc/x8_bf16.cpp, amx_block) with the weights
// streaming from memory, as a decode step of 32 x rows runs it: 256 MiB of x8 bf16 groups, a
// task of 4 groups (32 rows) after another, 2 x 2 tdpbf16ps per 32 values. Three ways:
//   whole first  the task's kc weight tiles regrouped into a panel, then the tile loop (before);
//   fused        tile t + 1 regrouped while tile t is on the tiles;
//   fused+pf4    the same, with the groups' records 4 tiles ahead prefetched (what runs now);
//   laid+pfN     no regrouping: the weights already lie as B tiles (a task's 2 KiB per 32 values,
//                as a load-time packing for the tiles would leave them), loaded by tileloadd
//                straight from the stream, N tiles (2 KiB each) ahead prefetched;
// and the regrouping alone (the memory side's ceiling). Per k: the default model's 896 and 4864.
// Skips, saying so, where the CPU lacks AMX-BF16 or the kernel refuses the tile data permission.
//
//   g++ -O2 -march=native -mamx-tile -mamx-bf16 -pthread benchmarks/amx_bf16_regroup_loop.cpp -o /tmp/amx_regroup
//   /tmp/amx_regroup            # ms, GB/s of weights and ns per tdpbf16ps, 1 and 2 threads
//
// 2-vCPU Intel Xeon with AMX (family 6 model 207; firecracker), 2026-12-06: see docs/performance.md.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

#include "amx_bf16_tiles.h"

// one weight tile (16 rows of two groups, 32 values) from 8 records of each group, as amx_regroup
static inline void regroup(const uint8_t* g0, const uint8_t* g1, int64_t q0, uint8_t* tile) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int i = 0; i < 8; ++i) {
    const __m512i r0 = _mm512_loadu_si512(g0 + 64 * (q0 + i)), r1 = _mm512_loadu_si512(g1 + 64 * (q0 + i));
    _mm512_store_si512(tile + 128 * i, _mm512_permutex2var_epi32(r0, even, r1));
    _mm512_store_si512(tile + 128 * i + 64, _mm512_permutex2var_epi32(r0, odd, r1));
  }
}

static inline void tiles(const uint16_t* xt, int64_t k, const uint8_t* w0, const uint8_t* w1) {
  _tile_loadd(4, xt, 2 * k);
  _tile_loadd(5, w0, 64);
  _tile_loadd(7, w1, 64);
  _tile_loadd(6, xt + 16 * k, 2 * k);
  _tile_dpbf16ps(0, 4, 5);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 6, 5);
  _tile_dpbf16ps(3, 6, 7);
}

enum Mode { kWholeFirst, kFused, kFusedPf4, kLaidPf4, kLaidPf8, kRegroupOnly };

static void run(Mode mode, const uint16_t* xb, int64_t k, const uint8_t* w, int64_t t0, int64_t t1, uint8_t* panel) {
  const int64_t kc = k / 32;
  alignas(64) float c[1024];
  for (int64_t task = t0; task < t1; ++task) {
    const uint8_t* g[4];
    for (int i = 0; i < 4; ++i) g[i] = w + (4 * task + i) * 16 * k;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    if (mode == kLaidPf4 || mode == kLaidPf8) {
      const uint8_t* tw = w + task * 64 * k;  // the task's kc tiles of 2 KiB (block 0, then block 1)
      const int64_t ahead = mode == kLaidPf4 ? 4 : 8;
      for (int64_t t = 0; t < kc; ++t) {
        if (t + ahead < kc)
          for (int line = 0; line < 32; ++line)
            _mm_prefetch(reinterpret_cast<const char*>(tw + 2048 * (t + ahead) + 64 * line), _MM_HINT_T0);
        tiles(xb + 32 * t, k, tw + 2048 * t, tw + 2048 * t + 1024);
      }
    } else if (mode == kWholeFirst) {
      for (int64_t t = 0; t < kc; ++t) {
        regroup(g[0], g[1], 8 * t, panel + 2048 * t);
        regroup(g[2], g[3], 8 * t, panel + 2048 * t + 1024);
      }
      asm volatile("" ::: "memory");
      for (int64_t t = 0; t < kc; ++t) tiles(xb + 32 * t, k, panel + 2048 * t, panel + 2048 * t + 1024);
    } else {
      regroup(g[0], g[1], 0, panel);
      regroup(g[2], g[3], 0, panel + 1024);
      for (int64_t t = 0; t < kc; ++t) {
        if (mode == kFusedPf4 && 512 * (t + 4) < 16 * k)
          for (int i = 0; i < 4; ++i)
            for (int line = 0; line < 8; ++line)
              _mm_prefetch(reinterpret_cast<const char*>(g[i] + 512 * (t + 4) + 64 * line), _MM_HINT_T0);
        if (t + 1 < kc) {
          regroup(g[0], g[1], 8 * (t + 1), panel + 2048 * (t + 1));
          regroup(g[2], g[3], 8 * (t + 1), panel + 2048 * (t + 1) + 1024);
        }
        asm volatile("" ::: "memory");
        if (mode != kRegroupOnly) tiles(xb + 32 * t, k, panel + 2048 * t, panel + 2048 * t + 1024);
      }
    }
    _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
    asm volatile("" ::: "memory");
  }
}

int main() {
  if (!amx_ok()) {
    std::printf("skipped: this CPU (or its kernel) offers no AMX-BF16 tiles\n");
    return 0;
  }
  const char* names[] = {"whole first", "fused", "fused+pf4", "laid+pf4", "laid+pf8", "regroup only"};
  for (int64_t k : {896, 4864}) {
    const int64_t bytes = int64_t(256) << 20, ntasks = bytes / (64 * k);
    std::vector<uint8_t> wv(ntasks * 64 * k + 64, 0x3f);
    const uint8_t* w = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wv.data()) + 63) & ~uintptr_t(63));
    std::vector<uint16_t> xv(32 * k + 64, 0x3f80);
    const uint16_t* xb = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(xv.data()) + 63) & ~uintptr_t(63));
    for (int threads : {1, 2})
      for (Mode mode : {kWholeFirst, kFused, kFusedPf4, kLaidPf4, kLaidPf8, kRegroupOnly}) {
        double best = 1e9;
        for (int rep = 0; rep < 3; ++rep) {
          const auto t0 = std::chrono::steady_clock::now();
          std::vector<std::thread> pool;
          for (int i = 0; i < threads; ++i)
            pool.emplace_back([&, i] {
              configure();
              std::vector<uint8_t> raw(2048 * (k / 32) + 64);
              uint8_t* panel = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t(63));
              run(mode, xb, k, w, ntasks * i / threads, ntasks * (i + 1) / threads, panel);
              _tile_release();
            });
          for (auto& t : pool) t.join();
          best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        std::printf("k=%-5ld %d thread(s) %-12s %6.1f ms %5.1f GB/s", static_cast<long>(k), threads, names[mode],
                    best * 1e3, bytes / best / 1e9);
        if (mode != kRegroupOnly) std::printf(" %5.1f ns per tdpbf16ps", best * 1e9 * threads / (ntasks * 4 * (k / 32)));
        std::printf("\n");
      }
  }
}
