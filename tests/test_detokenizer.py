"""Streaming detokenization on the tiny model's byte-level BPE tokenizer: multi-byte
characters split across tokens, stop strings never streamed past."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tandem.services.language.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "héllo wörld 你好 🙂 ok",
    "naïve café — 東京タワー, Ελληνικά and emoji 👩‍💻 at the end 🎉",
    "plain ascii text with spaces   and\nnewlines\n",
]


@pytest.fixture(scope="module")
def tok(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint("qwen2_5_vl"))


def stream(tok, ids, stop=None, step=1):
    d = IncrementalDetokenizer(tok, stop)
    pieces = []
    for i in range(0, len(ids), step):
        pieces.append(d.add(ids[i : i + step]))
        if d.stopped:
            break
    if not d.stopped:
        pieces.append(d.flush())
    return pieces, d


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_stream_equals_full_decode(tok, text, step):
    ids = tok.encode(text)
    # the tokenizer really splits some characters across tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii()
    pieces, _ = stream(tok, ids, step=step)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("héllo wörld 你好 🙂 ok", ["你好"], "héllo wörld "),
        ("héllo wörld 你好 🙂 ok", ["wör", "🙂"], "héllo "),  # earliest match wins
        ("héllo wörld 你好 🙂 ok", ["ö"], "héllo w"),  # stop inside a split character
        ("the cat sat on the mat", ["the mat", "sat in"], "the cat sat on "),
        ("aaa abab abc", ["abc"], "aaa abab "),  # overlapping partial matches
    ],
)
def test_stop_strings_never_streamed(tok, text, stop, expected):
    ids = tok.encode(text)
    pieces, d = stream(tok, ids, stop=stop)
    assert d.stopped
    assert "".join(pieces) == expected
    for i in range(1, len(pieces) + 1):  # no prefix of the stream ever holds a stop string
        assert not any(s in "".join(pieces[:i]) for s in stop)


def test_held_back_prefix_is_released_when_it_stops_matching(tok):
    text = "the cat sat on the mat"
    ids = tok.encode(text)
    pieces, d = stream(tok, ids, stop=["the dog"])
    assert not d.stopped and "".join(pieces) == text
    # "the" (a stop-string prefix) was held at least once, then released with what followed
    streamed, seen_hold = "", False
    dd = IncrementalDetokenizer(tok, ["the dog"])
    for n, i in enumerate(ids, 1):
        streamed += dd.add([i])
        seen_hold |= len(streamed) < len(tok.decode(ids[:n]))
    assert seen_hold


def test_flush_releases_incomplete_tail(tok):
    ids = tok.encode("ok 🙂")[:-1]  # the emoji's last bytes are missing
    assert tok.decode(ids).endswith("\ufffd")
    d = IncrementalDetokenizer(tok)
    out = "".join(d.add([i]) for i in ids)
    assert out == "ok"  # nothing of the incomplete character is streamed early
    assert out + d.flush() == tok.decode(ids)
