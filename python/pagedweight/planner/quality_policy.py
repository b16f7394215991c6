"""PagedWeight's quality-aware policy (Algorithm 1): lower the blocks whose predicted damage per freed byte
is smallest, through bitwidth-floor stages, until the pressure target D is met; reload by damage removed
per byte within a budget.

Predicted damage of lowering block i = (l, e, u) from b to b' = b - 1 (eq. 8):

    d = max(eps, mu_bucket(l,e) * g_i^{b->b'} * eta_i^{b->b'})

Floor stages (Algorithm 1's BitwidthFloorStages): stage s allows a block down to its bucket's stage-s
floor; stages go from the most protective to the loosest. Each stage yields a greedy plan (steps by
smallest damage per freed byte until D is met); SelectBestPlan takes the plan of the first stage that
could free (1 + stage_slack) * D (else the loosest), so floors are relaxed only as far as the pressure
needs, the damage ranking has room to choose, and no block goes below the floor of a stage the planner
has not reached. A pruning pass then drops steps the target does not need. The
plan queue holds the greedy order under the loosest floors with each step's first allowed stage (every
stage's order is a filter of it); it is rebuilt only when the state changes (desired bits, floors,
routing statistics, prompt features), so `refresh()` can run every scheduler iteration and the plan
itself is a filter-and-prefix lookup when pressure triggers.

Ablation switches (QualityOptions): routing statistics (off: no buckets, so mu = 1 and one stage with the
table's floors), prompt residual
(off: eta = 1), page movement (off: bits lowered under pressure are never raised again), global
sensitivity (off: g = number of bits dropped, so only bytes, buckets and eta rank the steps).
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np

from pagedweight.planner.calibration import CalibrationData, CalibrationError
from pagedweight.planner.observer import ObservedTraffic, RoutingObserver
from pagedweight.planner.prompt_residual import normalize_features
from pagedweight.planner.routing_stats import BlockBuckets, RoutingSnapshot, RoutingStats
from pagedweight.runtime.planner_api import BlockView, Observation, PageTableView, Plan, PlanStep

logger = logging.getLogger(__name__)

RoutingSource = Literal["calibration", "observer", "counts"]


@dataclass(frozen=True)
class QualityOptions:
    use_routing_stats: bool = True
    use_prompt_residual: bool = True
    use_page_movement: bool = True
    use_global_sensitivity: bool = True
    alpha: float = 1.0  # strength of the prompt residual (eq. 6)
    eps: float = 1e-12  # damage floor (eq. 8): keeps zero-damage steps ordered by bytes
    horizon_tokens: float = 65536.0  # e-folding horizon of the online routing EMA (routed weight ~ tokens)
    prior_tokens: float = 16384.0  # weight of the calibration masses at start, in the same unit
    # New routing statistics / prompt features rebuild the plan queue at most this often (Observation.now_s);
    # a change of desired bits or floors always rebuilds it. 0 = rebuild on every change.
    rebuild_interval_s: float = 0.5
    # A floor stage is used only if it could free (1 + stage_slack) * D (when no stage has that room, the
    # loosest). 0 = the first stage that can meet D, whose floors then decide most blocks. On the final
    # MoEfied SmolLM2 with uniform-grid planes (docs/results/quality.md), 0.25 beats 0 at every budget
    # (ppl at the 3/4/5-bit budgets 48.06 / 39.46 / 38.19 vs 50.85 / 40.23 / 38.40; uniform AP 61.37 /
    # 39.69 / 38.32); on an early smoke-test build 0 had been better (4368 vs 7367, uniform 7761).
    stage_slack: float = 0.25

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        if not (self.horizon_tokens > 0 and self.prior_tokens > 0):
            raise ValueError("horizon_tokens and prior_tokens must be > 0")
        if not self.stage_slack >= 0:
            raise ValueError(f"stage_slack must be >= 0, got {self.stage_slack}")
        if not self.rebuild_interval_s >= 0:
            raise ValueError(f"rebuild_interval_s must be >= 0, got {self.rebuild_interval_s}")


@dataclass(frozen=True)
class QueuedAction:
    """One one-bit step of one block in the plan queue."""

    block_id: int
    bits_from: int
    bits_to: int
    damage: float
    freed: int
    stage: int  # the first floor stage that allows this step (its target is >= that stage's floor)


@dataclass(frozen=True)
class PlanQueue:
    """The greedy order of every allowed step under the loosest floors, with each step's first stage.

    The greedy order under the floors of stage s is this order restricted to steps with stage <= s: a
    stage only cuts each block's step sequence shorter, and a heap merge of truncated sequences pops the
    remaining steps in the same relative order.
    """

    signature: tuple
    actions: tuple[QueuedAction, ...]
    num_stages: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "_stage", np.array([a.stage for a in self.actions], dtype=np.int64))
        object.__setattr__(self, "_freed", np.array([a.freed for a in self.actions], dtype=np.int64))

    def stage_indices(self, stage: int) -> np.ndarray:
        """Positions (in queue order) of the steps allowed in `stage`."""
        return np.nonzero(self._stage <= stage)[0]

    def max_freeable(self, stage: int | None = None) -> int:
        """Bytes freed by every step allowed in `stage` (default: the last, loosest stage)."""
        s = self.num_stages - 1 if stage is None else stage
        return int(self._freed[self._stage <= s].sum())


@dataclass(frozen=True)
class StepCosts:
    """Predicted damage and freed bytes of the step b -> b-1 of row i, at [i, b - bits_min]."""

    bits_min: int
    damage: np.ndarray  # [rows, bits] float64
    freed: np.ndarray  # [rows, bits] int64

    def damage_of(self, i: int, bits_from: int) -> float:
        return float(self.damage[i, bits_from - self.bits_min])

    def freed_of(self, i: int, bits_from: int) -> int:
        return int(self.freed[i, bits_from - self.bits_min])

    def ratio(self, i: int, bits_from: int) -> float:
        j = bits_from - self.bits_min
        freed = int(self.freed[i, j])
        if freed <= 0:
            raise ValueError(f"row {i}: the step {bits_from} -> {bits_from - 1} frees {freed} B; M^b must grow with b")
        return float(self.damage[i, j]) / freed


@dataclass(frozen=True)
class PlanReport:
    """What the last plan did; `feasible` is False when the floors could not free the target."""

    direction: Literal["offload", "reload"]
    target_bytes: int
    planned_bytes: int
    feasible: bool
    stage: int  # last floor stage used (-1: none)
    predicted_damage: float  # offload: damage added; reload: damage removed
    num_steps: int
    routing_source: RoutingSource

    def describe(self) -> str:
        if self.direction == "offload":
            head = "quality offload" if self.feasible else "quality offload INFEASIBLE"
            tail = "" if self.feasible else f" (floors allow at most {self.planned_bytes} B; lower the floors or free KV)"
            return (f"{head}: target {self.target_bytes} B, planned {self.planned_bytes} B in {self.num_steps} steps, "
                    f"stage {self.stage}, predicted damage {self.predicted_damage:.4g}, routing {self.routing_source}{tail}")
        return (f"quality reload: budget {self.target_bytes} B, planned {self.planned_bytes} B in {self.num_steps} "
                f"steps, damage removed {self.predicted_damage:.4g}, routing {self.routing_source}")


class QualityPolicy:
    """Policy 'quality'. Construct with the calibration; wire `observer` into the MoE forward (optional)."""

    def __init__(
        self,
        calib: CalibrationData,
        options: QualityOptions | None = None,
        observer: RoutingObserver | None = None,
    ) -> None:
        self.calib = calib
        self.options = options or QualityOptions()
        if observer is not None and (observer.num_layers, observer.num_experts) != (calib.num_layers, calib.num_experts):
            raise ValueError(
                f"observer shape ({observer.num_layers}, {observer.num_experts}) does not match the calibration "
                f"({calib.num_layers}, {calib.num_experts})"
            )
        self.observer = observer
        self.traffic_agreed = False  # TP: traffic arrives through take_traffic only (serving_loop.py)
        self.stats = RoutingStats.from_masses(calib.routing_mass, self.options.prior_tokens, self.options.horizon_tokens)
        self.routing_source: RoutingSource = "calibration"
        self._phi_norm = np.full((calib.num_layers, calib.num_experts, 3), np.nan)
        self._phi_version = 0
        self._observer_records_seen = 0
        self._last_counts: dict[tuple[int, int], float] = {}
        self._queue: PlanQueue | None = None
        self._g_cache: dict[tuple[int, int, str], np.ndarray] = {}
        self._freed_cache: dict[tuple[int, tuple], np.ndarray] = {}
        self._built_at_s = 0.0
        self._buckets = self._make_buckets()
        self._buckets_version = self.stats.version
        self.last_report: PlanReport | None = None

    # ---- inputs ---------------------------------------------------------------------------------
    def drain_observer(self) -> ObservedTraffic | None:
        """What the MoE forward recorded since the last drain (None when nothing new or not wired)."""
        obs = self.observer
        if obs is None or obs.records <= self._observer_records_seen:
            return None
        self._observer_records_seen = obs.records
        return obs.drain()

    def take_traffic(self, traffic: ObservedTraffic) -> None:
        """Fold observed traffic into the routing EMA and take its prompt features. Under TP the serving loop
        hands every rank the source rank's drain (agreed), and sets `traffic_agreed` so no rank folds its own."""
        self.stats.fold(traffic.routing)
        self._phi_norm = normalize_features(traffic.phi_raw, self.calib.residual.ref_norm)
        self._phi_version += 1
        self.routing_source = "observer"

    def _ingest(self, observation: Observation) -> None:
        """Fold new traffic into the routing EMA and take the newest prompt features."""
        if self.traffic_agreed:  # the serving loop calls take_traffic with the agreed traffic
            return
        obs = self.observer
        if obs is not None and obs.records > 0:  # wired into the MoE forward: the only traffic source
            traffic = self.drain_observer()
            if traffic is not None:
                self.take_traffic(traffic)
            return
        # Not wired: routing counts from the Observation give the masses (every slot weight 1) and no
        # prompt features (eta stays 1); `routing_source` and every plan's reason say which one is used.
        if observation.routing_counts:
            self._fold_counts(observation.routing_counts)

    def _fold_counts(self, counts: dict[tuple[int, int], float]) -> None:
        """Observation.routing_counts are cumulative: fold the difference since the last call."""
        delta = np.zeros_like(self.stats.weight_sums)
        for (layer, expert), c in counts.items():
            if 0 <= layer < delta.shape[0] and 0 <= expert < delta.shape[1]:
                delta[layer, expert] = float(c) - self._last_counts.get((layer, expert), 0.0)
        if (delta < 0).any():
            raise ValueError("Observation.routing_counts decreased; they must be cumulative since server start")
        self._last_counts = dict(counts)
        if delta.any():
            self.stats.fold(RoutingSnapshot(delta, delta.astype(np.int64), np.zeros(delta.shape[0], np.int64)))
            self.routing_source = "counts"

    def _make_buckets(self) -> BlockBuckets:
        return BlockBuckets.from_stats(self.calib.buckets, self.stats.normalized_mass())

    # ---- damage model ---------------------------------------------------------------------------
    def _bucket(self, row: BlockView) -> str:
        if not self.options.use_routing_stats:
            return "warm"
        return self._buckets.bucket(row.key.layer, row.key.expert)

    def predicted_damage(self, row: BlockView, bits_from: int, bits_to: int) -> float:
        """eq. 8 for one step of one block under the current statistics."""
        opt = self.options
        if opt.use_global_sensitivity:
            self._global_damage_row(row)  # clear error when the calibration lacks this block
            g = self.calib.sensitivity[(row.key.layer, row.key.expert, row.key.proj)].global_damage(bits_from, bits_to)
        else:
            g = float(bits_from - bits_to)
        mu = self.calib.buckets.mu[self._bucket(row)] if opt.use_routing_stats else 1.0
        eta = 1.0
        if opt.use_prompt_residual and row.key.expert < self.calib.num_experts:
            phi = self._phi_norm[row.key.layer, row.key.expert]
            eta = float(self.calib.residual.eta(row.key.proj, bits_from, bits_to, phi, opt.alpha))
        return max(opt.eps, mu * g * eta)

    @property
    def num_stages(self) -> int:
        """Floor stages in use; without routing statistics there are no buckets, so one stage (table floors)."""
        return self.calib.buckets.num_stages if self.options.use_routing_stats else 1

    def _stage_floor(self, row: BlockView, stage: int) -> int:
        if not self.options.use_routing_stats:
            return row.floor_bits
        return max(row.floor_bits, self.calib.buckets.floor(stage, self._bucket(row)))

    # ---- plan queue -----------------------------------------------------------------------------
    def refresh(self, table: PageTableView, observation: Observation) -> PlanQueue:
        """Ingest new traffic and rebuild the plan queue if anything it depends on changed (cheap otherwise)."""
        self._ingest(observation)
        if self.stats.version != self._buckets_version:
            self._buckets = self._make_buckets()
            self._buckets_version = self.stats.version
        rows = sorted(table, key=lambda r: r.key.sort_key())
        table_sig = tuple((r.block_id, r.desired_bits, r.floor_bits, r.ceiling_bits) for r in rows)
        signature = (table_sig, self._buckets_version, self._phi_version)
        q = self._queue
        stale_stats = q is not None and q.signature != signature and (
            observation.now_s - self._built_at_s >= self.options.rebuild_interval_s
        )
        if q is None or q.signature[0] != table_sig or stale_stats:
            self._check_rows(rows)
            self._queue = self._build_queue(rows, signature)
            self._built_at_s = observation.now_s
        return self._queue

    def _check_rows(self, rows: list[BlockView]) -> None:
        """Every row must lie inside what the calibration describes (else the statistics are for another model)."""
        c = self.calib
        for r in rows:
            if not 0 <= r.key.layer < c.num_layers:
                raise CalibrationError(f"page-table block {r.key} is in layer {r.key.layer}, the calibration covers "
                                       f"{c.num_layers} layers; re-run `pagedweight calibrate` for this checkpoint")
            if not (c.ap.bits_min <= r.floor_bits and r.ceiling_bits <= c.ap.bits_max):
                raise CalibrationError(f"page-table block {r.key} spans bits {r.floor_bits}..{r.ceiling_bits}, the "
                                       f"calibration covers {c.ap.bits_min}..{c.ap.bits_max}; re-run `pagedweight calibrate`")

    def step_costs(self, rows: list[BlockView]) -> StepCosts:
        """Damage and bytes of every one-bit step of every row, vectorised (eq. 8 for all rows at once).

        Column j is the transition (bits_min + j) -> (bits_min + j - 1); column 0 is unused.
        """
        opt, calib = self.options, self.calib
        bmin, bmax = calib.ap.bits_min, calib.ap.bits_max
        n, nb = len(rows), bmax - bmin + 1
        g = np.zeros((n, nb))
        freed = np.zeros((n, nb), dtype=np.int64)
        for i, r in enumerate(rows):
            freed[i] = self._freed_row(r, bmin, nb)
            if opt.use_global_sensitivity:
                g[i] = self._global_damage_row(r)
            else:
                g[i, 1:] = 1.0  # one bit dropped per step
        mu = np.ones(n)
        if opt.use_routing_stats:
            mu = np.array([calib.buckets.mu[self._bucket(r)] for r in rows])
        eta = np.ones((n, nb))
        if opt.use_prompt_residual:
            for proj in {r.key.proj for r in rows}:
                idx = np.array([i for i, r in enumerate(rows) if r.key.proj == proj and r.key.expert < calib.num_experts],
                               dtype=np.int64)
                if idx.size == 0:
                    continue
                phi = self._phi_norm[[rows[i].key.layer for i in idx], [rows[i].key.expert for i in idx]]
                for b in range(bmin + 1, bmax + 1):
                    eta[idx, b - bmin] = calib.residual.eta(proj, b, b - 1, phi, opt.alpha)
        damage = np.maximum(opt.eps, mu[:, None] * g * eta)
        return StepCosts(bmin, damage, freed)

    def _freed_row(self, row: BlockView, bmin: int, nb: int) -> np.ndarray:
        """Delta of every one-bit step of one block (eq. 3), cached per (block id, key, spec)."""
        ck = (row.block_id, (row.key, row.spec))
        cached = self._freed_cache.get(ck)
        if cached is None:
            cached = np.zeros(nb, dtype=np.int64)
            lo, hi = max(bmin, row.spec.bits_min), min(bmin + nb - 1, row.spec.bits_max)
            for b in range(lo + 1, hi + 1):
                cached[b - bmin] = row.bytes_at(b) - row.bytes_at(b - 1)
            self._freed_cache[ck] = cached
        return cached

    def _global_damage_row(self, row: BlockView) -> np.ndarray:
        """g for every one-bit step of one block, cached per block key (the calibration never changes)."""
        key = (row.key.layer, row.key.expert, row.key.proj)
        cached = self._g_cache.get(key)
        if cached is None:
            table = self.calib.sensitivity.get(key)
            if table is None:
                raise CalibrationError(
                    f"block {row.key} has no sensitivity in the calibration; re-run `pagedweight calibrate` for "
                    "this checkpoint"
                )
            bmin = self.calib.ap.bits_min
            cached = np.zeros(self.calib.ap.bits_max - bmin + 1)
            for b in table.bitwidths[1:]:
                cached[b - bmin] = table.global_damage(b, b - 1)
            self._g_cache[key] = cached
        return cached

    def _build_queue(self, rows: list[BlockView], signature: tuple) -> PlanQueue:
        costs = self.step_costs(rows)
        num_stages = self.num_stages
        floors = [[self._stage_floor(r, st) for st in range(num_stages)] for r in rows]  # non-increasing
        loosest = [f[-1] for f in floors]
        bits = [r.desired_bits for r in rows]
        # (damage per byte, row index) with row index = (layer, expert, proj) order: deterministic ties
        heap = [(costs.ratio(i, bits[i]), i) for i in range(len(rows)) if bits[i] - 1 >= loosest[i]]
        heapq.heapify(heap)
        actions: list[QueuedAction] = []
        while heap:
            _, i = heapq.heappop(heap)
            b = bits[i]
            first_stage = next(st for st in range(num_stages) if b - 1 >= floors[i][st])
            actions.append(QueuedAction(rows[i].block_id, b, b - 1, costs.damage_of(i, b), costs.freed_of(i, b),
                                        first_stage))
            bits[i] = b - 1
            if b - 2 >= loosest[i]:
                heapq.heappush(heap, (costs.ratio(i, b - 1), i))
        return PlanQueue(signature, tuple(actions), num_stages)

    # ---- Policy interface -----------------------------------------------------------------------
    def plan(self, table: PageTableView, target_bytes: int, observation: Observation) -> Plan:
        queue = self.refresh(table, observation)
        if target_bytes <= 0:
            return self._finish(table, [], "offload", target_bytes, True, -1)
        freed = np.array([a.freed for a in queue.actions], dtype=np.int64)
        # SelectBestPlan: the most protective floor stage with room to choose (stage_slack), else the loosest
        want = target_bytes * (1.0 + self.options.stage_slack)
        stage = next((st for st in range(queue.num_stages) if queue.max_freeable(st) >= want), queue.num_stages - 1)
        idx = queue.stage_indices(stage)
        cumulative = np.cumsum(freed[idx])
        if cumulative.size and cumulative[-1] >= target_bytes:
            n = int(np.searchsorted(cumulative, target_bytes, side="left")) + 1
            selected = self._prune([queue.actions[j] for j in idx[:n]], target_bytes)
            return self._finish(table, selected, "offload", target_bytes, True, stage)
        # even the loosest floors do not reach the target: free everything they allow
        return self._finish(table, list(queue.actions), "offload", target_bytes, False, queue.num_stages - 1)

    @staticmethod
    def _prune(selected: list[QueuedAction], target_bytes: int) -> list[QueuedAction]:
        """Drop steps the target does not need, most damaging first, only the lowest step of a block."""
        total = sum(a.freed for a in selected)
        keep = [True] * len(selected)
        steps_of: dict[int, list[int]] = {}
        for i, a in enumerate(selected):
            steps_of.setdefault(a.block_id, []).append(i)  # in queue order: highest bits first
        for i in sorted(range(len(selected)), key=lambda i: (-selected[i].damage, -i)):
            a = selected[i]
            own = steps_of[a.block_id]
            if own[-1] == i and total - a.freed >= target_bytes:
                keep[i] = False
                total -= a.freed
                own.pop()
        return [a for a, k in zip(selected, keep) if k]

    def plan_reload(self, table: PageTableView, budget_bytes: int, observation: Observation) -> Plan:
        self.refresh(table, observation)
        if not self.options.use_page_movement:
            self.last_report = PlanReport("reload", budget_bytes, 0, True, -1, 0.0, 0, self.routing_source)
            return Plan((), "quality reload disabled (ablation: no page movement)")
        rows = sorted(table, key=lambda r: r.key.sort_key())
        costs = self.step_costs(rows)
        bits = [r.desired_bits for r in rows]
        # raising b -> b+1 removes the damage of the step b+1 -> b and costs its bytes
        heap = [(-costs.ratio(i, bits[i] + 1), i) for i, r in enumerate(rows) if bits[i] + 1 <= r.ceiling_bits]
        heapq.heapify(heap)
        used, budget = 0, max(budget_bytes, 0)
        steps: list[QueuedAction] = []
        while heap:
            _, i = heapq.heappop(heap)
            b = bits[i]
            cost = costs.freed_of(i, b + 1)
            if used + cost > budget:
                continue  # a higher step of this block costs at least as much: drop the block
            used += cost
            steps.append(QueuedAction(rows[i].block_id, b, b + 1, costs.damage_of(i, b + 1), -cost, -1))
            bits[i] = b + 1
            if b + 2 <= rows[i].ceiling_bits:
                heapq.heappush(heap, (-costs.ratio(i, b + 2), i))
        return self._finish(table, steps, "reload", budget_bytes, True, -1)

    def _finish(self, table: PageTableView, actions: list[QueuedAction], direction: Literal["offload", "reload"],
                target: int, feasible: bool, stage: int) -> Plan:
        final: dict[int, int] = {}
        for a in actions:
            final[a.block_id] = a.bits_to
        steps = tuple(
            PlanStep(bid, b) for bid, b in sorted(final.items(), key=lambda kv: table.row(kv[0]).key.sort_key())
            if b != table.row(bid).desired_bits
        )
        moved = sum(abs(a.freed) for a in actions)
        self.last_report = PlanReport(direction, int(target), int(moved), feasible, stage,
                                      float(sum(a.damage for a in actions)), len(steps), self.routing_source)
        text = self.last_report.describe()
        if not feasible:
            logger.warning(text)
        return Plan(steps, text)
