"""Transfer layer shared by encoder and language: block buffers, Mooncake engine, Attach.

Encoder side:   MooncakeEngine, StagingArea, EmbeddingSender (serves Encoder.Attach)
Language side:  MooncakeEngine, EmbeddingBuffers, BlockAllocator, EmbeddingReceiver
Both:           PromptPayload, RowProtection (--transfer.protect), TransferError,
                transfer_metrics
"""

from tandem.transfer.allocator import BlockAllocator
from tandem.transfer.buffers import BufferLayout, EmbeddingBuffers, RowProtection
from tandem.transfer.engine import MooncakeEngine
from tandem.transfer.errors import TransferError
from tandem.transfer.metrics import transfer_metrics
from tandem.transfer.payload import PromptPayload
from tandem.transfer.receiver import EmbeddingReceiver, ReceiverLimits
from tandem.transfer.room import ReceiverState
from tandem.transfer.sender import EmbeddingSender
from tandem.transfer.sender_room import SenderState, SendStats
from tandem.transfer.staging import StagingArea

__all__ = [
    "BlockAllocator", "BufferLayout", "EmbeddingBuffers", "EmbeddingReceiver", "EmbeddingSender",
    "MooncakeEngine", "PromptPayload", "ReceiverLimits", "ReceiverState", "RowProtection", "SendStats", "SenderState",
    "StagingArea", "TransferError", "transfer_metrics",
]
