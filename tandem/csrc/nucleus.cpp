// The CPU sampler's cut and draw, a whole step's sampled rows in one call: the rules and
// the passes of services/language/engine/nucleus.py (which documents them and passes the
// constants they use), written once here so a row costs its passes and not ~25 Python and
// torch calls: a sample() of 32 rows of a 1,024-token vocabulary took 2.2-2.9 ms that way,
// 0.36 ms this way; at 152K tokens a row takes ~0.5 ms against ~1 ms (docs/benchmarks.md).
//
//   nucleus_draw(x [S, V] float32, temperature [S] float32, top_k [S] int64 (0: off),
//                top_p [S] float32 (1: off), min_p [S] float32 (0: off), u [S] float64,
//                buckets, span, spread, kept: optional [S, V] float64) -> ids [S] int64
//
// Row r: x / temperature, top-k (ties with the k-th kept), the weights e = exp(x - max)
// (vec16.h's exp_poly: the same bits on every vector path), each token's bucket by its
// distance below the max (`buckets` equal slices of [0, span); further down it weighs 0,
// its bucket one of `spread` more by its id), the per-bucket sums in float64 in id order,
// the bucket top-p cuts in, that bucket's tokens in the rule's order (probability down,
// then id), min-p, and the token at which the running kept weight, in bucket order (by id
// within a bucket, the cut bucket in the rule's order), passes u * the kept mass. Every
// step is nucleus.py's in the same order and the same float32/float64 types, so the two
// pick the same token wherever their exp agrees (torch's exp and exp_poly can differ in
// the last bit; tests/test_nucleus.py). `kept`, when given, receives each token's weight
// in the draw (0 where cut): the tests' view of the kept set.
//
// A row is computed from that row alone, in the same order whatever the batch (the seed
// contract of sampler.py); rows run in parallel, each thread over its own workspace.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec16.h"

namespace {

constexpr float kFloor = -87.f;  // x - max floored here (exp_poly's own clamp)
constexpr int64_t kTaskElems = 1 << 16;  // a parallel task's rows: at least this many logits

// One thread's buffers, grown to the largest vocabulary seen and kept (a fresh 600 KB
// vector per row would be a fresh mapping, page-faulted in each time). Fetched once per
// task and passed down: a thread_local in a shared library costs a call on every access.
struct Workspace {
  std::vector<float> x, e, cap;
  int64_t cap_vocab = 0, cap_buckets = 0, cap_spread = 0;  // what `cap` was made for
  std::vector<int32_t> bucket;
  std::vector<double> hist, run;
  std::vector<int64_t> ids;
};

Workspace& workspace() {
  thread_local Workspace ws;
  return ws;
}

// [V]: each token's last bucket, a far one by its id (B + id % spread), made once per
// vocabulary and kept.
const float* caps(Workspace& ws, int64_t V, int64_t B, int64_t spread) {
  if (ws.cap_vocab != V || ws.cap_buckets != B || ws.cap_spread != spread) {
    ws.cap.resize(V);
    for (int64_t k = 0; k < V; ++k) ws.cap[k] = static_cast<float>(B + k % spread);
    ws.cap_vocab = V, ws.cap_buckets = B, ws.cap_spread = spread;
  }
  return ws.cap.data();
}

// The largest of x[0..V) (-inf for none: a masked token is -inf).
float row_max(const float* x, int64_t V) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (V >= 16) {
    v16::V acc = v16::load(x);
    for (i = 16; i + 16 <= V; i += 16) acc = v16::max(acc, v16::load(x + i));
    float lanes[16];
    v16::store(lanes, acc);
    for (float f : lanes) top = std::max(top, f);
  }
  for (; i < V; ++i) top = std::max(top, x[i]);
  return top;
}

// The ids of bucket j's tokens, ascending, into `out`.
void in_bucket(const int32_t* bucket, int64_t V, int64_t j, std::vector<int64_t>& out) {
  out.clear();
  for (int64_t i = 0; i < V; ++i)
    if (bucket[i] == j) out.push_back(i);
}

// The running weight (float32 weights summed in float64, in id order) by bucket, the far
// buckets' tokens weighing 0, into `hist` [all].
void running(const int32_t* bucket, const float* weight, int64_t V, int64_t B, int64_t all,
             std::vector<double>& hist) {
  hist.assign(all, 0.0);
  double* h = hist.data();
  for (int64_t i = 0; i < V; ++i) h[bucket[i]] += weight[i];
  std::fill(hist.begin() + B, hist.end(), 0.0);
  for (int64_t j = 1; j < all; ++j) h[j] += h[j - 1];
}

// The running weight of `ids` into `run`.
void running_of(const std::vector<int64_t>& ids, const float* weight, std::vector<double>& run) {
  run.clear();
  double s = 0.0;
  for (int64_t id : ids) run.push_back(s += weight[id]);
}

// The first index in [0, n) whose value is > t (side="right"), or >= t (side="left").
int64_t search_right(const double* a, int64_t n, double t) {
  return std::upper_bound(a, a + n, t) - a;
}
int64_t search_left(const double* a, int64_t n, double t) {
  return std::lower_bound(a, a + n, t) - a;
}

// Row `xr`'s token; its kept weights into `kept` when not null.
int64_t draw_row(Workspace& ws, const float* xr, int64_t V, float temperature, int64_t top_k,
                 float top_p, float min_p, double u, int64_t B, float scale, int64_t spread,
                 double* kept) {
  const int64_t all = B + spread;
  ws.x.resize(V);
  ws.e.resize(V);
  ws.bucket.resize(V);
  float* x = ws.x.data();
  float* e = ws.e.data();
  int32_t* bucket = ws.bucket.data();
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) x[i] = xr[i] / temperature;
  if (0 < top_k && top_k < V) {  // keep x >= the k-th largest, ties included
    std::copy(x, x + V, e);  // (e is free until the weights)
    std::nth_element(e, e + (top_k - 1), e + V, std::greater<float>());
    const float kth = e[top_k - 1];
    for (int64_t i = 0; i < V; ++i)
      if (!(x[i] >= kth)) x[i] = ninf;
  }
  const float top = row_max(x, V);
  if (top == ninf) {  // no token left (nothing upstream leaves none): the first
    if (kept) std::fill(kept, kept + V, 0.0);
    return 0;
  }
  // weights e = exp(z) and buckets min(z * scale, cap), z = max(x - top, floor)
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const v16::V z = v16::max(v16::sub(v16::load(x + i), v16::set1(top)), v16::set1(kFloor));
    v16::store(e + i, v16::exp_poly(z));
  }
  if (i < V) {
    const v16::V z = v16::max(v16::sub(v16::load_n(x + i, V - i), v16::set1(top)),
                              v16::set1(kFloor));
    v16::store_n(e + i, v16::exp_poly(z), V - i);
  }
  const float* cap = caps(ws, V, B, spread);
  for (int64_t k = 0; k < V; ++k) {  // (one that vectorizes: no branch, no division)
    const float z = std::max(x[k] - top, kFloor);
    bucket[k] = static_cast<int32_t>(std::min(z * scale, cap[k]));  // the floor: z*scale >= 0
  }
  running(bucket, e, V, B, all, ws.hist);
  // top-p: the first bucket whose running weight reaches top_p * the total holds the cut;
  // its tokens in the rule's order (probability down, then id) until the mass before one
  // reaches the mark
  int64_t cut = all;
  std::vector<int64_t>& tail = ws.ids;
  tail.clear();
  if (top_p < 1.f) {
    const double target = static_cast<double>(top_p) * ws.hist[all - 1];
    cut = search_left(ws.hist.data(), all, target);
    const double above = cut ? ws.hist[cut - 1] : 0.0;
    in_bucket(bucket, V, cut, tail);
    std::sort(tail.begin(), tail.end(),
              [x](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
    double before = 0.0;
    int64_t n = static_cast<int64_t>(tail.size());
    for (int64_t k = 0; k < static_cast<int64_t>(tail.size()); ++k) {
      const double ek = e[tail[k]];
      before += ek;
      if (before + above - ek >= target) {  // (nucleus.py's order of operations)
        n = k;
        break;
      }
    }
    tail.resize(std::max<int64_t>(n, 1));
  }
  if (min_p > 0.f) {  // the most likely token weighs exp(0) = 1: keep e >= min_p
    for (int64_t k = 0; k < V; ++k) e[k] = e[k] >= min_p ? e[k] : 0.f;
    running(bucket, e, V, B, all, ws.hist);
  }
  // e is now each token's weight in the draw (where its bucket is kept)
  const double* cum = ws.hist.data();
  const double above = cut ? cum[cut - 1] : 0.0;
  double mass = above;
  ws.run.clear();
  if (cut < all) {
    running_of(tail, e, ws.run);
    mass = above + ws.run.back();
  }
  if (kept) {
    for (int64_t k = 0; k < V; ++k) kept[k] = bucket[k] < std::min(cut, B) ? e[k] : 0.0;
    for (int64_t id : tail) kept[id] = e[id];
  }
  // the draw: the token at which the running kept weight, in bucket order, passes u * mass
  const double t = u * mass;
  double local = t - above;  // within the tail (its ids, its running weight)
  if (t < above) {  // within an earlier bucket: its ids (the tail is not read again)
    const int64_t j = search_right(cum, cut, t);
    in_bucket(bucket, V, j, ws.ids);
    running_of(ws.ids, e, ws.run);
    local = t - (j ? cum[j - 1] : 0.0);
  }
  const int64_t n = static_cast<int64_t>(ws.run.size());
  const int64_t k = search_right(ws.run.data(), n, local);
  // rounding can put `local` at the bucket's end: its last token of positive weight
  const int64_t last = search_left(ws.run.data(), n, ws.run[n - 1]);
  return ws.ids[std::min(k, last)];
}

}  // namespace

torch::Tensor nucleus_draw(torch::Tensor x, torch::Tensor temperature, torch::Tensor top_k,
                           torch::Tensor top_p, torch::Tensor min_p, torch::Tensor u,
                           int64_t buckets, double span, int64_t spread,
                           c10::optional<torch::Tensor> kept) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be contiguous [S, V] float32");
  const int64_t S = x.size(0), V = x.size(1);
  auto check = [S](const torch::Tensor& t, torch::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == S && t.scalar_type() == dtype && t.is_contiguous(),
                name, " must be contiguous [S] of the documented dtype");
  };
  check(temperature, torch::kFloat32, "temperature");
  check(top_k, torch::kInt64, "top_k");
  check(top_p, torch::kFloat32, "top_p");
  check(min_p, torch::kFloat32, "min_p");
  check(u, torch::kFloat64, "u");
  TORCH_CHECK(V > 0 && buckets > 0 && spread > 0 && span > 0,
              "an empty vocabulary, or buckets/span/spread not positive");
  TORCH_CHECK(buckets + spread < std::numeric_limits<int32_t>::max(), "too many buckets");
  double* kp = nullptr;
  if (kept) {
    TORCH_CHECK(kept->sizes() == x.sizes() && kept->scalar_type() == torch::kFloat64 &&
                    kept->is_contiguous(), "kept must be contiguous [S, V] float64");
    kp = kept->data_ptr<double>();
  }
  auto ids = torch::empty({S}, torch::kInt64);
  const float *xp = x.data_ptr<float>(), *tp = temperature.data_ptr<float>(),
              *pp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  const int64_t* kk = top_k.data_ptr<int64_t>();
  const double* up = u.data_ptr<double>();
  int64_t* out = ids.data_ptr<int64_t>();
  // a bucket per (x - max) * scale: nucleus.py's float32 scale (-buckets / span in double)
  const float scale = static_cast<float>(-static_cast<double>(buckets) / span);
  at::parallel_for(0, S, std::max<int64_t>(1, kTaskElems / V), [&](int64_t r0, int64_t r1) {
    Workspace& ws = workspace();
    for (int64_t r = r0; r < r1; ++r)
      out[r] = draw_row(ws, xp + r * V, V, tp[r], kk[r], pp[r], mp[r], up[r], buckets, scale, spread,
                        kp ? kp + r * V : nullptr);
  });
  return ids;
}
