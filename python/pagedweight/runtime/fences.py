"""Fences: "everything enqueued before this point has finished", as the pager needs it.

The pager records a fence on the forward stream right after it rewrites the device page table, and on the
copy stream after a batch of host-to-device copies. Polling `done()` at later scheduler boundaries tells
it when old planes can be freed (no forward still reads them) and when copied planes can be committed.
On GPU a fence is a CUDA event; on CPU (and in tests) work is synchronous, so a fence is done at once.
Tests inject fences they complete by hand to check the ordering.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch


class Fence(Protocol):
    def done(self) -> bool:
        """True once the work enqueued before the fence was recorded has finished (non-blocking)."""
        ...


class FenceFactory(Protocol):
    def record(self) -> Fence:
        """A fence behind all work enqueued so far on the factory's stream (the current stream if none)."""
        ...


class ImmediateFence:
    def done(self) -> bool:
        return True


class ImmediateFenceFactory:
    """For CPU execution, where every enqueued op has already run when the call returns."""

    def record(self) -> Fence:
        return ImmediateFence()


class CudaEventFence:
    def __init__(self, stream: Optional[torch.cuda.Stream]) -> None:
        self._event = torch.cuda.Event()
        self._event.record(stream)  # None = current stream

    def done(self) -> bool:
        return self._event.query()

    def wait_on(self, stream: torch.cuda.Stream) -> None:
        stream.wait_event(self._event)


class CudaEventFenceFactory:
    """CUDA events recorded on `stream` (the current stream at record time when None)."""

    def __init__(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        self.stream = stream

    def record(self) -> Fence:
        return CudaEventFence(self.stream)
