// The decoder's pointwise steps around the linears, one pass each (CPU, float32):
//
//   rms_norm(x [T, D], w [D], eps) -> w * (x * rsqrt(mean(x^2) + eps))
//   silu_mul(gu [T, 2I]) -> [T, I] = silu(gu[:, :I]) * gu[:, I:]
//   rope_qk(qkv [T, (H + 2 Hkv) D], cos [T, D], sin [T, D], H, Hkv)
//       -> q [T, H, D], k [T, Hkv, D], rotary applied (rotate-half convention), contiguous
//
// Why: at decode batch sizes each torch op costs more in dispatch than in arithmetic, and
// these steps are ~30 small ops per layer (RMSNorm 8, rotary 14, split/reshape/contiguous);
// here they are 3 calls. Same formulas and operation order as the torch code they replace
// (model/decoder.py, model/rope.py); only the sum of squares is accumulated in another order
// (vec16.h's, the same on every CPU). Everything else is element-wise with no contraction
// (-ffp-contract=off), so every path of the build gives the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "vec16.h"

namespace {

constexpr int64_t kRowsPerTask = 4;

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be contiguous [T, D] float32");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(w.numel() == D && w.is_contiguous() && w.scalar_type() == torch::kFloat32,
              "w must be [D] float32");
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = xp + t * D;
      v16::V acc = v16::zero();  // the sum of squares in vec16.h's fixed order
      for (int64_t d = 0; d < D; d += 16) {
        const v16::V xv = v16::load_n(xr + d, D - d);
        acc = v16::fma(xv, xv, acc);
      }
      const float ss = v16::hsum(acc);
      const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + e);
      float* yr = yp + t * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) yr[d] = wp[d] * (xr[d] * r);
    }
  });
  return y;
}

torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == torch::kFloat32 && gu.is_contiguous() &&
                  gu.size(1) % 2 == 0, "gu must be contiguous [T, 2I] float32");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto y = torch::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *g = gp + t * 2 * I, *u = g + I;
      float* yr = yp + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) yr[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

std::vector<torch::Tensor> rope_qk(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                   int64_t H, int64_t Hkv) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous(),
              "qkv must be contiguous [T, (H + 2 Hkv) D] float32");
  const int64_t T = qkv.size(0), D = cos.size(1), W = qkv.size(1), half = D / 2;
  TORCH_CHECK(W == (H + 2 * Hkv) * D && D % 2 == 0, "qkv width does not match H, Hkv, D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T &&
                  sin.sizes() == cos.sizes() && cos.scalar_type() == torch::kFloat32,
              "cos/sin must be contiguous [T, D] float32");
  auto q = torch::empty({T, H, D}, qkv.options());
  auto k = torch::empty({T, Hkv, D}, qkv.options());
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        const float* x = src + t * W + h * D;
        float* o = h < H ? qp + (t * H + h) * D : kp + (t * Hkv + h - H) * D;
        // x * cos + cat(-x2, x1) * sin, each product rounded before the sum (as torch)
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = x[d] * c[d], b = -x[d + half] * s[d];
          o[d] = a + b;
        }
#pragma omp simd
        for (int64_t d = half; d < D; ++d) {
          const float a = x[d] * c[d], b = x[d - half] * s[d];
          o[d] = a + b;
        }
      }
    }
  });
  return {q, k};
}
