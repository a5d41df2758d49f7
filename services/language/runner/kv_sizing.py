"""How many KV pages a CUDA device holds (`kv_pages` 0): the pool is sized last, from the
memory left once everything else that lives on the device exists or has been measured.

Every rank runs these phases in this order (`ModelRunner.__init__`; with tensor
parallelism all ranks at once, so the collectives inside steps 2, 3 and 5 meet):

    1. the decoder adopts the weights: the loader's dict is consumed group by group, so no
       duplicate of a projection is alive any more (model/linear.py)
    2. the worst eager step, run twice over a provisional one-page KV cache (every block
       table entry is page 0): a chunk of `max_prefill_tokens` prompt rows and
       `max_decode_rows` decode rows, every one at `max_seq_len` of context. The first run
       grows the workspaces (they stay allocated, so step 4 sees them as used); the second
       is measured: its peak allocation beyond what was allocated before it
    3. the decode graphs' pool, measured the same way: the largest batch bucket's step at
       the widest width, plus every graph's logits output (each stays in the pool)
    4. the freed temporaries go back to the device (`empty_cache`) and `mem_get_info` reads
       what is free
    5. pages = floor(fraction x (free - eager peak - graph pool) / bytes per page) - 1 (the
       dummy page); with tensor parallelism the smallest over the ranks
    6. the KV cache is allocated, then the graphs are captured (all ranks together)
"""

from __future__ import annotations

import math

import torch


class DeviceMemory:
    """A CUDA device's memory as the sizing reads it (torch.cuda's allocator counters)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @classmethod
    def of(cls, device: torch.device) -> DeviceMemory:
        if device.type != "cuda":
            raise ValueError("sizing the KV pool by free memory needs CUDA; set kv_pages")
        return cls(device)

    def peak_of(self, step) -> int:
        """Bytes `step()` allocates at its peak beyond what was allocated before it."""
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        step()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    def free_bytes(self) -> int:
        """Free device memory, the allocator's cached (freed) blocks given back first."""
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(self.device)
        return free


def pages_for(fraction: float, free: int, reserve: int, per_page: int) -> int:
    """KV pages in `fraction` of the `free` bytes left after `reserve` (the measured steps
    and graphs), less the dummy page. Refuses a device with no room for one page."""
    pages = math.floor(fraction * (free - reserve) / per_page) - 1
    if pages < 1:
        raise ValueError(
            f"no device memory left for the KV pool: {free / 2**30:.2f} GiB free, "
            f"{reserve / 2**30:.2f} GiB set aside for the largest step and the decode graphs "
            "(lower max_prefill_tokens, max_running_requests, max_model_len or "
            "cuda_graph_max_bs, or raise kv_memory_fraction)")
    return pages
