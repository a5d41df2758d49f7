// The one Python module of the language tier's CPU kernels (see cpu_kernels.py).
#include <torch/extension.h>

#include "vec16.h"

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);
torch::Tensor pack_linear(torch::Tensor wt);
torch::Tensor pack_bias(torch::Tensor bias);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias,
                            int64_t N);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
namespace strip_pool {
void set_helpers(int64_t count, int64_t spin_us);
int64_t helpers();
int64_t selftest(int64_t jobs);
}
std::vector<torch::Tensor> rope_qk(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                   int64_t H, int64_t Hkv);
torch::Tensor segment_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                torch::Tensor cu, bool causal, double scale);
torch::Tensor nucleus_draw(torch::Tensor x, torch::Tensor temperature, torch::Tensor top_k,
                           torch::Tensor top_p, torch::Tensor min_p, torch::Tensor u,
                           int64_t buckets, double span, int64_t spread,
                           c10::optional<torch::Tensor> kept);

// NOTE: every kernel releases the GIL while it computes, so the process's asyncio thread
// (gRPC streaming, transfers) runs beside the engine thread's forward instead of waiting
// for Python's switch interval.
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, NoGil(),
        "decode attention over a paged KV cache, read in place");
  m.def("pack_linear", &pack_linear, NoGil(), "[K, N] float32 weight -> column strips [J, K, 32]");
  m.def("pack_bias", &pack_bias, NoGil(), "[N] float32 bias -> zero-padded to whole strips");
  m.def("packed_linear", &packed_linear, NoGil(), "x [M, K] @ packed weight (+ packed bias) -> [M, N]");
  m.def("rms_norm", &rms_norm, NoGil(), "RMSNorm of contiguous [T, D] float32 rows");
  m.def("silu_mul", &silu_mul, NoGil(), "silu(gate) * up of a fused [T, 2I] gate/up output");
  m.def("set_pool_helpers", &strip_pool::set_helpers, NoGil(), py::arg("count"),
        py::arg("spin_us") = 100,
        "helper threads of the claim-based pool for one-thread steps' linears (0: none), "
        "and how long each spins after a job before it sleeps");
  m.def("pool_helpers", &strip_pool::helpers, "helper threads of the claim-based pool");
  m.def("pool_selftest", &strip_pool::selftest, NoGil(), py::arg("jobs"),
        "the pool protocol's own check over back-to-back jobs: tasks run outside their job "
        "or other than once (0 when it holds)");
  m.def("isa", [] { return std::string(v16::kPath); },
        "the vector path this build runs: avx512, avx2, neon or generic (vec16.h)");
  m.def("rope_qk", &rope_qk, NoGil(), "q, k with rotary applied, split out of a fused qkv output");
  m.def("segment_attention", &segment_attention, NoGil(),
        "attention within packed segments of rows (each attends to its own; optionally causal)");
  m.def("nucleus_draw", &nucleus_draw, NoGil(), py::arg("x"), py::arg("temperature"),
        py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"), py::arg("buckets"),
        py::arg("span"), py::arg("spread"), py::arg("kept") = py::none(),
        "the sampler's cut and draw for [S, V] rows, one uniform each (engine/nucleus.py)");
}
