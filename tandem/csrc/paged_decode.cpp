// Decode attention that reads K/V pages in place (CPU).
//
// One query token per sequence attends to keys [0, seq_len) of that sequence, which live
// in the paged cache at slot block_table[t / page_size] * page_size + t % page_size:
//
//   q            [B, H, D]                 contiguous: the caches' dtype, or float32
//   k/v_cache    [P, page_size, Hkv, D]    contiguous, float32, bfloat16 or half (one dtype)
//   block_tables [B, W] int64              pages of each row (W * page_size >= seq_len)
//   seq_lens     [B] int64                 >= 1
//   out          [B, H, D]                 q's dtype
//
// Work is split over (row, kv head): the G = H / Hkv query heads that share a kv head read
// each key and value once. Scores, softmax and the weighted sum run in float32 (as the
// SDPA path does), two passes over the keys: scores, then exp-weights times values. The
// query and the keys and values are widened to float32 as they are loaded (exactly: a
// bfloat16 or half value is a float32 value), the result rounded to q's dtype once at the
// end; so any (q, cache) dtypes give the bits the float32 kernel gives on the widened
// tensors (q.float(), k_cache.float(), v_cache.float()), rounded to q's dtype.
//
// Arithmetic (the same on every path of vec16.h, so the same bits on every CPU):
//   score_t   = hsum(FMA chain over the head dim in 16-lane slices, tail zero-padded) * scale
//   p_t       = exp(score_t - max): the polynomial of vec16.h for whole 16-key blocks,
//               std::exp for the last L % 16 keys; z = hsum(block sums) + the tail, in order
//   out[d]    = (FMA chain over t of p_t * v_t[d]) / z
// `item_fast` serves float32 and bfloat16 caches whose head dim is a multiple of 16 with
// all G query heads of a kv head in one pass over the keys and one over the values (the
// accumulators of as many heads as fit the registers at once); it computes exactly the
// values above. A bfloat16 cache there costs one widening per 16 elements loaded
// (vec16.h `load_bf16`: zero-extend and shift) and half the bytes of a float32 one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace {

using v16::V;

template <typename T>
inline float load(const T* p, int64_t i) { return static_cast<float>(p[i]); }

// 16 keys' or values' elements widened to float32 (exact), and the first n of them.
inline V load_kv(const float* p) { return v16::load(p); }
inline V load_kv(const at::BFloat16* p) {  // a BFloat16 is its 16 bits (c10/util/BFloat16.h)
  return v16::load_bf16(reinterpret_cast<const uint16_t*>(p));
}
template <typename T>
inline V load_kv_n(const T* p, int64_t n) { return v16::load_n(p, n); }
inline V load_kv_n(const at::BFloat16* p, int64_t n) {
  return v16::load_bf16_n(reinterpret_cast<const uint16_t*>(p), n);
}

// dot(a, b) over D elements: 16 lanes at a time, one fixed reduction.
template <typename T>
inline float dot(const float* a, const T* b, int64_t D) {
  V acc = v16::zero();
  for (int64_t d = 0; d < D; d += 16)
    acc = v16::fma(v16::load_n(a + d, D - d), load_kv_n(b + d, D - d), acc);
  return v16::hsum(acc);
}

// sg[t] = exp(sg[t] - m) for t < L; returns the sum.
inline float exp_shifted(float* sg, int64_t L, float m) {
  const V mv = v16::set1(m);
  V zv = v16::zero();
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) {
    const V e = v16::exp_poly(v16::sub(v16::load(sg + t), mv));
    v16::store(sg + t, e);
    zv = v16::add(zv, e);
  }
  float z = v16::hsum(zv);
  for (; t < L; ++t) z += (sg[t] = std::exp(sg[t] - m));
  return z;
}

// out[0:D) = sum_t p[t] * v_t[0:D) over the L values of one kv head, 16 lanes of the head
// dimension at a time, each lane's sum one FMA chain over t.
template <typename T>
inline void weighted_sum(const float* p, const T* vc, const int64_t* rows, int64_t L,
                         int64_t D, float* out) {
  for (int64_t d = 0; d < D; d += 16) {
    V acc = v16::zero();
    for (int64_t t = 0; t < L; ++t)
      acc = v16::fma(v16::set1(p[t]), load_kv_n(vc + rows[t] + d, D - d), acc);
    v16::store_n(out + d, acc, D - d);
  }
}

// The largest divisor of nd that is at most cap (the 16-lane slices of a head one pass of
// the weighted sum keeps in registers).
constexpr int slices_per_pass(int nd, int cap) {
  for (int c = nd < cap ? nd : cap; c > 1; --c)
    if (nd % c == 0) return c;
  return 1;
}

// The keys and values of a row lie a page apart at most, in no order the hardware's
// prefetchers follow (pages are granted in any order, and the other kv heads' rows sit
// between two of this head's), so the kernel prefetches them itself: a key row kAhead
// keys ahead of the one it scores (into L1), the value row of the key it scores (into L2:
// the weighted sum reads it after every score), and a value row kAhead ahead of the one
// it sums (into L1). Hints only: no result changes.
constexpr int64_t kAhead = 8;

// Every cache line of the `bytes` bytes at p, into L1 (locality 3) or L2 (2).
template <int Locality>
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, Locality);
}

// A float32 query, a float32 or bfloat16 cache (KV), D = 16 * ND: the G query heads of one
// kv head together (see the top); out float32.
template <int ND, typename KV>
void item_fast(const float* q, const KV* kc, const KV* vc, const int64_t* rows,
               int64_t L, int64_t G, float scale, float* scores, float* out) {
  constexpr int64_t D = 16 * ND;
  constexpr int64_t kRowBytes = D * static_cast<int64_t>(sizeof(KV));
  for (int64_t t = 0; t < L; ++t) {  // each key row loaded once for all G heads
    if (t + kAhead < L) prefetch_lines<3>(kc + rows[t + kAhead], kRowBytes);
    prefetch_lines<2>(vc + rows[t], kRowBytes);
    V kv[ND];
    for (int d = 0; d < ND; ++d) kv[d] = load_kv(kc + rows[t] + 16 * d);
    for (int64_t g = 0; g < G; ++g) {
      V acc = v16::zero();
      for (int d = 0; d < ND; ++d) acc = v16::fma(v16::load(q + g * D + 16 * d), kv[d], acc);
      scores[g * L + t] = v16::hsum(acc) * scale;
    }
  }
  std::vector<float> z(G);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    z[g] = exp_shifted(sg, L, *std::max_element(sg, sg + L));
  }
  // Each pass: GC heads x DC slices of accumulators, each value row's DC slices loaded once.
  constexpr int DC = slices_per_pass(ND, v16::kRegs);
  constexpr int GC = v16::kRegs / DC > 0 ? v16::kRegs / DC : 1;
  for (int64_t g0 = 0; g0 < G; g0 += GC) {
    const int64_t ng = std::min<int64_t>(GC, G - g0);
    for (int d0 = 0; d0 < ND; d0 += DC) {
      V acc[GC][DC];
      for (int g = 0; g < GC; ++g)
        for (int d = 0; d < DC; ++d) acc[g][d] = v16::zero();
      for (int64_t t = 0; t < L; ++t) {
        if (t + kAhead < L)
          prefetch_lines<3>(vc + rows[t + kAhead] + 16 * d0, DC * 16 * sizeof(KV));
        V vv[DC];
        for (int d = 0; d < DC; ++d) vv[d] = load_kv(vc + rows[t] + 16 * (d0 + d));
        for (int64_t g = 0; g < ng; ++g) {
          const V p = v16::set1(scores[(g0 + g) * L + t]);
          for (int d = 0; d < DC; ++d) acc[g][d] = v16::fma(p, vv[d], acc[g][d]);
        }
      }
      for (int64_t g = 0; g < ng; ++g) {
        const V s = v16::set1(z[g0 + g]);  // divided, as the generic path does
        for (int d = 0; d < DC; ++d)
          v16::store(out + (g0 + g) * D + 16 * (d0 + d), v16::div(acc[g][d], s));
      }
    }
  }
}

template <typename KV>
using FastFn = void (*)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t,
                        float, float*, float*);

// item_fast for head dims 32, 64, 80, 96 and 128; nullptr for the others.
template <typename KV>
inline FastFn<KV> fast_for(int64_t D) {
  switch (D) {
    case 32: return item_fast<2, KV>;
    case 64: return item_fast<4, KV>;
    case 80: return item_fast<5, KV>;
    case 96: return item_fast<6, KV>;
    case 128: return item_fast<8, KV>;
    default: return nullptr;
  }
}

// Q: q's and out's dtype (KV's, or float); KV: the caches'.
template <typename Q, typename KV>
void decode(const Q* q, const KV* kc, const KV* vc, const int64_t* bt, const int64_t* lens,
            Q* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t ps, int64_t W,
            float scale) {
  const int64_t G = H / Hkv;
  constexpr bool kFastKV = std::is_same_v<KV, float> || std::is_same_v<KV, at::BFloat16>;
  constexpr bool kFloatQ = std::is_same_v<Q, float>;
  FastFn<KV> fast = nullptr;
  if constexpr (kFastKV) fast = fast_for<KV>(D);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    std::vector<int64_t> rows;  // element offset of key/value t of this (row, kv head)
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / Hkv, kvh = item % Hkv, L = lens[b];
      const int64_t head0 = (b * H + kvh * G) * D;  // the G heads are adjacent in q and out
      rows.resize(L);
      for (int64_t t = 0, page = 0; t < L; ++page)  // no division in the loops below
        for (int64_t slot = 0; slot < ps && t < L; ++slot, ++t)
          rows[t] = ((bt[b * W + page] * ps + slot) * Hkv + kvh) * D;
      scores.assign(G * L, 0.f);
      if (!kFloatQ || !fast)  // the query in float32 (exact)
        for (int64_t i = 0; i < G * D; ++i) qf[i] = load(q, head0 + i);
      if constexpr (kFastKV) {
        if (fast) {
          if constexpr (kFloatQ) {
            fast(q + head0, kc, vc, rows.data(), L, G, scale, scores.data(), out + head0);
          } else {  // rounded to q's dtype once, as the generic path below does
            fast(qf.data(), kc, vc, rows.data(), L, G, scale, scores.data(), acc.data());
            for (int64_t i = 0; i < G * D; ++i) out[head0 + i] = static_cast<Q>(acc[i]);
          }
          continue;
        }
      }
      for (int64_t t = 0; t < L; ++t)
        for (int64_t g = 0; g < G; ++g)
          scores[g * L + t] = dot(qf.data() + g * D, kc + rows[t], D) * scale;
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        const float z = exp_shifted(sg, L, *std::max_element(sg, sg + L));
        float* ag = acc.data() + g * D;
        weighted_sum(sg, vc, rows.data(), L, D, ag);
        for (int64_t d = 0; d < D; ++d) out[head0 + g * D + d] = static_cast<Q>(ag[d] / z);
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
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must have one shape");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kv_type, "k_cache and v_cache must have one dtype");
  const bool float_q = q.scalar_type() == torch::kFloat32;
  TORCH_CHECK(q.scalar_type() == kv_type || float_q,
              "q must have the caches' dtype or be float32, got ", q.scalar_type(), " over ",
              kv_type);
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_type, "paged_decode", [&] {
    const auto* kc = k_cache.data_ptr<scalar_t>();
    const auto* vc = v_cache.data_ptr<scalar_t>();
    const auto* btp = bt.data_ptr<int64_t>();
    const auto* lp = lens.data_ptr<int64_t>();
    const auto sc = static_cast<float>(scale);
    if (float_q)  // float32 activations over any cache (the runner's float32 products)
      decode<float, scalar_t>(q.data_ptr<float>(), kc, vc, btp, lp, out.data_ptr<float>(), B,
                              H, Hkv, D, ps, W, sc);
    else
      decode<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), kc, vc, btp, lp,
                                 out.data_ptr<scalar_t>(), B, H, Hkv, D, ps, W, sc);
  });
  return out;
}
