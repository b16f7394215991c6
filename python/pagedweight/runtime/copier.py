"""Host-to-device plane copies for reloads, on a dedicated copy stream.

`copy(pairs)` enqueues dst.copy_(src) for every (dst, src) pair and returns a fence behind them. On CUDA
the copy stream first waits for the current (forward) stream: the arena may have just poisoned or
relocated into the destination slots there, and those writes must land before the plane data. Sources
are pinned host tensors, so the copies are truly asynchronous.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from pagedweight.runtime.fences import CudaEventFence, Fence, ImmediateFence


class Copier(Protocol):
    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Fence: ...


class TorchCopier:
    """dst.copy_(src) on `stream` (CUDA) or synchronously (CPU, stream None)."""

    def __init__(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        self.stream = stream
        self.bytes_copied = 0

    @classmethod
    def for_device(cls, device: torch.device) -> "TorchCopier":
        return cls(torch.cuda.Stream(device) if device.type == "cuda" else None)

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Fence:
        for dst, src in pairs:
            if dst.numel() * dst.element_size() != src.numel() * src.element_size():
                raise ValueError(f"copy size mismatch: dst {tuple(dst.shape)} {dst.dtype}, src {tuple(src.shape)} {src.dtype}")
        nbytes = sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        self.bytes_copied += nbytes
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(_bytes(src))
            return ImmediateFence()
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(_bytes(src), non_blocking=True)
            return CudaEventFence(self.stream)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (arena slots are untyped bytes)."""
    if not t.is_contiguous():
        raise ValueError("copy source must be contiguous (host planes and tables are stored contiguous)")
    return t.reshape(-1).view(torch.uint8)
