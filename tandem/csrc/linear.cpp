// Float32 linear layers over weights packed in column strips (CPU).
//
//   pack_linear(wt [K, N]) -> wp [J, K, NB]     J = ceil(N / NB), strip j holds columns
//                                               [j*NB, (j+1)*NB) of wt (zero-padded tail),
//                                               in wt's dtype: float32 or bfloat16
//   pack_bias(bias [N]) -> [J * NB]             zero-padded to whole strips
//   packed_linear(x [M, K], wp, bias_p | None, N) -> y [M, N] = x @ wt (+ bias)
//
// A bfloat16 wp is widened to float32 as it is loaded (exactly: bfloat16 is float32's top
// half), so its products are the same bits as those of the float32 copy of the same weights,
// from half the bytes: a decode step streams every weight once, so it reads half as much.
//
// Why: MKL's sgemm runs decode-sized products (M = 4..32 rows) at 25-45% of the core's
// FMA peak on this hardware, and a decode step reads every weight once, so a product
// whose every weight element is loaded once and used by several rows from registers
// runs at the memory's pace instead. A packed strip is contiguous (K * NB floats), so
// the weights stream sequentially whatever N is.
//
// Each output tile (rows x 16 or 32 columns) is held in registers; its dot products run over
// k in blocks of KC, in order, one fused multiply-add per k, each block's sum added into y
// (so rounding grows with KC + K / KC, not with K). A row's result does not depend on M or
// on which other rows share the batch (batch-invariant), and is deterministic; and since
// every y element is that same chain of FMAs on every path of vec16.h (AVX-512, AVX2, NEON,
// generic), a result is the same bits on every CPU.
// The next k block of weights is prefetched while this one is used: the tiles of a block
// each issue their share of its prefetches, spread over their k loop (a hint: no result
// changes). Without it a decode-sized product stalled on every block's first touch, since
// only the first tile of a block reads memory and the others reuse it from L1 (Intel
// Xeon, AVX-512, 1 thread, a decode step's 48 projections: 29 -> 19 ms at 32 rows, 18 ->
// 13 at 8; docs/benchmarks.md).
// Work splits over strips: torch's intra-op threads (at::parallel_for), or, for a step on
// one torch thread, the claim-based pool of strip_pool.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <functional>
#include <utility>
#include <vector>

#include "vec16.h"

namespace {

using v16::V;

constexpr int64_t NB = 32;   // strip width: two V of 16 floats
constexpr int64_t KC = 128;  // k per register pass; passes add into y (bounds rounding growth)
constexpr int64_t MB = 240;  // rows per task at most
constexpr int64_t MQ = 24;   // a task's rows are a multiple of every path's tile heights (8, 6)
// Register tiles, two shapes: "wide" tiles of up to MRW rows x 32 columns (a whole strip:
// 2 vectors a row) and "tall" tiles of up to MRT rows x 16 columns (half a strip, run once
// per half). Each holds its accumulators in registers with room for one k's weights and
// a broadcast x:
//   AVX-512  wide 8 rows: 16 accumulators of 32 zmm (no tall tiles)
//   AVX2     tall 6 rows: 12 ymm accumulators + 2 weights + 1 broadcast of 16 ymm (a wide
//            3-row tile leaves no register for the weights: each FMA reloads its weight,
//            15 loads per 12 FMAs); wide 3-row tiles serve the last 1-3 rows, where a tall
//            tile's few accumulators would leave the FMA units waiting on latency
//   NEON     tall 6 rows: 24 q accumulators + 4 + 1 of 32 q; wide 2 rows for the last ones
// Rows go to tall tiles while more than MRW are left, then to one wide tile. The shapes
// change how often a weight or an x is reloaded, never a result: each y element is its
// own FMA chain over k.
#if defined(TANDEM_AVX512)
constexpr int MRW = 8, MRT = 0;
#elif defined(TANDEM_AVX2)
constexpr int MRW = 3, MRT = 6;
#elif defined(TANDEM_NEON)
constexpr int MRW = 2, MRT = 6;
#else
constexpr int MRW = 4, MRT = 0;
#endif

// One register tile over one k block [k0, k1): R rows of x times 16 * H columns of the
// strip at w (row stride NB) -> y (row stride ldy). y = the block's sum (+ bias) for the
// first block, y + the block's sum after it.
// Weights as stored: float32, or bfloat16 bits widened on load.
inline V load_w(const float* p) { return v16::load(p); }
inline V load_w(const uint16_t* p) { return v16::load_bf16(p); }

// Ahead: this tile's share of the next block's weights to prefetch (nullptr: none), one
// strip row of it every `every` k.
struct Ahead {
  const char* at;
  int64_t every;
};

template <int R, int H, typename W>
inline void tile(const float* x, int64_t K, int64_t k0, int64_t k1, const W* w,
                 const float* bias, float* y, int64_t ldy, Ahead ahead) {
  V acc[R][H], b[H];
  for (int h = 0; h < H; ++h) b[h] = k0 == 0 && bias ? v16::load(bias + 16 * h) : v16::zero();
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = b[h];
  const char* pf = ahead.at;
  int64_t pf_k = pf ? k0 : k1;  // the next k that prefetches (a counter: no division here)
  for (int64_t k = k0; k < k1; ++k) {
    if (k == pf_k) {
      __builtin_prefetch(pf);
      if constexpr (sizeof(W) * NB > 64) __builtin_prefetch(pf + 64);  // a float32 row: 2 lines
      pf += sizeof(W) * NB;
      pf_k += ahead.every;
    }
    V wk[H];
    for (int h = 0; h < H; ++h) wk[h] = load_w(w + k * NB + 16 * h);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V xr = v16::set1(x[r * K + k]);
      for (int h = 0; h < H; ++h) acc[r][h] = v16::fma(xr, wk[h], acc[r][h]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    for (int h = 0; h < H; ++h) {
      if (k0 > 0) acc[r][h] = v16::add(v16::load(yr + 16 * h), acc[r][h]);
      v16::store(yr + 16 * h, acc[r][h]);
    }
  }
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, int64_t, int64_t, const W*, const float*,
                        float*, int64_t, Ahead);

// table[r] = the r-row tile of H vectors a row (r = 1..rows; entry 0 unused).
template <int H, typename W, size_t... I>
constexpr std::array<TileFn<W>, sizeof...(I) + 1> make_tiles(std::index_sequence<I...>) {
  return {{nullptr, &tile<static_cast<int>(I) + 1, H, W>...}};
}
template <typename W>
constexpr auto WIDE = make_tiles<2, W>(std::make_index_sequence<MRW>{});
template <typename W>
constexpr auto TALL = make_tiles<1, W>(std::make_index_sequence<MRT>{});

}  // namespace

namespace strip_pool {
bool run(int64_t total, const std::function<void(int64_t)>& task);
}

torch::Tensor pack_linear(torch::Tensor wt) {
  TORCH_CHECK(wt.dim() == 2 && (wt.scalar_type() == torch::kFloat32 ||
                                wt.scalar_type() == torch::kBFloat16),
              "wt must be [K, N] float32 or bfloat16");
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

namespace {

// y [M, N] = x [M, K] @ wp (+ bias) over weights of type W (the layout of pack_linear).
template <typename W>
void run_packed(const float* xp, const W* wpp, const float* bp, float* yp, int64_t M,
                int64_t K, int64_t N, int64_t J) {
  // One task: rows [m0, m1) of one strip; k blocks outer, row tiles inner, so a block of
  // the strip (KC x NB weights, 16 KB in float32) stays in L1 while every row tile uses it;
  // each y element still sees its k blocks in order, so the order of the loops changes no
  // result.
  // Tasks run row block by row block (t = block * J + strip): a block's rows of x (per x K)
  // stay in L2 across the strips, and its y tiles (per x NB) across the k blocks; one
  // block of every strip at once streamed x and y from L3 (5760 rows: 130-200 GFLOP/s on
  // one Zen 5 core at ViT and prefill shapes, 215-235 in blocks of 240).
  // The blocks are of one size (a multiple of MQ, at most MB): torch's threads take equal
  // runs of tasks, so with one 240-row block and one 16-row block (M = 256) one thread did
  // 94 % of the work and two threads ran no faster than one.
  if (M == 0) return;
  const int64_t fewest = (M + MB - 1) / MB;
  const int64_t per = ((M + fewest - 1) / fewest + MQ - 1) / MQ * MQ;  // <= MB: MQ divides MB
  const int64_t blocks = (M + per - 1) / per;
  auto task = [&](int64_t t) {
    const int64_t j = t % J, m0 = t / J * per, rows = std::min(per, M - m0);
    const int64_t ncols = std::min(NB, N - j * NB);
    const W* w = wpp + j * K * NB;
    const float* b = bp ? bp + j * NB : nullptr;
    const float* x0 = xp + m0 * K;
    // The last strip of an N that is not a multiple of NB runs on a scratch copy of its
    // rows (the same operations, so the same bits); its first ncols columns are kept.
    std::vector<float> scratch(ncols == NB ? 0 : rows * NB);
    float* y0 = ncols == NB ? yp + m0 * N + j * NB : scratch.data();
    const int64_t ld = ncols == NB ? N : NB;
    // The tile calls of one k block (tall ones run once per half strip), and each one's
    // share of the next block's KC strip rows to prefetch. The next block follows this one
    // in wp, the next strip's first after a strip's last (the strip the next task most
    // likely takes); past wp's end, nothing.
    int64_t tall = 0;  // the loop below: tall tiles while more than MRW rows are left
    if constexpr (MRT > 0) tall = rows > MRW ? (rows - MRW + MRT - 1) / MRT : 0;
    const int64_t calls = 2 * tall + (std::max<int64_t>(rows - tall * MRT, 0) + MRW - 1) / MRW;
    const int64_t share = (KC + calls - 1) / calls;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t k1 = std::min(K, k0 + KC);
      int64_t call = 0;
      auto ahead = [&]() {  // offsets, not pointers: no pointer is formed past wp's end
        const int64_t at = (j * K + k1 + call++ * share) * NB;
        return Ahead{at + share * NB <= J * K * NB ? reinterpret_cast<const char*>(wpp + at)
                                                   : nullptr,
                     calls};
      };
      int64_t m = 0;
      for (; MRT > 0 && rows - m > MRW; m += MRT) {  // tall tiles, where the path has them
        const int r = static_cast<int>(std::min<int64_t>(MRT, rows - m));
        for (int64_t c = 0; c < NB; c += 16)
          TALL<W>[r](x0 + m * K, K, k0, k1, w + c, b ? b + c : nullptr, y0 + m * ld + c, ld,
                     ahead());
      }
      for (; m < rows; m += MRW) {
        const int r = static_cast<int>(std::min<int64_t>(MRW, rows - m));
        WIDE<W>[r](x0 + m * K, K, k0, k1, w, b, y0 + m * ld, ld, ahead());
      }
    }
    if (ncols != NB)
      for (int64_t i = 0; i < rows; ++i)
        std::copy(scratch.data() + i * NB, scratch.data() + i * NB + ncols,
                  yp + (m0 + i) * N + j * NB);
  };
  // A step on one torch thread (small: model_runner's cpu_parallel_min_tokens) shares its
  // tasks with the claim-based pool's helpers, if any (strip_pool.cpp); otherwise torch's
  // OpenMP threads split them. Each task is computed whole by one thread either way, so
  // the result does not depend on the path.
  if (at::get_num_threads() == 1 && strip_pool::run(blocks * J, task)) return;
  at::parallel_for(0, blocks * J, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) task(t);
  });
}

}  // namespace

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias,
                            int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == NB && wp.is_contiguous() &&
                  (wp.scalar_type() == torch::kFloat32 || wp.scalar_type() == torch::kBFloat16),
              "wp must come from pack_linear");
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
  if (wp.scalar_type() == torch::kBFloat16)
    run_packed(xc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(wp.data_ptr()), bp,
               y.data_ptr<float>(), M, K, N, J);
  else
    run_packed(xc.data_ptr<float>(), wp.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N, J);
  return y;
}
