"""Per-row token masks: a matcher per request over its compiled grammar, the batch's rows
masked to what each grammar allows next, and the mask kernel warmed at start-up."""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("tandem.language.grammar")


def matcher(compiled):
    """A fresh matcher (one per request) over a compiled grammar."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def apply_masks(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """`logits` [B, V] with each row whose matcher is not None masked to the tokens its
    grammar allows next (a new tensor when any row is masked)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    out = logits.float().clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=rows)
    return out


def warm_masks(device: torch.device, vocab_size: int) -> None:
    """Run the mask kernel as `apply_masks` does, once per shape it specialises on, at
    start-up: so its first-use cost is not paid by the first structured request, on the
    engine thread, with every running stream waiting. On CUDA that is xgrammar's Triton
    kernel, compiled per specialisation (a row count of 1, a multiple of 16, any other);
    on the CPU the import of xgrammar (under a second) and its C++ kernel's first call."""
    import xgrammar as xgr

    t0 = time.monotonic()
    logits = torch.zeros(16, vocab_size, dtype=torch.float32, device=device)
    bitmask = xgr.allocate_token_bitmask(16, vocab_size).to(device)
    for rows in (1, 2, 16):
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(range(rows)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("structured output: mask kernel ready on %s (%.1f s)", device,
             time.monotonic() - t0)
