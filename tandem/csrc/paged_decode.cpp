// Decode attention that reads K/V pages in place (CPU).
//
// One query token per sequence attends to keys [0, seq_len) of that sequence, which live
// in the paged cache at slot block_table[t / page_size] * page_size + t % page_size:
//
//   q            [B, H, D]                 contiguous, float32 or bfloat16
//   k/v_cache    [P, page_size, Hkv, D]    contiguous (same dtype as q)
//   block_tables [B, W] int64              pages of each row (W * page_size >= seq_len)
//   seq_lens     [B] int64                 >= 1
//   out          [B, H, D]
//
// Work is split over (row, kv head): the G = H / Hkv query heads that share a kv head read
// each key and value once. Scores, softmax and the weighted sum run in float32 (as the
// SDPA path does), two passes over the keys: scores, then exp-weights times values (one
// pass per query head, accumulating in registers; the head's values stay in L2). For
// float32 with head_dim 64 or 128 on AVX-512, `item_fast` serves all G heads of a kv head
// in one pass over the keys and one over the values.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float load(const T* p, int64_t i) { return static_cast<float>(p[i]); }

// dot(a, b) over D floats, and acc += p * v: the two inner loops. The AVX-512 versions
// keep 16-lane partial sums and reduce once per dot (D a multiple of 16); the generic
// ones serve every other dtype and width.
template <typename T>
inline float dot(const float* a, const T* b, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * load(b, d);
  return s;
}

// sg[t] = exp(sg[t] - m) for t < L; returns the sum.
inline float exp_shifted(float* sg, int64_t L, float m) {
  float z = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  // exp(x) = 2^n * exp(r), x = n ln2 + r, |r| <= ln2 / 2; exp(r) by its Taylor polynomial
  // to degree 7 (relative error < 2e-8 on that range: below float32's own rounding).
  const __m512 mv = _mm512_set1_ps(m), log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2 = _mm512_set1_ps(0.693147180559945309f);
  __m512 zv = _mm512_setzero_ps();
  for (; t + 16 <= L; t += 16) {
    __m512 x = _mm512_sub_ps(_mm512_loadu_ps(sg + t), mv);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // exp below that is 0 in float32 anyway
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
    const __m512 r = _mm512_fnmadd_ps(n, ln2, x);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    const __m512 e = _mm512_scalef_ps(p, n);
    _mm512_storeu_ps(sg + t, e);
    zv = _mm512_add_ps(zv, e);
  }
  z = _mm512_reduce_add_ps(zv);
#endif
  for (; t < L; ++t) z += (sg[t] = std::exp(sg[t] - m));
  return z;
}

// out[0:D) = sum_t p[t] * v_t[0:D) over the L values of one kv head: 16 lanes of the head
// dimension at a time, the accumulator held in a register across all t.
template <typename T>
inline void weighted_sum(const float* p, const T* vc, const int64_t* rows, int64_t L,
                         int64_t D, float* out) {
  std::fill(out, out + D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const T* vp = vc + rows[t];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] += p[t] * load(vp, d);
  }
}

#if defined(__AVX512F__)
template <>
inline float dot<float>(const float* a, const float* b, int64_t D) {
  if (D % 16) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
    return s;
  }
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
}

template <>
inline void weighted_sum<float>(const float* p, const float* vc, const int64_t* rows,
                                int64_t L, int64_t D, float* out) {
  if (D % 16) {
    std::fill(out, out + D, 0.f);
    for (int64_t t = 0; t < L; ++t)
      for (int64_t d = 0; d < D; ++d) out[d] += p[t] * vc[rows[t] + d];
    return;
  }
  for (int64_t d = 0; d < D; d += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; ++t)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(vc + rows[t] + d), acc);
    _mm512_storeu_ps(out + d, acc);
  }
}
#endif

#if defined(__AVX512F__)
// float32, D = 16 * ND (ND = 4 or 8: head_dim 64 or 128): the G query heads of one kv head
// together. Each key row is loaded once for all G dot products, and each value row once
// for all G weighted sums, which keep G * ND independent accumulators (no FMA chain of
// length L, as one head and one 16-lane slice at a time would have).
template <int ND>
void item_fast(const float* q, const float* kc, const float* vc, const int64_t* rows,
               int64_t L, int64_t G, float scale, float* scores, float* out) {
  constexpr int kAcc = 16 / ND;  // query heads per pass: kAcc * ND accumulators
  for (int64_t g0 = 0; g0 < G; g0 += kAcc) {
    const int64_t ng = std::min<int64_t>(kAcc, G - g0);
    __m512 qv[kAcc][ND];
    for (int64_t g = 0; g < ng; ++g)
      for (int d = 0; d < ND; ++d) qv[g][d] = _mm512_loadu_ps(q + (g0 + g) * 16 * ND + 16 * d);
    for (int64_t t = 0; t < L; ++t) {
      __m512 kv[ND];
      for (int d = 0; d < ND; ++d) kv[d] = _mm512_loadu_ps(kc + rows[t] + 16 * d);
      for (int64_t g = 0; g < ng; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int d = 1; d < ND; ++d) acc = _mm512_fmadd_ps(qv[g][d], kv[d], acc);
        scores[(g0 + g) * L + t] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
  }
  std::vector<float> z(G);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    z[g] = exp_shifted(sg, L, *std::max_element(sg, sg + L));
  }
  for (int64_t g0 = 0; g0 < G; g0 += kAcc) {
    const int64_t ng = std::min<int64_t>(kAcc, G - g0);
    __m512 acc[kAcc][ND];
    for (int64_t g = 0; g < kAcc; ++g)
      for (int d = 0; d < ND; ++d) acc[g][d] = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; ++t) {
      __m512 vv[ND];
      for (int d = 0; d < ND; ++d) vv[d] = _mm512_loadu_ps(vc + rows[t] + 16 * d);
      for (int64_t g = 0; g < ng; ++g) {
        const __m512 p = _mm512_set1_ps(scores[(g0 + g) * L + t]);
        for (int d = 0; d < ND; ++d) acc[g][d] = _mm512_fmadd_ps(p, vv[d], acc[g][d]);
      }
    }
    for (int64_t g = 0; g < ng; ++g) {
      const __m512 s = _mm512_set1_ps(z[g0 + g]);  // divided, as the generic path does
      for (int d = 0; d < ND; ++d)
        _mm512_storeu_ps(out + (g0 + g) * 16 * ND + 16 * d, _mm512_div_ps(acc[g][d], s));
    }
  }
}
#endif

template <typename T>
void decode(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
            T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t ps, int64_t W,
            float scale) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    std::vector<int64_t> rows;  // element offset of key/value t of this (row, kv head)
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / Hkv, kvh = item % Hkv, L = lens[b];
      rows.resize(L);
      for (int64_t t = 0, page = 0; t < L; ++page)  // no division in the loops below
        for (int64_t slot = 0; slot < ps && t < L; ++slot, ++t)
          rows[t] = ((bt[b * W + page] * ps + slot) * Hkv + kvh) * D;
      scores.assign(G * L, 0.f);
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {
        T* o = out + (b * H + kvh * G) * D;  // the G heads of this kv head are adjacent
        if (D == 64) {
          item_fast<4>(q + (b * H + kvh * G) * D, kc, vc, rows.data(), L, G, scale, scores.data(), o);
          continue;
        }
        if (D == 128) {
          item_fast<8>(q + (b * H + kvh * G) * D, kc, vc, rows.data(), L, G, scale, scores.data(), o);
          continue;
        }
      }
#endif
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(q, (b * H + kvh * G + g) * D + d);
      for (int64_t t = 0; t < L; ++t)
        for (int64_t g = 0; g < G; ++g)
          scores[g * L + t] = dot(qf.data() + g * D, kc + rows[t], D) * scale;
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        const float z = exp_shifted(sg, L, *std::max_element(sg, sg + L));
        float* ag = acc.data() + g * D;
        weighted_sum(sg, vc, rows.data(), L, D, ag);
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + kvh * G + g) * D + d] = static_cast<T>(ag[d] / z);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [B,H,D], caches [P,ps,Hkv,D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t ps = k_cache.size(1), Hkv = k_cache.size(2), W = bt.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0 && bt.size(0) == B && lens.size(0) == B,
              "shape mismatch");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                     v_cache.data_ptr<scalar_t>(), bt.data_ptr<int64_t>(),
                     lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, Hkv, D, ps, W,
                     static_cast<float>(scale));
  });
  return out;
}
