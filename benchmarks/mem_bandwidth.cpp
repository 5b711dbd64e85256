// Memory read bandwidth: 1 thread, then 2 threads each reading its half, of a buffer far
// larger than the last-level cache (what one decode step does with the weights).
//
//   g++ -O3 -march=native -pthread benchmarks/mem_bandwidth.cpp -o /tmp/mem_bandwidth
//   /tmp/mem_bandwidth [MiB]      # default 1024 MiB; best of 5 passes, GB/s (10^9 bytes)
//
// 2-vCPU AMD EPYC Zen 4 (AVX-512 BF16, no AMX), quiet, best of 3, 2026-12-02: 23.1 GB/s on
// 1 thread, 30.7 GB/s on 2; busy (load 5-6), 7.1 and 11.6 GB/s
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

// Sum of 64-bit words in [p, p + n): four independent accumulators, so the loads, not the
// adds, bound it.
static uint64_t read_range(const uint64_t* p, size_t n) {
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (size_t i = 0; i + 4 <= n; i += 4) {
    s0 += p[i];
    s1 += p[i + 1];
    s2 += p[i + 2];
    s3 += p[i + 3];
  }
  return s0 + s1 + s2 + s3;
}

// Bytes per second of `threads` threads each reading an equal share of buf once.
static double pass(const uint64_t* buf, size_t words, int threads, uint64_t* sink) {
  std::vector<uint64_t> sums(threads);
  std::vector<std::thread> pool;
  const size_t share = words / threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; t++)
    pool.emplace_back([&, t] { sums[t] = read_range(buf + t * share, share); });
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (uint64_t v : sums) *sink += v;
  return share * threads * sizeof(uint64_t) / s;
}

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 1024;
  const size_t words = mib * 1024 * 1024 / sizeof(uint64_t);
  auto* buf = static_cast<uint64_t*>(std::aligned_alloc(64, words * sizeof(uint64_t)));
  for (size_t i = 0; i < words; i++) buf[i] = i;  // touch every page before timing
  uint64_t sink = 0;
  for (int threads : {1, 2}) {
    double best = 0;
    for (int r = 0; r < 5; r++) best = std::max(best, pass(buf, words, threads, &sink));
    std::printf("%d thread(s): %.1f GB/s read (%zu MiB buffer)\n", threads, best / 1e9, mib);
  }
  std::printf("(checksum %llu)\n", static_cast<unsigned long long>(sink % 1000));
  std::free(buf);
}
