// The driver the peak benchmarks share: the same register-only loop on n threads at once, and
// their summed rate. `run_one(seed, sink)` runs one thread's loop and returns its instructions
// per second; the sink keeps the compiler from dropping the loop.
#pragma once

#include <thread>
#include <vector>

template <typename RunOne>
double run_threads(int threads, RunOne run_one) {
  std::vector<double> rate(threads);
  std::vector<float> sink(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; t++)
    pool.emplace_back([&, t] { rate[t] = run_one(1.0f + t, &sink[t]); });
  for (auto& th : pool) th.join();
  double total = 0;
  for (double r : rate) total += r;
  return total;
}
