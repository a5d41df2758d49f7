"""plan_split (services/encoder/split.py) on plain data: where a split prompt is cut.

A cut falls only before a unit the lead's ViT must run (weight > 0): a helper is never
given a range that starts with (or holds only) units the lead has cached, and every share
holds ViT work.
"""

from __future__ import annotations

import pytest

from tandem.services.encoder.split import plan_split


def _plan(weights: list[int], helpers: int, payload_start: int = 0):
    starts = [10 + 100 * i for i in range(len(weights))]  # one unit per 100 tokens
    total = 10 + 100 * len(weights) - payload_start
    return plan_split(starts, weights, payload_start, total,
                      [f"h{k}" for k in range(helpers)])


def _weights(shares, weights: list[int]) -> list[int]:
    return [sum(weights[s.first_unit:s.end_unit]) for s in shares]


@pytest.mark.parametrize(("weights", "helpers"), [
    ([1, 10, 0, 0, 1], 2),  # was: a helper given units 2 (cached) alone
    ([6, 0, 0, 5], 1),  # was: the helper's range started with the lead's cached units
    ([6, 0, 0, 5], 2),
    ([0, 3, 0, 3, 0, 3], 2),
    ([5, 5, 5, 5], 3),
    ([1, 1, 0, 1, 0, 0, 1], 3),
])
def test_every_share_has_vit_work_and_helpers_start_at_work(weights, helpers):
    shares = _plan(weights, helpers)
    assert shares, "a split was possible"
    assert all(w > 0 for w in _weights(shares, weights)), shares
    assert all(weights[s.first_unit] > 0 for s in shares[1:]), shares
    # contiguous, in order, covering every unit and token
    assert shares[0].first_unit == 0 and shares[-1].end_unit == len(weights)
    assert all(a.end_unit == b.first_unit and a.end_token == b.first_token
               for a, b in zip(shares, shares[1:], strict=False))
    assert [s.helper for s in shares] == ["", *[f"h{k}" for k in range(len(shares) - 1)]]


def test_cached_units_join_the_share_before_them():
    shares = _plan([1, 10, 0, 0, 1], 2)
    assert [(s.first_unit, s.end_unit) for s in shares] == [(0, 4), (4, 5)]
    shares = _plan([6, 0, 0, 5], 1)
    assert [(s.first_unit, s.end_unit) for s in shares] == [(0, 3), (3, 4)]
    assert shares[1].first_token == 310 and shares[1].end_token == 410


def test_no_split_without_two_units_of_work_or_helpers():
    assert _plan([0, 5, 0], 2) == []
    assert _plan([5, 5], 0) == []
    assert _plan([0, 0], 1) == []


def test_units_in_the_cached_prefix_stay_with_the_lead():
    # units 0 and 1 start inside the language side's cached prefix (250 tokens)
    shares = _plan([4, 4, 4, 4], 3, payload_start=250)
    assert shares and shares[0].first_unit == 0
    assert all(s.first_unit >= 2 for s in shares[1:])
