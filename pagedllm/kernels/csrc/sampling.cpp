// Random sampling of whole rows in one C++ pass per row, for the sampler's random rows:
//   sample_rows(logits, temperature, top_k, top_p, min_p, u)
// What it computes is the sampler's full path (sample/sampler.py, vLLM v1's order): z = logits / T,
// min-p (drop ids whose probability is below min_p times the top one), top-k (keep the ids at
// least as large as the k-th largest), top-p (keep the smallest set of the largest ids whose
// probability, renormalised after the filters before it, reaches p), then one draw: the kept ids'
// CDF, in id order, inverted at u times their mass. Each filter keeps the ids above a threshold,
// so the kept set is {e >= eps}, e the unnormalised probability, and nothing is sorted over the
// whole vocabulary.
//
// Per row (rows in parallel; the row's e in a scratch row):
//   1. m = max z (a NaN or an infinite max: the row gets -1, "not finite", as the full path's
//      draw finds no id there);
//   2. e_i = exp(z_i - m) (simd.h's exp, vectors and tail alike; 0 where z_i - m < -87: an -inf
//      (banned) logit, or a probability below float's normal range); the top id's e is 1;
//   3. min-p: eps = min_p;
//   4. top-k: the k-th largest e >= eps (a heap of the k largest, vectors of 8 that beat none of
//      them skipped whole; nth_element beyond 4,096);
//   5. top-p: the mass of the e >= eps, then the ids that can hold the nucleus's edge (those
//      below c hold at most c V of the mass: c = (1 - p) mass / 2V leaves them out), sorted (or
//      bucketed by their float's top bits first, when there are many) and walked from the
//      largest until their running mass reaches p of it;
//   6. the draw: the kept e summed per block of 64 ids (float) and over the blocks in order
//      (float64); the block where the running sum passes min(u S, the float64 below S), then the
//      id inside it. An id of probability 0 is never drawn.
// Ties at a threshold are all kept (the full path's sort keeps some of a tie at the top-p edge,
// which ones depending on the sort; its top-k keeps them all).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;  // ids a block sum covers (the draw walks blocks, then one block)
constexpr float kExpFloor = -87.f;  // below: e = 0 (exp_nonpositive clamps at -87.3)
constexpr int64_t kHeapMaxK = 4096;  // top-k up to this: a heap of the k largest; beyond, nth_element
constexpr size_t kSortMax = 8192;  // top-p candidates up to this: sorted; beyond, bucketed first

// m = max of l / t; false when a value is NaN or the max is not finite
bool row_max(const float* l, int64_t v, float t, float& m) {
  bool nan;
  m = pagedllm_simd::row_max<true>(l, v, t, nan);
  return !nan && std::isfinite(m);
}

// e_i = exp(l_i / t - m), 0 below kExpFloor (the top id's e is exactly 1)
void row_exp(const float* l, int64_t v, float t, float m, float* e) {
  int64_t i = 0;
#ifdef PAGEDLLM_AVX2
  const __m256 tv = _mm256_set1_ps(t), mv = _mm256_set1_ps(m), floor = _mm256_set1_ps(kExpFloor);
  for (; i + 8 <= v; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(l + i), tv), mv);
    const __m256 x = pagedllm_simd::exp_nonpositive(d);
    _mm256_storeu_ps(e + i, _mm256_and_ps(x, _mm256_cmp_ps(d, floor, _CMP_GE_OQ)));
  }
#endif
  for (; i < v; ++i) {
    const float d = l[i] / t - m;
    e[i] = d >= kExpFloor ? pagedllm_simd::exp_nonpositive1(d) : 0.f;
  }
}

// bs[j] = the sum of the e >= eps in block j (float within the block); returns their sum in
// block order (float64), the order the draw walks them in
double block_sums(const float* e, int64_t v, float eps, std::vector<double>& bs) {
  const int64_t blocks = (v + kBlock - 1) / kBlock;
  bs.resize(blocks);
  double total = 0.0;
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t i0 = j * kBlock, i1 = std::min(v, i0 + kBlock);
    float sum = 0.f;
    int64_t i = i0;
#ifdef PAGEDLLM_AVX2
    if (i1 - i0 == kBlock) {
      const __m256 ev = _mm256_set1_ps(eps);
      __m256 acc = _mm256_setzero_ps();
      for (; i < i1; i += 8) {
        const __m256 x = _mm256_loadu_ps(e + i);
        acc = _mm256_add_ps(acc, _mm256_and_ps(x, _mm256_cmp_ps(x, ev, _CMP_GE_OQ)));
      }
      sum = pagedllm_simd::hsum(acc);
    }
#endif
    for (; i < i1; ++i) sum += e[i] >= eps ? e[i] : 0.f;
    bs[j] = sum;
    total += sum;
  }
  return total;
}

// the values e >= c (c > 0) into out
void collect(const float* e, int64_t v, float c, std::vector<float>& out) {
  out.clear();
  int64_t i = 0;
#ifdef PAGEDLLM_AVX2
  const __m256 cv = _mm256_set1_ps(c);
  for (; i + 8 <= v; i += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + i), cv, _CMP_GE_OQ));
    while (mask) {
      const int b = __builtin_ctz(mask);
      out.push_back(e[i + b]);
      mask &= mask - 1;
    }
  }
#endif
  for (; i < v; ++i)
    if (e[i] >= c) out.push_back(e[i]);
}

// The k-th largest of the e >= eps (k >= 1), or eps when fewer than k are
float kth_largest(const float* e, int64_t v, float eps, int64_t k, std::vector<float>& buf) {
  if (k > kHeapMaxK) {
    collect(e, v, eps, buf);
    if (static_cast<int64_t>(buf.size()) < k) return eps;
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<float>());
    return buf[k - 1];
  }
  // a min-heap of the k largest so far; a vector of 8 that beats none of them is skipped whole
  buf.clear();
  const auto offer = [&](float x) {
    if (x < eps) return;
    if (static_cast<int64_t>(buf.size()) < k) {
      buf.push_back(x);
      std::push_heap(buf.begin(), buf.end(), std::greater<float>());
    } else if (x > buf.front()) {
      std::pop_heap(buf.begin(), buf.end(), std::greater<float>());
      buf.back() = x;
      std::push_heap(buf.begin(), buf.end(), std::greater<float>());
    }
  };
  int64_t i = 0;
#ifdef PAGEDLLM_AVX2
  for (; i + 8 <= v; i += 8) {
    const float floor = static_cast<int64_t>(buf.size()) < k ? eps : std::nextafter(buf.front(), 2.f);
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + i), _mm256_set1_ps(floor), _CMP_GE_OQ));
    while (mask) {
      offer(e[i + __builtin_ctz(mask)]);
      mask &= mask - 1;
    }
  }
#endif
  for (; i < v; ++i) offer(e[i]);
  return static_cast<int64_t>(buf.size()) < k ? eps : buf.front();
}

// The smallest value of the nucleus of the e >= eps: walking them from the largest, the one at
// which their running mass reaches p total (total: the mass of all e >= eps); ties all kept
float nucleus_edge(const float* e, int64_t v, float eps, float p, double total, std::vector<float>& buf) {
  const double goal = static_cast<double>(p) * total;
  // the ids below c hold at most c v <= (1 - p) total / 2 of the mass: the nucleus stops above
  const double c = std::max<double>(eps, 0.5 * (1.0 - p) * total / static_cast<double>(v));
  collect(e, v, static_cast<float>(std::min(c, 1.0)), buf);
  if (buf.empty()) return eps;
  double run = 0.0;
  auto walk = [&](std::vector<float>::iterator b, std::vector<float>::iterator end) -> std::pair<bool, float> {
    std::sort(b, end, std::greater<float>());
    for (auto it = b; it != end; ++it) {
      run += *it;
      if (run >= goal) return {true, *it};
    }
    return {false, 0.f};
  };
  if (buf.size() > kSortMax) {
    // bucket the candidates by the top bits of their float (a power of two in 16 steps), walk
    // the buckets' masses, and sort only the bucket where the goal falls
    const auto key = [](float x) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      return static_cast<int>((0x3F800000u - std::min(u, 0x3F800000u)) >> 19);
    };
    constexpr int kKeys = (0x3F800000 >> 19) + 1;
    std::vector<double> mass(kKeys, 0.0);
    for (float x : buf) mass[key(x)] += x;
    int b = 0;
    while (b + 1 < kKeys && run + mass[b] < goal) run += mass[b++];
    auto mid = std::partition(buf.begin(), buf.end(), [&](float x) { return key(x) == b; });
    const auto [found, edge] = walk(buf.begin(), mid);
    if (found) return edge;
    return mid == buf.begin() ? eps : *std::min_element(buf.begin(), mid);
  }
  const auto [found, edge] = walk(buf.begin(), buf.end());
  return found ? edge : buf.back();  // rounding left the goal unreached: all the candidates
}

// One id of the e >= eps by the inverse of their CDF in id order at u (bs, total: block_sums')
int64_t draw(const float* e, int64_t v, float eps, const std::vector<double>& bs, double total, double u) {
  const double target = std::min(u * total, std::nextafter(total, 0.0));
  double run = 0.0;
  int64_t j = 0;
  const int64_t blocks = static_cast<int64_t>(bs.size());
  while (j + 1 < blocks && run + bs[j] <= target) run += bs[j++];
  int64_t last = -1;
  for (int64_t i = j * kBlock, i1 = std::min(v, i + kBlock); i < i1; ++i)
    if (e[i] >= eps) {
      run += e[i];
      last = i;
      if (run > target) return i;
    }
  return last;  // the block's own float64 sum fell short of its float one by rounding
}

struct Filters {
  int64_t top_k;  // >= V: none
  float top_p;    // >= 1: none
  float min_p;    // <= 0: none
};

struct Scratch {
  std::vector<float> e, buf;
  std::vector<double> bs;
};

int64_t sample_row(const float* l, int64_t v, float t, const Filters& f, double u, Scratch& s) {
  float m;
  if (!row_max(l, v, t, m)) return -1;
  s.e.resize(v);
  const float* e = s.e.data();
  row_exp(l, v, t, m, s.e.data());
  // every e > 0 is at least exp(-87) > FLT_MIN: eps = FLT_MIN keeps them all
  float eps = std::numeric_limits<float>::min();
  if (f.min_p > 0.f) eps = std::max(eps, f.min_p);
  if (f.top_k < v) eps = std::max(eps, kth_largest(e, v, eps, std::max<int64_t>(f.top_k, 1), s.buf));
  double total = block_sums(e, v, eps, s.bs);
  if (f.top_p < 1.f) {
    const float edge = nucleus_edge(e, v, eps, f.top_p, total, s.buf);
    if (edge > eps) {
      eps = edge;
      total = block_sums(e, v, eps, s.bs);
    }
  }
  if (!(total > 0.0)) return -1;
  return draw(e, v, eps, s.bs, total, u);
}

}  // namespace

// logits [N, V] float32; temperature [N] float32 (> 0); top_k [N] int64 (V or more: none),
// top_p [N] float32 (1: none), min_p [N] float32 (0: none), each optional; u [N] float64 in [0, 1)
// -> [N] int64 ids, -1 for a row whose logits are not finite
at::Tensor sample_rows(const at::Tensor& logits_in, const at::Tensor& temperature_in,
                       const c10::optional<at::Tensor>& top_k_in, const c10::optional<at::Tensor>& top_p_in,
                       const c10::optional<at::Tensor>& min_p_in, const at::Tensor& u_in) {
  TORCH_CHECK(logits_in.device().is_cpu() && logits_in.dim() == 2, "logits must be a [N, V] CPU tensor");
  const at::Tensor logits = logits_in.to(at::kFloat).contiguous();
  const int64_t n = logits.size(0), v = logits.size(1);
  const auto column = [n](const at::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == n, name, " must hold one value per row (", n, "), got ", t.sizes());
    return t.to(at::kCPU, type).contiguous();
  };
  const at::Tensor temperature = column(temperature_in, at::kFloat, "temperature");
  const at::Tensor u = column(u_in, at::kDouble, "u");
  const at::Tensor top_k = top_k_in ? column(*top_k_in, at::kLong, "top_k") : at::Tensor();
  const at::Tensor top_p = top_p_in ? column(*top_p_in, at::kFloat, "top_p") : at::Tensor();
  const at::Tensor min_p = min_p_in ? column(*min_p_in, at::kFloat, "min_p") : at::Tensor();
  const float* tp = temperature.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(tp[r] > 0.f, "temperature must be > 0 for a random row, got ", tp[r]);
  at::Tensor out = at::empty({n}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* lp = logits.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    Scratch scratch;
    for (int64_t r = r0; r < r1; ++r) {
      const Filters f{top_k.defined() ? top_k.data_ptr<int64_t>()[r] : v,
                      top_p.defined() ? top_p.data_ptr<float>()[r] : 1.f,
                      min_p.defined() ? min_p.data_ptr<float>()[r] : 0.f};
      op[r] = sample_row(lp + r * v, v, tp[r], f, up[r], scratch);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor? top_k, Tensor? top_p, Tensor? min_p, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("sample_rows", &sample_rows); }
