"""Keep PagedWeight's decisions identical on every tensor-parallel rank.

Each TP rank holds its shard of every expert block and runs its own pager and elastic KV cache, so all
ranks must commit the same bitwidths and move the same number of KV tokens at the same scheduler
iteration. Two things differ between ranks and are agreed on once per iteration over the TP CPU group, in
one all-gather of a fixed int64 row per rank (plus a pickled exchange on the iterations that carry routing
statistics or traffic):

- the step's inputs: a policy reads the clock and the routing statistics (the runtime's routing mass and,
  for the quality policy, the traffic its RoutingObserver recorded), which a rank samples at its own moments
  and from its own forward, so the first rank's sample is used everywhere;
- fence completion: a CUDA event completes at its own moment on each rank, so a fence counts as done only
  once every rank's device has completed it (runtime/fence_ledger.py).

Every rank also reports a digest of what it has done so far (committed bitwidths, transitions, bytes
handed to the KV cache, KV capacity); a digest that differs between ranks is a bug, logged with both sides
and counted in the state endpoint, which is how the two-GPU benchmark proves the ranks stayed in step.

Quiet iterations skip the exchange (and the whole PagedWeight step): when an exchange shows every rank idle (pager
idle, no fence pending: FLAG_IDLE), no reload wanted (the free KV at most the high watermark, reloads held, or every
rank with nothing to reload: FLAG_TOP), no queued KV demand, no hold change, and the source rank's available KV
blocks above the low watermark by more than `window` iterations could allocate, the next `window - 1` iterations
skip (`quiet_window`). The verdict is a function of the gathered rows alone, so every rank skips the same
iterations; routing statistics and traffic accumulate locally meanwhile and travel at the next exchange.
"""

from __future__ import annotations

import logging
import pickle
import struct
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from pagedweight.runtime.latency_histogram import LatencyHistogram
from pagedweight.runtime.fence_ledger import FenceLedger

logger = logging.getLogger("pagedweight")


@dataclass(frozen=True)
class StepInputs:
    available_blocks: int
    evictable_blocks: int
    now_s: float
    # (layer, expert) -> routing mass; None when unchanged since the last broadcast (saves bandwidth).
    routing: Optional[Mapping[tuple[int, int], float]]
    # KV blocks the first waiting request needs beyond what is free now (0 when it fits or nothing waits).
    waiting_blocks: int = 0
    # An operator's hold on reloads (set_internal_state paged_weight_hold_reloads), as the source rank has it.
    reloads_held: bool = False
    # The quality policy's observed traffic (routing weights, routed-input norms: planner/observer.py) drained
    # on the source rank since its last drain; None when not due. Every rank folds this one, not its own.
    traffic: Optional[Any] = None


@dataclass(frozen=True)
class RankDigest:
    """What one rank has done by the start of an iteration; equal on every rank when they are in step."""

    iteration: int
    commits_crc: int  # running CRC-32 of every (block, bits) commit, in order
    transitions: int
    bytes_to_kv: int
    kv_capacity_tokens: int
    kv_available_tokens: int
    fences_recorded: int


# The fixed-size part of a rank's report: one int64 row, gathered as a tensor every iteration. Floats travel as
# their IEEE-754 bits. Fields of StepInputs other than the routing and traffic payloads, the digest, the rank's
# previous exchange time, and up to FENCE_SLOTS completed fence numbers.
FENCE_SLOTS = 16
_FLAGS, _AVAILABLE, _EVICTABLE, _NOW, _WAITING, _HELD, _LAST_US, _DIGEST = 0, 1, 2, 3, 4, 5, 6, 7
_DIGEST_FIELDS = tuple(RankDigest.__dataclass_fields__)
_N_DONE = _DIGEST + len(_DIGEST_FIELDS)
_FENCES = _N_DONE + 1
ROW = _FENCES + FENCE_SLOTS
FLAG_PAYLOAD = 1  # the source rank has routing statistics or traffic to send this iteration
FLAG_FENCES = 2  # this rank completed more fences than the row holds
FLAG_SRC = 4  # this row is the source rank's: its inputs are the ones every rank uses
FLAG_IDLE = 8  # this rank's pager is idle and its fence ledger has nothing pending
FLAG_TOP = 16  # this rank has nothing to reload: every block at its ceiling, the KV cache at its minimum
QUIET_WINDOW = 16  # K: an exchange on a quiet system covers this many iterations (itself and K - 1 skipped)
SIZE_EVERY = 64  # pickled exchanges between two measurements of this rank's payload size


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _i2f(x: int) -> float:
    return struct.unpack("<d", struct.pack("<q", x))[0]


def pack_report(local: StepInputs, is_src: bool, done: tuple[int, ...], digest: RankDigest,
                last_us: float, idle: bool = False, top: bool = False) -> torch.Tensor:
    row = [0] * ROW
    payload = is_src and (local.routing is not None or local.traffic is not None)
    row[_FLAGS] = ((FLAG_PAYLOAD if payload else 0) | (FLAG_FENCES if len(done) > FENCE_SLOTS else 0)
                   | (FLAG_SRC if is_src else 0) | (FLAG_IDLE if idle else 0) | (FLAG_TOP if top else 0))
    row[_AVAILABLE], row[_EVICTABLE] = local.available_blocks, local.evictable_blocks
    row[_NOW], row[_WAITING], row[_HELD] = _f2i(local.now_s), local.waiting_blocks, int(local.reloads_held)
    row[_LAST_US] = _f2i(last_us)
    for i, name in enumerate(_DIGEST_FIELDS):
        row[_DIGEST + i] = int(getattr(digest, name))
    row[_N_DONE] = len(done)
    row[_FENCES:_FENCES + min(len(done), FENCE_SLOTS)] = done[:FENCE_SLOTS]
    return torch.tensor(row, dtype=torch.int64)


def unpack_digest(row: list[int]) -> RankDigest:
    return RankDigest(**{name: row[_DIGEST + i] for i, name in enumerate(_DIGEST_FIELDS)})


def unpack_inputs(row: list[int], routing: Any, traffic: Any) -> StepInputs:
    return StepInputs(available_blocks=row[_AVAILABLE], evictable_blocks=row[_EVICTABLE], now_s=_i2f(row[_NOW]),
                      routing=routing, waiting_blocks=row[_WAITING], reloads_held=bool(row[_HELD]), traffic=traffic)


def quiet_window(agreed: StepInputs, all_idle: bool, all_top: bool, held_changed: bool, low_blocks: int,
                 high_blocks: int, blocks_per_iteration: int, window: int) -> int:
    """Iterations to skip after an exchange (0: exchange again at the next one), from agreed values only.

    Skipping is safe when nothing can happen that the step would have to act on before the next exchange: no rank
    has an operation or fence in flight, no KV demand waits, no reload is wanted (the relax signal needs more free
    blocks than the high watermark, unless reloads are held or no rank has anything to reload), and the available
    blocks stay above the low watermark even if every one of the `window` iterations until the next exchange
    allocates the most an iteration may (`blocks_per_iteration`; 0: unknown, never skip)."""
    if window <= 1 or blocks_per_iteration <= 0 or not all_idle or held_changed or agreed.waiting_blocks > 0:
        return 0
    if agreed.available_blocks - window * blocks_per_iteration <= low_blocks:
        return 0
    free = agreed.available_blocks + agreed.evictable_blocks
    if free > high_blocks and not agreed.reloads_held and not all_top:
        return 0
    return window - 1


class TpStepSync:
    """One small tensor all-gather per iteration (the source rank's scalar inputs, every rank's completed fences
    and digest); a second, pickled exchange only on iterations where the source rank has routing statistics or
    traffic to send, or a rank completed more fences than the row holds (decided from the gathered rows, so every
    rank takes the same path)."""

    def __init__(self, group: Any, src_global_rank: int, is_src: bool, ledger: Optional[FenceLedger] = None,
                 window: int = QUIET_WINDOW):
        self.group = group
        self.src = src_global_rank
        self.is_src = is_src
        self.ledger = ledger  # None: fences are each rank's own (tests' control runs only)
        self.world_size = dist.get_world_size(group)
        self.exchanges = 0
        self.object_exchanges = 0  # exchanges that also moved pickled payloads
        self.digest_mismatches = 0
        self.last_digests: list[RankDigest] = []
        # Time of this rank's exchange (both collectives), and of every rank's as they report it one exchange
        # later; the bytes this rank sent (the row, plus the pickled payload when there was one, its size measured
        # every SIZE_EVERY pickled exchanges).
        self.agreement = LatencyHistogram()
        self.rank_agreement = [LatencyHistogram() for _ in range(self.world_size)]
        self.report_bytes_max = 0
        self.report_bytes_last = 0
        self._extra_bytes = 0  # this rank's pickled payload size, as last measured
        self._last_us = 0.0
        # Quiet windows (quiet_window): K, the iterations left to skip, how many were skipped, and what the last
        # exchange's rows said (every rank idle / at the top, digests equal; the agreed reload hold).
        self.window = window
        self.skip_left = 0
        self.skipped = 0
        self.windows = 0
        self.all_idle = False
        self.all_top = False
        self._held: Optional[bool] = None
        self.held_changed = False

    def skip(self) -> bool:
        """True on an iteration inside a quiet window: no exchange, no step (the same answer on every rank)."""
        if self.skip_left <= 0:
            return False
        self.skip_left -= 1
        self.skipped += 1
        return True

    def open_window(self, agreed: StepInputs, low_blocks: int, high_blocks: int, blocks_per_iteration: int) -> int:
        """After an exchange: skip the next quiet_window(...) iterations (0 when anything is not quiet)."""
        self.skip_left = quiet_window(agreed, self.all_idle, self.all_top, self.held_changed, low_blocks,
                                      high_blocks, blocks_per_iteration, self.window)
        self.windows += self.skip_left > 0
        return self.skip_left

    def __call__(self, local: StepInputs, digest: RankDigest, idle: bool = False, top: bool = False) -> StepInputs:
        """`idle`, `top`: this rank's FLAG_IDLE / FLAG_TOP (quiet_window reads them only as every rank sent them)."""
        t0 = time.perf_counter()
        self.skip_left = 0  # an exchange ends any window (open_window may start the next)
        done = self.ledger.local_done() if self.ledger is not None else ()
        row = pack_report(local, self.is_src, done, digest, self._last_us, idle, top)
        rows_t = [torch.empty_like(row) for _ in range(self.world_size)]
        dist.all_gather(rows_t, row, group=self.group)
        rows = [r.tolist() for r in rows_t]
        flags = 0
        for r in rows:
            flags |= r[_FLAGS] & (FLAG_PAYLOAD | FLAG_FENCES)
        sent = ROW * 8
        routing = traffic = None
        fences_by_rank = [tuple(r[_FENCES:_FENCES + r[_N_DONE]]) for r in rows]
        if flags:
            mine = (local.routing, local.traffic) if self.is_src else None
            extra = (mine, done if len(done) > FENCE_SLOTS else None)
            if self.object_exchanges % SIZE_EVERY == 0:  # all_gather_object pickles it again: measure seldom
                self._extra_bytes = len(pickle.dumps(extra))
            sent += self._extra_bytes
            extras: list[Any] = [None] * self.world_size
            dist.all_gather_object(extras, extra, group=self.group)
            self.object_exchanges += 1
            for i, (payload, all_done) in enumerate(extras):
                if payload is not None:
                    routing, traffic = payload
                if all_done is not None:
                    fences_by_rank[i] = tuple(all_done)
        self.report_bytes_last = sent
        self.report_bytes_max = max(self.report_bytes_max, sent)
        self.exchanges += 1
        if self.exchanges > 1:
            for hist, r in zip(self.rank_agreement, rows):
                hist.add(_i2f(r[_LAST_US]))
        if self.ledger is not None:
            self.ledger.agree(fences_by_rank)
        in_step = self._check([unpack_digest(r) for r in rows])
        self.all_idle = in_step and all(r[_FLAGS] & FLAG_IDLE for r in rows)
        self.all_top = in_step and all(r[_FLAGS] & FLAG_TOP for r in rows)
        src_row = next(r for r in rows if r[_FLAGS] & FLAG_SRC)
        held = bool(src_row[_HELD])
        self.held_changed = self._held is not None and held != self._held
        self._held = held
        self._last_us = (time.perf_counter() - t0) * 1e6
        self.agreement.add(self._last_us)
        return unpack_inputs(src_row, routing, traffic)

    def _check(self, digests: list[RankDigest]) -> bool:
        self.last_digests = digests
        if all(d == digests[0] for d in digests[1:]):
            return True
        self.digest_mismatches += 1
        if self.digest_mismatches <= 5 or self.digest_mismatches % 1000 == 0:
            logger.error(
                "PagedWeight: TP ranks out of step (mismatch %d): %s",
                self.digest_mismatches, "; ".join(f"rank {i}: {d}" for i, d in enumerate(digests)),
            )
        return False

    def state(self) -> dict:
        return {
            "world_size": self.world_size,
            "exchanges": self.exchanges,
            "object_exchanges": self.object_exchanges,
            "digest_mismatches": self.digest_mismatches,
            # iterations a quiet window skipped (no exchange, no step), the windows opened, and K
            "skipped": self.skipped,
            "quiet_windows": self.windows,
            "quiet_window": self.window,
            "fences_agreed": self.ledger.agreed if self.ledger is not None else None,
            "fences_pending": self.ledger.pending if self.ledger is not None else None,
            "ranks": [asdict(d) for d in self.last_digests],
            "agreement_us": self.agreement.state(),
            # every rank's exchange time as it reported it (one exchange late), and the bytes this rank sent
            # (every rank receives world_size of them)
            "rank_agreement_us": [h.state() for h in self.rank_agreement],
            "report_bytes": {"last": self.report_bytes_last, "max": self.report_bytes_max, "row": ROW * 8},
        }


def make_tp_sync(pager: Any, kv: Any, ledger: Optional[FenceLedger], group: Any, src_global_rank: int,
                 is_src: bool) -> TpStepSync:
    """Start agreeing on `ledger`'s fences and return the iteration sync. The pager's fences and copier and the
    KV backing's fences were built over this ledger (PagedRuntime.build, patches/kv_cache.py); it numbers
    nothing until started here.

    Call while the pager is idle (after the initial load drained): fences recorded before this point would
    be polled rank by rank. `ledger=None` (each rank's own fences) exists for control runs in tests."""
    if ledger is not None:
        if not pager.idle():
            raise RuntimeError("make_tp_sync needs an idle pager: fences already in flight would be polled per rank")
        if kv is not None:
            # KV memory parked before this point (e.g. by SGLang's post-capture resize) waits on raw events
            # that each rank would release at its own moment: wait for them once here, on every rank.
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            kv.poll()
        ledger.start()
    return TpStepSync(group, src_global_rank, is_src, ledger)
