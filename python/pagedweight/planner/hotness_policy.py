"""DynaExq's hotness policy: keep each layer's hottest experts at high precision, the rest at low.

Hotness is an EMA of router counts taken on a time cadence T_u (time, not tokens, so it is stable across
batch shapes):  S_{l,e} <- a * S_{l,e} + (1 - a) * c_{l,e},  c = tokens routed to e during the interval.

The high-precision set H_l of each layer is its top-n by S. n follows the memory budget: the policy fills
"slots" in the order (rank within layer, then hotness), i.e. the same n in every layer and the remainder
to the hottest (n+1)-th experts, and takes the longest prefix whose bytes fit. Hysteresis: an expert
already in H_l ranks with a bonus of `margin * mean(S_l)`, so an outsider must beat it by that margin to
displace it, and near-ties do not thrash.

Experts move as a whole (both projections). High precision = each block's ceiling (or `hi_bits`), low =
its floor (or `lo_bits`). An offload plan only lowers and a reload plan only raises (planner_api rules),
so each plan moves toward the top-n assignment without crossing the current bitwidths.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal


from pagedweight.runtime.planner_api import BlockView, Observation, PageTableView, Plan, PlanStep


@dataclass(frozen=True)
class HotnessOptions:
    interval_s: float = 1.0  # T_u
    ema: float = 0.8  # a
    margin: float = 0.1  # hysteresis, as a fraction of the layer's mean hotness
    hi_bits: int | None = None  # None: each block's ceiling
    lo_bits: int | None = None  # None: each block's floor

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s (T_u) must be > 0, got {self.interval_s}")
        if not 0 <= self.ema < 1:
            raise ValueError(f"ema (a) must be in [0, 1), got {self.ema}")
        if not self.margin >= 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if self.hi_bits is not None and self.lo_bits is not None and self.lo_bits > self.hi_bits:
            raise ValueError(f"lo_bits {self.lo_bits} > hi_bits {self.hi_bits}")


class HotnessPolicy:
    """Policy 'hotness'. Reads Observation.routing_counts (cumulative per (layer, expert)) and now_s."""

    def __init__(self, options: HotnessOptions | None = None) -> None:
        self.options = options or HotnessOptions()
        self.hotness: dict[tuple[int, int], float] = {}
        self._counts_at_update: dict[tuple[int, int], float] = {}
        self._last_update_s: float | None = None
        self.updates = 0

    def update(self, observation: Observation) -> bool:
        """Apply the EMA if T_u has passed since the last update (the first call always updates)."""
        now = observation.now_s
        if self._last_update_s is not None and now - self._last_update_s < self.options.interval_s:
            return False
        a = self.options.ema
        keys = set(self.hotness) | set(observation.routing_counts)
        for k in sorted(keys):
            c = float(observation.routing_counts.get(k, 0.0)) - self._counts_at_update.get(k, 0.0)
            if c < 0:
                raise ValueError(f"Observation.routing_counts[{k}] decreased; they must be cumulative")
            self.hotness[k] = a * self.hotness.get(k, 0.0) + (1 - a) * c
        self._counts_at_update = {k: float(v) for k, v in observation.routing_counts.items()}
        self._last_update_s = now
        self.updates += 1
        return True

    # ---- assignment -----------------------------------------------------------------------------
    def _hi(self, r: BlockView) -> int:
        h = self.options.hi_bits
        return r.ceiling_bits if h is None else min(max(h, r.floor_bits), r.ceiling_bits)

    def _lo(self, r: BlockView) -> int:
        lo = self.options.lo_bits
        return r.floor_bits if lo is None else min(max(lo, r.floor_bits), r.ceiling_bits)

    def slot_order(self, table: PageTableView) -> tuple[list[tuple[int, int]], dict[tuple[int, int], list[BlockView]]]:
        """Experts in the order they get high precision: (rank in layer with hysteresis, -hotness, layer)."""
        experts: dict[tuple[int, int], list[BlockView]] = defaultdict(list)
        for r in table:
            experts[(r.key.layer, r.key.expert)].append(r)
        by_layer: dict[int, list[int]] = defaultdict(list)
        for layer, e in experts:
            by_layer[layer].append(e)
        slots: list[tuple[int, float, int, int]] = []
        for layer in sorted(by_layer):
            es = sorted(by_layer[layer])
            scores = {e: self.hotness.get((layer, e), 0.0) for e in es}
            bonus = self.options.margin * (sum(scores.values()) / len(es))
            # An expert whose every block is already at high precision is in the current set H_l.
            ranked = sorted(
                es,
                key=lambda e: (
                    -(scores[e] + (bonus if all(r.desired_bits >= self._hi(r) for r in experts[(layer, e)]) else 0.0)),
                    e,
                ),
            )
            slots.extend((rank, -scores[e], layer, e) for rank, e in enumerate(ranked))
        slots.sort()
        return [(layer, e) for _, _, layer, e in slots], experts

    def _targets(self, order: list[tuple[int, int]], experts: dict, k: int, direction: Literal["offload", "reload"]) -> dict[int, int]:
        """Block targets when the first k slots are high precision, moved only in the plan's direction."""
        hot = set(order[:k])
        out = {}
        for ex, rows in experts.items():
            for r in rows:
                want = self._hi(r) if ex in hot else self._lo(r)
                out[r.block_id] = min(r.desired_bits, want) if direction == "offload" else max(r.desired_bits, want)
        return out

    @staticmethod
    def _bytes(experts: dict, targets: dict[int, int]) -> int:
        return sum(r.bytes_at(targets[r.block_id]) for rows in experts.values() for r in rows)

    def _longest_fitting(self, order, experts, direction, limit: int) -> tuple[int, dict[int, int]]:
        """Largest k whose assignment uses <= limit bytes (bytes grow with k); k = -1 if none fits."""
        lo, hi, best = 0, len(order), -1
        best_t: dict[int, int] = {}
        while lo <= hi:  # binary search: bytes(k) is non-decreasing in k
            mid = (lo + hi) // 2
            t = self._targets(order, experts, mid, direction)
            if self._bytes(experts, t) <= limit:
                best, best_t, lo = mid, t, mid + 1
            else:
                hi = mid - 1
        return best, best_t

    # ---- Policy interface -----------------------------------------------------------------------
    def plan(self, table: PageTableView, target_bytes: int, observation: Observation) -> Plan:
        self.update(observation)
        order, experts = self.slot_order(table)
        current = sum(r.bytes_at(r.desired_bits) for r in table)
        if target_bytes <= 0:
            return Plan((), "hotness offload: nothing to free")
        k, targets = self._longest_fitting(order, experts, "offload", current - target_bytes)
        if k < 0:  # even every expert at low precision does not free enough
            targets = self._targets(order, experts, 0, "offload")
            freed = current - self._bytes(experts, targets)
            return self._plan(table, targets, f"hotness offload INFEASIBLE: target {target_bytes} B, low precision "
                                              f"everywhere frees only {freed} B")
        freed = current - self._bytes(experts, targets)
        return self._plan(table, targets, f"hotness offload: target {target_bytes} B, planned {freed} B, "
                                          f"{k} high-precision experts")

    def refresh(self, table: PageTableView, observation: Observation) -> None:
        """Hotness folds the routing counts when it plans (update): nothing to re-rank ahead of that."""

    def plan_reload(self, table: PageTableView, budget_bytes: int, observation: Observation) -> Plan:
        self.update(observation)
        order, experts = self.slot_order(table)
        current = sum(r.bytes_at(r.desired_bits) for r in table)
        k, targets = self._longest_fitting(order, experts, "reload", current + max(budget_bytes, 0))
        if k < 0:
            return Plan((), f"hotness reload: budget {budget_bytes} B raises no expert")
        used = self._bytes(experts, targets) - current
        return self._plan(table, targets, f"hotness reload: budget {budget_bytes} B, planned {used} B, "
                                          f"{k} high-precision experts")

    @staticmethod
    def _plan(table: PageTableView, targets: dict[int, int], reason: str) -> Plan:
        rows = sorted(table, key=lambda r: r.key.sort_key())
        return Plan(tuple(PlanStep(r.block_id, targets[r.block_id]) for r in rows
                          if targets[r.block_id] != r.desired_bits), reason)
