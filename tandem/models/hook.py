"""Registers Tandem's image-only processors the moment transformers' AutoProcessor loads.

`import tandem` must stay light (the gRPC SDK imports it; no torch, no transformers), yet
after it `AutoProcessor.from_pretrained(dir)` must work. So `tandem/__init__.py` installs a
`sys.meta_path` finder that watches for one module, transformers' processor auto-mapping, and
runs `tandem.models.processor.register()` right after that module has executed. Every road
to `AutoProcessor` goes through that module, and nothing heavy is imported before it is.

This module imports only the standard library.
"""

from __future__ import annotations

import importlib.abc
import sys

TARGET = "transformers.models.auto.processing_auto"


def _register() -> None:
    try:
        from tandem.models.processor import register

        register()
    except Exception as e:  # never break transformers' own import
        import warnings

        warnings.warn(f"tandem: could not register image-only processors: {e!r}", stacklevel=2)


class _RegisteringLoader(importlib.abc.Loader):
    """Wraps the real loader; registers after the module body has run."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        # NOTE: runs after the module is complete and in sys.modules, so register() may
        # import `transformers.AutoProcessor` without a circular partial import.
        _register()

    def __getattr__(self, name):  # get_code, get_source, is_package, ... of the real loader
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Install the hook once; register at once if transformers' auto-mapping is loaded."""
    if TARGET in sys.modules:
        _register()
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
