"""bfloat16 as a tested dtype: our language runner in bfloat16 against transformers in
bfloat16, on the same inputs (the prompt payload a bfloat16 encoder sends: transformers'
own bfloat16 embeddings and image features), for every architecture and at --tp 2 (gloo).

What must hold, row by row (prompt logits over the whole prompt, then every decode step
teacher-forced along transformers' greedy tokens):
- |our logit - transformers' logit| <= BF16_TOL for every vocabulary entry. The logits of
  these checkpoints are O(1-10) (checked): bfloat16 keeps 8 significant bits, so BF16_TOL
  is 6-12 units in the last place at the largest logit (scale 8-16 and 4-8). The runner's
  own rounding differs from transformers' (other GEMM orders, the paged decode kernel, the
  fused projections), and so does torch's bfloat16 GEMM between CPUs (oneDNN with or
  without AVX512-BF16): measured up to ~0.2 on AVX-512 hosts and 0.3125 on an AMD EPYC
  with AVX2 alone (qwen2_5_vl small, a decode row whose largest logit is 4.9; 0.21 there
  with gather + SDPA), while our float32 runner on the same inputs is up to ~0.4 away from
  transformers' bfloat16 (its own distance from exact arithmetic). The bound must hold on
  every host the suite runs on, so it sits above the largest measured, below that 0.4.
- the greedy id equals transformers' wherever transformers' top-2 margin exceeds BF16_TOL
  (a claim beyond the bound, which alone lets margins up to 2 * BF16_TOL flip). Rows under
  it are near ties (bfloat16 rounds logits to ties often): counted, not compared, reported.
- MoE: a row whose token had a router near tie in transformers' step (its k-th and
  (k+1)-th expert probabilities within ROUTER_TIE in some layer) may pick another expert
  in our runner, a discrete jump beyond any rounding bound: counted, not compared, and
  reported. Later rows are compared again (a flipped token reaches them only through
  attention).
At least half the rows of every case are compared, so no case passes on ties alone.

On the CPU, bfloat16 runs either on torch's bfloat16 linears and the paged decode kernel in
bfloat16 (`cpu_bf16_compute=bfloat16`; the packed kernels' products are float32), or, what
`auto` picks on a CPU without AMX, with float32 products over the same weights (packed in
bfloat16 and widened by the kernel as it loads them, or widened copies with the torch
linears) and attention in float32 over the bfloat16 KV cache (`float32`; a float32 cache on
the gather path); both are checked, the bfloat16 cache against the float32 one of the
same values bit for bit, and the packed bfloat16 weights against their widened copies
bit for bit. `pytest --device cuda` runs the runner on
the GPU against the same CPU oracle (`make gpu-check`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import language_oracle as oracle
import pytest
import torch
from test_language_model import Seq
from test_tensor_parallel import stop, tp_engine

from tandem.services.language.engine.kv_pages import KVPagePool
from tandem.services.language.runner.forward_batch import ForwardBatch
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings

ARCHS = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
BF16 = torch.bfloat16
BF16_TOL = 0.375  # max |logit difference| per compared row (see the module docstring)
GREEDY_MARGIN = BF16_TOL  # greedy ids compared where the oracle's top-2 margin exceeds it
ROUTER_TIE = 0.02  # MoE: expert probabilities this close are a near tie
LOGIT_SCALE = (1.0, 16.0)  # the range of max |logit| in which BF16_TOL means what it says
STEPS = 10
DEVICE = oracle.test_device()
PAGE = oracle.page_size(DEVICE)  # the CPU-only cases' too (4)
CUDA_PAGE = oracle.page_size("cuda")
BACKENDS = ["auto", "gather"] if DEVICE.type == "cpu" else ["auto"]


@dataclass
class Agreement:
    """How one case's rows compared with transformers (what the report lists)."""

    case: str
    rows: int = 0  # logits rows in the case
    compared: int = 0  # rows held to BF16_TOL
    greedy_compared: int = 0  # of those, rows whose greedy id was compared
    near_ties: int = 0  # rows whose top-2 margin was within GREEDY_MARGIN (ids not compared)
    routing_ties: int = 0  # rows after a router near tie (not compared)
    max_diff: float = 0.0  # over the compared rows
    failures: list[str] = field(default_factory=list)

    def check(self, got: torch.Tensor, ref: torch.Tensor, router_margin: torch.Tensor) -> None:
        """got/ref [n, vocab] float32 on the CPU; router_margin [n] (inf: no router)."""
        assert got.shape == ref.shape, (got.shape, ref.shape)
        scale = ref.abs().max().item()
        assert LOGIT_SCALE[0] <= scale <= LOGIT_SCALE[1], f"{self.case}: logit scale {scale}"
        top2 = ref.topk(2, dim=-1).values
        for i in range(ref.shape[0]):
            self.rows += 1
            if router_margin[i] < ROUTER_TIE:
                self.routing_ties += 1
                continue
            diff = (got[i] - ref[i]).abs().max().item()
            self.compared += 1
            self.max_diff = max(self.max_diff, diff)
            if diff > BF16_TOL:
                self.failures.append(f"row {self.rows - 1}: max |diff| {diff:.4f} > {BF16_TOL}")
            if top2[i, 0] - top2[i, 1] <= GREEDY_MARGIN:
                self.near_ties += 1
            else:
                self.greedy_compared += 1
                if int(got[i].argmax()) != int(ref[i].argmax()):
                    self.failures.append(f"row {self.rows - 1}: greedy id differs")

    def assert_holds(self) -> None:
        assert not self.failures, f"{self.case}: " + "; ".join(self.failures[:8])
        assert self.compared * 2 >= self.rows, f"{self.case}: only {self.compared}/{self.rows} compared"


_REPORT: list[Agreement] = []


@pytest.fixture(scope="module", autouse=True)
def report(request):
    """The near ties and routing ties of every case, listed after the module's tests."""
    yield
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    if tr is None or not _REPORT:
        return
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        tr.write_line("")
        tr.write_sep("-", f"bfloat16 against transformers (bound {BF16_TOL}, device {DEVICE})")
        for a in _REPORT:
            tr.write_line(
                f"{a.case}: {a.compared}/{a.rows} rows within the bound (max {a.max_diff:.4f}),"
                f" greedy ids compared on {a.greedy_compared}, near ties {a.near_ties},"
                f" router near ties {a.routing_ties}"
            )


def finish(a: Agreement, record_property) -> None:
    _REPORT.append(a)
    for k, v in asdict(a).items():
        if k != "failures":
            record_property(f"bf16_{k}", v)
    a.assert_holds()


class RouterMargins:
    """transformers' MoE routing margins per token of each forward: the k-th minus the
    (k+1)-th expert probability, the smallest over the layers (inf without a router)."""

    def __init__(self, model) -> None:
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        self.calls: list[list[torch.Tensor]] = []

    def __enter__(self) -> RouterMargins:
        def hook(mod, _inp, out):
            p = torch.softmax(out[0].float(), dim=-1).sort(dim=-1, descending=True).values
            margin = p[:, mod.top_k - 1] - p[:, mod.top_k]
            if mod is self.routers[0]:
                self.calls.append([])
            self.calls[-1].append(margin)

        self.handles = [r.register_forward_hook(hook) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def per_call(self, lengths: list[int]) -> list[torch.Tensor]:
        """One [n] tensor per forward (n tokens each; all inf for a model without routers)."""
        if not self.routers:
            return [torch.full((n,), float("inf")) for n in lengths]
        assert [c[0].numel() for c in self.calls] == lengths, "one hook call per forward"
        return [torch.stack(c).amin(dim=0) for c in self.calls]


@dataclass
class Prompt:
    payload: object  # PromptPayload in bfloat16
    prompt_ref: torch.Tensor  # [L, vocab] transformers' prompt logits
    prompt_margin: torch.Tensor  # [L]
    tokens: list[int]  # transformers' greedy tokens
    step_ref: torch.Tensor  # [len(tokens), vocab] the logits of each greedy step
    step_margin: torch.Tensor  # [len(tokens)]


_ORACLES: dict[tuple[str, str], list[Prompt]] = {}


def bf16_oracle(path, arch: str, size: str) -> list[Prompt]:
    """transformers in bfloat16 on a text-only and a two-image prompt (cached per model)."""
    if (arch, size) in _ORACLES:
        return _ORACLES[(arch, size)]
    model, proc = oracle.load(path, BF16)
    prompts = []
    for n_img in (0, 2):
        images = [oracle.make_image(5 * n_img + i, (56 + 28 * i, 84 - 28 * i)) for i in range(n_img)]
        inputs = oracle.make_inputs(proc, f"Describe picture {n_img} in a few words.", images)
        payload = oracle.payload(model, inputs)
        assert payload.input_embeds.dtype == BF16
        with RouterMargins(model) as rm:
            prompt_ref = oracle.prompt_logits(model, inputs)
            tokens, step_ref = oracle.generate(model, inputs, STEPS)
        n = inputs["input_ids"].shape[1]
        margins = rm.per_call([n, n] + [1] * (len(tokens) - 1))
        prompts.append(Prompt(payload, prompt_ref, margins[0], tokens, step_ref,
                              torch.cat([margins[1][-1:], *margins[2:]])))
    _ORACLES[(arch, size)] = prompts
    return prompts


def run_case(runner, num_pages: int, prompts: list[Prompt], name: str) -> Agreement:
    """Each prompt in two chunks (prompt logits), then its greedy steps teacher-forced."""
    a = Agreement(name)
    pool = KVPagePool(num_pages, runner.page_size)
    for p in prompts:
        s = Seq(0, p.payload, pool)
        half = p.payload.num_tokens // 2
        got = torch.cat([runner.forward(ForwardBatch([s.prompt_chunk(k)])).prompt_logits[0]
                         for k in (half, p.payload.num_tokens - half)])
        a.check(got.float().cpu(), p.prompt_ref, p.prompt_margin)
        rows = [got[-1]]
        for t in p.tokens[:-1]:
            rows.append(runner.forward(ForwardBatch([s.decode_chunk(t)])).last_logits[0])
        a.check(torch.stack(rows).float().cpu(), p.step_ref, p.step_margin)
        s.free()
    assert pool.num_free == pool.num_total
    return a


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_runner_within_bound_of_transformers(arch, backend, checkpoint, record_property):
    path = checkpoint(arch)
    prompts = bf16_oracle(path, arch, "tiny")
    pages = oracle.kv_pages(256, DEVICE)
    runner = ModelRunner(
        oracle.text_weights(path, BF16), RunnerSettings(page_size=PAGE, attention_backend=backend),
        num_pages=pages, device=DEVICE, dtype=BF16,
    )
    finish(run_case(runner, pages, prompts, f"{arch} tiny {backend}"), record_property)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_bf16_small_preset_within_bound(arch, checkpoint, record_property):
    """12 layers: the rounding of a deeper stack (the tiny preset has 2)."""
    path = checkpoint(arch, "small")
    prompts = bf16_oracle(path, arch, "small")
    pages = oracle.kv_pages(256, DEVICE, page=16)
    runner = ModelRunner(oracle.text_weights(path, BF16), RunnerSettings(page_size=16),
                         num_pages=pages, device=DEVICE, dtype=BF16)
    finish(run_case(runner, pages, prompts, f"{arch} small"), record_property)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="--tp 2 over gloo on the CPU (one GPU here)")
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl_moe"])  # sliced KV biases; MoE
def test_bf16_tp2_within_bound_of_transformers(arch, checkpoint, record_property):
    path = checkpoint(arch)
    prompts = bf16_oracle(path, arch, "tiny")
    engine = tp_engine(path, 64, dtype="bfloat16")
    try:
        runner = engine.runner
        assert runner.tp.size == 2 and runner.dtype == BF16
        finish(run_case(runner, 64, prompts, f"{arch} tiny tp2"), record_property)
    finally:
        stop(engine)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's bfloat16 paths")
def test_bf16_on_cpu_torch_gemm_keeps_every_tensor_bf16(checkpoint):
    """cpu_bf16_compute='bfloat16': torch's bfloat16 linears (the packed kernels are float32
    only: `auto` falls back, `packed_cpu` is refused with the reason), every parameter and
    the KV cache bfloat16, the decode kernel, where built, in bfloat16."""
    from tandem.cpu_kernels import paged_decode_op

    weights = oracle.text_weights(checkpoint("qwen3_vl_moe"), BF16)
    native = RunnerSettings(page_size=PAGE, cpu_bf16_compute="bfloat16")
    runner = ModelRunner(weights.copy(), native, num_pages=8, dtype=BF16)
    assert runner.linear_kernels is None and runner.linear_dtype == BF16
    assert {p.dtype for p in runner.model.parameters()} == {BF16}
    assert {t.dtype for t in (*runner.kv.k, *runner.kv.v)} == {BF16}
    assert runner.decode_op is paged_decode_op()
    with pytest.raises(ValueError, match="float32"):
        ModelRunner(weights.copy(), RunnerSettings(page_size=PAGE, linear_backend="packed_cpu",
                                                   cpu_bf16_compute="bfloat16"),
                    num_pages=8, dtype=BF16)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's bfloat16 paths")
def test_bf16_on_cpu_float32_products_keep_the_weights_values(checkpoint):
    """cpu_bf16_compute='float32' (what `auto` picks on a CPU without AMX): products in
    float32 over the same weight values, packed in bfloat16 where the kernels build (the
    same bits as packing their float32 widening), held widened to float32 with the torch
    linears; norms, every step's activations and, on the paged_cpu kernels, the KV cache
    stay bfloat16 (attention computes in float32 over it); the gather path's cache is
    float32."""
    from tandem.cpu_kernels import paged_decode_op
    from tandem.services.language.model.attention import AttentionBackend
    from tandem.services.language.model.linear import DenseLinear

    weights = oracle.text_weights(checkpoint("qwen3_vl"), BF16)
    runner = ModelRunner(weights.copy(), RunnerSettings(page_size=PAGE, cpu_bf16_compute="float32"),
                         num_pages=8, dtype=BF16)
    assert runner.linear_dtype == torch.float32 and runner.dtype == BF16
    kv = {t.dtype for t in (*runner.kv.k, *runner.kv.v)}
    if paged_decode_op() is not None and runner.attention.backend is AttentionBackend.PAGED_CPU:
        assert kv == {BF16} and runner.attention.compute_dtype == torch.float32
    else:
        assert kv == {torch.float32} and runner.attention.compute_dtype is None
    gather = ModelRunner(weights, RunnerSettings(page_size=PAGE, cpu_bf16_compute="float32",
                                                 attention_backend="gather"),
                         num_pages=8, dtype=BF16)
    assert {t.dtype for t in (*gather.kv.k, *gather.kv.v)} == {torch.float32}
    assert gather.attention.compute_dtype is None
    linears = [m for m in runner.model.modules() if isinstance(m, DenseLinear)]
    assert linears and all(m.compute_dtype == torch.float32 for m in linears)
    if runner.linear_kernels is not None:  # packed: bfloat16 weights, widened as loaded
        assert {m.packed.weight_p.dtype for m in linears} == {BF16}
        for m in linears:
            p = m.packed
            x = torch.randn(5, p.in_features)
            assert torch.equal(p(x), runner.linear_kernels.packed_linear(
                x, p.weight_p.float(), p.bias_p, p.out_features))
    unpacked = ModelRunner(oracle.text_weights(checkpoint("qwen3_vl"), BF16), RunnerSettings(
        page_size=PAGE, cpu_bf16_compute="float32", linear_backend="torch"),
        num_pages=8, dtype=BF16)
    assert {m.weight_t.dtype for m in unpacked.model.modules()
            if isinstance(m, DenseLinear)} == {torch.float32}
    assert runner.model.norm.weight.dtype == BF16
    assert runner.model.embed(torch.tensor([1, 2])).dtype == BF16
    with pytest.raises(ValueError, match="cpu_bf16_compute"):
        ModelRunner(oracle.text_weights(checkpoint("qwen3_vl"), BF16),
                    RunnerSettings(page_size=PAGE, cpu_bf16_compute="fp8"), num_pages=8, dtype=BF16)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's bfloat16 paths")
@pytest.mark.parametrize("compute", ["bfloat16", "float32"])
def test_bf16_each_cpu_compute_within_bound(compute, checkpoint, record_property):
    """Both ways of computing bfloat16 on the CPU, whichever `auto` picks on this host,
    within the bound (qwen3_vl tiny: q/k norms, interleaved MRoPE, deepstack)."""
    path = checkpoint("qwen3_vl")
    prompts = bf16_oracle(path, "qwen3_vl", "tiny")
    runner = ModelRunner(oracle.text_weights(path, BF16),
                         RunnerSettings(page_size=PAGE, cpu_bf16_compute=compute),
                         num_pages=64, device=DEVICE, dtype=BF16)
    finish(run_case(runner, 64, prompts, f"qwen3_vl tiny {compute}"), record_property)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's bfloat16 paths")
def test_bf16_kv_cache_gives_the_float32_caches_logits_bit_for_bit(checkpoint):
    """Float32 products (`cpu_bf16_compute=float32`) on the paged_cpu kernels: the runner's
    bfloat16 KV cache gives the logits the float32 cache of the same values gave (the
    choice before it), bit for bit: prompt chunks without and with a cached prefix, then
    decode steps (qwen3_vl tiny)."""
    from dataclasses import replace

    from tandem.services.language.model.attention import AttentionBackend

    path = checkpoint("qwen3_vl")
    prompts = bf16_oracle(path, "qwen3_vl", "tiny")
    settings = RunnerSettings(page_size=PAGE, cpu_bf16_compute="float32",
                              attention_backend="paged_cpu")
    try:
        new = ModelRunner(oracle.text_weights(path, BF16), settings, num_pages=64, dtype=BF16)
    except ValueError:
        pytest.skip("no C++ toolchain to build the kernels")
    old = ModelRunner(oracle.text_weights(path, BF16), settings, num_pages=64, dtype=BF16)
    assert new.attention.backend is AttentionBackend.PAGED_CPU and new.kv.k[0].dtype == BF16
    old.kv_dtype, old.attention = torch.float32, replace(old.attention, compute_dtype=None)
    old._allocate_kv(64)  # the float32 cache of the same values
    for p in prompts:
        logits = []
        for runner in (new, old):
            pool = KVPagePool(64, PAGE)
            s = Seq(0, p.payload, pool)
            half = p.payload.num_tokens // 2
            rows = [runner.forward(ForwardBatch([s.prompt_chunk(k)])).prompt_logits[0]
                    for k in (half, p.payload.num_tokens - half)]
            rows += [runner.forward(ForwardBatch([s.decode_chunk(t)])).last_logits
                     for t in p.tokens[:-1]]
            logits.append(torch.cat(rows))
        assert torch.equal(logits[0], logits[1])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_on_cuda_within_bound_and_graph_replay_equals_eager(arch, checkpoint, record_property):
    """On the GPU whatever --device says (a `gpu` test: `pytest -m gpu` runs it): the
    bfloat16 runner against transformers as above, then its decode graphs in bfloat16,
    captured and replayed for batches of 1-8 rows (padded sizes included), against the
    eager step: within BF16_TOL and the same greedy ids outside near ties."""
    from test_graph_runner import _decode_batch, _prefill

    path = checkpoint(arch)
    prompts = bf16_oracle(path, arch, "tiny")
    pages = oracle.kv_pages(256, "cuda")
    runner = ModelRunner(oracle.text_weights(path, BF16), RunnerSettings(page_size=CUDA_PAGE),
                         num_pages=pages, device="cuda", dtype=BF16)
    finish(run_case(runner, pages, prompts, f"{arch} tiny cuda"), record_property)

    max_seq = 256
    graphs = ModelRunner(
        oracle.text_weights(path, BF16),
        RunnerSettings(page_size=CUDA_PAGE, cuda_graph_max_bs=8, max_seq_len=max_seq),
        num_pages=oracle.kv_pages(8 * max_seq, "cuda"), device="cuda", dtype=BF16,
    )
    gr = graphs.graph_runner
    assert gr is not None and gr.use_graphs and gr.graphs
    seqs = _prefill(graphs, KVPagePool(graphs.num_pages, CUDA_PAGE), 8, seed=2)
    for bs in (1, 3, 8):
        batch = _decode_batch(seqs[:bs])
        got = gr.run(batch).last_logits.float()
        want = graphs.forward_eager(batch).last_logits.float()
        assert (got - want).abs().max().item() <= BF16_TOL, bs
        top2 = want.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > GREEDY_MARGIN  # near ties are not compared
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), bs
