"""Random weights for a transformers config, written tensor by tensor: no model in memory.

`plan_weights(config, dtype)` lists every tensor the checkpoint holds, under the names and
in the layout transformers' `save_pretrained` writes (its model built on the meta device,
tied weights dropped, its save-time renames applied), with the value each starts from:

    ones    the weight of a norm (RMSNorm, LayerNorm)
    zeros   a bias
    normal  everything else: N(0, initializer_range) of its tower (text or vision)

as transformers' own initialisation does for these models. `write_weights(plan, out)` then
writes the safetensors shards (and the index when there are several): each file's header
first (every shape is known up front), then each tensor generated in blocks of BLOCK
elements and written as it comes, so a 16 GB checkpoint is built holding about one block
(~100 MB) in memory (tests/test_real_sizes.py measures it). The values depend only on
(tensor name, seed, generating device): a per-tensor generator, fixed block size; the same
(config, seed) on the same kind of device writes the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

log = logging.getLogger("tandem.models")

BLOCK = 1 << 24  # elements generated at a time (64 MB of float32 before the cast)
PROGRESS_S = 10.0  # a long write says how far it got at least this often
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class Init(Enum):
    ONES = "ones"
    ZEROS = "zeros"
    NORMAL = "normal"


@dataclass(frozen=True)
class TensorPlan:
    name: str  # as stored in the checkpoint
    shape: tuple[int, ...]
    init: Init
    std: float  # NORMAL only

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class WeightPlan:
    """Every tensor of the checkpoint and the file that holds it."""

    dtype: torch.dtype
    tensors: tuple[TensorPlan, ...]  # sorted by name
    shards: dict[str, tuple[str, ...]]  # file name -> tensor names, in file order
    model_class: str  # transformers' class that `save_pretrained` would name

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def total_bytes(self) -> int:
        return self.num_parameters * self.dtype.itemsize


def plan_weights(config, dtype: torch.dtype, max_shard_bytes: int = 4 << 30) -> WeightPlan:
    """The tensors transformers' model for `config` saves, and their shards (never more than
    `max_shard_bytes` of tensors per file, unless one tensor alone is larger)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(map(str, _ST_DTYPES))}, got {dtype}")
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    text_std = config.text_config.initializer_range
    vision_std = config.vision_config.initializer_range
    init_of: dict[int, tuple[Init, float]] = {}  # by tensor identity (renames keep it)
    for mod_name, mod in model.named_modules():
        is_norm = "norm" in type(mod).__name__.lower()
        std = vision_std if "visual" in mod_name.split(".") else text_std
        for p_name, p in mod.named_parameters(recurse=False):
            if is_norm:
                init = Init.ONES if p_name == "weight" else Init.ZEROS
            else:
                init = Init.ZEROS if p_name == "bias" or p_name.endswith("_bias") else Init.NORMAL
            init_of[id(p)] = (init, std)
    state = remove_tied_weights_from_state_dict(model.state_dict(keep_vars=True), model)
    state = revert_weight_conversion(model, state)  # the names save_pretrained writes
    tensors = []
    for name in sorted(state):
        t = state[name]
        if id(t) not in init_of:  # a persistent buffer: nothing here knows its value
            raise ValueError(f"{name}: a saved tensor that is no parameter")
        init, std = init_of[id(t)]
        tensors.append(TensorPlan(name, tuple(t.shape), init, std))
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_bytes
    )
    shards = {f: tuple(sorted(names)) for f, names in split.filename_to_tensors.items()}
    return WeightPlan(dtype, tuple(tensors), shards, type(model).__name__)


def _header(plan: WeightPlan, names: tuple[str, ...]) -> bytes:
    """A safetensors header for `names`, data laid out in that order, padded to 8 bytes."""
    by_name = {t.name: t for t in plan.tensors}
    st_dtype, size = _ST_DTYPES[plan.dtype], plan.dtype.itemsize
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for n in names:
        t = by_name[n]
        header[n] = {"dtype": st_dtype, "shape": list(t.shape),
                     "data_offsets": [offset, offset + t.numel * size]}
        offset += t.numel * size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _seed(name: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _blocks(t: TensorPlan, dtype: torch.dtype, seed: int, device: torch.device):
    """The tensor's values in `dtype` on the CPU, BLOCK elements at a time."""
    gen = None
    if t.init is Init.NORMAL:
        gen = torch.Generator(device=device).manual_seed(_seed(t.name, seed))
    for start in range(0, t.numel, BLOCK):
        n = min(BLOCK, t.numel - start)
        if t.init is Init.NORMAL:
            block = torch.empty(n, device=device).normal_(0.0, t.std, generator=gen)
        else:
            block = torch.full((n,), 1.0 if t.init is Init.ONES else 0.0, device=device)
        yield block.to(dtype).cpu()


def write_weights(plan: WeightPlan, out: Path, seed: int = 0, device="cpu") -> None:
    """Write the plan's shards into `out` (and model.safetensors.index.json if several)."""
    device = torch.device(device)
    by_name = {t.name: t for t in plan.tensors}
    t0 = last = time.monotonic()
    done = 0
    for file, names in plan.shards.items():
        with open(out / file, "wb") as f:
            f.write(_header(plan, names))
            for name in names:
                for block in _blocks(by_name[name], plan.dtype, seed, device):
                    f.write(block.view(torch.uint8).numpy())
                    done += block.numel() * plan.dtype.itemsize
                    if time.monotonic() - last >= PROGRESS_S:
                        last = time.monotonic()
                        log.info("random weights: %.1f of %.1f GB written (%s, %.0f s)",
                                 done / 1e9, plan.total_bytes / 1e9, file, last - t0)
    if len(plan.shards) > 1:
        write_index(plan, out)


def write_index(plan: WeightPlan, out: Path) -> None:
    """model.safetensors.index.json, as save_pretrained writes it for a sharded model."""
    index = {
        "metadata": {"total_parameters": plan.num_parameters, "total_size": plan.total_bytes},
        "weight_map": {n: f for f, names in plan.shards.items() for n in names},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
