"""A real language-side transfer endpoint for encoder tests: Mooncake + block buffers + receiver."""

from __future__ import annotations

import torch

from tandem.config import TransferConfig
from tandem.transfer.buffers import EmbeddingBuffers
from tandem.transfer.engine import MooncakeEngine
from tandem.transfer.receiver import EmbeddingReceiver, ReceiverLimits


class LanguageSide:
    """Receives prompt payloads from an encoder, as a language instance would."""

    def __init__(
        self,
        embed_dim: int,
        ports: tuple[int, int],
        reserve_tokens: int = 64,
        num_blocks: int = 96,
        block_size: int = 16,
    ) -> None:
        cfg = TransferConfig(min_port=ports[0], max_port=ports[1], timeout_s=20.0)
        self.engine = MooncakeEngine(cfg)
        self.buffers = EmbeddingBuffers(num_blocks, block_size, embed_dim, torch.float32)
        self.buffers.register(self.engine)
        self.receiver = EmbeddingReceiver(
            self.engine, self.buffers, cfg, ReceiverLimits(reserve_tokens=reserve_tokens)
        )
        self.allocator = self.receiver.allocator
