"""The lock (constraints.txt) decides what every install gets: each dependency pyproject.toml
names is pinned there, and the venv the suite runs in holds exactly the locked versions (so a
fresh machine's `make setup` installs what the last green suite ran with, not whatever a
package index serves that day)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lock_module():
    spec = importlib.util.spec_from_file_location("lock", ROOT / "deploy" / "scripts" / "lock.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


lock = _lock_module()


def test_every_dependency_pyproject_names_is_pinned():
    pins = lock.read_lock(lock.LOCK)
    missing = [n for n in lock.direct_dependencies() if n not in pins]
    assert not missing, f"pyproject.toml names {missing}, which constraints.txt does not pin"
    assert all(v and "+" not in v for v in pins.values())  # exact, no local labels


def test_the_venv_holds_the_locked_versions():
    """Every installed distribution the lock names is at its pin (torch's local label
    aside); only the project itself is unpinned."""
    if sys.prefix == sys.base_prefix:
        import pytest

        pytest.skip("not in the project's venv")
    import site

    pins = lock.read_lock(lock.LOCK)
    off = {}
    # the venv's own site-packages: not sys.path, where setuptools puts its vendored copies
    # (packaging, platformdirs, wheel at its own versions) once anything imported it
    for dist in md.distributions(path=site.getsitepackages()):
        name = lock._canon(dist.metadata["Name"])
        if name in pins and dist.version.split("+", 1)[0] != pins[name]:
            off[name] = (dist.version, pins[name])
    assert not off, f"installed vs locked: {off}"


def test_the_lock_reports_what_changed():
    assert lock.changes({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "2.1", "d": "4"}) == [
        "  b: 2 -> 2.1", "  c: removed (was 3)", "  d: added 4"]
