// The AMX-BF16 ceiling of this CPU: tdpbf16ps on tiles already loaded (16 x 16 float32 sums,
// 16 x 32 bf16 by 32 x 16 bf16: 8192 multiply-adds an instruction), four independent sums, on
// 1 thread and then 2 at once. A second line times the same with the x tile reloaded from L1
// before each instruction (what a gemm's inner loop does at best). Skips, saying so, where the
// CPU lacks AMX-BF16 or the kernel refuses the tile data permission.
//
//   g++ -O2 -mamx-tile -mamx-bf16 -pthread benchmarks/amx_bf16_peak.cpp -o /tmp/amx_bf16_peak
//   /tmp/amx_bf16_peak            # G tdpbf16ps/s and GFLOP/s (16384 per instruction)
//
// 2-vCPU Intel Xeon with AMX (family 6 model 143 class; KVM), 2026-12-04: see docs/performance.md.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "amx_bf16_tiles.h"

// n rounds of 4 tdpbf16ps into tmm0-3 from tmm4 (x) and tmm5 (w); reload: x reloaded each time
static double run(int64_t n, bool reload) {
  alignas(64) static thread_local uint16_t buf[2][512];
  for (int i = 0; i < 512; ++i) buf[0][i] = buf[1][i] = 0x3f80;  // 1.0
  configure();
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, buf[0], 64);
  _tile_loadd(5, buf[1], 64);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    if (reload) {
      _tile_loadd(4, buf[0], 64); _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, buf[0], 64); _tile_dpbf16ps(1, 6, 5);
      _tile_loadd(4, buf[0], 64); _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, buf[0], 64); _tile_dpbf16ps(3, 6, 5);
    } else {
      _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 5);
      _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(3, 4, 5);
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  alignas(64) float out[256];
  _tile_stored(0, out, 64);
  _tile_release();
  if (out[0] < 0) std::printf("impossible\n");
  return s;
}

int main() {
  if (!amx_ok()) {
    std::printf("skipped: this CPU (or its kernel) offers no AMX-BF16 tiles\n");
    return 0;
  }
  const int64_t n = 20'000'000;
  for (bool reload : {false, true}) {
    for (int threads : {1, 2}) {
      std::vector<double> secs(threads);
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { secs[t] = run(n, reload); });
      for (auto& th : pool) th.join();
      double worst = 0;
      for (double s : secs) worst = s > worst ? s : worst;
      const double g = threads * 4.0 * n / worst / 1e9;
      std::printf("%d thread(s)%s: %.2f G tdpbf16ps/s = %.0f GFLOP/s\n", threads,
                  reload ? ", x tile reloaded" : "", g, g * 16384);
    }
  }
}
