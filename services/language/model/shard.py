"""Tensor parallelism's split of the text decoder: which slice of each tensor a rank holds.

Megatron-style, the one place the rule lives (the loader reads exactly these slices, the
decoder is built with the sizes they imply):

    q_proj (+bias)        column-parallel: rows of this rank's query heads (H / N each)
    k_proj, v_proj (+b)   column-parallel: rows of this rank's KV heads (Hkv / N each); with
                          fewer KV heads than ranks (N % Hkv == 0) each rank holds the one KV
                          head its query heads use (replicated over N / Hkv ranks)
    o_proj                row-parallel: columns of this rank's heads; one all-reduce after,
                          then the bias (whole, added once)
    gate_proj, up_proj    column-parallel: rows [r * I/N, (r+1) * I/N)
    down_proj             row-parallel: the same columns; one all-reduce after
    MoE experts           every expert's gate/up rows and down columns of the same range of
                          moe_intermediate (each rank a slice of every expert); one all-reduce
                          of the weighted sum; the router (`mlp.gate`) is replicated
    lm_head               split by vocabulary: rows [r * ceil(V/N), ...), gathered to rank 0
                          for sampling (a tied head: the same rows of the embedding table)

Replicated by design (every rank holds the whole tensor): the embedding table (decode
tokens are embedded on every rank; it is also a tied head's source), the norms (input,
post-attention, final, q/k), and the MoE router.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tandem.units import ceil_div

# normalized-name patterns (tandem.models.split's names) of the split tensors
_Q = re.compile(r"^layers\.\d+\.self_attn\.q_proj\.(weight|bias)$")
_KV = re.compile(r"^layers\.\d+\.self_attn\.[kv]_proj\.(weight|bias)$")
_O = re.compile(r"^layers\.\d+\.self_attn\.o_proj\.weight$")
_UP = re.compile(r"^layers\.\d+\.mlp\.(experts\.\d+\.)?(gate|up)_proj\.weight$")
_DOWN = re.compile(r"^layers\.\d+\.mlp\.(experts\.\d+\.)?down_proj\.weight$")
_FUSED_UP = re.compile(r"^layers\.\d+\.mlp\.experts\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^layers\.\d+\.mlp\.experts\.down_proj$")
REPLICATED = ("embed_tokens.weight", "norm.weight", "input_layernorm", "post_attention_layernorm",
              "q_norm", "k_norm", "o_proj.bias", "mlp.gate.weight")


@dataclass(frozen=True)
class ReadPlan:
    """Read `parts` (index tuples into the stored tensor) and concatenate them on `dim`."""

    dim: int
    parts: tuple[tuple[slice, ...], ...]


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` over a decoder of this shape."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    vocab_size: int
    hidden_size: int

    def __post_init__(self) -> None:
        n = self.size
        problems = []
        if self.num_heads % n:
            problems.append(f"{self.num_heads} attention heads")
        if self.num_kv_heads % n and n % self.num_kv_heads:
            problems.append(f"{self.num_kv_heads} KV heads (neither divides the other)")
        if self.intermediate_size % n:
            problems.append(f"intermediate size {self.intermediate_size}")
        if self.moe_intermediate_size % n:
            problems.append(f"MoE intermediate size {self.moe_intermediate_size}")
        if problems:
            raise ValueError(f"--tp {n} does not divide the model's " + ", ".join(problems))

    @classmethod
    def of(cls, spec, rank: int, size: int) -> Shard:
        """`spec` is a tandem.models.checkpoint.ModelSpec."""
        return cls(rank, size, int(spec.num_attention_heads), int(spec.num_key_value_heads),
                   int(spec.head_dim), int(spec.intermediate_size),
                   int(spec.moe_intermediate_size or 0), int(spec.vocab_size),
                   int(spec.hidden_size))

    # ---- local sizes --------------------------------------------------------------------
    @property
    def heads(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def moe_intermediate(self) -> int:
        return self.moe_intermediate_size // self.size

    @property
    def vocab(self) -> range:
        per = ceil_div(self.vocab_size, self.size)
        return range(min(self.vocab_size, self.rank * per), min(self.vocab_size, (self.rank + 1) * per))

    @property
    def vocab_per_rank(self) -> int:
        return ceil_div(self.vocab_size, self.size)

    # ---- what to read -------------------------------------------------------------------
    def _kv_rows(self) -> slice:
        d = self.head_dim
        if self.num_kv_heads % self.size == 0:
            a = self.rank * self.kv_heads
        else:  # fewer KV heads than ranks: the one this rank's query heads use
            a = self.rank // (self.size // self.num_kv_heads)
        return slice(a * d, (a + self.kv_heads) * d)

    def plan(self, name: str, shape: tuple[int, ...]) -> ReadPlan | None:
        """How rank `rank` reads the stored tensor `name` (normalized) of `shape`; None:
        whole (replicated)."""
        all_ = slice(None)
        heads = slice(self.rank * self.heads * self.head_dim,
                      (self.rank + 1) * self.heads * self.head_dim)
        inter = slice(self.rank * self.intermediate, (self.rank + 1) * self.intermediate)
        m = self.moe_intermediate
        moe = slice(self.rank * m, (self.rank + 1) * m)
        moe_up = slice(self.moe_intermediate_size + self.rank * m,
                       self.moe_intermediate_size + (self.rank + 1) * m)
        per_expert = ".experts." in name and not name.endswith(("gate_up_proj", "down_proj"))
        if _Q.match(name):
            return ReadPlan(0, ((heads,),))
        if _KV.match(name):
            return ReadPlan(0, ((self._kv_rows(),),))
        if _O.match(name):
            return ReadPlan(1, ((all_, heads),))
        if _UP.match(name):
            return ReadPlan(0, ((moe if per_expert else inter,),))
        if _DOWN.match(name):
            return ReadPlan(1, ((all_, moe if per_expert else inter),))
        if _FUSED_UP.match(name):  # [E, 2I, H] as transformers writes it, or [E, H, 2I]
            if shape[1] == 2 * self.moe_intermediate_size:
                return ReadPlan(1, ((all_, moe), (all_, moe_up)))
            return ReadPlan(2, ((all_, all_, moe), (all_, all_, moe_up)))
        if _FUSED_DOWN.match(name):  # [E, H, I] as transformers writes it, or [E, I, H]
            if shape[2] == self.moe_intermediate_size and shape[1] == self.hidden_size:
                return ReadPlan(2, ((all_, all_, moe),))
            return ReadPlan(1, ((all_, moe),))
        if name == "lm_head.weight":
            v = self.vocab
            return ReadPlan(0, ((slice(v.start, v.stop),),))
        return None
