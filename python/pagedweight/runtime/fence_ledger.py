"""Fences whose completion is a group decision (tensor parallelism).

Under TP every rank runs its own pager and elastic KV cache over its shard, and each of their decisions
(commit a bitwidth, free planes and grow the KV pool, hand released KV chunks back to the budget) waits
for a fence. A CUDA event completes at its own moment on each rank, so ranks polling their own events
would take the same decision at different scheduler iterations: for an iteration the two shards of a block
would run at different bitwidths, and the KV pools, which SGLang needs identical on every rank (each rank
schedules the same batches from its own allocator), would differ in size.

The ledger numbers fences in the order they are recorded, which is the same on every rank as long as
their decisions agree (by induction from an idle start). Once per iteration each rank reports the numbers
its device has completed; a fence counts as done only once every rank has completed it. Nothing blocks:
a rank whose device is behind just delays the decision by an iteration for everyone.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from pagedweight.runtime.copier import Copier
from pagedweight.runtime.fences import Fence, FenceFactory


def _inner_done(inner: Any) -> bool:
    # Pager fences answer done(); the elastic KV backing records raw CUDA events, which answer query().
    done = getattr(inner, "done", None)
    return bool(done()) if done is not None else bool(inner.query())


class LedgerFence:
    """A fence that is done when the group agreed it is; `query` for the KV backing's event protocol."""

    __slots__ = ("seq", "inner", "agreed")

    def __init__(self, seq: int, inner: Any) -> None:
        self.seq = seq
        self.inner = inner
        self.agreed = False

    def done(self) -> bool:
        return self.agreed

    def query(self) -> bool:
        return self.agreed

    def synchronize(self) -> None:
        # A blocking wait takes its decision at the same call on every rank, so it needs no agreement.
        self.inner.synchronize()

    def wait_on(self, stream: Any) -> None:
        self.inner.wait_on(stream)


class FenceLedger:
    """`started=False`: the ledger the runtime is built with (PagedRuntime.build) before serving begins. Until
    `start()` the wrapped fence sources hand out their own fences, unnumbered: the load-time drain and SGLang's
    KV sizing wait on them blockingly, which needs no agreement (tp_sync.make_tp_sync starts the ledger once
    the pager is idle and the KV memory parked so far is released)."""

    def __init__(self, started: bool = True) -> None:
        self.started = started
        self.recorded = 0  # fences numbered so far (part of the TP digest: equal on every rank)
        self.agreed = 0
        self._pending: dict[int, LedgerFence] = {}

    def start(self) -> None:
        """Number and agree every fence recorded from now on."""
        self.started = True

    def track(self, inner: Any) -> Any:
        """A ledger fence over `inner` (`inner` itself before `start()`)."""
        if not self.started:
            return inner
        fence = LedgerFence(self.recorded, inner)
        self.recorded += 1
        self._pending[fence.seq] = fence
        return fence

    def local_done(self) -> tuple[int, ...]:
        """Numbers of the pending fences this rank's device has completed (non-blocking)."""
        return tuple(seq for seq, f in self._pending.items() if _inner_done(f.inner))

    def agree(self, done_by_rank: Sequence[Iterable[int]]) -> int:
        """Mark done the fences every rank completed; returns how many became done."""
        if not done_by_rank:
            return 0
        common = set(done_by_rank[0]).intersection(*done_by_rank[1:])
        for seq in common:
            fence = self._pending.pop(seq, None)
            if fence is not None:
                fence.agreed = True
                self.agreed += 1
        return len(common)

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- wrappers for the three places fences come from ----------------------------------------------

    def wrap_factory(self, factory: FenceFactory) -> FenceFactory:
        return _LedgerFenceFactory(self, factory)

    def wrap_copier(self, copier: Copier) -> Copier:
        return _LedgerCopier(self, copier)

    def wrap_event_fn(self, record: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """For the elastic KV backing: record(stream) -> event becomes record(stream) -> ledger fence."""
        return lambda stream: self.track(record(stream))


class _LedgerFenceFactory:
    def __init__(self, ledger: FenceLedger, inner: FenceFactory) -> None:
        self.ledger = ledger
        self.inner = inner

    def record(self) -> Fence:
        return self.ledger.track(self.inner.record())


class _LedgerCopier:
    def __init__(self, ledger: FenceLedger, inner: Copier) -> None:
        self.ledger = ledger
        self.inner = inner

    def copy(self, pairs) -> Fence:
        return self.ledger.track(self.inner.copy(pairs))

    @property
    def bytes_copied(self) -> int:
        return getattr(self.inner, "bytes_copied", 0)
