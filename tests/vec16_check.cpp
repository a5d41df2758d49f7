// Every operation of tandem/csrc/vec16.h on fixed inputs, printed as bit patterns: built for
// each path (native, -DTANDEM_FORCE_GENERIC, and aarch64 NEON under qemu where the cross
// tools are installed), the outputs must be identical (tests/test_vec16_paths.py).
// All path-specific code of the kernels lives in vec16.h, so this covers every line of it.
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "../tandem/csrc/vec16.h"

using v16::V;

namespace {

uint32_t state = 12345;
float next_float(float scale) {  // a fixed LCG: the same inputs on every build
  state = state * 1664525u + 1013904223u;
  return (static_cast<float>(state >> 8) / 16777216.f - 0.5f) * 2.f * scale;
}

void put(const char* what, float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  std::printf("%s %08x\n", what, bits);
}

void put_v(const char* what, V v) {
  float f[16];
  v16::store(f, v);
  for (float x : f) put(what, x);
}

}  // namespace

int main() {
  std::printf("path %s\n", v16::kPath);
  for (int rep = 0; rep < 200; ++rep) {
    float a[16], b[16], c[16];
    for (int i = 0; i < 16; ++i) {
      a[i] = next_float(3.f);
      b[i] = next_float(3.f);
      c[i] = next_float(1e3f);
    }
    const V x = v16::load(a), y = v16::load(b), z = v16::load(c);
    put_v("add", v16::add(x, y));
    put_v("sub", v16::sub(x, z));
    put_v("mul", v16::mul(x, y));
    put_v("div", v16::div(x, y));
    put_v("max", v16::max(x, y));
    put_v("fma", v16::fma(x, y, z));
    put_v("round", v16::round_even(v16::mul(x, v16::set1(7.3f))));
    put("hsum", v16::hsum(v16::mul(z, x)));
    // exp over [-100, 0]: the clamp, the reduction, the polynomial and 2^n
    float e[16];
    for (int i = 0; i < 16; ++i) e[i] = -std::abs(next_float(100.f));
    put_v("exp", v16::exp_poly(v16::load(e)));
    // tails: the first n lanes in, the first n lanes out
    const int n = 1 + rep % 16;
    float out[16];
    for (float& o : out) o = -1.f;
    v16::store_n(out, v16::add(v16::load_n(a, n), v16::set1(1.f)), n);
    for (float o : out) put("tail", o);
    // an FMA chain as the kernels run them (dot product of 300 terms, reduced by hsum)
    V acc = v16::zero();
    for (int k = 0; k < 300; k += 16) {
      float p[16], q[16];
      for (int i = 0; i < 16; ++i) p[i] = next_float(1.f), q[i] = next_float(1.f);
      acc = v16::fma(v16::load_n(p, 300 - k), v16::load_n(q, 300 - k), acc);
    }
    put("dot", v16::hsum(acc));
    // bfloat16 widening (load_bf16, load_bf16_n): LCG bit patterns (every exponent, NaNs,
    // infinities, subnormals among them), then the same FMA chain over bfloat16 keys
    uint16_t h[16];
    for (uint16_t& x : h) x = static_cast<uint16_t>(next_float(1.f) * 32768.f + 32768.f);
    h[rep % 16] = static_cast<uint16_t>(0x0001 + rep);  // a subnormal
    put_v("bf16", v16::load_bf16(h));
    for (float& o : out) o = -1.f;
    v16::store_n(out, v16::load_bf16_n(h, n), n);
    for (float o : out) put("bf16 tail", o);
    V bacc = v16::zero();
    for (int k = 0; k < 64; k += 16) {
      float p[16];
      uint16_t kb[16];
      for (int i = 0; i < 16; ++i) {
        p[i] = next_float(1.f);
        const float f = next_float(2.f);
        uint32_t bits;
        std::memcpy(&bits, &f, sizeof bits);
        kb[i] = static_cast<uint16_t>(bits >> 16);
      }
      bacc = v16::fma(v16::load(p), v16::load_bf16(kb), bacc);
    }
    put("bf16 dot", v16::hsum(bacc));
  }
  return 0;
}
