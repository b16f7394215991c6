"""The quality (PagedWeight), hotness (DynaExq) and static policies on small synthetic page tables.

Properties: offload plans meet D when the floors allow it and say INFEASIBLE otherwise; reload plans never
exceed the budget; no block goes below a floor stage the planner has not reached; plans are deterministic
and valid under planner_api.validate_plan. Hand cases pin the damage formula and each ablation switch.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from pagedweight.format.layout import BlockSpec
from pagedweight.planner.calibration import APIdentity, CalibrationData, CalibrationError
from pagedweight.planner.factory import make_policy
from pagedweight.planner.hotness_policy import HotnessOptions, HotnessPolicy
from pagedweight.planner.observer import RoutingObserver
from pagedweight.planner.prompt_residual import PromptResidualModel, ResidualHead
from pagedweight.planner.quality_policy import QualityOptions, QualityPolicy
from pagedweight.planner.routing_stats import BucketConfig
from pagedweight.planner.sensitivity import SensitivityTable
from pagedweight.planner.static_policy import StaticPolicy
from pagedweight.runtime.blocks import BlockKey
from tests.support.fake_page_table import Row, Table
from pagedweight.runtime.planner_api import Observation, plan_bytes_delta, validate_plan

BITS = (2, 4)
SPEC_BIG = BlockSpec(out_features=32, in_features=128, bits_min=2, bits_max=4, group_size=64)  # w13
SPEC_SMALL = BlockSpec(out_features=16, in_features=128, bits_min=2, bits_max=4, group_size=64)  # w2
STAGES = ({"hot": 4, "warm": 3, "cold": 3}, {"hot": 3, "warm": 3, "cold": 2}, {"hot": 2, "warm": 2, "cold": 2})
OBS = Observation()

def make_table(layers: int, experts: int, bits: int = 4, floor: int = 2, ceiling: int = 4) -> Table:
    keys = [BlockKey(l, e, p) for l in range(layers) for e in range(experts) for p in ("w13", "w2")]
    keys.reverse()  # block ids deliberately not in key order
    return Table([Row(i, k, SPEC_BIG if k.proj == "w13" else SPEC_SMALL, bits, bits, floor, ceiling)
                  for i, k in enumerate(keys)])


def make_calib(layers: int, experts: int, mass: np.ndarray | None = None, seed: int = 0,
               heads: dict | None = None, sens: dict | None = None) -> CalibrationData:
    rng = np.random.default_rng(seed)
    if sens is None:
        sens = {}
        for l in range(layers):
            for e in range(experts):
                for p in ("w13", "w2"):
                    s4 = float(rng.uniform(0, 0.1))
                    s3 = s4 + float(rng.uniform(0.1, 1.0))
                    sens[(l, e, p)] = SensitivityTable({4: s4, 3: s3, 2: s3 + float(rng.uniform(0.5, 4.0))})
    if mass is None:
        mass = np.full((layers, experts), 1.0 / experts)
    return CalibrationData(
        ap=APIdentity("bcq", *BITS, "sha"),
        num_layers=layers,
        num_experts=experts,
        sensitivity=sens,
        routing_mass=mass,
        buckets=BucketConfig(1.5, 0.5, {"hot": 3.0, "warm": 1.0, "cold": 0.25}, STAGES),
        residual=PromptResidualModel(heads or {}, np.ones((layers, experts, 3))),
    )


def total_bytes(table: Table) -> int:
    return sum(r.bytes_at(r.desired_bits) for r in table)


# ---- quality: hand cases ---------------------------------------------------------------------------
def test_quality_picks_lowest_damage_per_byte_hand_case():
    table = make_table(1, 2)  # rows: (0,1,w2)=0 (0,1,w13)=1 (0,0,w2)=2 (0,0,w13)=3
    sens = {(0, 0, "w13"): SensitivityTable({4: 0.0, 3: 1.0, 2: 5.0}),
            (0, 0, "w2"): SensitivityTable({4: 0.0, 3: 0.1, 2: 5.0}),
            (0, 1, "w13"): SensitivityTable({4: 0.0, 3: 0.5, 2: 5.0}),
            (0, 1, "w2"): SensitivityTable({4: 0.0, 3: 1.0, 2: 5.0})}
    calib = make_calib(1, 2, sens=sens)
    pol = QualityPolicy(calib)
    small, big = SPEC_SMALL.bytes_at(4) - SPEC_SMALL.bytes_at(3), SPEC_BIG.bytes_at(4) - SPEC_BIG.bytes_at(3)
    # damage per byte: (0,0,w2) 0.1/small < (0,1,w13) 0.5/big < (0,0,w13) 1/big < (0,1,w2) 1/small
    assert pol.predicted_damage(table.row(2), 4, 3) == pytest.approx(0.1)  # mu(warm) = 1, eta = 1
    plan = pol.plan(table, small, OBS)
    assert [(s.block_id, s.target_bits) for s in plan.steps] == [(2, 3)]
    # greedy prefix is (0,0,w2) then (0,1,w13); the big step alone covers small + 1, so pruning drops
    # the first step (damage 0.5 instead of 0.6)
    plan = pol.plan(table, small + 1, OBS)
    assert [(s.block_id, s.target_bits) for s in plan.steps] == [(1, 3)]
    assert pol.last_report.feasible and pol.last_report.predicted_damage == pytest.approx(0.5)
    plan = pol.plan(table, big + 1, OBS)
    assert {(s.block_id, s.target_bits) for s in plan.steps} == {(2, 3), (1, 3)}
    assert pol.last_report.predicted_damage == pytest.approx(0.6)
    assert pol.last_report.planned_bytes == small + big


def test_quality_damage_formula_eq8_with_bucket_and_eta():
    table = make_table(1, 2)
    mass = np.array([[0.9, 0.1]])  # normalised 1.8 (hot) and 0.2 (cold)
    head = ResidualHead(w=(1.0, 0.0, 0.0), a=-1.0, confidence=0.5, rho_min=-2, rho_max=2, num_samples=9)
    calib = make_calib(1, 2, mass=mass, heads={"w13:4->3": head})
    obs = RoutingObserver(1, 2)
    pol = QualityPolicy(calib, QualityOptions(alpha=2.0), observer=obs)
    # route one token of norm 3 to expert 0 only, with weight 1: phi = (3, 3, 3) / ref 1
    obs.record(0, torch.tensor([[3.0, 0.0]]), torch.tensor([[0, 1]]), torch.tensor([[1.0, 0.0]]))
    pol.refresh(table, OBS)
    row = next(r for r in table if r.key == BlockKey(0, 0, "w13"))
    g = calib.sensitivity[(0, 0, "w13")].global_damage(4, 3)
    eta = math.exp(2.0 * 0.5 * (3.0 - 1.0))
    assert pol._bucket(row) == "hot"
    assert pol.predicted_damage(row, 4, 3) == pytest.approx(3.0 * g * eta)
    w2 = next(r for r in table if r.key == BlockKey(0, 0, "w2"))  # no head for w2 -> eta 1
    assert pol.predicted_damage(w2, 4, 3) == pytest.approx(3.0 * calib.sensitivity[(0, 0, "w2")].global_damage(4, 3))
    cold = next(r for r in table if r.key == BlockKey(0, 1, "w13"))  # cold; its phi is NaN -> eta 1
    assert pol.predicted_damage(cold, 4, 3) == pytest.approx(0.25 * calib.sensitivity[(0, 1, "w13")].global_damage(4, 3))


def test_quality_ablation_switches():
    table = make_table(1, 2)
    mass = np.array([[0.9, 0.1]])
    head = ResidualHead(w=(1.0, 0.0, 0.0), a=0.0, confidence=1.0, rho_min=-2, rho_max=2, num_samples=9)
    calib = make_calib(1, 2, mass=mass, heads={"w13:4->3": head})
    row = next(r for r in table if r.key == BlockKey(0, 0, "w13"))
    g = calib.sensitivity[(0, 0, "w13")].global_damage(4, 3)

    def damage(**kw):
        obs = RoutingObserver(1, 2)
        pol = QualityPolicy(calib, QualityOptions(**kw), observer=obs)
        obs.record(0, torch.tensor([[1.0, 0.0]]), torch.tensor([[0, 1]]), torch.tensor([[1.0, 0.0]]))
        pol.refresh(table, OBS)
        return pol.predicted_damage(row, 4, 3)

    assert damage() == pytest.approx(3.0 * g * math.e)
    assert damage(use_prompt_residual=False) == pytest.approx(3.0 * g)
    assert damage(use_routing_stats=False) == pytest.approx(g * math.e)
    assert damage(use_global_sensitivity=False) == pytest.approx(3.0 * 1.0 * math.e)  # g = bits dropped
    pol = QualityPolicy(calib, QualityOptions(use_page_movement=False))
    table.apply(pol.plan(table, 1, OBS))
    assert len(pol.plan_reload(table, 10**9, OBS)) == 0
    # without routing statistics there are no buckets: one stage, the table's floors
    pol = QualityPolicy(calib, QualityOptions(use_routing_stats=False))
    assert pol.num_stages == 1 and pol._stage_floor(row, 0) == row.floor_bits


def test_quality_relaxes_floors_only_as_far_as_needed():
    # expert 0 hot (stage floors 4, 3, 2), expert 1 cold (3, 2, 2); the hot expert's steps are the cheapest
    sens = {(0, 0, p): SensitivityTable({4: 0.0, 3: 0.01, 2: 0.02}) for p in ("w13", "w2")}
    sens |= {(0, 1, p): SensitivityTable({4: 0.0, 3: 10.0, 2: 20.0}) for p in ("w13", "w2")}
    table = make_table(1, 2)
    calib = make_calib(1, 2, mass=np.array([[0.9, 0.1]]), sens=sens)
    pol = QualityPolicy(calib, QualityOptions(stage_slack=0.0))
    one_expert = sum(SPEC.bytes_at(4) - SPEC.bytes_at(3) for SPEC in (SPEC_BIG, SPEC_SMALL))
    # stage 0 allows only the cold expert's 4 -> 3: enough for this target, so the hot one is untouched
    plan = pol.plan(table, one_expert, OBS)
    assert pol.last_report.stage == 0
    assert {(table.row(s.block_id).key.expert, s.target_bits) for s in plan.steps} == {(1, 3)}
    # more than stage 0 can free: stage 1 opens the hot expert's 4 -> 3, which is far cheaper than cold 3 -> 2
    plan = pol.plan(table, one_expert + 1, OBS)
    assert pol.last_report.stage == 1
    targets = {(table.row(s.block_id).key.expert, table.row(s.block_id).key.proj): s.target_bits for s in plan.steps}
    assert all(b >= 3 for b in targets.values()) and (0, "w13") in targets
    # with slack 1.0, stage 0 (capacity = one expert) has no room for even half of it: stage 1 is used
    roomy = QualityPolicy(calib, QualityOptions(stage_slack=1.0))
    plan = roomy.plan(table, one_expert // 2 + 1, OBS)
    assert roomy.last_report.stage == 1
    assert {table.row(s.block_id).key.expert for s in plan.steps} == {0}  # the cheap hot steps, now allowed


def test_quality_prunes_unneeded_last_step():
    # big (w13) steps are cheaper per byte, small ones cheap in absolute damage; after the greedy prefix the
    # first big step is no longer needed once a later small+big pair covers D
    table = make_table(1, 1)  # rows: 0 = (0,0,w2) small, 1 = (0,0,w13) big
    small, big = SPEC_SMALL.bytes_at(4) - SPEC_SMALL.bytes_at(3), SPEC_BIG.bytes_at(4) - SPEC_BIG.bytes_at(3)
    sens = {(0, 0, "w13"): SensitivityTable({4: 0.0, 3: 1.0, 2: 2.0}),
            (0, 0, "w2"): SensitivityTable({4: 0.0, 3: 0.6, 2: 1.0})}
    pol = QualityPolicy(make_calib(1, 1, sens=sens, mass=np.array([[1.0]])))
    # queue (stage floors 4/3/3 -> warm floor 3 first): big 1/big < small 0.6/small, so big first then small
    plan = pol.plan(table, big + 1, OBS)
    assert plan_bytes_delta(table, plan) >= big + 1
    # both steps needed: nothing pruned
    assert {(s.block_id, s.target_bits) for s in plan.steps} == {(0, 3), (1, 3)}
    plan = pol.plan(table, small, OBS)  # the greedy first step is the big one; it alone covers D
    assert [(s.block_id, s.target_bits) for s in plan.steps] == [(1, 3)]


def test_quality_infeasible_is_reported_and_frees_the_maximum():
    table = make_table(2, 2, floor=3)
    pol = QualityPolicy(make_calib(2, 2))
    maxfree = sum(r.bytes_at(4) - r.bytes_at(3) for r in table)
    plan = pol.plan(table, maxfree + 1, OBS)
    assert "INFEASIBLE" in plan.reason and not pol.last_report.feasible
    assert plan_bytes_delta(table, plan) == maxfree
    assert all(s.target_bits == 3 for s in plan.steps)
    validate_plan(table, plan, "offload")
    assert len(pol.plan(table, 0, OBS)) == 0


def test_quality_missing_sensitivity_is_a_clear_error():
    table = make_table(1, 2)
    calib = make_calib(1, 2)
    del calib.sensitivity[(0, 1, "w2")]
    with pytest.raises(CalibrationError, match="layer0.expert1.w2 has no sensitivity"):
        QualityPolicy(calib).plan(table, 1, OBS)
    with pytest.raises(CalibrationError, match="calibration covers 1 layers"):
        QualityPolicy(make_calib(1, 2)).plan(make_table(2, 2), 1, OBS)
    wide = make_table(1, 2, ceiling=4)
    for r in wide:
        r.floor_bits = 1
    with pytest.raises(CalibrationError, match="calibration covers 2..4"):
        QualityPolicy(make_calib(1, 2)).plan(wide, 1, OBS)


# ---- quality: properties over random states --------------------------------------------------------
def random_state(seed: int) -> tuple[Table, CalibrationData]:
    rnd = random.Random(seed)
    layers, experts = rnd.randint(1, 3), rnd.randint(1, 5)
    table = make_table(layers, experts)
    for r in table:
        r.floor_bits = rnd.choice([2, 2, 3])
        r.desired_bits = r.committed_bits = rnd.randint(r.floor_bits, 4)
    mass = np.random.default_rng(seed).dirichlet(np.ones(experts), size=layers)
    return table, make_calib(layers, experts, mass=mass, seed=seed)


@pytest.mark.parametrize("seed", range(40))
def test_quality_offload_properties(seed):
    table, calib = random_state(seed)
    pol = QualityPolicy(calib)
    rnd = random.Random(seed)
    maxfree = sum(r.bytes_at(r.desired_bits) - r.bytes_at(r.floor_bits) for r in table)
    target = rnd.randint(1, max(1, int(maxfree * 1.2)))
    plan = pol.plan(table, target, OBS)
    validate_plan(table, plan, "offload")
    freed = plan_bytes_delta(table, plan)
    if target <= maxfree:
        assert freed >= target and pol.last_report.feasible
    else:
        assert freed == maxfree and not pol.last_report.feasible and "INFEASIBLE" in plan.reason
    # floor stages: no block below the floors of the stage used, and that stage is the first that can meet D
    stage = pol.last_report.stage
    queue = pol.refresh(table, OBS)
    final = {r.block_id: r.desired_bits for r in table} | {s.block_id: s.target_bits for s in plan.steps}
    for r in table:
        assert final[r.block_id] >= min(r.desired_bits, pol._stage_floor(r, stage))
    want = target * (1 + pol.options.stage_slack)
    roomy = [st for st in range(queue.num_stages) if queue.max_freeable(st) >= want]
    if pol.last_report.feasible:
        assert stage == (roomy[0] if roomy else queue.num_stages - 1)
    # deterministic: a fresh policy on the same state gives the same plan
    assert QualityPolicy(calib).plan(table, target, OBS) == plan


@pytest.mark.parametrize("seed", range(40))
def test_quality_reload_never_exceeds_budget(seed):
    table, calib = random_state(seed)
    pol = QualityPolicy(calib)
    budget = random.Random(seed).randint(0, 4000)
    plan = pol.plan_reload(table, budget, OBS)
    validate_plan(table, plan, "reload")
    assert 0 <= -plan_bytes_delta(table, plan) <= budget
    assert QualityPolicy(calib).plan_reload(table, budget, OBS) == plan
    # greedy is maximal: no block left below its ceiling could still take one more bit
    used = -plan_bytes_delta(table, plan)
    final = {r.block_id: r.desired_bits for r in table} | {s.block_id: s.target_bits for s in plan.steps}
    for r in table:
        b = final[r.block_id]
        if b < r.ceiling_bits:
            assert used + r.bytes_at(b + 1) - r.bytes_at(b) > budget


def test_quality_offload_then_reload_round_trip_prefers_hot_blocks():
    sens = {(0, e, p): SensitivityTable({4: 0.0, 3: 1.0, 2: 3.0}) for e in range(3) for p in ("w13", "w2")}
    table = make_table(1, 3)
    pol = QualityPolicy(make_calib(1, 3, mass=np.array([[0.7, 0.2, 0.1]]), sens=sens))  # hot, warm, cold
    start = total_bytes(table)
    table.apply(pol.plan(table, 10**9, OBS))  # everything to the floor
    assert all(r.desired_bits == 2 for r in table)
    small = SPEC_SMALL.bytes_at(3) - SPEC_SMALL.bytes_at(2)
    (step,) = pol.plan_reload(table, small, OBS).steps  # only a w2 step fits; the hot expert's (mu 3) wins
    assert table.row(step.block_id).key == BlockKey(0, 0, "w2") and step.target_bits == 3
    assert pol.last_report.predicted_damage == pytest.approx(3.0 * 2.0)  # mu_hot * g(3 -> 2)
    table.apply(pol.plan_reload(table, 10**9, OBS))
    assert total_bytes(table) == start


def test_quality_plan_queue_is_reused_until_state_changes():
    table, calib = random_state(5)
    pol = QualityPolicy(calib)
    q1 = pol.refresh(table, OBS)
    assert pol.refresh(table, OBS) is q1
    table.apply(pol.plan(table, 1, OBS))
    assert pol.refresh(table, OBS) is not q1


def test_quality_rebuilds_on_new_statistics_at_most_every_interval():
    table, calib = random_state(7)
    pol = QualityPolicy(calib, QualityOptions(rebuild_interval_s=1.0))
    q1 = pol.refresh(table, Observation(now_s=0.0))
    q2 = pol.refresh(table, Observation(now_s=0.5, routing_counts={(0, 0): 10.0}))
    assert q2 is q1  # new statistics, but within the interval: the prepared queue stays
    q3 = pol.refresh(table, Observation(now_s=1.5, routing_counts={(0, 0): 10.0}))
    assert q3 is not q1 and q3.signature[1] == pol.stats.version


def test_vectorised_step_costs_match_scalar_eq8():
    table, calib = random_state(11)
    head = ResidualHead(w=(0.5, -0.2, 0.1), a=0.05, confidence=0.8, rho_min=-1, rho_max=1, num_samples=9)
    calib.residual.heads["w13:4->3"] = head
    calib.residual.heads["w2:3->2"] = head
    obs = RoutingObserver(calib.num_layers, calib.num_experts)
    pol = QualityPolicy(calib, observer=obs)
    gen = torch.Generator().manual_seed(0)
    obs.record(0, torch.randn(32, 8, generator=gen), torch.randint(0, calib.num_experts, (32, 2), generator=gen),
               torch.rand(32, 2, generator=gen))
    pol.refresh(table, OBS)
    rows = sorted(table, key=lambda r: r.key.sort_key())
    costs = pol.step_costs(rows)
    for i, r in enumerate(rows):
        for b in (3, 4):
            assert costs.damage_of(i, b) == pytest.approx(pol.predicted_damage(r, b, b - 1), rel=1e-12)
            assert costs.freed_of(i, b) == r.bytes_at(b) - r.bytes_at(b - 1)


def test_quality_online_routing_shift_reorders_plan():
    # two experts with identical sensitivity; calibration says expert 0 is hot
    sens = {(0, e, p): SensitivityTable({4: 0.0, 3: 1.0, 2: 3.0}) for e in range(2) for p in ("w13", "w2")}
    calib = make_calib(1, 2, mass=np.array([[0.9, 0.1]]), sens=sens)
    table = make_table(1, 2)
    d = SPEC_BIG.bytes_at(4) - SPEC_BIG.bytes_at(3)
    pol = QualityPolicy(calib, QualityOptions(horizon_tokens=10.0, prior_tokens=10.0))
    first = pol.plan(table, d, OBS)
    assert {table.row(s.block_id).key.expert for s in first.steps} == {1}
    # traffic moves entirely to expert 1 (cumulative counts, no observer wired)
    shifted = Observation(now_s=1.0, routing_counts={(0, 0): 0.0, (0, 1): 500.0})
    second = pol.plan(table, d, shifted)
    assert pol.routing_source == "counts"
    assert {table.row(s.block_id).key.expert for s in second.steps} == {0}


# ---- hotness ---------------------------------------------------------------------------------------
def test_hotness_ema_on_time_cadence():
    pol = HotnessPolicy(HotnessOptions(interval_s=1.0, ema=0.5))
    assert pol.update(Observation(now_s=0.0, routing_counts={(0, 0): 4.0}))
    assert pol.hotness[(0, 0)] == pytest.approx(2.0)  # 0.5*0 + 0.5*4
    assert not pol.update(Observation(now_s=0.5, routing_counts={(0, 0): 10.0}))  # within T_u
    assert pol.update(Observation(now_s=1.2, routing_counts={(0, 0): 10.0}))
    assert pol.hotness[(0, 0)] == pytest.approx(0.5 * 2.0 + 0.5 * 6.0)
    with pytest.raises(ValueError, match="decreased"):
        pol.update(Observation(now_s=5.0, routing_counts={(0, 0): 1.0}))


def test_hotness_keeps_top_n_per_layer_within_budget():
    table = make_table(2, 4)
    counts = {(0, 0): 100.0, (0, 1): 50.0, (0, 2): 10.0, (0, 3): 1.0,
              (1, 0): 1.0, (1, 1): 10.0, (1, 2): 50.0, (1, 3): 100.0}
    pol = HotnessPolicy(HotnessOptions(margin=0.0))
    per_expert = (SPEC_BIG.bytes_at(4) - SPEC_BIG.bytes_at(2)) + (SPEC_SMALL.bytes_at(4) - SPEC_SMALL.bytes_at(2))
    # free enough for 5 experts at low precision: 3 stay high -> n = 1 per layer plus the hottest rank-2 expert
    plan = pol.plan(table, 5 * per_expert, Observation(routing_counts=counts))
    validate_plan(table, plan, "offload")
    assert plan_bytes_delta(table, plan) >= 5 * per_expert
    table.apply(plan)
    high = {(r.key.layer, r.key.expert) for r in table if r.desired_bits == 4}
    assert high == {(0, 0), (1, 3), (0, 1)} or high == {(0, 0), (1, 3), (1, 2)}
    # reload within budget: exactly one more expert fits
    plan = pol.plan_reload(table, per_expert + 10, Observation(routing_counts=counts))
    validate_plan(table, plan, "reload")
    assert 0 < -plan_bytes_delta(table, plan) <= per_expert + 10
    # infeasible offload
    plan = pol.plan(table, 10**9, Observation(routing_counts=counts))
    assert "INFEASIBLE" in plan.reason


def test_hotness_hysteresis_prevents_thrash():
    table = make_table(1, 2)
    per_expert = (SPEC_BIG.bytes_at(4) - SPEC_BIG.bytes_at(2)) + (SPEC_SMALL.bytes_at(4) - SPEC_SMALL.bytes_at(2))
    pol = HotnessPolicy(HotnessOptions(interval_s=1.0, ema=0.0, margin=0.2))
    table.apply(pol.plan(table, per_expert, Observation(now_s=0, routing_counts={(0, 0): 100.0, (0, 1): 90.0})))
    assert [r.desired_bits for r in sorted(table, key=lambda r: r.key.sort_key())] == [4, 4, 2, 2]
    # interval counts 95 (in the set) vs 100 (outside): within the 20% margin, the current set stays
    near_tie = Observation(now_s=1, routing_counts={(0, 0): 195.0, (0, 1): 190.0})
    pol.update(near_tie)
    assert pol.slot_order(table)[0][0] == (0, 0)
    no_margin = HotnessPolicy(HotnessOptions(interval_s=1.0, ema=0.0, margin=0.0))
    no_margin.update(Observation(now_s=0, routing_counts={(0, 0): 100.0, (0, 1): 90.0}))
    no_margin.update(near_tie)
    assert no_margin.slot_order(table)[0][0] == (0, 1)  # without hysteresis the near-tie swaps
    # interval counts 5 vs 210: a clear change of the hot set passes the margin
    pol.update(Observation(now_s=2, routing_counts={(0, 0): 200.0, (0, 1): 400.0}))
    assert pol.slot_order(table)[0][0] == (0, 1)


# ---- static and factory ----------------------------------------------------------------------------
def test_static_policy_never_plans():
    table = make_table(1, 2)
    pol = StaticPolicy()
    plan = pol.plan(table, 1000, OBS)
    assert len(plan) == 0 and "left unanswered" in plan.reason
    assert len(pol.plan_reload(table, 1000, OBS)) == 0


def test_make_policy(tmp_path):
    calib = make_calib(1, 2)
    assert isinstance(make_policy("static"), StaticPolicy)
    hot = make_policy("hotness", options={"interval_s": 2.0})
    assert isinstance(hot, HotnessPolicy) and hot.options.interval_s == 2.0
    assert hot.options.ema == HotnessPolicy().options.ema  # options not named keep their defaults
    q = make_policy("quality", calib, {"alpha": 0.5})
    assert isinstance(q, QualityPolicy) and q.options.alpha == 0.5 and q.calib is calib
    calib.save(tmp_path / "calibration.json")
    loaded = make_policy("quality", tmp_path)
    assert isinstance(loaded, QualityPolicy) and loaded.options == QualityPolicy(calib).options
    assert (loaded.calib.num_layers, loaded.calib.num_experts) == (1, 2)
    assert (loaded.calib.routing_mass == calib.routing_mass).all()
    with pytest.raises(ValueError, match="needs a calibration"):
        make_policy("quality")
    with pytest.raises(ValueError, match="unknown option"):
        make_policy("hotness", options={"alpah": 1})
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")


def test_policies_on_the_runtime_page_table():
    from pagedweight.runtime.page_table import WeightPageTable

    blocks = [(BlockKey(l, e, p), SPEC_BIG if p == "w13" else SPEC_SMALL)
              for l in range(2) for e in range(3) for p in ("w13", "w2")]
    table = WeightPageTable(blocks, initial_bits=4)
    calib = make_calib(2, 3, mass=np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]))
    counts = Observation(now_s=0.0, routing_counts={(l, e): float(10 * (l + e + 1)) for l in range(2) for e in range(3)})
    for pol in (QualityPolicy(calib), HotnessPolicy(), StaticPolicy()):
        before = {r.block_id: r.desired_bits for r in table}
        plan = pol.plan(table, 2000, counts)
        validate_plan(table, plan, "offload")
        if not isinstance(pol, StaticPolicy):
            assert plan_bytes_delta(table, plan) >= 2000
        for s in plan.steps:
            table.set_desired(s.block_id, s.target_bits)
        plan = pol.plan_reload(table, 1000, counts)
        validate_plan(table, plan, "reload")
        assert -plan_bytes_delta(table, plan) <= 1000
        for bid, bits in before.items():
            table.set_desired(bid, bits)


def test_every_policy_answers_refresh_and_only_ranking_ones_change_their_plans():
    """refresh is part of the Policy interface: the serving loop calls it on every policy when routing
    statistics arrive. Policies that rank nothing plan exactly as before; the quality policy re-ranks by the
    new traffic (all routing on one expert makes the other the first to lose a bit, whatever the sensitivities)."""
    from pagedweight.planner.scripted_policy import ScriptedPolicy

    hot_obs = Observation(iteration=1, now_s=1.0, routing_counts={(0, 1): 1000.0})
    for policy in (StaticPolicy(), ScriptedPolicy(), HotnessPolicy()):
        table = make_table(1, 2)
        before = policy.plan(table, 1, OBS).steps
        policy.refresh(table, hot_obs)
        assert policy.plan(table, 1, OBS).steps == before, type(policy).__name__
    # the quality policy keeps what refresh folded: its next plan (asked without routing) follows the traffic
    for hot_expert, lowered in ((1, 0), (0, 1)):
        for seed in range(3):
            quality = QualityPolicy(make_calib(1, 2, mass=np.array([[0.5, 0.5]]), seed=seed),
                                    QualityOptions(prior_tokens=1.0))
            table = make_table(1, 2)
            quality.refresh(table, Observation(iteration=1, now_s=1.0, routing_counts={(0, hot_expert): 1000.0}))
            (first,) = quality.plan(table, 1, OBS).steps
            assert table.row(first.block_id).key.expert == lowered, (hot_expert, seed)
