"""The interface between the paging mechanism and the policies that choose which blocks change bitwidth.

A policy sees the weight page table through the read-only `PageTableView` protocol and answers with a
`Plan`: a list of (block_id, target_bits). It plans against each block's *desired* bitwidth (what earlier
plans already asked for, possibly still in flight), not the committed one, so asking it again while a
plan is being applied never double-counts bytes. The pager (runtime/pager.py) applies plans; a policy
never touches memory.

Two questions, one per direction:
- `plan(table, target_bytes, obs)`: lower desired bitwidths to free at least `target_bytes` (as much as
  the floors allow when that is not possible). Every step lowers: floor_bits <= target < desired.
- `plan_reload(table, budget_bytes, obs)`: raise desired bitwidths using at most `budget_bytes`.
  Every step raises: desired < target <= ceiling_bits.

`validate_plan` checks a plan against these rules; the pager calls it on every plan it receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal, Mapping, Protocol, Sequence, runtime_checkable

from pagedweight.format.layout import BlockSpec
from pagedweight.runtime.blocks import BlockKey

Direction = Literal["offload", "reload"]


@runtime_checkable
class BlockView(Protocol):
    """What a policy may read of one page-table row."""

    block_id: int
    key: BlockKey
    spec: BlockSpec
    committed_bits: int  # what the kernel reads now (or after the next boundary)
    desired_bits: int  # what the plans so far asked for
    floor_bits: int  # lowest bitwidth a plan may ask for (>= spec.bits_min)
    ceiling_bits: int  # highest bitwidth a plan may ask for (<= spec.bits_max)

    def bytes_at(self, bits: int) -> int:
        """M^b: GPU bytes of this block at bitwidth b (b planes + table_b)."""
        ...


class PageTableView(Protocol):
    """Read-only view of the weight page table: rows indexed by block_id = 0..len-1."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[BlockView]: ...

    def row(self, block_id: int) -> BlockView: ...


@dataclass(frozen=True)
class Observation:
    """What the scheduler knows at the iteration a plan is asked for.

    `routing_counts` maps (layer, expert) to the tokens routed to that expert since the server started
    (monotone; a policy keeps its own decayed copy if it needs hotness). Empty when not collected.
    """

    iteration: int = 0
    now_s: float = 0.0
    kv_free_blocks: int = 0
    kv_pressure_bytes: int = 0  # the pressure signal's target D
    routing_counts: Mapping[tuple[int, int], float] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanStep:
    block_id: int
    target_bits: int


@dataclass(frozen=True)
class Plan:
    """Target bitwidths for some blocks; at most one step per block. `reason` goes to the log line."""

    steps: tuple[PlanStep, ...] = ()
    reason: str = ""

    def __len__(self) -> int:
        return len(self.steps)

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]], reason: str = "") -> "Plan":
        return cls(tuple(PlanStep(int(b), int(t)) for b, t in pairs), reason)


class Policy(Protocol):
    """What a bitwidth policy implements (quality-aware, hotness, scripted, ...)."""

    def plan(self, table: PageTableView, target_bytes: int, observation: Observation) -> Plan: ...

    def plan_reload(self, table: PageTableView, budget_bytes: int, observation: Observation) -> Plan: ...

    def refresh(self, table: PageTableView, observation: Observation) -> object:
        """Called when new routing statistics arrive (every ~0.5 s), before any plan of that iteration: a policy
        that ranks blocks by traffic re-ranks here; the others do nothing. The return value is not used."""
        ...


def plan_bytes_delta(table: PageTableView, plan: Plan) -> int:
    """Bytes the plan frees (> 0) or needs (< 0) relative to the desired bitwidths."""
    delta = 0
    for step in plan.steps:
        row = table.row(step.block_id)
        delta += row.bytes_at(row.desired_bits) - row.bytes_at(step.target_bits)
    return delta


def validate_plan(table: PageTableView, plan: Plan, direction: Direction) -> None:
    """Raise ValueError naming the offending step when `plan` breaks the rules of `direction`."""
    if direction not in ("offload", "reload"):
        raise ValueError(f"direction must be 'offload' or 'reload', got {direction!r}")
    seen: set[int] = set()
    for step in plan.steps:
        if not 0 <= step.block_id < len(table):
            raise ValueError(f"plan step {step}: block_id outside 0..{len(table) - 1}")
        if step.block_id in seen:
            raise ValueError(f"plan step {step}: block {step.block_id} appears twice; merge the steps")
        seen.add(step.block_id)
        row = table.row(step.block_id)
        if not row.floor_bits <= step.target_bits <= row.ceiling_bits:
            raise ValueError(
                f"plan step {step} for {row.key}: target outside the allowed range "
                f"{row.floor_bits}..{row.ceiling_bits} (floor..ceiling)"
            )
        if direction == "offload" and step.target_bits >= row.desired_bits:
            raise ValueError(f"offload step {step} for {row.key} does not lower desired bits {row.desired_bits}")
        if direction == "reload" and step.target_bits <= row.desired_bits:
            raise ValueError(f"reload step {step} for {row.key} does not raise desired bits {row.desired_bits}")
