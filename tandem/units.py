"""Unit arithmetic shared by every tier: how many fixed-size units hold n items."""

from __future__ import annotations


def ceil_div(n: int, unit: int) -> int:
    """Units of size `unit` that hold `n` items (KV pages, embedding blocks, chunks)."""
    if n < 0 or unit <= 0:
        raise ValueError(f"bad ceil_div({n}, {unit})")
    return -(-n // unit)
