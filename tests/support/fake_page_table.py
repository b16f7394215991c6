"""A minimal in-memory PageTableView (planner_api) for policy tests over the runtime's BlockRow rows."""

from __future__ import annotations

from pagedweight.runtime.page_table import BlockRow


# The runtime's own row type: block id, key, spec, committed/desired/floor/ceiling bits (planes stay on host).
Row = BlockRow


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
