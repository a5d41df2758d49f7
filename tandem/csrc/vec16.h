// Sixteen float32 lanes: the one vector type of the CPU kernels, on every instruction set.
//
// Paths, chosen at build time from the compiler's target (cpu_kernels.py builds with
// -march=native, or a forced path: TANDEM_KERNEL_ISA):
//   avx512   one __m512                    x86-64 with AVX-512F
//   avx2     two __m256                    x86-64 with AVX2 and FMA
//   neon     four float32x4_t              aarch64
//   generic  float[16], plain C++          anything else, or -DTANDEM_FORCE_GENERIC
//
// Contract, which every kernel relies on for its "same bits on every CPU" claim:
//   - every operation is lane-wise IEEE float32, round to nearest even; `fma` rounds once
//     (the generic path calls std::fma, never a * b + c);
//   - `hsum` adds the 16 lanes in one fixed tree: lanes i + (i + 8), then i + (i + 4), then
//     i + (i + 2), then lane 0 + lane 1 (the order GCC's _mm512_reduce_add_ps uses, written
//     out so no path depends on a compiler's choice);
//   - `exp_poly` is one polynomial with the same operations on every path;
//   - `load_bf16` widens 16 bfloat16 values (their bits as uint16_t) to float32 exactly:
//     each is the high half of its float32 (the low 16 bits zero), so the result is the
//     float32 value torch's `.float()` gives, on every path (NaN payloads, infinities,
//     subnormals included: a shift, no arithmetic).
// So a kernel written once over V gives bit-identical results on every path; only how
// many V it may hold in registers (kRegs) and its tile sizes differ, never an order of
// summation. tests/test_cpu_kernels.py checks this against forced builds.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(TANDEM_FORCE_GENERIC)
#define TANDEM_GENERIC 1
#elif defined(__AVX512F__)
#define TANDEM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define TANDEM_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define TANDEM_NEON 1
#include <arm_neon.h>
#else
#define TANDEM_GENERIC 1
#endif

namespace v16 {

#if defined(TANDEM_AVX512)
constexpr const char* kPath = "avx512";
constexpr int kRegs = 16;  // V accumulators a kernel may keep live (32 zmm registers)
struct V { __m512 a; };
inline V load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, V v) { _mm512_storeu_ps(p, v.a); }
inline V set1(float x) { return {_mm512_set1_ps(x)}; }
inline V add(V x, V y) { return {_mm512_add_ps(x.a, y.a)}; }
inline V mul(V x, V y) { return {_mm512_mul_ps(x.a, y.a)}; }
inline V div(V x, V y) { return {_mm512_div_ps(x.a, y.a)}; }
inline V max(V x, V y) { return {_mm512_max_ps(x.a, y.a)}; }
inline V fma(V x, V y, V z) { return {_mm512_fmadd_ps(x.a, y.a, z.a)}; }
inline V round_even(V x) {
  return {_mm512_roundscale_ps(x.a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// 2^n for integral n in [-126, 127], built from its exponent bits (exact).
inline V pow2(V n) {
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.a), _mm512_set1_epi32(127));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
inline V load_bf16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline __m256 sum8(V x) {  // lanes i + (i + 8)
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.a), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(x.a), hi);
}
#elif defined(TANDEM_AVX2)
constexpr const char* kPath = "avx2";
constexpr int kRegs = 6;  // 12 of the 16 ymm registers
struct V { __m256 lo, hi; };
inline V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, V v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
inline V set1(float x) { const __m256 s = _mm256_set1_ps(x); return {s, s}; }
inline V add(V x, V y) { return {_mm256_add_ps(x.lo, y.lo), _mm256_add_ps(x.hi, y.hi)}; }
inline V mul(V x, V y) { return {_mm256_mul_ps(x.lo, y.lo), _mm256_mul_ps(x.hi, y.hi)}; }
inline V div(V x, V y) { return {_mm256_div_ps(x.lo, y.lo), _mm256_div_ps(x.hi, y.hi)}; }
inline V max(V x, V y) { return {_mm256_max_ps(x.lo, y.lo), _mm256_max_ps(x.hi, y.hi)}; }
inline V fma(V x, V y, V z) {
  return {_mm256_fmadd_ps(x.lo, y.lo, z.lo), _mm256_fmadd_ps(x.hi, y.hi, z.hi)};
}
inline V round_even(V x) {
  constexpr int m = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, m), _mm256_round_ps(x.hi, m)};
}
inline __m256 pow2_8(__m256 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline V pow2(V n) { return {pow2_8(n.lo), pow2_8(n.hi)}; }
inline __m256 bf16_8(const uint16_t* p) {  // 8 bfloat16 -> 8 float32: zero-extend, shift
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline V load_bf16(const uint16_t* p) { return {bf16_8(p), bf16_8(p + 8)}; }
inline __m256 sum8(V x) { return _mm256_add_ps(x.lo, x.hi); }
#elif defined(TANDEM_NEON)
constexpr const char* kPath = "neon";
constexpr int kRegs = 6;  // 24 of the 32 q registers
struct V { float32x4_t q[4]; };
inline V load(const float* p) {
  return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}};
}
inline void store(float* p, V v) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, v.q[i]);
}
inline V set1(float x) { const float32x4_t s = vdupq_n_f32(x); return {{s, s, s, s}}; }
#define TANDEM_NEON_OP(name, expr)                                   \
  inline V name(V x, V y) {                                          \
    V r;                                                             \
    for (int i = 0; i < 4; ++i) r.q[i] = expr(x.q[i], y.q[i]);       \
    return r;                                                        \
  }
TANDEM_NEON_OP(add, vaddq_f32)
TANDEM_NEON_OP(mul, vmulq_f32)
TANDEM_NEON_OP(div, vdivq_f32)
TANDEM_NEON_OP(max, vmaxq_f32)
#undef TANDEM_NEON_OP
inline V fma(V x, V y, V z) {  // vfmaq_f32(z, x, y) = z + x * y, one rounding
  V r;
  for (int i = 0; i < 4; ++i) r.q[i] = vfmaq_f32(z.q[i], x.q[i], y.q[i]);
  return r;
}
inline V round_even(V x) {
  V r;
  for (int i = 0; i < 4; ++i) r.q[i] = vrndnq_f32(x.q[i]);
  return r;
}
inline V pow2(V n) {
  V r;
  for (int i = 0; i < 4; ++i) {
    const int32x4_t e = vaddq_s32(vcvtnq_s32_f32(n.q[i]), vdupq_n_s32(127));
    r.q[i] = vreinterpretq_f32_s32(vshlq_n_s32(e, 23));
  }
  return r;
}
inline V load_bf16(const uint16_t* p) {  // vshll: widen each u16 to u32, shifted by 16
  V r;
  for (int i = 0; i < 4; ++i) r.q[i] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4 * i), 16));
  return r;
}
#else
constexpr const char* kPath = "generic";
constexpr int kRegs = 4;
struct V { float f[16]; };
inline V load(const float* p) { V r; std::memcpy(r.f, p, sizeof r.f); return r; }
inline void store(float* p, V v) { std::memcpy(p, v.f, sizeof v.f); }
inline V set1(float x) { V r; for (float& f : r.f) f = x; return r; }
#define TANDEM_GENERIC_OP(name, expr)                                \
  inline V name(V x, V y) {                                          \
    V r;                                                             \
    for (int i = 0; i < 16; ++i) r.f[i] = expr;                      \
    return r;                                                        \
  }
TANDEM_GENERIC_OP(add, x.f[i] + y.f[i])
TANDEM_GENERIC_OP(mul, x.f[i] * y.f[i])
TANDEM_GENERIC_OP(div, x.f[i] / y.f[i])
TANDEM_GENERIC_OP(max, x.f[i] > y.f[i] ? x.f[i] : y.f[i])
#undef TANDEM_GENERIC_OP
inline V fma(V x, V y, V z) {
  V r;
  for (int i = 0; i < 16; ++i) r.f[i] = std::fma(x.f[i], y.f[i], z.f[i]);
  return r;
}
inline V round_even(V x) {
  V r;
  for (int i = 0; i < 16; ++i) r.f[i] = std::nearbyint(x.f[i]);
  return r;
}
inline V pow2(V n) {
  V r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.f[i]) + 127) << 23;
    std::memcpy(&r.f[i], &bits, sizeof bits);
  }
  return r;
}
inline V load_bf16(const uint16_t* p) {
  V r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    std::memcpy(&r.f[i], &bits, sizeof bits);
  }
  return r;
}
#endif

inline V zero() { return set1(0.f); }
inline V sub(V x, V y) { return add(x, mul(y, set1(-1.f))); }  // x + (-y) == x - y exactly

// The fixed reduction tree of the contract above.
inline float hsum(V x) {
#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
  const __m256 s8 = sum8(x);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // lanes 0 + 2, 1 + 3
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
#elif defined(TANDEM_NEON)
  // s8 = lanes 0-3 + 8-11 | lanes 4-7 + 12-15; s4 = its two halves added
  const float32x4_t s4 = vaddq_f32(vaddq_f32(x.q[0], x.q[2]), vaddq_f32(x.q[1], x.q[3]));
  const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
  return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
#else
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = x.f[i] + x.f[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

// The first n lanes (0 < n <= 16) from p, the others zero; and the store of the first n.
inline V load_n(const float* p, int64_t n) {
  if (n >= 16) return load(p);
  float buf[16] = {};
  std::memcpy(buf, p, sizeof(float) * n);
  return load(buf);
}
inline void store_n(float* p, V v, int64_t n) {
  if (n >= 16) return store(p, v);
  float buf[16];
  store(buf, v);
  std::memcpy(p, buf, sizeof(float) * n);
}
// The first n bfloat16 values (bits), widened as load_bf16, the other lanes zero.
inline V load_bf16_n(const uint16_t* p, int64_t n) {
  if (n >= 16) return load_bf16(p);
  uint16_t buf[16] = {};
  std::memcpy(buf, p, sizeof(uint16_t) * n);
  return load_bf16(buf);
}
// The first n elements of another dtype (bfloat16, half), converted to float.
template <typename T>
inline V load_n(const T* p, int64_t n) {
  float buf[16] = {};
  for (int64_t i = 0; i < n && i < 16; ++i) buf[i] = static_cast<float>(p[i]);
  return load(buf);
}

// exp(x) lane-wise for x <= 0, the result exact to float32's own rounding: x is clamped at
// -87 (below it exp is under float32's normal range), x = n ln2 + r with |r| <= ln2 / 2,
// exp(r) by its Taylor polynomial to degree 7 (relative error < 2e-8 on that range), times
// 2^n.
inline V exp_poly(V x) {
  x = max(x, set1(-87.f));
  const V n = round_even(mul(x, set1(1.44269504088896341f)));
  const V r = fma(n, set1(-0.693147180559945309f), x);
  V p = set1(1.f / 5040);
  p = fma(p, r, set1(1.f / 720));
  p = fma(p, r, set1(1.f / 120));
  p = fma(p, r, set1(1.f / 24));
  p = fma(p, r, set1(1.f / 6));
  p = fma(p, r, set1(0.5f));
  p = fma(p, r, set1(1.f));
  p = fma(p, r, set1(1.f));
  return mul(p, pow2(n));
}

}  // namespace v16
