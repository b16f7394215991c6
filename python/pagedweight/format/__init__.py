"""The Any-Precision (AP) checkpoint format: layout, quantizers, reader and writer (docs/format.md)."""

from pagedweight.format.arch import SHARED, BlockKey
from pagedweight.format.block import QuantizedBlock
from pagedweight.format.checkpoint import APCheckpoint, APCheckpointWriter
from pagedweight.format.manifest import APCheckpointError
from pagedweight.format.quantize import quantize_block

__all__ = [
    "SHARED",
    "APCheckpoint",
    "APCheckpointError",
    "APCheckpointWriter",
    "BlockKey",
    "QuantizedBlock",
    "quantize_block",
]
