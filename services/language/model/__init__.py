"""Text decoders of the supported VLMs (our own modules; transformers is only the oracle)."""

from tandem.services.language.model.config import DecoderConfig
from tandem.services.language.model.decoder import QwenVLDecoder

__all__ = ["DecoderConfig", "QwenVLDecoder"]
