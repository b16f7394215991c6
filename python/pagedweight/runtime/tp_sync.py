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
SIZE_EVERY = 64  # pickled exchanges between two measurements of this rank's payload size


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _i2f(x: int) -> float:
    return struct.unpack("<d", struct.pack("<q", x))[0]


def pack_report(local: StepInputs, is_src: bool, done: tuple[int, ...], digest: RankDigest,
                last_us: float) -> torch.Tensor:
    row = [0] * ROW
    payload = is_src and (local.routing is not None or local.traffic is not None)
    row[_FLAGS] = ((FLAG_PAYLOAD if payload else 0) | (FLAG_FENCES if len(done) > FENCE_SLOTS else 0)
                   | (FLAG_SRC if is_src else 0))
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


class TpStepSync:
    """One small tensor all-gather per iteration (the source rank's scalar inputs, every rank's completed fences
    and digest); a second, pickled exchange only on iterations where the source rank has routing statistics or
    traffic to send, or a rank completed more fences than the row holds (decided from the gathered rows, so every
    rank takes the same path)."""

    def __init__(self, group: Any, src_global_rank: int, is_src: bool, ledger: Optional[FenceLedger] = None):
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

    def __call__(self, local: StepInputs, digest: RankDigest) -> StepInputs:
        t0 = time.perf_counter()
        done = self.ledger.local_done() if self.ledger is not None else ()
        row = pack_report(local, self.is_src, done, digest, self._last_us)
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
        self._check([unpack_digest(r) for r in rows])
        self._last_us = (time.perf_counter() - t0) * 1e6
        self.agreement.add(self._last_us)
        src_row = next(r for r in rows if r[_FLAGS] & FLAG_SRC)
        return unpack_inputs(src_row, routing, traffic)

    def _check(self, digests: list[RankDigest]) -> None:
        self.last_digests = digests
        if all(d == digests[0] for d in digests[1:]):
            return
        self.digest_mismatches += 1
        if self.digest_mismatches <= 5 or self.digest_mismatches % 1000 == 0:
            logger.error(
                "PagedWeight: TP ranks out of step (mismatch %d): %s",
                self.digest_mismatches, "; ".join(f"rank {i}: {d}" for i, d in enumerate(digests)),
            )

    def state(self) -> dict:
        return {
            "world_size": self.world_size,
            "exchanges": self.exchanges,
            "object_exchanges": self.object_exchanges,
            "digest_mismatches": self.digest_mismatches,
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
