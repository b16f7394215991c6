"""The pager: applies bitwidth plans to the page table, the plane arena and the budget, asynchronously.

Driven from the scheduler loop with plain calls: `submit(plan)` whenever a policy produced one, and
`on_boundary()` once per scheduler iteration at the safe boundary, with the forward stream current
(device page-table writes, relocation copies and poison fills are enqueued there). Nothing blocks.

Per block at most one operation is active; its phases:

  offload q -> d (d < q)
    LOADING   table_d is copied in (budget reserve, or the staging reserve when the KV side holds
              everything; arena alloc; copy-stream fence)
    READY     copy fence done -> commit q := d (row staged; written by this boundary's flush)
    RETIRING  planes [d, q) and table_q wait for the fence recorded after that flush: then no forward
              still reads them -> arena free (relocations restaged), bytes back to the budget and the
              KV side (`on_bytes_freed`)
  reload q -> d (d > q)
    LOADING   budget reserve for planes [q, d) + table_d, arena alloc, host -> device copies on the copy
              stream (back-pressure: at most `max_inflight_bytes` in flight)
    READY     copy fence done -> commit q := d
    RETIRING  table_q waits for the post-flush fence, then is freed

Re-planning is safe at any time: `submit` only moves `desired_bits`; an active operation finishes (or,
when its copied data is no longer wanted, is aborted before it was ever committed: nothing read it) and
the block is picked up again while desired != committed. Submitting the same plan twice is a no-op.

Accounting invariant (tests): budget.used("weights") == table.resident_bytes() + staging bytes held.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Protocol

import torch

from pagedweight.format.layout import TABLE_DTYPE
from pagedweight.runtime.arena import PlaneArena, Relocation
from pagedweight.runtime.budget import MemoryBudget, Reservation
from pagedweight.runtime.copier import Copier
from pagedweight.runtime.device_mirror import DevicePageTableMirror
from pagedweight.runtime.fences import Fence, FenceFactory, ImmediateFence
from pagedweight.runtime.page_table import PlaneState, WeightPageTable
from pagedweight.runtime.planner_api import Direction, Plan, plan_bytes_delta, validate_plan

logger = logging.getLogger(__name__)

Item = tuple[str, int]  # ("plane", p) or ("table", bits)


class HostWeights(Protocol):
    """The parent model in (pinned) host memory, indexed like the page table."""

    def host_planes(self, block_id: int) -> torch.Tensor:
        """uint8 [bits_max, N, K/8], contiguous."""
        ...

    def host_table(self, block_id: int, bits: int) -> torch.Tensor:
        """The block's table for `bits` (layout.BlockSpec.table_shape), contiguous."""
        ...


class OpKind(enum.Enum):
    OFFLOAD = "offload"
    RELOAD = "reload"


class OpPhase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    RETIRING = "retiring"


@dataclass
class PagerConfig:
    max_inflight_bytes: int = 256 << 20  # host->device bytes in flight; one op may exceed it when alone
    # Weights bytes held back so an offload can still load its lower table when the KV cache holds every
    # free byte (otherwise memory pressure could block the very offload that relieves it). None = the
    # largest table of any block, enough for one offload at a time; 0 disables it.
    staging_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_inflight_bytes <= 0:
            raise ValueError(f"max_inflight_bytes must be positive, got {self.max_inflight_bytes}")
        if self.staging_bytes is not None and self.staging_bytes < 0:
            raise ValueError(f"staging_bytes must be >= 0, got {self.staging_bytes}")


@dataclass
class PagerCounters:
    boundaries: int = 0
    plans: int = 0
    plan_steps: int = 0
    offloads_started: int = 0
    offloads_committed: int = 0
    reloads_started: int = 0
    reloads_committed: int = 0
    ops_aborted: int = 0
    ops_done: int = 0
    deferred_budget: int = 0
    deferred_backpressure: int = 0
    deferred_quarantine: int = 0
    deferred_inbound: int = 0
    items_loaded: int = 0
    items_freed: int = 0
    bytes_loaded: int = 0
    bytes_freed: int = 0
    bytes_to_kv: int = 0
    relocations: int = 0
    rows_flushed: int = 0

    @property
    def transitions(self) -> int:
        return self.offloads_committed + self.reloads_committed


@dataclass
class _Op:
    block_id: int
    kind: OpKind
    from_bits: int
    to_bits: int
    phase: OpPhase = OpPhase.LOADING
    fence: Optional[Fence] = None
    loaded: list[Item] = field(default_factory=list)
    retiring: list[Item] = field(default_factory=list)
    inflight_bytes: int = 0


@dataclass(frozen=True)
class BoundaryReport:
    """What one `on_boundary` call did (the scheduler hook logs or exports it)."""

    committed: tuple[int, ...]  # block ids whose committed bits changed
    freed_bytes: int
    started: int
    rows_flushed: int


class Pager:
    def __init__(
        self,
        table: WeightPageTable,
        arena: PlaneArena,
        budget: MemoryBudget,
        host: HostWeights,
        copier: Copier,
        fences: FenceFactory,
        on_bytes_freed: Optional[Callable[[int], None]] = None,
        config: Optional[PagerConfig] = None,
    ) -> None:
        self.table = table
        self.arena = arena
        self.budget = budget
        self.host = host
        self.copier = copier
        self.fences = fences
        self.on_bytes_freed = on_bytes_freed
        self.config = config or PagerConfig()
        self.mirror = DevicePageTableMirror(table, arena.addr)
        self.counters = PagerCounters()
        self._ops: dict[int, _Op] = {}
        self._queue: OrderedDict[int, None] = OrderedDict()  # blocks whose desired != committed, FIFO
        self._inbound: set[int] = set()  # arena handles with a host->device copy in flight
        self._quarantined: list[tuple[Fence, list[Relocation]]] = []
        self._inflight_bytes = 0
        staging = self.config.staging_bytes
        if staging is None:
            staging = max((r.spec.table_bytes(r.spec.bits_max) for r in table), default=0)
        self.staging_capacity = staging
        self.staging_free = 0
        if self.staging_capacity:
            res = budget.try_reserve("weights", self.staging_capacity)
            if res is None:
                raise ValueError(
                    f"the budget has {budget.free} B free, less than the pager's staging reserve "
                    f"{self.staging_capacity} B; lower staging_bytes or raise the budget"
                )
            budget.commit(res)
            self.staging_free = self.staging_capacity
        for row in table:
            if row.desired_bits != row.committed_bits:
                self._queue[row.block_id] = None

    # -- scheduler-facing API -----------------------------------------------------------------------

    def submit(self, plan: Plan, direction: Optional[Direction] = None) -> None:
        """Record the plan's targets as desired bitwidths; `on_boundary` carries them out.

        With `direction`, the plan is checked against that direction's rules (planner_api.validate_plan);
        without, steps may go either way (a swap) but must stay within each block's floor..ceiling.
        """
        if direction is not None:
            validate_plan(self.table, plan, direction)
        seen: set[int] = set()
        for step in plan.steps:
            if step.block_id in seen:
                raise ValueError(f"plan step {step}: block {step.block_id} appears twice; merge the steps")
            seen.add(step.block_id)
            row = self.table.row(step.block_id)
            if not row.floor_bits <= step.target_bits <= row.ceiling_bits:
                raise ValueError(
                    f"plan step {step} for {row.key}: target outside {row.floor_bits}..{row.ceiling_bits} (floor..ceiling)"
                )
        delta = plan_bytes_delta(self.table, plan)
        for step in plan.steps:
            self.table.set_desired(step.block_id, step.target_bits)  # validates the range
            row = self.table.row(step.block_id)
            if row.desired_bits != row.committed_bits or step.block_id in self._ops:
                self._queue[step.block_id] = None
        self.counters.plans += 1
        self.counters.plan_steps += len(plan.steps)
        logger.info(
            "pagedweight plan: %d steps, %+d B for the KV cache, weights %d -> %d B desired (%s)",
            len(plan.steps),
            delta,
            self.table.committed_bytes(),
            self.table.desired_bytes(),
            plan.reason or "no reason given",
        )

    def on_boundary(self) -> BoundaryReport:
        """One safe scheduler boundary; call with the forward stream current."""
        self.counters.boundaries += 1
        relocations: list[Relocation] = []
        self._release_quarantine()
        freed = self._poll(relocations)
        committed = self._commit_ready()
        started = self._start_ops()
        rows = self.mirror.flush()
        self.counters.rows_flushed += rows
        # One fence behind this flush: once done, no forward reads the rows it replaced. Only recorded
        # when something waits for it, so an idle boundary enqueues nothing.
        waiting = [op for op in self._ops.values() if op.phase is OpPhase.RETIRING and op.fence is None]
        if waiting or relocations:
            fence = self.fences.record()
            for op in waiting:
                op.fence = fence
            if relocations:
                self._quarantined.append((fence, relocations))
        return BoundaryReport(tuple(committed), freed, started, rows)

    def idle(self) -> bool:
        """No operation active, nothing queued and no relocation waiting for its fence."""
        return not self._ops and not self._queue and not self._quarantined

    def drain(self, max_boundaries: int = 10_000, wait: Optional[Callable[[], None]] = None) -> int:
        """Run boundaries until idle (load time, tests); `wait` (e.g. torch.cuda.synchronize) runs between
        them so fences complete. Returns the boundaries used; raises when not idle after `max_boundaries`."""
        for n in range(1, max_boundaries + 1):
            self.on_boundary()
            if self.idle():
                return n
            if wait is not None:
                wait()
        raise RuntimeError(
            f"pager not idle after {max_boundaries} boundaries: {len(self._ops)} ops, {len(self._queue)} queued, "
            f"deferred budget={self.counters.deferred_budget}; is the weights budget large enough for the desired bits?"
        )

    def resident(self, block_id: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Typed views of what the kernel reads for a block now: planes [N, K/8] uint8 for p < q and
        table_q (layout.BlockSpec.table_shape, float16). For the CPU reference path; valid until the
        next boundary (a relocation may move them)."""
        row = self.table.row(block_id)
        q = row.committed_bits
        if q == 0:
            raise RuntimeError(f"{row.key} is not loaded yet; run boundaries (or drain()) first")
        shape = row.spec.planes_shape()[1:]
        planes = [self.arena.tensor(row.planes[p].handle).view(shape) for p in range(q)]
        table = self.arena.tensor(row.tables[q].handle).view(TABLE_DTYPE).view(row.spec.table_shape(q))
        return planes, table

    @property
    def inflight_bytes(self) -> int:
        return self._inflight_bytes

    def pending_offload_bytes(self) -> int:
        """Bytes planned to leave the weights that have not reached the KV side yet (sum of M^q - M^d over
        blocks lowering, plus retiring items). A scheduler subtracts it from the pressure target so it
        does not plan the same bytes twice."""
        total = 0
        for row in self.table:
            if row.desired_bits < row.committed_bits:
                total += row.bytes_at(row.committed_bits) - row.bytes_at(row.desired_bits)
        for op in self._ops.values():
            if op.phase is OpPhase.RETIRING:
                total += sum(self._item_bytes(op.block_id, it) for it in op.retiring)
        return total

    def pending_reload_bytes(self) -> int:
        """Bytes that queued reloads (desired > committed, not started) will still reserve. A scheduler
        subtracts it from the free budget before asking a policy for more reloads."""
        total = 0
        for row in self.table:
            if row.desired_bits > row.committed_bits and row.block_id not in self._ops:
                total += row.bytes_at(row.desired_bits) - row.bytes_at(row.committed_bits)
        return total

    def state(self, include_blocks: bool = False) -> dict:
        """JSON-ready snapshot for the state endpoint; `include_blocks` adds
        [layer, expert, proj, committed, desired] per block."""
        phases = {p.value: 0 for p in OpPhase}
        for op in self._ops.values():
            phases[op.phase.value] += 1
        arena = self.arena.stats()
        return {
            "counters": {**asdict(self.counters), "transitions": self.counters.transitions},
            "ops": phases,
            "queued_blocks": len(self._queue),
            "inflight_bytes": self._inflight_bytes,
            "staging_free_bytes": self.staging_free,
            "weights_committed_bytes": self.table.committed_bytes(),
            "weights_desired_bytes": self.table.desired_bytes(),
            "weights_resident_bytes": self.table.resident_bytes(),
            "arena": asdict(arena),
            "budget": asdict(self.budget.snapshot()),
            **(
                {"blocks": [[r.key.layer, r.key.expert, r.key.proj, r.committed_bits, r.desired_bits] for r in self.table]}
                if include_blocks
                else {}
            ),
        }

    # -- boundary phases ----------------------------------------------------------------------------

    def _release_quarantine(self) -> None:
        keep = []
        for fence, relocs in self._quarantined:
            if fence.done():
                for r in relocs:
                    self.arena.release(r)
            else:
                keep.append((fence, relocs))
        self._quarantined = keep

    def _poll(self, relocations: list[Relocation]) -> int:
        freed = 0
        for block_id in list(self._ops):
            op = self._ops[block_id]
            if op.phase is OpPhase.LOADING and op.fence is not None and op.fence.done():
                self._finish_loading(op)
                row = self.table.row(block_id)
                unwanted = (
                    row.desired_bits <= row.committed_bits
                    if op.kind is OpKind.RELOAD
                    else row.desired_bits >= row.committed_bits
                )
                if unwanted:  # re-planned while copying: never committed, so nothing read it; free now
                    op.retiring = list(op.loaded)
                    for kind, index in op.retiring:
                        self.table.set_state(block_id, kind, index, PlaneState.IN_FLIGHT)
                    op.phase, op.fence = OpPhase.RETIRING, ImmediateFence()
                    self.counters.ops_aborted += 1
            if op.phase is OpPhase.RETIRING and op.fence is not None and op.fence.done():
                freed += self._free_items(op, op.retiring, relocations)
                if not op.retiring:
                    self._finish(op)
        return freed

    def _commit_ready(self) -> list[int]:
        committed = []
        for op in self._ops.values():
            if op.phase is not OpPhase.READY:
                continue
            old = op.from_bits
            self.table.commit(op.block_id, op.to_bits)
            if op.kind is OpKind.OFFLOAD:
                op.retiring = [("plane", p) for p in range(op.to_bits, old)] + [("table", old)]
                self.counters.offloads_committed += 1
            else:
                op.retiring = [("table", old)] if old else []
                self.counters.reloads_committed += 1
            for kind, index in op.retiring:
                self.table.set_state(op.block_id, kind, index, PlaneState.IN_FLIGHT)
            op.phase, op.fence = OpPhase.RETIRING, None
            committed.append(op.block_id)
        return committed

    def _start_ops(self) -> int:
        started = 0
        candidates = [b for b in self._queue if b not in self._ops]
        rows = [self.table.row(b) for b in candidates]
        for row in rows:
            if row.desired_bits == row.committed_bits:
                del self._queue[row.block_id]
        # offloads first: they relieve KV pressure; reloads only spend spare memory
        offloads = [r for r in rows if r.desired_bits < r.committed_bits]
        reloads = [r for r in rows if r.desired_bits > r.committed_bits]
        for row in offloads + reloads:
            kind = OpKind.OFFLOAD if row.desired_bits < row.committed_bits else OpKind.RELOAD
            op = _Op(row.block_id, kind, row.committed_bits, row.desired_bits)
            if kind is OpKind.OFFLOAD:
                items: list[Item] = [("table", op.to_bits)]
            else:
                items = [("plane", p) for p in range(op.from_bits, op.to_bits)] + [("table", op.to_bits)]
            nbytes = sum(self._item_bytes(row.block_id, it) for it in items)
            if self._inflight_bytes and self._inflight_bytes + nbytes > self.config.max_inflight_bytes:
                self.counters.deferred_backpressure += 1
                if kind is OpKind.RELOAD:
                    break  # keep reload order; later reloads wait too
                continue
            if not self._load(op, items, nbytes):
                continue
            del self._queue[row.block_id]
            self._ops[row.block_id] = op
            started += 1
            if kind is OpKind.OFFLOAD:
                self.counters.offloads_started += 1
            else:
                self.counters.reloads_started += 1
        return started

    # -- helpers ------------------------------------------------------------------------------------

    def _load(self, op: _Op, items: list[Item], nbytes: int) -> bool:
        """Reserve, allocate and start copying `items`; False (nothing changed) when deferred."""
        reservation: Optional[Reservation] = self.budget.try_reserve("weights", nbytes)
        from_staging = False
        if reservation is None:
            if op.kind is OpKind.OFFLOAD and self.staging_free >= nbytes:
                self.staging_free -= nbytes
                from_staging = True
            else:
                self.counters.deferred_budget += 1
                return False
        handles: list[int] = []
        for item in items:
            h = self.arena.alloc(self._item_bytes(op.block_id, item))
            if h is None:
                break
            handles.append(h)
        if len(handles) < len(items):
            for h in reversed(handles):  # each is the tail of its class: no relocation
                assert self.arena.free(h) is None
            if from_staging:
                self.staging_free += nbytes
            else:
                self.budget.cancel(reservation)
            self.counters.deferred_quarantine += 1
            return False
        if reservation is not None:
            self.budget.commit(reservation)
        pairs = []
        host_planes = self.host.host_planes(op.block_id) if any(k == "plane" for k, _ in items) else None
        for (kind, index), h in zip(items, handles):
            if kind == "plane":
                self.table.attach_plane(op.block_id, index, h, PlaneState.IN_FLIGHT)
                pairs.append((self.arena.tensor(h), host_planes[index]))
            else:
                self.table.attach_table(op.block_id, index, h, PlaneState.IN_FLIGHT)
                pairs.append((self.arena.tensor(h), self.host.host_table(op.block_id, index)))
            self._inbound.add(h)
        op.loaded = list(items)
        op.inflight_bytes = nbytes
        op.fence = self.copier.copy(pairs)
        self._inflight_bytes += nbytes
        self.counters.items_loaded += len(items)
        self.counters.bytes_loaded += nbytes
        return True

    def _finish_loading(self, op: _Op) -> None:
        row = self.table.row(op.block_id)
        for kind, index in op.loaded:
            res = row.planes[index] if kind == "plane" else row.tables[index]
            self._inbound.discard(res.handle)
            self.table.set_state(op.block_id, kind, index, PlaneState.GPU)
        self._inflight_bytes -= op.inflight_bytes
        op.inflight_bytes = 0
        op.phase, op.fence = OpPhase.READY, None

    def _free_items(self, op: _Op, items: list[Item], relocations: list[Relocation]) -> int:
        """Free the items of `items` (removing them from the list) whose arena free would not move an
        in-flight copy; returns the bytes freed."""
        freed = 0
        for item in list(items):
            kind, index = item
            row = self.table.row(op.block_id)
            res = row.planes[index] if kind == "plane" else row.tables[index]
            last = self.arena.last_live(res.nbytes)
            if last != res.handle and last in self._inbound:
                self.counters.deferred_inbound += 1  # the relocation would copy a half-written item
                continue
            self.table.detach(op.block_id, kind, index)
            reloc = self.arena.free(res.handle)
            if reloc is not None:
                self.table.on_relocated(reloc.handle)
                relocations.append(reloc)
                self.counters.relocations += 1
            items.remove(item)
            freed += res.nbytes
            self.counters.items_freed += 1
        if freed:
            self._return_bytes(freed)
        return freed

    def _return_bytes(self, nbytes: int) -> None:
        refill = min(self.staging_capacity - self.staging_free, nbytes)
        self.staging_free += refill
        rest = nbytes - refill
        self.counters.bytes_freed += nbytes
        if rest:
            self.budget.release("weights", rest)
            self.counters.bytes_to_kv += rest
            if self.on_bytes_freed is not None:
                self.on_bytes_freed(rest)

    def _finish(self, op: _Op) -> None:
        del self._ops[op.block_id]
        self.counters.ops_done += 1
        row = self.table.row(op.block_id)
        if row.desired_bits != row.committed_bits:
            self._queue[op.block_id] = None

    def _item_bytes(self, block_id: int, item: Item) -> int:
        spec = self.table.row(block_id).spec
        return spec.plane_bytes() if item[0] == "plane" else spec.table_bytes(item[1])
