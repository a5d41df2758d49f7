"""No test measures or bounds a duration: speed belongs in a benchmark (bench/), and a test
on a shared, noisy machine checks behaviour (an exit status, an error line, the state
reached, which mechanism ended a wait), never how long something took.

Enforced on the source: outside tests/waiting.py (the one helper that waits for a state,
under a hang guard), no file under tests/ reads a clock. A clock read is a call of
`monotonic`, `perf_counter`, `process_time` or `thread_time` (and their `_ns` forms) on
anything, of `time()` / `time_ns()` on anything (`time.time()`, an alias's, an event
loop's), or of any of these imported by name from `time`. The one exception builds a
deadline handed to the code under test: a read inside a keyword argument whose name holds
"deadline" (`deadline_unix_ms=int((time.time() + 30) * 1000)`, `Budget(deadline=...)`), or
inside a function whose name holds "deadline".
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
WAITING = TESTS / "waiting.py"
_ANY_OBJECT = {f"{c}{ns}" for c in ("monotonic", "perf_counter", "process_time", "thread_time")
               for ns in ("", "_ns")}
_CLOCK_NAMES = _ANY_OBJECT | {"time", "time_ns"}


def clock_reads(source: str) -> list[tuple[int, str]]:
    """(line, call) of each clock read in `source` that does not build a deadline."""
    tree = ast.parse(source)
    by_name = {a.asname or a.name for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module == "time"
               for a in node.names if a.name in _CLOCK_NAMES}
    exempt: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg and "deadline" in node.arg.lower():
            exempt |= {id(n) for n in ast.walk(node.value)}
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                "deadline" in node.name.lower():
            exempt |= {id(n) for n in ast.walk(node)}
    hits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or id(node) in exempt:
            continue
        f = node.func
        clock = (isinstance(f, ast.Attribute) and (
            f.attr in _ANY_OBJECT or (f.attr in ("time", "time_ns") and not node.args)
        )) or (isinstance(f, ast.Name) and f.id in by_name)
        if clock:
            hits.append((node.lineno, ast.unparse(node)))
    return sorted(hits)


def test_no_test_reads_a_clock():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == WAITING or "__pycache__" in path.parts:
            continue
        for line, call in clock_reads(path.read_text()):
            found.append(f"{path.relative_to(TESTS.parent)}:{line}: {call}")
    assert not found, (
        "tests read a clock (a duration measured or bounded); check the state reached or "
        "what ended the wait instead, and wait through tests/waiting.py:\n" + "\n".join(found))


def test_the_rule_catches_each_form_and_spares_deadlines():
    caught = """
import time
import time as _time
from time import monotonic, perf_counter as pc
t0 = time.monotonic()
took = _time.perf_counter() - t0
a = monotonic()
b = pc()
c = time.time()
d = asyncio.get_running_loop().time()
e = time.process_time_ns()
end = time.time() + 10
"""
    assert [line for line, _ in clock_reads(caught)] == [5, 6, 7, 8, 9, 10, 11, 12]
    spared = """
import time
req = Request(1, deadline=time.monotonic() - 1)
msg = Encode(deadline_unix_ms=int((time.time() + 30) * 1000))
def _deadline(cmd):
    return time.time() + cmd["deadline_s"]
time.sleep(0.5)
when = datetime.time(12, 0)
"""
    assert clock_reads(spared) == []
