"""PagedWeight inside SGLang's scheduler loop: pressure -> policy -> pager, once per iteration.

`PagedWeightScheduler.step` runs at the top of every `Scheduler.get_next_batch_to_run`, which is the safe
boundary: in the normal loop the previous forward has been launched and its results processed; in the
overlap loop forward k is in flight on the forward stream while batch k+1 is being prepared. Device
page-table writes are enqueued on the forward stream there, so forward k reads the old rows and forward
k+1 the new ones, and the fence recorded after them tells the pager when forward k (the last reader of
freed planes) is done. The elastic KV cache's free-list edits stay on the scheduler's own stream (the one
current when it calls the step), where SGLang reads its allocator (kvcache/elastic_kv.py: Streams).

The PagedWeightScheduler is built, wired once, by serving/builder.py (`build_serving`).
"""

from __future__ import annotations

import math
import struct
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagedweight.runtime.controller import PagingController
from pagedweight.runtime.latency_histogram import LatencyHistogram
from pagedweight.runtime.paged_runtime import PagedRuntime
from pagedweight.runtime.planner_api import Observation
from pagedweight.runtime.tp_sync import RankDigest, StepInputs, TpStepSync

# Routing statistics are copied from the device at most this often (the copy waits for the forward).
ROUTING_REFRESH_S = 0.5


@dataclass
class PagedWeightScheduler:
    runtime: PagedRuntime
    controller: PagingController
    page_size: int
    capacity_blocks: int
    forward_stream: Any = None
    metrics: Any = None  # PagedWeightMetrics when --enable-metrics
    tp_sync: Optional[TpStepSync] = None  # TP > 1: rank 0's inputs, agreed fences, digests of every rank
    queue_aware: bool = True  # the first waiting request's KV demand counts as pressure
    waiting_blocks: int = 0  # that demand at the last step (blocks it lacked)
    reloads_held: bool = False  # operator hold (set_internal_state paged_weight_hold_reloads=1): keep the plan
    # The most KV blocks one iteration may allocate (chunked prefill plus every running request's decode pages:
    # iteration_blocks); 0 (unknown) never opens a quiet window of the TP agreement (tp_sync.quiet_window).
    blocks_per_iteration: int = 0
    iteration: int = 0
    commits_crc: int = 0  # running CRC-32 of (block, bits) commits: compared across TP ranks
    started_s: float = field(default_factory=time.monotonic)
    step_timing: LatencyHistogram = field(default_factory=LatencyHistogram)  # host time of each step()
    _routing: dict = field(default_factory=dict)
    _routing_at: float = -1.0
    _traffic_at: float = -1.0
    _top_at: int = -1  # pager transitions when _top was computed
    _top: bool = False

    def step(self, scheduler: Any) -> None:
        t0 = time.perf_counter()
        try:
            self._step(scheduler)
        finally:
            self.step_timing.add((time.perf_counter() - t0) * 1e6)

    def _step(self, scheduler: Any) -> None:
        self.iteration += 1
        if self.tp_sync is not None and self.tp_sync.skip():
            return  # a quiet window (agreed at the last exchange): routing and traffic accumulate until the next one
        available = full_available_tokens(scheduler.token_to_kv_pool_allocator) // self.page_size
        evictable = full_evictable_tokens(scheduler.tree_cache) // self.page_size
        inputs = StepInputs(
            available_blocks=available,
            evictable_blocks=evictable,
            now_s=time.monotonic() - self.started_s,
            routing=self._fresh_routing(),
            waiting_blocks=self._waiting_blocks(scheduler, available + evictable),
            reloads_held=self.reloads_held,
            traffic=self._fresh_traffic(),
        )
        if self.tp_sync is not None:
            inputs = self.tp_sync(inputs, self._digest(scheduler), idle=self._idle(), top=self._nothing_to_reload())
            sig = self.controller.signal
            self.tp_sync.open_window(inputs, sig.threshold_blocks, sig.relax_blocks, self.blocks_per_iteration)
        if inputs.traffic is not None:
            self.controller.policy.take_traffic(inputs.traffic)
        self.waiting_blocks = inputs.waiting_blocks
        if inputs.routing is not None:
            self._routing = dict(inputs.routing)
        obs = Observation(iteration=self.iteration, now_s=inputs.now_s, routing_counts=self._routing)
        if inputs.routing is not None:
            self.controller.policy.refresh(self.runtime.table, obs)  # e.g. the quality policy re-ranks its queue
        kv = self.controller.kv
        if kv is not None and self.forward_stream is not None and kv.allocator_stream is None:
            # the scheduler's own stream (its schedule stream, the same for the loop's life): the elastic cache
            # edits the free lists there
            kv.allocator_stream = torch.cuda.current_stream(self.forward_stream.device)
        ctx = torch.cuda.stream(self.forward_stream) if self.forward_stream is not None else nullcontext()
        with ctx:
            # A request that waits for KV counts as pressure: the blocks it lacks count as used.
            report = self.controller.step(
                inputs.available_blocks,
                inputs.evictable_blocks,
                obs,
                waiting_blocks=inputs.waiting_blocks,
                allow_reload=not inputs.reloads_held,
            )
        if report.boundary.committed and self.tp_sync is not None:  # only the TP digest reads it
            self._record_commits(report.boundary.committed)
        if self.metrics is not None:
            self.metrics.update(self, scheduler.max_total_num_tokens)

    def _idle(self) -> bool:
        """This rank's pager has nothing in flight or queued and no fence of the TP ledger is pending."""
        ledger = self.tp_sync.ledger if self.tp_sync is not None else None
        return self.runtime.pager.idle() and (ledger is None or ledger.pending == 0)

    def _nothing_to_reload(self) -> bool:
        """Every block committed at its ceiling and the elastic KV cache at its minimum: a relax could neither
        shrink the cache nor reload a block (recomputed only after the pager's transitions changed)."""
        kv = self.controller.kv
        if kv is not None and kv.capacity_tokens > kv.min_tokens:
            return False
        transitions = self.runtime.pager.counters.transitions
        if transitions != self._top_at:
            self._top_at = transitions
            self._top = all(r.committed_bits == r.desired_bits == r.ceiling_bits for r in self.runtime.table)
        return self._top

    def _record_commits(self, block_ids: tuple[int, ...]) -> None:
        """Fold this boundary's (block, committed bits) pairs into the running CRC the TP digest compares."""
        table = self.runtime.table
        flat = [v for b in block_ids for v in (b, table.row(b).committed_bits)]
        self.commits_crc = zlib.crc32(struct.pack(f"<{len(flat)}i", *flat), self.commits_crc)

    def _digest(self, scheduler: Any) -> RankDigest:
        counters = self.runtime.pager.counters
        ledger = self.tp_sync.ledger if self.tp_sync is not None else None
        return RankDigest(
            iteration=self.iteration,
            commits_crc=self.commits_crc,
            transitions=counters.transitions,
            bytes_to_kv=counters.bytes_to_kv,
            kv_capacity_tokens=int(scheduler.max_total_num_tokens),
            kv_available_tokens=full_available_tokens(scheduler.token_to_kv_pool_allocator),
            fences_recorded=ledger.recorded if ledger is not None else 0,
        )

    def _waiting_blocks(self, scheduler: Any, free_blocks: int) -> int:
        """Blocks the first waiting request lacks: 0 if it fits, nothing waits, or lowering bitwidths could not
        make it fit now.

        The pressure signal counts free blocks; on long-context work that is not enough: SGLang admits a long
        prompt only when it fits, so the cache can keep more free blocks than the low watermark while long
        requests queue. Counting the head-of-line request's demand lets the weights make room for it. But
        only when the room the weights can still give (the elastic cache's maximum minus its capacity now)
        covers what the request lacks: otherwise it must wait for running requests to finish whatever the
        bitwidths, and lowering them would cost quality for nothing (seen on the H200: a 7k-token prompt
        pushed every block to the floor, docs/results/longbench.md)."""
        if not self.queue_aware:
            return 0
        demand = head_of_line_demand_tokens(scheduler)
        if demand <= 0:
            return 0
        lack = max(0, -(-demand // self.page_size) - free_blocks)
        kv = self.controller.kv
        growable = (kv.max_tokens - kv.capacity_tokens) // self.page_size if kv is not None else 0
        if lack > growable:
            return 0
        return lack

    def _fresh_traffic(self) -> Any:
        """TP with the quality policy: the observer's traffic since the last drain, drained on every rank on the
        routing cadence (so no rank's recorder grows), shipped from the source rank only (None otherwise)."""
        policy = self.controller.policy
        if self.tp_sync is None or getattr(policy, "observer", None) is None:
            return None
        policy.traffic_agreed = True
        now = time.monotonic()
        if now - self._traffic_at < ROUTING_REFRESH_S:
            return None
        self._traffic_at = now
        traffic = policy.drain_observer()
        return traffic if self.tp_sync.is_src else None

    def _fresh_routing(self) -> Optional[dict]:
        """New routing statistics when due (on the source rank only under TP), else None (unchanged)."""
        if self.tp_sync is not None and not self.tp_sync.is_src:
            return None
        now = time.monotonic()
        if now - self._routing_at < ROUTING_REFRESH_S:
            return None
        self._routing_at = now
        return self.runtime.routing_mass()

    def state(self) -> dict:
        sig = self.controller.signal
        kv = self.controller.kv
        return {
            "elastic_kv": kv.state_dict() if kv is not None else None,
            "iteration": self.iteration,
            "reloads_held": self.reloads_held,
            "policy": type(self.controller.policy).__name__,
            "kv": {
                "capacity_blocks": self.capacity_blocks,
                "page_size": self.page_size,
                "offload_below_blocks": sig.threshold_blocks,
                "reload_above_blocks": sig.relax_blocks,
                "bytes_per_block": sig.bytes_per_block,
                "waiting_blocks": self.waiting_blocks,
                "queue_aware": self.queue_aware,
                "offload_signals": sig.offload_signals,
                "relax_signals": sig.relax_signals,
            },
            "gpu_memory": _gpu_memory(self.forward_stream),
            # host time of PagedWeight's per-iteration step (the TP agreement included): its overhead per step
            "step_us": self.step_timing.state(),
            "tp": self.tp_sync.state() if self.tp_sync is not None else None,
            **self.runtime.state(include_blocks=True),
        }


def _gpu_memory(stream: Any) -> Optional[dict]:
    """The driver's free/total bytes of this process's device (None without CUDA): plane memory the arena
    unmaps shows up here, and so does KV memory the elastic cache maps."""
    if stream is None:
        return None
    free, total = torch.cuda.mem_get_info(stream.device)
    return {"free_bytes": int(free), "total_bytes": int(total)}


# SGLang clips max_new_tokens at this many when it estimates a request's KV need at admission
# (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION); the same clip keeps one huge request from draining the weights.
CLIP_MAX_NEW_TOKENS = 4096


def iteration_blocks(chunked_prefill_size: Any, max_running_requests: Any, page_size: int,
                     tokens_per_request: int = 1) -> int:
    """The most KV blocks one scheduler iteration may allocate: a prefill chunk (its pages, plus a partial page per
    request it extends) and every running request's decode tokens (`tokens_per_request`: 1, or a speculative
    step's draft tokens), in pages. 0 (unknown: chunked prefill off, so one prefill is unbounded) when either is
    unset."""
    chunk, running = int(chunked_prefill_size or 0), int(max_running_requests or 0)
    if chunk <= 0 or running <= 0 or page_size <= 0:
        return 0
    per_request = (max(1, int(tokens_per_request)) - 1) // page_size + 1
    return -(-chunk // page_size) + running * (per_request + 1)


def full_available_tokens(allocator: Any) -> int:
    """Free token slots the pressure signal counts: a hybrid sliding-window allocator's full-attention ones (the
    pool the elastic cache grows; its sliding-window pool is bounded by the window, not the context), else all."""
    full = getattr(allocator, "full_available_size", None)
    return int(full() if full is not None else allocator.available_size())


def full_evictable_tokens(tree_cache: Any) -> int:
    """Radix-cache tokens that eviction could free, in full-attention slots for a tree with a sliding-window part
    (UnifiedRadixCache with its SWA component, SWARadixCache: they keep full and sliding-window counts apart, and
    SWARadixCache.evictable_size() is not defined)."""
    supports_swa = getattr(tree_cache, "supports_swa", None)
    if supports_swa is not None and supports_swa():
        return int(tree_cache.full_evictable_size())
    return int(tree_cache.evictable_size())


def head_of_line_demand_tokens(scheduler: Any) -> int:
    """KV tokens the first waiting request needs to be admitted: its prompt plus its expected output
    (max_new_tokens, clipped, times SGLang's current new-token ratio), as SGLang's admission estimates it."""
    queue = getattr(scheduler, "waiting_queue", None)
    if not queue:
        return 0
    req = queue[0]
    prompt = len(getattr(req, "origin_input_ids", None) or [])
    params = getattr(req, "sampling_params", None)
    max_new = int(getattr(params, "max_new_tokens", None) or 0)
    tracker = getattr(scheduler, "new_token_ratio_tracker", None)
    ratio = float(getattr(tracker, "current", 1.0)) if tracker is not None else 1.0
    return prompt + math.ceil(min(max_new, CLIP_MAX_NEW_TOKENS) * ratio)

