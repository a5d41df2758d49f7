"""Text decoders of the supported VLMs (our own modules; transformers is only the oracle)."""

from services.language.model.config import DecoderConfig
from services.language.model.decoder import QwenVLDecoder

__all__ = ["DecoderConfig", "QwenVLDecoder"]
