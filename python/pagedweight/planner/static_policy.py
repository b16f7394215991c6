"""The `static` policy: bitwidths never change (the user's fixed-precision baseline)."""

from __future__ import annotations

from pagedweight.runtime.planner_api import Observation, PageTableView, Plan


class StaticPolicy:
    """Answers every request with an empty plan and says why, so the pager logs an honest reason."""

    def plan(self, table: PageTableView, target_bytes: int, observation: Observation) -> Plan:
        reason = "static policy: bitwidths are fixed"
        if target_bytes > 0:
            reason += f"; {target_bytes} B of KV pressure left unanswered (use --paged-weight-policy quality|hotness)"
        return Plan((), reason)

    def plan_reload(self, table: PageTableView, budget_bytes: int, observation: Observation) -> Plan:
        return Plan((), "static policy: bitwidths are fixed")

    def refresh(self, table: PageTableView, observation: Observation) -> None:
        """Nothing ranks blocks here: nothing to re-rank."""
