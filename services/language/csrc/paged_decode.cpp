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
// SDPA path does), two passes over the keys: scores, then exp-weights times values.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float load(const T* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename T>
void decode(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
            T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t ps, int64_t W,
            float scale) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / Hkv, kvh = item % Hkv, L = lens[b];
      const int64_t* pages = bt + b * W;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(q, (b * H + kvh * G + g) * D + d);
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* kp = kc + ((pages[t / ps] * ps + t % ps) * Hkv + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * load(kp, d);
          scores[g * L + t] = s * scale;
        }
      }
      std::vector<float> denom(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        const float m = *std::max_element(sg, sg + L);
        float z = 0.f;
        for (int64_t t = 0; t < L; ++t) z += (sg[t] = std::exp(sg[t] - m));
        denom[g] = z;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* vp = vc + ((pages[t / ps] * ps + t % ps) * Hkv + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * load(vp, d);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + kvh * G + g) * D + d] = static_cast<T>(acc[g * D + d] / denom[g]);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache, read in place");
}
