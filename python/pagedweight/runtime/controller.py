"""One scheduler iteration of PagedWeight: pressure signal -> policy -> pager -> boundary.

The scheduler hook calls `step()` once per iteration, at the safe boundary, with the forward stream
current and the KV allocator's free/evictable block counts. Under pressure the policy is asked for the
bytes the KV side still lacks (the target D minus what earlier plans are already freeing); on a relax
signal the KV side first hands its spare free blocks back to the budget (`ElasticKV.shrink`), then the
policy may spend the free budget on reloads. Bytes freed by offloads reach the KV side through the
pager's `on_bytes_freed` callback (the runtime's KV link to the KV cache's grow: paged_runtime.py).

With TP > 1 every rank must apply the same plans at the same iteration: run the policy on one rank and
broadcast its plans (the scheduler hook's job), or make sure every input of `step` is identical on all
ranks (the KV allocators are, since all ranks schedule the same batches).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Protocol

from pagedweight.runtime.pager import BoundaryReport, Pager
from pagedweight.runtime.planner_api import Observation, Plan, Policy
from pagedweight.runtime.pressure import KVPressureSignal, PressureReading


class ElasticKV(Protocol):
    def shrink(self, nbytes: int) -> int:
        """Unmap up to `nbytes` of free KV memory and release it to the budget (kind "kv"); returns
        the bytes actually released (only free slots can go)."""
        ...


@dataclass(frozen=True)
class StepReport:
    reading: PressureReading
    offload_plan: Optional[Plan]
    reload_plan: Optional[Plan]
    kv_released_bytes: int
    boundary: BoundaryReport


class PagingController:
    def __init__(
        self,
        pager: Pager,
        policy: Policy,
        signal: KVPressureSignal,
        kv: Optional[ElasticKV] = None,
        reload_headroom_bytes: int = 0,
    ) -> None:
        if reload_headroom_bytes < 0:
            raise ValueError(f"reload_headroom_bytes must be >= 0, got {reload_headroom_bytes}")
        self.pager = pager
        self.policy = policy
        self.signal = signal
        self.kv = kv
        self.reload_headroom_bytes = reload_headroom_bytes

    def step(
        self,
        available_blocks: int,
        evictable_blocks: int = 0,
        observation: Optional[Observation] = None,
        waiting_blocks: int = 0,
        allow_reload: bool = True,
    ) -> StepReport:
        """`allow_reload=False` (an operator's hold) keeps the current plan under relax: no KV shrink, no
        reload; offloads under pressure still run, since refusing them would starve the KV cache."""
        reading = self.signal.update(available_blocks, evictable_blocks, waiting_blocks)
        obs = dataclasses.replace(
            observation or Observation(), kv_free_blocks=reading.free_blocks, kv_pressure_bytes=reading.target_bytes
        )
        table = self.pager.table
        offload = reload = None
        released = 0
        if reading.target_bytes > 0:
            need = reading.target_bytes - self.pager.pending_offload_bytes()
            if need > 0:
                plan = self.policy.plan(table, need, obs)
                if plan.steps:
                    self.pager.submit(plan, direction="offload")
                    offload = plan
        elif reading.relax and allow_reload:
            if self.kv is not None and reading.relax_bytes:
                released = self.kv.shrink(reading.relax_bytes)
            spare = self.pager.budget.free - self.pager.pending_reload_bytes() - self.reload_headroom_bytes
            if spare > 0:
                plan = self.policy.plan_reload(table, spare, obs)
                if plan.steps:
                    self.pager.submit(plan, direction="reload")
                    reload = plan
        return StepReport(reading, offload, reload, released, self.pager.on_boundary())
