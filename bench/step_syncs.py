"""Host syncs of decode steps: inside the body a decode CUDA graph records, and outside it
(the tier's wiring: it drives the runner and the engine's sampler together).

    decode_step_host_syncs(runner, batch_size=8, shaped=False, steps=2) -> [StepSyncs]

Runs `steps` decode steps of `batch_size` rows through `runner`'s graph runner and the
sampler, as the engine does (`core.py`), under a `HostSyncCounter` (tandem/host_syncs.py).
The graph runner's step body (`GraphRunner._step`, what a graph records) runs eagerly over
the same static buffers while it counts: a replay dispatches no op to count. Each row is
its own request, a mix of greedy rows and sampled ones (temperature, top-k, top-p, min-p,
typical-p, a seed, logprobs); `shaped` adds repetition, presence and frequency penalties, a logit bias and
min_tokens to every row. Between steps each drawn token is appended as the scheduler's
commit does, so the second step is the steady state (penalty state made, not re-made).

What must hold (tests/test_host_syncs.py on a fake CUDA device; `make gpu-check` on a
GPU): no sync in the captured body, at most one outside it (the drawn ids to the host).
It lives in bench/ beside gpu_check.py, not in the package: it serves only that check and
the test (and imports unittest.mock).

`fake_cuda_runner` builds a runner whose tensors live on a fake CUDA device (no GPU),
inside an open `fake_cuda()`: nothing is captured (no graphs exist there), so its graph
runner always runs the step body eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor

from tandem.host_syncs import HostSync, HostSyncCounter, IncompleteCount
from tandem.sampling import SamplingParams
from tandem.services.language.engine.request import Request, RequestSpec
from tandem.services.language.engine.sampler import sample
from tandem.services.language.runner.forward_batch import (
    ForwardBatch,
    SeqChunk,
    decode_positions,
)
from tandem.services.language.runner.graph_runner import GraphRunner
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings
from tandem.transfer.payload import PromptPayload
from tandem.units import ceil_div

CAPTURED = "captured"  # the counter's region: GraphRunner._step
CONTEXT = 9  # tokens each row has in its cache before the first measured step


@dataclass(frozen=True)
class StepSyncs:
    """The host syncs of one decode step."""

    captured: list[HostSync]  # inside the body a decode graph records: must be none
    outside: list[HostSync]  # the rest of the step (the runner's host part, the sampler)
    # Why the step stopped before its end ("": it ran to the end): under fake CUDA an op
    # that needs values (IncompleteCount), or what a READ's stand-in value led to. The
    # counts are then minima.
    stopped: str = ""

    @property
    def complete(self) -> bool:
        return not self.stopped

    def describe(self) -> str:
        more = f" (at least: stopped by {self.stopped})" if self.stopped else ""
        return (f"{len(self.captured)} in the graph body, {len(self.outside)} outside{more}: "
                + "; ".join(str(e) for e in self.captured + self.outside))


def _params(row: int, shaped: bool) -> SamplingParams:
    plain = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=row),
             dict(temperature=1.1, top_k=20, min_p=0.05, seed=row),
             dict(temperature=0.7, top_k=5, top_p=0.5, logprobs=True, top_logprobs=3),
             dict(temperature=1.2, typical_p=0.8, seed=row)]
    p = plain[row % len(plain)]
    if shaped:
        p = dict(p, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                 logit_bias={1: 2.0, 3: -1.5}, min_tokens=64)
    return SamplingParams(**p)


@torch.inference_mode()
def decode_step_host_syncs(runner: ModelRunner, batch_size: int = 8, shaped: bool = False,
                           steps: int = 2) -> list[StepSyncs]:
    """Count the host syncs of `steps` decode steps (module docstring). Writes KV pages
    [0, batch_size * pages-per-row) of `runner`'s cache."""
    gr = runner.graph_runner
    if gr is None:
        raise ValueError("the runner has no decode graph runner (cuda_graph_max_bs 0, or a "
                         "model it does not capture)")
    if not 1 <= batch_size <= gr.batch_sizes[-1]:
        raise ValueError(f"batch_size {batch_size} is outside the graphs' 1..{gr.batch_sizes[-1]}")
    vocab, ps = runner.vocab_size, runner.page_size
    per_row = ceil_div(CONTEXT + steps, ps)
    if batch_size * per_row > runner.num_pages:
        raise ValueError(f"{batch_size} rows need {batch_size * per_row} KV pages, the runner "
                         f"has {runner.num_pages}")
    reqs, chunks = [], []
    for i in range(batch_size):
        prompt = [(7 * i + j) % vocab for j in range(CONTEXT - 2)]
        req = Request(RequestSpec(i, _params(i, shaped), PromptPayload.of_token_ids(prompt)))
        for t in ((5 * i + 1) % vocab, (5 * i + 2) % vocab):  # generated so far
            req.append_output(t, None)
        reqs.append(req)
        pages = list(range(i * per_row, (i + 1) * per_row))
        chunks.append(SeqChunk(i, CONTEXT - 1, decode_positions(CONTEXT - 1, 0), pages,
                               token_ids=torch.tensor(req.output_ids[-1:])))
    eos = frozenset(runner.eos_token_ids)
    out: list[StepSyncs] = []
    graphs, gr.use_graphs = gr.use_graphs, False  # the body a graph records, run eagerly
    try:
        for _ in range(steps):
            counter = HostSyncCounter(regions={CAPTURED: GraphRunner._step})
            stopped = ""
            tokens = [0] * batch_size
            with counter:
                try:
                    logits = runner.forward(ForwardBatch(chunks)).last_logits
                    tokens = sample(logits, reqs, eos, rows=list(range(batch_size))).token_ids
                except Exception as e:  # reported with the counts (module docstring)
                    if not isinstance(e, IncompleteCount) and not _is_fake(runner):
                        raise  # on a real device a failing step is an error, not a count
                    stopped = f"{type(e).__name__}: {e}"[:300]
            out.append(StepSyncs(counter.in_region(CAPTURED), counter.in_region(None),
                                 stopped))
            for i, (req, c) in enumerate(zip(reqs, chunks, strict=True)):  # the commit
                req.append_output(int(tokens[i]), None)
                nxt = c.start + 1
                chunks[i] = SeqChunk(i, nxt, decode_positions(nxt, 0), c.block_table,
                                     token_ids=torch.tensor([int(tokens[i])]))
    finally:
        gr.use_graphs = graphs
    return out


def _is_fake(runner: ModelRunner) -> bool:
    return isinstance(runner.kv.k[0], FakeTensor)


def fake_cuda_runner(weights, settings: RunnerSettings, dtype: torch.dtype,
                     num_pages: int = 64) -> ModelRunner:
    """A runner on a fake CUDA device (call inside `tandem.host_syncs.fake_cuda()`), with a
    decode graph runner that never captures (there is no CUDA to capture on)."""
    if settings.cuda_graph_max_bs < 1:
        raise ValueError("a fake CUDA runner is for counting decode steps: give it "
                         "cuda_graph_max_bs >= 1")
    with mock.patch.object(GraphRunner, "capture", lambda self: None):
        runner = ModelRunner(weights, settings, num_pages=num_pages,
                             device="cuda", dtype=dtype)
    if runner.graph_runner is not None:
        runner.graph_runner.use_graphs = False
    return runner
