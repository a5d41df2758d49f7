"""Tandem: encoder/language disaggregated serving for vision-language models.

Importing `tandem` is cheap (no torch, no transformers). It installs an import hook
(`tandem.models.hook`) that registers image-only Qwen processors with transformers'
`AutoProcessor` when transformers loads it, so Tandem's checkpoints (and real Qwen-VL ones)
load with the Auto classes on machines without torchvision.
"""

from tandem.models import hook as _hook

__version__ = "0.1.0"
DISTRIBUTION = "tandem-vlm"  # the name pip knows it by (pyproject.toml's project.name)


def version() -> str:
    """The installed distribution's version (the source tree's when not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(DISTRIBUTION)
    except PackageNotFoundError:
        return __version__


_hook.install()
