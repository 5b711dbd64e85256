// The greedy token of a bf16 output head without its full logits: an int8 pass over a Q8_0 copy
// of the head, a proven bound on how far each of its logits can be from the bf16 one, and the
// bf16 logits of the few ids the bound cannot rule out.
//
//   bf16_head_argmax(x [M, K] float32, w: the head's bf16 x8 records, wq: its Q8_0 x8 copy,
//                    norms [3, N] float32, k, step_rows) -> [M] int64
//
// Row m's token is the id linear_x8 would give its largest logit in a call of step_rows rows (0:
// M; the step's rows, of which x holds the plain greedy ones), the first of equals, as the
// sampler's argmax takes it; or -1 where this op does not decide (the caller then computes the
// logits): a row whose x, seen x or int8 logits are not finite, a variant whose rows' bits depend
// on the batch at M or step_rows rows (pagedllm_bf16::seen_x's `alone`), a variant with no
// integer kernels (pagedllm_ggml::q8_int_linear).
//
// Why it is exact. Let x^ be x as the bf16 kernels multiply it (seen_x), x~ as the int8 kernels
// quantize it (d q per 32 values), w_i row i of the head and w~_i its Q8_0 copy. Row i's logit
// l_i (the kernel's) and int8 value a_i (the Q8_0 kernels') satisfy, with t_i = x^ . w_i exactly:
//   |l_i - t_i| <= g_k |x^| |w_i|                       (K float32 additions of exact products;
//                                                         g_k = (K + 64) 2^-24)
//   |a_i - t_i| <= |x^ - x~| |w_i| + |x~| |w_i - w~_i|   (x^ w - x~ w~ = (x^ - x~) w + x~ (w - w~),
//                 + g_a |x~| |w~_i|                      Cauchy-Schwarz; the int8 dots are exact,
//                                                         the float updates add at most g_a =
//                                                         (K / 32 + 64) 2^-24 of |x~| |w~_i|)
// (|.| the 2-norm; the norms of w_i, w_i - w~_i and w~_i are norms[0..2], made at load in float64
// and rounded up), plus c0 = 2^-110 (|x^|_1 + |x~|_1 + K) for flushed denormals. So
// |a_i - l_i| <= B_i, and this op takes B_i (1 + 2^-10) + 2^-20 |a_i| as its bound, a margin that
// covers its own float32 rounding of a_i +- B_i. With L = max_j (a_j - B_j) (reached at some j*,
// l_j* >= L), an id with a_i + B_i < L has l_i < L <= l_j*: it is not the argmax, nor tied with it.
// The ids left (one, most rows: then it is the token) get their bf16 logits from the same kernel
// (group_logits: the bits linear_x8 gives them, row by row) and the first largest wins.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kRows = 8;  // rows of an x8 group

struct RowBound {  // B_i = (alpha |w_i| + beta |w_i - w~_i| + gamma |w~_i| + c0) (1 + 2^-10) + 2^-20 |a_i|
  float alpha, beta, gamma, c0;
};

// the row's bound terms, or false where its x (or x as the kernels see it) is not finite
bool row_bound(const float* x, const float* seen, const float* xt, int64_t k, RowBound& b) {
  double ex = 0, nt = 0, ns = 0, l1 = 0;
  for (int64_t i = 0; i < k; ++i) {
    if (!std::isfinite(x[i]) || !std::isfinite(seen[i])) return false;
    const double s = seen[i], t = xt[i];
    ex += (s - t) * (s - t);
    nt += t * t;
    ns += s * s;
    l1 += std::fabs(s) + std::fabs(t);
  }
  const double u = std::ldexp(1.0, -24), gk = (k + 64) * u, ga = (k / 32 + 64) * u;
  const double up = 1 + std::ldexp(1.0, -20);  // the float32 casts below round up past this
  b.alpha = static_cast<float>((std::sqrt(ex) + gk * std::sqrt(ns)) * up);
  b.beta = static_cast<float>(std::sqrt(nt) * up);
  b.gamma = static_cast<float>(ga * std::sqrt(nt) * up);
  b.c0 = static_cast<float>(std::ldexp(l1 + k, -110) * up);
  return true;
}

inline float bound1(const RowBound& b, float wn, float en, float tn, float a) {
  return (b.alpha * wn + b.beta * en + b.gamma * tn + b.c0) * (1.f + 0x1p-10f) + 0x1p-20f * std::fabs(a);
}

// ids whose a_i + B_i reaches max_j (a_j - B_j), in order; false where an a_i is not finite
bool candidates(const float* a, const float* wn, const float* en, const float* tn, int64_t n, const RowBound& b,
                std::vector<int64_t>& out) {
  out.clear();
  float lo = -std::numeric_limits<float>::infinity();
  bool bad = false;
  int64_t i = 0;
#ifdef PAGEDLLM_AVX2
  // each lane keeps its own running max of a - B: a lower bound of the row's, so an id it lets
  // through may be dropped at the end, and none it drops could have stayed
  const __m256 al = _mm256_set1_ps(b.alpha), be = _mm256_set1_ps(b.beta), ga = _mm256_set1_ps(b.gamma),
               c0 = _mm256_set1_ps(b.c0), grow = _mm256_set1_ps(1.f + 0x1p-10f), rel = _mm256_set1_ps(0x1p-20f),
               sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 lv = _mm256_set1_ps(lo), badv = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i), mag = _mm256_andnot_ps(sign, av);
    badv = _mm256_or_ps(badv, _mm256_cmp_ps(mag, inf, _CMP_NLT_UQ));  // inf or NaN
    __m256 bv = _mm256_fmadd_ps(al, _mm256_loadu_ps(wn + i),
                                _mm256_fmadd_ps(be, _mm256_loadu_ps(en + i),
                                                _mm256_fmadd_ps(ga, _mm256_loadu_ps(tn + i), c0)));
    bv = _mm256_fmadd_ps(bv, grow, _mm256_mul_ps(rel, mag));
    lv = _mm256_max_ps(lv, _mm256_sub_ps(av, bv));
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(av, bv), lv, _CMP_GE_OQ));
    if (hit)
      for (int j = 0; j < 8; ++j)
        if (hit >> j & 1) out.push_back(i + j);
  }
  bad = _mm256_movemask_ps(badv) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, lv);
  lo = *std::max_element(lanes, lanes + 8);
#endif
  for (; i < n; ++i) {
    if (!std::isfinite(a[i])) bad = true;
    const float bi = bound1(b, wn[i], en[i], tn[i], a[i]);
    lo = std::max(lo, a[i] - bi);
    if (a[i] + bi >= lo) out.push_back(i);
  }
  if (bad) return false;
  size_t kept = 0;
  for (const int64_t id : out)
    if (a[id] + bound1(b, wn[id], en[id], tn[id], a[id]) >= lo) out[kept++] = id;
  out.resize(kept);
  return true;
}

at::Tensor bf16_head_argmax(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& wq,
                            const at::Tensor& norms, int64_t k, int64_t step_rows) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "x must be [M, ", k, "]");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(1) == 16 * k,
              "w must be a bf16 x8 weight [N / 8, ", 16 * k, "] (uint8)");
  const int64_t m = x_in.size(0), n = w.size(0) * kRows;
  TORCH_CHECK(step_rows == 0 || step_rows >= m, "step_rows (", step_rows, ") must be 0 or at least x's ", m,
              " rows");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.dim() == 2 && norms.size(0) == 3 &&
                  norms.size(1) == n,
              "norms must be a contiguous float32 [3, ", n, "]");
  TORCH_CHECK(wq.dim() == 2 && wq.size(0) == w.size(0), "the Q8_0 copy must have the head's ", w.size(0), " groups");
  at::Tensor tokens = at::full({m}, -1, x_in.options().dtype(at::kLong));
  if (m == 0) return tokens;
  // the rows' bits must be those the step's full head call (step_rows of them) would give
  const pagedllm_bf16::SeenX seen = pagedllm_bf16::seen_x(x_in, k, std::max(m, step_rows));
  if (!seen.alone) return tokens;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor a, xt;
  if (!pagedllm_ggml::q8_int_linear(x, wq, k, a, xt)) return tokens;
  const float *xp = x.data_ptr<float>(), *sp = seen.x.data_ptr<float>(), *tp = xt.data_ptr<float>(),
              *ap = a.data_ptr<float>(), *np = norms.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> cand, groups;
    std::vector<float> logits;
    for (int64_t r = r0; r < r1; ++r) {
      RowBound b;
      if (!row_bound(xp + r * k, sp + r * k, tp + r * k, k, b)) continue;
      if (!candidates(ap + r * n, np, np + n, np + 2 * n, n, b, cand) || cand.empty()) continue;
      if (cand.size() == 1) {
        out[r] = cand[0];
        continue;
      }
      groups.clear();
      for (const int64_t id : cand)
        if (groups.empty() || groups.back() != id / kRows) groups.push_back(id / kRows);
      logits.resize(groups.size() * kRows);
      pagedllm_bf16::group_logits(seen, r, w, k, groups.data(), static_cast<int64_t>(groups.size()), logits.data());
      int64_t best = -1;
      float top = 0.f;
      size_t g = 0;
      for (const int64_t id : cand) {  // ids in order: the first of equal logits wins
        while (groups[g] != id / kRows) ++g;
        const float v = logits[g * kRows + id % kRows];
        if (std::isnan(v)) {
          best = -1;
          break;
        }
        if (best < 0 || v > top) best = id, top = v;
      }
      out[r] = best;
    }
  });
  return tokens;
}

float round_up(double v) {  // the float32 nearest v from above
  float f = static_cast<float>(v);
  if (static_cast<double>(f) < v) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}

// The screen's Q8_0 copy of a bf16 x8 head [N / 8, 16 k] and its norms [3, N] (|w_i|, |w_i - w~_i|,
// |w~_i|, float64 rounded up): each 32 values of a row as d = fp16(max |w| / 127), q = round(w / d)
// (nearest, ties even; within +-127), in ggml_x8.cpp's Q8_0 records (d[8] fp16, then byte
// 16 + 32 c + 4 r + i = q[r][4 c + i]). The copy need not be the best Q8_0 of w: the norms are
// those of the values it holds. Empty tensors where a scale is not a finite fp16.
std::tuple<at::Tensor, at::Tensor> bf16_head_q8_copy(const at::Tensor& w, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  k % 32 == 0 && w.size(1) == 16 * k,
              "w must be a bf16 x8 weight [N / 8, 16 k] with k a multiple of 32");
  constexpr int64_t kRec = 16 + 8 * 32;  // one Q8_0 record: 8 rows x 32 values
  const int64_t groups = w.size(0), n = groups * kRows, nb = k / 32;
  at::Tensor wq = pagedllm_ops::empty_weights(groups, nb * kRec);
  at::Tensor norms = at::empty({3, n}, at::kFloat);
  uint8_t* dst = wq.data_ptr<uint8_t>();
  float* np = norms.data_ptr<float>();
  std::atomic<bool> finite{true};
  constexpr int64_t kChunkGroups = 256;  // rows widened at a time (2,048 of k floats: ~7 MB at k 896)
  for (int64_t c0 = 0; c0 < groups; c0 += kChunkGroups) {
    const int64_t c1 = std::min(groups, c0 + kChunkGroups);
    const at::Tensor rows = pagedllm_bf16::widen_rows(w, k, c0, c1);  // [8 (c1 - c0), k]
    const float* rp = rows.data_ptr<float>();
    at::parallel_for(c0, c1, 16, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int r = 0; r < kRows; ++r) {
          const float* row = rp + ((g - c0) * kRows + r) * k;
          double wn = 0, en = 0, tn = 0;
          for (int64_t b = 0; b < nb; ++b) {
            float amax = 0.f;
            for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(row[32 * b + i]));
            const at::Half dh = static_cast<at::Half>(amax / 127.f);
            const float d = static_cast<float>(dh);
            if (!std::isfinite(d) || !std::isfinite(amax)) finite = false;
            uint8_t* rec = dst + g * nb * kRec + b * kRec;
            std::memcpy(rec + 2 * r, &dh, 2);
            for (int i = 0; i < 32; ++i) {
              const float v = row[32 * b + i];
              const float q = d > 0.f ? std::min(127.f, std::max(-127.f, std::nearbyint(v / d))) : 0.f;
              rec[16 + 32 * (i / 4) + 4 * r + i % 4] = static_cast<uint8_t>(static_cast<int8_t>(q));
              const double t = static_cast<double>(d) * q;
              wn += static_cast<double>(v) * v;
              en += (v - t) * (v - t);
              tn += t * t;
            }
          }
          const int64_t id = g * kRows + r;
          np[id] = round_up(std::sqrt(wn));
          np[n + id] = round_up(std::sqrt(en));
          np[2 * n + id] = round_up(std::sqrt(tn));
        }
    });
  }
  if (!finite) return {at::empty({0}, at::kByte), at::empty({0}, at::kFloat)};
  return {wq, norms};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("bf16_head_argmax(Tensor x, Tensor w, Tensor wq, Tensor norms, int k, int step_rows=0) -> Tensor");
  m.def("bf16_head_q8_copy(Tensor w, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("bf16_head_argmax", &bf16_head_argmax);
  m.impl("bf16_head_q8_copy", &bf16_head_q8_copy);
}
