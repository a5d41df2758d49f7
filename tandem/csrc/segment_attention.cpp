// Attention within packed segments (CPU, float32): a prefill chunk's causal self-attention
// and the vision tower's attention per frame or window.
//
//   segment_attention(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], cu [S + 1] int64,
//                     causal, scale) -> out [T, H, D] (contiguous)
//
// Rows [cu[s], cu[s + 1]) are segment s; a query attends to the keys of its own segment:
// all of them, or (causal) those at or before its own row. Query head h reads kv head
// h / (H / Hkv). Rows of q, k, v may have any stride; each head's D floats are contiguous.
//
// Why: torch's CPU flash attention ran a 1481-token causal chunk (8 heads over 2, D 64) at
// ~70 GFLOP/s and the ViT's 32-192-row segments at ~40-75 on one Zen 5 core. Here scores
// are register tiles of rows x 32 keys over keys packed transposed (one FMA a query
// element, as the packed linear), and the weighted sum tiles of rows x head-dim slices.
//
// Arithmetic (the same operations on every path of vec16.h, so the same bits on every CPU):
//   s[i, t]   = (FMA chain over d = 0..D-1 of q[i, d] * k[t, d]) * scale
//   p[i, t]   = exp_poly(s[i, t] - m[i]), m[i] = max of s[i, t] over the keys row i sees;
//               0 for the keys it does not see
//   z[i]      = hsum of the 16-lane sums of p[i, .] over 16-key blocks counted from the
//               segment's first key, in order
//   out[i, d] = (FMA chain over t of p[i, t] * v[t, d]) / z[i]
// A row's result depends on its segment's keys alone, not on the other segments of the
// call nor on how rows are grouped into tiles: keys it does not see add exact zeros.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <memory>
#include <utility>
#include <vector>

#include "vec16.h"

namespace {

using v16::V;

constexpr int64_t QT = 32;  // query rows a work item takes (all G heads of one kv head)
// Rows of a score tile (each rows x 32 keys: 2 accumulators a row) and of the weighted
// sum's tiles (rows x DC head-dim slices), by the path's registers.
constexpr int RS = v16::kRegs / 2 > 1 ? v16::kRegs / 2 : 1;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Scores of R rows x 16 * NV keys: s[r, n] = chain over d of q[r, d] * kt[d, n], scaled.
template <int R, int NV>
void qk_tile(const float* q, int64_t qs, const float* kt, int64_t ldk, int64_t D, float scale,
             float* s, int64_t lds) {
  V acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = v16::zero();
  for (int64_t d = 0; d < D; ++d) {
    V kv[NV];
    for (int n = 0; n < NV; ++n) kv[n] = v16::load(kt + d * ldk + 16 * n);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V qv = v16::set1(q[r * qs + d]);
      for (int n = 0; n < NV; ++n) acc[r][n] = v16::fma(qv, kv[n], acc[r][n]);
    }
  }
  const V sc = v16::set1(scale);
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) v16::store(s + r * lds + 16 * n, v16::mul(acc[r][n], sc));
}

using QkFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float, float*,
                      int64_t);
template <int NV, size_t... I>
constexpr std::array<QkFn, sizeof...(I) + 1> qk_tiles(std::index_sequence<I...>) {
  return {{nullptr, &qk_tile<static_cast<int>(I) + 1, NV>...}};
}
constexpr auto QK32 = qk_tiles<2>(std::make_index_sequence<RS>{});
constexpr auto QK16 = qk_tiles<1>(std::make_index_sequence<RS>{});

// Weighted sums of R rows over n keys, head-dim slices [c0, c0 + DC) of 16: out[r, c] =
// chain over t of p[r, t] * v[t, c], divided by z[r]; `cols` valid columns from slice c0.
template <int R, int DC>
void pv_tile(const float* p, int64_t ldp, const float* vp, int64_t ldv, int64_t n,
             const float* z, float* out, int64_t ldo, int64_t cols) {
  V acc[R][DC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) acc[r][c] = v16::zero();
  for (int64_t t = 0; t < n; ++t) {
    V vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = v16::load(vp + t * ldv + 16 * c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V pr = v16::set1(p[r * ldp + t]);
      for (int c = 0; c < DC; ++c) acc[r][c] = v16::fma(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const V zr = v16::set1(z[r]);  // divided, as the decode kernel does
    for (int c = 0; c < DC && 16 * c < cols; ++c)
      v16::store_n(out + r * ldo + 16 * c, v16::div(acc[r][c], zr), cols - 16 * c);
  }
}

using PvFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*,
                      float*, int64_t, int64_t);
// Rows a weighted-sum tile of DC slices keeps in registers.
constexpr int pv_rows(int dc) { return v16::kRegs / dc > 1 ? v16::kRegs / dc : 1; }
template <int DC, size_t... I>
constexpr std::array<PvFn, sizeof...(I) + 1> pv_tiles(std::index_sequence<I...>) {
  return {{nullptr, &pv_tile<static_cast<int>(I) + 1, DC>...}};
}
// Slices a pass of the weighted sum keeps at most (the registers; 8: head dims up to 128
// in one pass).
constexpr int DCMAX = v16::kRegs < 8 ? v16::kRegs : 8;
template <int DC>
constexpr auto PV = pv_tiles<DC>(std::make_index_sequence<pv_rows(DC)>{});

// rows [0, n) of a weighted sum in tiles of pv_rows(DC) rows, slices [c0, c0 + DC).
template <int DC>
void pv_rows_pass(const float* p, int64_t ldp, const float* vp, int64_t ldv, int64_t keys,
                  const float* z, float* out, int64_t ldo, int64_t n, int64_t cols) {
  constexpr int RP = pv_rows(DC);
  for (int64_t r = 0; r < n; r += RP) {
    const int rr = static_cast<int>(std::min<int64_t>(RP, n - r));
    PV<DC>[rr](p + r * ldp, ldp, vp, ldv, keys, z + r, out + r * ldo, ldo, cols);
  }
}

void pv_pass(int dc, const float* p, int64_t ldp, const float* vp, int64_t ldv, int64_t keys,
             const float* z, float* out, int64_t ldo, int64_t n, int64_t cols) {
  switch (dc) {
    case 1: return pv_rows_pass<1>(p, ldp, vp, ldv, keys, z, out, ldo, n, cols);
    case 2: return pv_rows_pass<2>(p, ldp, vp, ldv, keys, z, out, ldo, n, cols);
    case 3: return pv_rows_pass<3>(p, ldp, vp, ldv, keys, z, out, ldo, n, cols);
    case 4: return pv_rows_pass<4>(p, ldp, vp, ldv, keys, z, out, ldo, n, cols);
    case 5: return pv_rows_pass<5>(p, ldp, vp, ldv, keys, z, out, ldo, n, cols);
    case 6: return pv_rows_pass<6>(p, ldp, vp, ldv, keys, z, out, ldo, n, cols);
    case 7: return pv_rows_pass<7>(p, ldp, vp, ldv, keys, z, out, ldo, n, cols);
    case 8: return pv_rows_pass<8>(p, ldp, vp, ldv, keys, z, out, ldo, n, cols);
  }
  TORCH_CHECK(false, "segment_attention: no weighted-sum tile of ", dc, " slices");
}

// The largest divisor of nd that is at most DCMAX: slices per pass of the weighted sum.
int slices_per_pass(int64_t nd) {
  for (int c = static_cast<int>(std::min<int64_t>(nd, DCMAX)); c > 1; --c)
    if (nd % c == 0) return c;
  return 1;
}

}  // namespace

torch::Tensor segment_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                torch::Tensor cu, bool causal, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [T, heads, D]");
  for (const auto& x : {q, k, v, cu})
    TORCH_CHECK(x.device().is_cpu(), "segment_attention runs on the CPU");
  for (const auto& x : {q, k, v})
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.stride(2) == 1 &&
                    (x.size(1) == 1 || x.stride(1) == x.size(2)),
                "q, k, v: float32, each head's D floats contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(k.size(0) == T && v.size(0) == T && v.size(1) == Hkv && k.size(2) == D &&
                  v.size(2) == D && Hkv > 0 && H % Hkv == 0, "q, k, v shapes do not match");
  TORCH_CHECK(cu.dim() == 1 && cu.scalar_type() == torch::kInt64 && cu.size(0) >= 1,
              "cu must be [S + 1] int64");
  auto cuc = cu.contiguous();
  const int64_t* c = cuc.data_ptr<int64_t>();
  const int64_t S = cu.size(0) - 1;
  TORCH_CHECK(c[0] == 0 && c[S] == T, "cu must run from 0 to T");
  int64_t longest = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(c[s + 1] >= c[s], "cu must not decrease");
    longest = std::max(longest, c[s + 1] - c[s]);
  }
  auto out = torch::empty({T, H, D}, q.options());
  if (T == 0) return out;
  const int64_t G = H / Hkv, Dp = round_up(D, 16), ND = Dp / 16;
  // Keys transposed per kv head, kt[h][d][t] (t the row; 32 zero columns past T, so a tile
  // of 32 keys may run past a segment's end: those scores are never used), and values
  // with their head dim zero-padded to whole slices, vp[h][t][Dp].
  const int64_t ldk = T + 32;
  std::unique_ptr<float[]> kt(new float[Hkv * D * ldk]), vp(new float[Hkv * T * Dp]);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vsrc = v.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  // Blocks of 64 rows of one kv head: their keys (64 x D floats) stay in L1 while each
  // column is written out contiguously.
  const int64_t tb = (T + 63) / 64;
  at::parallel_for(0, Hkv * tb, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t h = it / tb, t0 = it % tb * 64, t1 = std::min(T, t0 + 64);
      for (int64_t d = 0; d < D; ++d) {
        float* col = kt.get() + (h * D + d) * ldk;
        for (int64_t t = t0; t < t1; ++t) col[t] = kp[t * ks + h * D + d];
      }
      for (int64_t t = t0; t < t1; ++t) {
        float* vr = vp.get() + (h * T + t) * Dp;
        std::copy(vsrc + t * vs + h * D, vsrc + t * vs + h * D + D, vr);
        std::fill(vr + D, vr + Dp, 0.f);
      }
    }
  });
  for (int64_t hd = 0; hd < Hkv * D; ++hd) std::fill(&kt[hd * ldk + T], &kt[hd * ldk + ldk], 0.f);
  // Work items: (segment, kv head, a tile of up to QT query rows), all G heads of it.
  struct Item { int64_t seg, h, i0; };
  std::vector<Item> listed, items;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t i0 = 0; i0 < c[s + 1] - c[s]; i0 += QT) listed.push_back({s, h, i0});
  // Causal: a later tile sees more keys; taken first, last, second, second last, ..., so
  // that the threads' contiguous shares (at::parallel_for) hold as much work each.
  for (size_t a = 0, b = listed.size(); a < b; ++a) {
    items.push_back(listed[a]);
    if (causal && a + 1 < b) items.push_back(listed[--b]);
  }
  const int dc = slices_per_pass(ND);
  const int64_t lds = round_up(longest, 32) + 32;
  const float sc = static_cast<float>(scale);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> sbuf(QT * lds), z(QT);
    for (int64_t w = lo; w < hi; ++w) {
      const Item it = items[w];
      const int64_t seg0 = c[it.seg], L = c[it.seg + 1] - seg0;
      const int64_t n = std::min(QT, L - it.i0);  // query rows of the item
      const int64_t kend = causal ? it.i0 + n : L;  // keys any of them sees
      const int64_t kblocks = round_up(kend, 16);
      const float* ktile = kt.get() + it.h * D * ldk + seg0;
      const float* vtile = vp.get() + (it.h * T + seg0) * Dp;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = it.h * G + g;
        const float* q0 = qp + (seg0 + it.i0) * qs + head * D;
        for (int64_t r = 0; r < n; r += RS) {
          const int rr = static_cast<int>(std::min<int64_t>(RS, n - r));
          int64_t t = 0;
          for (; t + 16 < kend; t += 32)
            QK32[rr](q0 + r * qs, qs, ktile + t, ldk, D, sc, sbuf.data() + r * lds + t, lds);
          if (t < kend)
            QK16[rr](q0 + r * qs, qs, ktile + t, ldk, D, sc, sbuf.data() + r * lds + t, lds);
        }
        for (int64_t r = 0; r < n; ++r) {
          float* sr = sbuf.data() + r * lds;
          const int64_t seen = causal ? it.i0 + r + 1 : L;
          const float m = *std::max_element(sr, sr + seen);
          const V mv = v16::set1(m);
          V zv = v16::zero();
          for (int64_t t = 0; t < kblocks; t += 16) {
            V e = v16::exp_poly(v16::sub(v16::load(sr + t), mv));
            if (t + 16 > seen) {  // the block with the last key seen: zero the keys past it
              float buf[16];
              v16::store(buf, e);
              for (int64_t j = std::max<int64_t>(0, seen - t); j < 16; ++j) buf[j] = 0.f;
              e = v16::load(buf);
            }
            v16::store(sr + t, e);
            zv = v16::add(zv, e);
          }
          z[r] = v16::hsum(zv);
        }
        float* o0 = op + ((seg0 + it.i0) * H + head) * D;
        for (int64_t c0 = 0; c0 < ND; c0 += dc)
          pv_pass(dc, sbuf.data(), lds, vtile + 16 * c0, Dp, kend, z.data(), o0 + 16 * c0, H * D,
                  n, D - 16 * c0);
      }
    }
  });
  return out;
}
