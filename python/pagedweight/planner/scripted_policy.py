"""The `scripted` policy: a deterministic sweep for tests and bring-up (no quality model, no hotness)."""

from __future__ import annotations

from pagedweight.runtime.planner_api import BlockView, Observation, PageTableView, Plan, PlanStep


class ScriptedPolicy:
    """Deterministic policy for tests and bring-up: no quality model, no hotness.

    Offload sweeps the blocks in (layer, expert, proj) order, lowering each by one bit per sweep, until the
    freed bytes reach the target or every block sits at its floor. Reload sweeps in the same order raising
    by one bit per sweep while the next bit fits in the remaining budget.
    """

    def plan(self, table: PageTableView, target_bytes: int, observation: Observation) -> Plan:
        rows = sorted(table, key=lambda r: r.key.sort_key())
        target = {r.block_id: r.desired_bits for r in rows}
        freed = 0
        progressed = True
        while freed < target_bytes and progressed:
            progressed = False
            for r in rows:
                if freed >= target_bytes:
                    break
                bits = target[r.block_id]
                if bits > r.floor_bits:
                    freed += r.bytes_at(bits) - r.bytes_at(bits - 1)
                    target[r.block_id] = bits - 1
                    progressed = True
        return self._changed(rows, target, f"scripted offload: target {target_bytes} B, planned {freed} B")

    def plan_reload(self, table: PageTableView, budget_bytes: int, observation: Observation) -> Plan:
        rows = sorted(table, key=lambda r: r.key.sort_key())
        target = {r.block_id: r.desired_bits for r in rows}
        used = 0
        progressed = True
        while progressed:
            progressed = False
            for r in rows:
                bits = target[r.block_id]
                if bits < r.ceiling_bits:
                    cost = r.bytes_at(bits + 1) - r.bytes_at(bits)
                    if used + cost <= budget_bytes:
                        used += cost
                        target[r.block_id] = bits + 1
                        progressed = True
        return self._changed(rows, target, f"scripted reload: budget {budget_bytes} B, planned {used} B")

    def refresh(self, table: PageTableView, observation: Observation) -> None:
        """The sweep order is fixed: nothing to re-rank."""

    @staticmethod
    def _changed(rows: list[BlockView], target: dict[int, int], reason: str) -> Plan:
        steps = tuple(PlanStep(r.block_id, target[r.block_id]) for r in rows if target[r.block_id] != r.desired_bits)
        return Plan(steps, reason)
