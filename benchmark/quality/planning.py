"""From a policy and a byte budget to a bitwidth per block, the way the runtime asks (planner_api).

Every run starts a fresh page table with every block at the parent bitwidth (desired = bits_max) and asks
`policy.plan(table, target_bytes = bytes_now - budget, observation)`; the plan's steps become the
desired bitwidths. Floors are the policy's own (bucket floor stages for 'quality', the rows' floor for
'hotness'). `spike_then_relax` first plans to a tighter budget and then asks `plan_reload` for the bytes
the relaxed budget gives back (the page-movement ablation).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pagedweight.format.layout import BlockSpec
from pagedweight.runtime.blocks import BlockKey
from pagedweight.runtime.page_table import WeightPageTable
from pagedweight.runtime.planner_api import Observation, Plan, validate_plan

Blocks = list[tuple[BlockKey, BlockSpec]]


@dataclass
class PlannedPoint:
    assignment: dict[BlockKey, int]
    bytes: int
    budget: int
    reason: str

    def histogram(self) -> dict[str, int]:
        """Blocks per bitwidth."""
        return {str(b): n for b, n in sorted(Counter(self.assignment.values()).items())}


def bytes_of(blocks: Blocks, assignment: dict[BlockKey, int]) -> int:
    return sum(spec.bytes_at(assignment[key]) for key, spec in blocks)


def uniform(blocks: Blocks, bits: int) -> dict[BlockKey, int]:
    return {key: bits for key, _ in blocks}


def fresh_table(blocks: Blocks) -> WeightPageTable:
    return WeightPageTable(blocks, initial_bits=max(spec.bits_max for _, spec in blocks))


def _apply(table: WeightPageTable, plan: Plan, direction: str) -> None:
    validate_plan(table, plan, direction)
    for step in plan.steps:
        table.set_desired(step.block_id, step.target_bits)


def _point(table: WeightPageTable, budget: int, reason: str) -> PlannedPoint:
    assignment = {row.key: row.desired_bits for row in table}
    return PlannedPoint(assignment, table.desired_bytes(), int(budget), reason)


def plan_to_budget(policy, blocks: Blocks, budget: int, observation: Observation | None = None) -> PlannedPoint:
    observation = observation or Observation()
    table = fresh_table(blocks)
    plan = policy.plan(table, table.desired_bytes() - int(budget), observation)
    _apply(table, plan, "offload")
    return _point(table, budget, plan.reason)


def spike_then_relax(policy, blocks: Blocks, spike_budget: int, budget: int,
                     observation: Observation | None = None) -> PlannedPoint:
    """Pressure first needs `spike_budget`, then relaxes to `budget`: offload, then reload what fits."""
    observation = observation or Observation()
    table = fresh_table(blocks)
    plan = policy.plan(table, table.desired_bytes() - int(spike_budget), observation)
    _apply(table, plan, "offload")
    reload = policy.plan_reload(table, int(budget) - table.desired_bytes(), observation)
    _apply(table, reload, "reload")
    return _point(table, budget, f"{plan.reason} | then {reload.reason}")
