// Float32 linear layers over weights packed in column strips (CPU).
//
//   pack_linear(wt [K, N]) -> wp [J, K, NB]     J = ceil(N / NB), strip j holds columns
//                                               [j*NB, (j+1)*NB) of wt (zero-padded tail)
//   pack_bias(bias [N]) -> [J * NB]             zero-padded to whole strips
//   packed_linear(x [M, K], wp, bias_p | None, N) -> y [M, N] = x @ wt (+ bias)
//
// Why: MKL's sgemm runs decode-sized products (M = 4..32 rows) at 25-45% of the core's
// FMA peak on this hardware, and a decode step reads every weight once, so a product
// whose every weight element is loaded once and used by up to MR rows from registers
// runs at the memory's pace instead. A packed strip is contiguous (K * NB floats), so
// the weights stream sequentially whatever N is.
//
// Each output tile is MR rows x NB columns held in registers; its dot products run over
// k in blocks of KC, in order, one fused multiply-add per k, each block's sum added into y
// (so rounding grows with KC + K / KC, not with K). A row's result does not depend on M or
// on which other rows share the batch (batch-invariant), and is deterministic.
// Work splits over strips: torch's intra-op threads (at::parallel_for), or, for a step on
// one torch thread, the claim-based pool of strip_pool.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NB = 32;  // strip width: two 16-float vectors
constexpr int MR = 8;       // rows per register tile: 8 x 2 accumulators of 32 registers
constexpr int64_t KC = 128; // k per register pass; passes add into y (bounds rounding growth)

#if defined(__AVX512F__)
template <int R>
inline void tile(const float* x, int64_t K, const float* w, const float* bias,
                 float* y, int64_t ldy, int64_t ncols) {
  const __mmask16 m0 = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);
  const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1);
  __m512 a0[R], a1[R];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    const __m512 b0 = k0 == 0 && bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 b1 = k0 == 0 && bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) { a0[r] = b0; a1[r] = b1; }
    for (int64_t k = k0; k < k1; ++k) {
      const __m512 w0 = _mm512_loadu_ps(w + k * NB), w1 = _mm512_loadu_ps(w + k * NB + 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xr = _mm512_set1_ps(x[r * K + k]);
        a0[r] = _mm512_fmadd_ps(xr, w0, a0[r]);
        a1[r] = _mm512_fmadd_ps(xr, w1, a1[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {  // y = this block's sum (first block) or y + it
      float* yr = y + r * ldy;
      if (k0 > 0) {
        a0[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, yr), a0[r]);
        a1[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, yr + 16), a1[r]);
      }
      _mm512_mask_storeu_ps(yr, m0, a0[r]);
      _mm512_mask_storeu_ps(yr + 16, m1, a1[r]);
    }
  }
}
#else
template <int R>
inline void tile(const float* x, int64_t K, const float* w, const float* bias,
                 float* y, int64_t ldy, int64_t ncols) {
  float acc[R][NB];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < NB; ++c) acc[r][c] = k0 == 0 && bias ? bias[c] : 0.f;
    for (int64_t k = k0; k < k1; ++k)
      for (int r = 0; r < R; ++r) {
        const float xr = x[r * K + k];
#pragma omp simd
        for (int64_t c = 0; c < NB; ++c) acc[r][c] += xr * w[k * NB + c];
      }
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < ncols; ++c)
        y[r * ldy + c] = k0 > 0 ? y[r * ldy + c] + acc[r][c] : acc[r][c];
  }
}
#endif

using TileFn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t,
                        int64_t);
constexpr TileFn TILES[MR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                  tile<5>, tile<6>, tile<7>, tile<8>};

}  // namespace

namespace strip_pool {
bool run(int64_t total, const std::function<void(int64_t)>& task);
}

torch::Tensor pack_linear(torch::Tensor wt) {
  TORCH_CHECK(wt.dim() == 2 && wt.scalar_type() == torch::kFloat32, "wt must be [K, N] float32");
  const int64_t K = wt.size(0), N = wt.size(1), J = (N + NB - 1) / NB;
  auto padded = torch::zeros({K, J * NB}, wt.options());
  padded.narrow(1, 0, N).copy_(wt);
  return padded.view({K, J, NB}).permute({1, 0, 2}).contiguous();
}

torch::Tensor pack_bias(torch::Tensor bias) {
  TORCH_CHECK(bias.dim() == 1 && bias.scalar_type() == torch::kFloat32, "bias must be [N] float32");
  const int64_t N = bias.size(0), J = (N + NB - 1) / NB;
  auto padded = torch::zeros({J * NB}, bias.options());
  padded.narrow(0, 0, N).copy_(bias);
  return padded;
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias,
                            int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == NB && wp.is_contiguous(), "wp must come from pack_linear");
  const int64_t M = x.size(0), K = x.size(1), J = wp.size(0);
  TORCH_CHECK(wp.size(1) == K && (N + NB - 1) / NB == J, "x, wp and N do not match");
  auto xc = x.contiguous();
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == J * NB, "bias must come from pack_bias");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wpp = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto strip = [&](int64_t j) {
    const int64_t ncols = std::min(NB, N - j * NB);
    const float* w = wpp + j * K * NB;
    for (int64_t m = 0; m < M; m += MR) {
      const int r = static_cast<int>(std::min<int64_t>(MR, M - m));
      TILES[r](xp + m * K, K, w, bp ? bp + j * NB : nullptr, yp + m * N + j * NB, N, ncols);
    }
  };
  // A step on one torch thread (small: model_runner's cpu_parallel_min_tokens) shares its
  // strips with the claim-based pool's helpers, if any (strip_pool.cpp); otherwise torch's
  // OpenMP threads split them. Each strip is computed whole by one thread either way, so
  // the result does not depend on the path.
  if (at::get_num_threads() == 1 && strip_pool::run(J, strip)) return y;
  at::parallel_for(0, J, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) strip(j);
  });
  return y;
}
