"""Checkpoints: the tiny-model builder, spec reading and split (encoder / language) loading.

Import the submodules directly (`tandem.models.tiny`, `.checkpoint`, `.split`); this package
itself imports nothing heavy, because `tandem/__init__.py` imports `tandem.models.hook`.
"""
