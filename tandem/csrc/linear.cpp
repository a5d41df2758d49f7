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
// on which other rows share the batch (batch-invariant), and is deterministic; and since
// every y element is that same chain of FMAs on every path of vec16.h (AVX-512, AVX2, NEON,
// generic), a result is the same bits on every CPU.
// Work splits over strips: torch's intra-op threads (at::parallel_for), or, for a step on
// one torch thread, the claim-based pool of strip_pool.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <functional>
#include <utility>

#include "vec16.h"

namespace {

using v16::V;

constexpr int64_t NB = 32;   // strip width: two V of 16 floats
constexpr int64_t KC = 128;  // k per register pass; passes add into y (bounds rounding growth)
// Rows per register tile: 2 V accumulators a row, the tile's accumulators kept in registers
// (AVX-512: 16 of 32 zmm; AVX2: 12 of 16 ymm; NEON: 24 of 32 q). The tile height changes
// how often a weight is reloaded, never a result: each y element is its own FMA chain.
#if defined(TANDEM_AVX512)
constexpr int MR = 8;
#elif defined(TANDEM_AVX2) || defined(TANDEM_NEON)
constexpr int MR = 3;
#else
constexpr int MR = 4;
#endif

// One register tile: R rows of x times one strip -> R x NB outputs at y (row stride ldy),
// all NB columns written (a strip's tail columns go through a scratch tile, see below).
template <int R>
inline void tile(const float* x, int64_t K, const float* w, const float* bias, float* y,
                 int64_t ldy) {
  V a0[R], a1[R];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    const V b0 = k0 == 0 && bias ? v16::load(bias) : v16::zero();
    const V b1 = k0 == 0 && bias ? v16::load(bias + 16) : v16::zero();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) { a0[r] = b0; a1[r] = b1; }
    for (int64_t k = k0; k < k1; ++k) {
      const V w0 = v16::load(w + k * NB), w1 = v16::load(w + k * NB + 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const V xr = v16::set1(x[r * K + k]);
        a0[r] = v16::fma(xr, w0, a0[r]);
        a1[r] = v16::fma(xr, w1, a1[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {  // y = this block's sum (first block) or y + it
      float* yr = y + r * ldy;
      if (k0 > 0) {
        a0[r] = v16::add(v16::load(yr), a0[r]);
        a1[r] = v16::add(v16::load(yr + 16), a1[r]);
      }
      v16::store(yr, a0[r]);
      v16::store(yr + 16, a1[r]);
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t);

template <size_t... I>
constexpr std::array<TileFn, MR + 1> make_tiles(std::index_sequence<I...>) {
  return {{nullptr, &tile<static_cast<int>(I) + 1>...}};
}
constexpr auto TILES = make_tiles(std::make_index_sequence<MR>{});

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
    const float* b = bp ? bp + j * NB : nullptr;
    for (int64_t m = 0; m < M; m += MR) {
      const int r = static_cast<int>(std::min<int64_t>(MR, M - m));
      float* y0 = yp + m * N + j * NB;
      if (ncols == NB) {
        TILES[r](xp + m * K, K, w, b, y0, N);
        continue;
      }
      // The last strip of an N that is not a multiple of NB: the tile runs on a scratch
      // tile (the same operations, so the same bits) and its first ncols columns are kept.
      alignas(64) float scratch[MR * NB];
      TILES[r](xp + m * K, K, w, b, scratch, NB);
      for (int i = 0; i < r; ++i) std::copy(scratch + i * NB, scratch + i * NB + ncols, y0 + i * N);
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
