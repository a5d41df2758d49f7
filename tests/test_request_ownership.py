"""A language `Request`'s fields are written by their owner module only (request.py's
docstring has the table): an AST scan of services/language/ for every write to an owned
field — assignment, augmented assignment, `del`, an item write, or a mutating method call
on it (`req.kv.block_table.extend(...)`) — and every call of the one-writer methods
(`transition`, `append_output`) outside their owner.

A write through `self` is an object's own attribute (the runner's `self.kv` is its KV
cache, not a request's) and is not checked. A write through an alias
(`bt = req.kv.block_table; bt.append(p)`) is not seen: the scan catches the direct forms.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tandem.sampling import SamplingParams
from tandem.services.language.engine.request import (
    Request,
    RequestSpec,
    RequestStatus,
    TransitionError,
)
from tandem.transfer.payload import PromptPayload

ROOT = Path(__file__).resolve().parent.parent
LANGUAGE = ROOT / "services" / "language"
REQUEST, SCHEDULER, CORE, SAMPLER = (f"engine/{m}.py" for m in
                                     ("request", "scheduler", "core", "sampler"))

# A field's path on a request -> the one module (under services/language/) that writes it.
# The longest path that matches a write decides (`trace.chunks` before `trace`).
OWNERS: dict[tuple[str, ...], str] = {
    ("spec",): REQUEST,
    ("arrival",): REQUEST,
    ("status",): REQUEST,  # only inside Request.transition (called by the scheduler)
    ("output_ids",): REQUEST,  # only inside Request.append_output (the scheduler's commit)
    ("output_logprobs",): REQUEST,
    ("max_new_tokens",): REQUEST,  # given at construction
    ("trace",): REQUEST,  # given at construction
    ("trace", "chunks"): CORE,
    ("early_prefill_tokens",): CORE,
    ("kv",): SCHEDULER,
    ("times", "queued"): SCHEDULER,
    ("times", "first_scheduled"): SCHEDULER,
    ("times", "first_token"): CORE,
    ("times", "last_token"): CORE,
    ("times", "created"): REQUEST,
    ("sampler", "generator"): SAMPLER,
    ("sampler", "penalties"): SAMPLER,
    ("sampler", "seed"): CORE,
    ("sampler", "grammar_future"): CORE,
    ("sampler", "matcher"): CORE,
}
# The one-writer methods and the one module that calls them.
METHODS = {"transition": SCHEDULER, "append_output": SCHEDULER}
MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "sort",
                      "reverse", "update", "add", "discard", "setdefault", "popitem"})


def _chain(node: ast.expr) -> tuple[str, list[str]] | None:
    """`c.req.kv.block_table` -> ("c", ["req", "kv", "block_table"]); None for other
    shapes (a call's result, a subscript in the middle of the chain)."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not attrs or not isinstance(node, ast.Name):
        return None
    return node.id, attrs[::-1]


def _owner(attrs: list[str]) -> tuple[tuple[str, ...], str] | None:
    best = None
    for key, owner in OWNERS.items():
        for i in range(len(attrs) - len(key) + 1):
            if tuple(attrs[i:i + len(key)]) == key and (best is None or len(key) > len(best[0])):
                best = key, owner
    return best


def _targets(node: ast.AST) -> list[ast.expr]:
    """The attribute chains a statement or call writes."""
    match node:
        case ast.Assign(targets=ts):
            pass
        case ast.AugAssign(target=t) | ast.AnnAssign(target=t):
            ts = [t]
        case ast.Delete(targets=ts):
            pass
        case ast.Call(func=ast.Attribute(value=v, attr=m)) if m in MUTATORS:
            return [v]
        case _:
            return []
    out: list[ast.expr] = []
    todo = list(ts)
    while todo:
        t = todo.pop()
        if isinstance(t, ast.Tuple | ast.List):
            todo.extend(t.elts)
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
        elif isinstance(t, ast.Subscript):  # an item write writes the container
            todo.append(t.value)
        else:
            out.append(t)
    return out


def violations(path: Path, rel: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        for target in _targets(node):
            chain = _chain(target)
            if chain is None:
                continue
            base, attrs = chain
            hit = _owner(attrs)
            if hit is None or (base == "self" and attrs[0] == hit[0][0]):
                continue  # not a request's field, or an object's own attribute
            key, owner = hit
            if rel != owner:
                found.append(f"{rel}:{node.lineno} writes {base}.{'.'.join(attrs)} "
                             f"({'.'.join(key)} is {owner}'s)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = METHODS.get(node.func.attr)
            if owner is not None and rel != owner:
                found.append(f"{rel}:{node.lineno} calls .{node.func.attr}() "
                             f"({owner}'s to call)")
    return found


def scan(root: Path = LANGUAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        found += violations(path, path.relative_to(root).as_posix())
    return found


def test_each_request_field_is_written_by_its_owner_only():
    found = scan()
    assert not found, "\n".join(found)


def test_only_the_language_tier_holds_a_request():
    """The scan covers services/language/: no other tier may reach a Request."""
    for tier in ("encoder", "router"):
        for path in (ROOT / "services" / tier).rglob("*.py"):
            assert "language.engine.request" not in path.read_text(), path


def test_the_scan_sees_each_form_of_write(tmp_path):
    """A planted write of each form outside the owner is reported (and only those)."""
    planted = tmp_path / "engine" / "policy.py"
    planted.parent.mkdir()
    planted.write_text(
        "def f(req, c, self):\n"
        "    req.status = 1\n"
        "    req.kv.block_table.extend([1])\n"
        "    c.req.kv.num_computed_tokens += 4\n"
        "    del req.kv.block_table[2:]\n"
        "    req.output_ids.append(3)\n"
        "    a, req.trace = 1, None\n"
        "    req.transition(2)\n"
        "    self.kv = None\n"  # its own attribute: not a request's
        "    req.times.first_token = 0.0\n"
    )
    lines = sorted(int(v.split(":")[1].split()[0]) for v in scan(tmp_path))
    assert lines == [2, 3, 4, 5, 6, 7, 8, 10]


def _req(**kw) -> Request:
    return Request(RequestSpec(1, SamplingParams(max_tokens=4),
                               PromptPayload.of_token_ids([1, 2, 3])), **kw)


def test_transition_follows_the_order():
    S = RequestStatus
    r = _req()
    for s in (S.WAITING, S.PREFILLING, S.WAITING_FOR_ROWS, S.PREFILLING, S.RUNNING,
              S.WAITING, S.PREFILLING, S.RUNNING, S.FINISHED_LENGTH):
        r.transition(s)  # forward, a streamed prompt's pause, a retraction
    assert r.status is S.FINISHED_LENGTH
    with pytest.raises(TransitionError):
        r.transition(S.RUNNING)  # nothing leaves a finished status
    with pytest.raises(TransitionError):
        r.transition(S.FINISHED_ABORT)
    waiting = _req()
    waiting.transition(S.WAITING)
    with pytest.raises(TransitionError):
        waiting.transition(S.NEW)  # only an admitted request goes back (to WAITING)
    running = _req()
    for s in (S.WAITING, S.PREFILLING, S.RUNNING):
        running.transition(s)
    with pytest.raises(TransitionError):
        running.transition(S.PREFILLING)


def test_append_output_keeps_ids_and_logprobs_together():
    r = _req()
    r.append_output(5, -0.5)
    r.append_output(6, -0.25)
    assert (r.output_ids, r.output_logprobs) == ([5, 6], [-0.5, -0.25])
    plain = _req()
    plain.append_output(7, None)  # no logprobs asked
    assert (plain.output_ids, plain.output_logprobs) == ([7], [])


def test_budget_and_trace_are_given_at_construction():
    assert _req().max_new_tokens == 4
    assert _req(max_new_tokens=2).max_new_tokens == 2
    assert Request(RequestSpec(1, SamplingParams(), PromptPayload.of_token_ids([1]))).max_new_tokens is None
