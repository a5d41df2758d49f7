"""The one table of the tiers' process kinds: for each, the module and class of its settings
and the module whose `serve(config)` runs it. Named as strings and imported on use, so the
shared package never imports a tier (tests/test_import_graph.py: this is the one module
allowed to name them); `tandem <tier>` and `tandem serve`'s dry run both read it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    config_module: str
    config_class: str
    serve_module: str

    def config(self) -> type:
        """The tier's pydantic settings class (imports the tier's config module)."""
        return getattr(importlib.import_module(self.config_module), self.config_class)

    def serve(self, config) -> int:
        return importlib.import_module(self.serve_module).serve(config) or 0


TIERS = {
    "encoder": Tier("tandem.services.encoder.config", "EncoderConfig",
                    "tandem.services.encoder.main"),
    "language": Tier("tandem.services.language.config", "LanguageConfig",
                     "tandem.services.language.main"),
    "router": Tier("tandem.services.router.config", "RouterConfig",
                   "tandem.services.router.main"),
}
