"""A minimal in-memory PageTableView (planner_api) for policy tests: rows are plain mutable dataclasses."""

from __future__ import annotations

from dataclasses import dataclass

from pagedweight.format.layout import BlockSpec
from pagedweight.runtime.blocks import BlockKey


@dataclass
class Row:
    block_id: int
    key: BlockKey
    spec: BlockSpec
    committed_bits: int
    desired_bits: int
    floor_bits: int
    ceiling_bits: int

    def bytes_at(self, bits: int) -> int:
        return self.spec.bytes_at(bits)


class Table:
    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def row(self, block_id: int) -> Row:
        return self.rows[block_id]

    def apply(self, plan) -> None:
        """Record a plan's targets as desired bitwidths (what the pager's submit does)."""
        for s in plan.steps:
            self.rows[s.block_id].desired_bits = s.target_bits
