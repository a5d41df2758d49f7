"""Tandem: encoder/language disaggregated serving for vision-language models.

Importing `tandem` is cheap (no torch). `tandem.models` registers the processor classes
that let `transformers`' Auto classes load Tandem's checkpoints on machines without
torchvision; it is imported lazily by the code that needs it.
"""

__version__ = "0.1.0"
