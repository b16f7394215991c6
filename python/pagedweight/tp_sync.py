"""Keep PagedWeight's decisions identical on every tensor-parallel rank.

Each TP rank holds its shard of every expert block and runs its own pager and elastic KV cache, so all
ranks must commit the same bitwidths and move the same number of KV tokens at the same scheduler
iteration. Two things differ between ranks and are agreed on once per iteration, in one collective over
the TP CPU group:

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
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from pagedweight.latency_histogram import LatencyHistogram
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


@dataclass(frozen=True)
class _RankReport:
    inputs: Optional[StepInputs]  # the source rank's only
    fences_done: tuple[int, ...]
    digest: RankDigest
    last_agreement_us: float  # how long this rank's previous exchange took (0 before the first)


SIZE_EVERY = 64  # exchanges between two measurements of a report's pickled size


class TpStepSync:
    """One all-gather per iteration: the source rank's inputs, agreed fences, digests of every rank."""

    def __init__(self, group: Any, src_global_rank: int, is_src: bool, ledger: Optional[FenceLedger] = None):
        self.group = group
        self.src = src_global_rank
        self.is_src = is_src
        self.ledger = ledger  # None: fences are each rank's own (tests' control runs only)
        self.world_size = dist.get_world_size(group)
        self.exchanges = 0
        self.digest_mismatches = 0
        self.last_digests: list[RankDigest] = []
        # Time of this rank's exchange (the collective, pickling included), and of every rank's as they report
        # it one exchange later; the pickled size of this rank's report, sampled every SIZE_EVERY exchanges.
        self.agreement = LatencyHistogram()
        self.rank_agreement = [LatencyHistogram() for _ in range(self.world_size)]
        self.report_bytes_max = 0
        self.report_bytes_last = 0
        self._last_us = 0.0

    def __call__(self, local: StepInputs, digest: RankDigest) -> StepInputs:
        t0 = time.perf_counter()
        done = self.ledger.local_done() if self.ledger is not None else ()
        report = _RankReport(local if self.is_src else None, done, digest, self._last_us)
        if self.exchanges % SIZE_EVERY == 0:
            self.report_bytes_last = len(pickle.dumps(report))
            self.report_bytes_max = max(self.report_bytes_max, self.report_bytes_last)
        reports: list[Any] = [None] * self.world_size
        dist.all_gather_object(reports, report, group=self.group)
        self.exchanges += 1
        if self.exchanges > 1:
            for hist, r in zip(self.rank_agreement, reports):
                hist.add(r.last_agreement_us)
        if self.ledger is not None:
            self.ledger.agree([r.fences_done for r in reports])
        self._check([r.digest for r in reports])
        self._last_us = (time.perf_counter() - t0) * 1e6
        self.agreement.add(self._last_us)
        return next(r.inputs for r in reports if r.inputs is not None)

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
            "digest_mismatches": self.digest_mismatches,
            "fences_agreed": self.ledger.agreed if self.ledger is not None else None,
            "fences_pending": self.ledger.pending if self.ledger is not None else None,
            "ranks": [asdict(d) for d in self.last_digests],
            "agreement_us": self.agreement.state(),
            # every rank's exchange time as it reported it (one exchange late), and the report's pickled size:
            # all_gather_object moves world_size of them to every rank
            "rank_agreement_us": [h.state() for h in self.rank_agreement],
            "report_bytes": {"last": self.report_bytes_last, "max": self.report_bytes_max, "every": SIZE_EVERY},
        }


def make_tp_sync(pager: Any, kv: Any, group: Any, src_global_rank: int, is_src: bool, agree_fences: bool = True) -> TpStepSync:
    """Route the pager's and the KV backing's fences through one ledger and return the iteration sync.

    Call while the pager is idle (after the initial load drained): fences recorded before this point would
    be polled rank by rank. `agree_fences=False` exists for control runs in tests."""
    ledger = None
    if agree_fences:
        if not pager.idle():
            raise RuntimeError("make_tp_sync needs an idle pager: fences already in flight would be polled per rank")
        ledger = FenceLedger()
        pager.fences = ledger.wrap_factory(pager.fences)
        pager.copier = ledger.wrap_copier(pager.copier)
        if kv is not None:
            # KV memory parked before this point (e.g. by SGLang's post-capture resize) waits on raw events
            # that each rank would release at its own moment: wait for them once here, on every rank.
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            kv.poll()
            kv.backing.wrap_fences(ledger.wrap_event_fn)
    return TpStepSync(group, src_global_rank, is_src, ledger)
