"""Every planner formula against hand-computed cases: sensitivity (eq. 2-4), routing mass (eq. 1) and its
EMA, buckets, prompt-residual features and heads (eq. 5-6), and the calibration file round trip."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pagedweight.format.layout import BlockSpec, dequantize, pack_bits
from pagedweight.planner.calibration import APIdentity, CalibrationData, CalibrationError, load_for_checkpoint
from pagedweight.planner.observer import RoutingObserver
from pagedweight.planner.prompt_residual import (
    PromptResidualModel,
    ResidualHead,
    features_from_sums,
    fit_head,
    routed_input_sums,
)
from pagedweight.planner.routing_stats import (
    BlockBuckets,
    BucketConfig,
    RoutingSnapshot,
    RoutingStats,
    bucket_multipliers,
    bucket_thresholds,
    default_floor_stages,
    routing_mass,
)
from pagedweight.planner.sensitivity import (
    SensitivityTable,
    activation_derivative,
    expert_output_hessians,
    freed_bytes,
    hessian_sensitivity,
    sensitivity_by_bits,
)


# ---- sensitivity -----------------------------------------------------------------------------------
def test_hessian_sensitivity_hand_case():
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    wq = torch.tensor([[1.5, 2.0], [2.0, 4.5]])
    h = torch.tensor([2.0, 10.0])
    # column 0: (0.5^2 + 1^2) * 2 = 2.5 ; column 1: (0 + 0.5^2) * 10 = 2.5
    assert hessian_sensitivity(w, wq, h) == pytest.approx(5.0)


def test_hessian_sensitivity_per_element_h_hand_case():
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    wq = torch.tensor([[1.5, 2.0], [2.0, 4.5]])
    h = torch.tensor([[2.0, 7.0], [3.0, 10.0]])
    # 0.25 * 2 + 0 * 7 + 1 * 3 + 0.25 * 10 = 6.0
    assert hessian_sensitivity(w, wq, h) == pytest.approx(6.0)


def test_hessian_sensitivity_rejects_bad_shapes_and_negative_h():
    w = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="one entry per input column"):
        hessian_sensitivity(w, w, torch.ones(2))
    with pytest.raises(ValueError, match="per weight"):
        hessian_sensitivity(w, w, torch.ones(3, 2))
    with pytest.raises(ValueError, match="cannot be negative"):
        hessian_sensitivity(w, w, torch.tensor([1.0, -1.0, 0.0]))
    with pytest.raises(ValueError, match="one shape"):
        hessian_sensitivity(w, torch.zeros(3, 2), torch.ones(3))


def test_sensitivity_on_real_planes_matches_definition():
    # one 1x8 bcq block, group 8: planes chosen by hand, scales 1, 0.5, 0.25, offset 0
    spec = BlockSpec(out_features=1, in_features=8, bits_min=1, bits_max=3, group_size=8)
    bits = torch.tensor([[[1, 0, 1, 0, 1, 1, 0, 0]], [[1, 1, 0, 0, 1, 0, 1, 0]], [[0, 0, 0, 1, 1, 1, 1, 1]]])
    planes = pack_bits(bits)  # [3, 1, 1]
    tables = {b: torch.tensor([[[1.0]], [[0.5]], [[0.25]], [[0.0]]])[list(range(b)) + [3]].half() for b in (1, 2, 3)}
    w_ref = dequantize(planes, tables[3], 3, "bcq", 8)  # the 3-bit weight is the reference: s^3 = 0
    h = torch.arange(1.0, 9.0)
    s = sensitivity_by_bits(w_ref, h, spec.bitwidths, lambda b: dequantize(planes, tables[b], b, "bcq", 8))
    assert s[3] == 0.0
    # at 2 bits the third plane (+-0.25) is missing everywhere: s = 0.0625 * sum(h) = 0.0625 * 36
    assert s[2] == pytest.approx(0.0625 * 36)
    # at 1 bit planes 2 and 3 are missing: error = 0.5*(2b1-1) + 0.25*(2b2-1)
    err = 0.5 * (2 * bits[1, 0].float() - 1) + 0.25 * (2 * bits[2, 0].float() - 1)
    assert s[1] == pytest.approx(float((err**2 * h).sum()))


def test_expert_output_hessians_hand_case():
    # identity activation, so act' = 1: f(x) = W_down ((W_gate x) * (W_up x))
    x = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    w_gate = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # g = x: [[1, 2], [3, 0]]
    w_up = torch.tensor([[1.0, 1.0], [0.0, 2.0]])  # u = [[3, 4], [3, 0]]
    w_down = torch.tensor([[1.0, 2.0], [0.0, 1.0]])  # column norms^2 c = (1, 5)
    h = expert_output_hessians(x, w_gate, w_up, w_down, lambda z: z)
    # gate: c_n mean_t u_tn^2 x_tk^2 -> n=0: mean(9*(1,4), 9*(9,0)) = (45, 18); n=1: 5 * mean(16*(1,4), 0) = (40, 160)
    assert h.gate.flatten().tolist() == pytest.approx([45.0, 18.0, 40.0, 160.0])
    # up: c_n mean_t g_tn^2 x_tk^2 -> n=0: mean((1,4), 9*(9,0)) = (41, 2); n=1: 5 * mean(4*(1,4), 0) = (10, 40)
    assert h.up.flatten().tolist() == pytest.approx([41.0, 2.0, 10.0, 40.0])
    # down: mean_t a_tj^2 with a = g * u = [[3, 8], [9, 0]] -> (45, 32)
    assert h.down.tolist() == pytest.approx([45.0, 32.0])
    with pytest.raises(ValueError, match="do not form an expert"):
        expert_output_hessians(x, w_gate, w_up, w_down.T[:1], lambda z: z)
    # loss-weighted: F [T, H] weights token t's output dimension m; c_tn = F_t . W_down[:, n]^2
    f = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # c = [[1, 4], [0, 2]]
    h = expert_output_hessians(x, w_gate, w_up, w_down, lambda z: z, out_weight=f)
    # gate: mean_t c_tn u_tn^2 x_tk^2 -> t0 gives n=0 (9, 36), n=1 4*16*(1, 4); t1 gives 0 (c=0 or u=0)
    assert h.gate.flatten().tolist() == pytest.approx([4.5, 18.0, 32.0, 128.0])
    # up: mean_t c_tn g_tn^2 x_tk^2 -> t0 gives n=0 (1, 4), n=1 4*4*(1, 4); t1 gives 0
    assert h.up.flatten().tolist() == pytest.approx([0.5, 2.0, 8.0, 32.0])
    # down [H, I]: mean_t F_tm a_tj^2 -> m=0: t0 (9, 64) / 2; m=1: t1 2*(81, 0) / 2
    assert h.down.flatten().tolist() == pytest.approx([4.5, 32.0, 81.0, 0.0])
    with pytest.raises(ValueError, match="out_weight"):
        expert_output_hessians(x, w_gate, w_up, w_down, lambda z: z, out_weight=-f)


def test_activation_derivative_matches_silu_closed_form():
    z = torch.linspace(-8, 8, 101, dtype=torch.float64)
    sig = torch.sigmoid(z)
    assert torch.allclose(activation_derivative(torch.nn.functional.silu, z), sig * (1 + z * (1 - sig)), atol=1e-8)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("proj", ["gate", "up", "down"])
def test_expert_output_sensitivity_is_the_output_error_of_one_weight(proj, weighted):
    """One perturbed weight has no cross terms: s must equal the measured mean (loss-weighted) squared change
    of the expert's output (first order), for gate, up and down alike, i.e. every projection on one scale."""
    torch.manual_seed(0)
    x = torch.randn(64, 6, dtype=torch.float64)
    w = {"gate": torch.randn(4, 6, dtype=torch.float64), "up": torch.randn(4, 6, dtype=torch.float64),
         "down": torch.randn(6, 4, dtype=torch.float64) * 3}
    f = torch.rand(64, 6, dtype=torch.float64) ** 2 if weighted else torch.ones(64, 6, dtype=torch.float64)
    act = torch.nn.functional.silu

    def out(ws):
        return (act(x @ ws["gate"].T) * (x @ ws["up"].T)) @ ws["down"].T

    h = expert_output_hessians(x, w["gate"], w["up"], w["down"], act, f if weighted else None)
    wq = dict(w)
    wq[proj] = w[proj].clone()
    wq[proj][1, 2] += 1e-4
    measured = float((f * (out(wq) - out(w)).pow(2)).sum(1).mean())
    predicted = hessian_sensitivity(w[proj], wq[proj], getattr(h, proj))
    assert predicted == pytest.approx(measured, rel=1e-3)


def test_global_damage_freed_bytes_and_sum():
    t = SensitivityTable({2: 9.0, 3: 4.0, 4: 5.0})  # non-monotone on purpose
    assert t.global_damage(3, 2) == 5.0
    assert t.global_damage(4, 3) == 0.0  # max(4 - 5, 0)
    assert (t + SensitivityTable({2: 1.0, 3: 1.0, 4: 1.0})).s(2) == 10.0
    with pytest.raises(KeyError, match="no sensitivity stored for 5 bits"):
        t.s(5)
    with pytest.raises(ValueError, match="finite and >= 0"):
        SensitivityTable({2: -1.0})
    spec = BlockSpec(out_features=16, in_features=128, bits_min=2, bits_max=8, group_size=64)
    # M^b = b * 16*128/8 + (b+1)*16*2*2  ->  M^4 - M^3 = 256 + 64
    assert freed_bytes(spec, 4, 3) == 320
    with pytest.raises(ValueError, match="outside the stored range"):
        freed_bytes(spec, 9, 3)


# ---- routing mass and buckets ----------------------------------------------------------------------
def test_routing_mass_eq1_hand_case():
    ids = torch.tensor([[0, 1], [1, 2], [0, -1]])
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [1.0, 0.5]])  # the -1 slot is ignored
    m = routing_mass(w, ids, 3)
    total = 0.6 + 0.4 + 0.7 + 0.3 + 1.0
    assert m.tolist() == pytest.approx([1.6 / total, 1.1 / total, 0.3 / total])


def test_routing_stats_ema_and_prior():
    stats = RoutingStats.from_masses(np.array([[0.5, 0.5]]), prior_tokens=10.0, horizon_tokens=10.0)
    assert stats.mass().tolist() == [[0.5, 0.5]]
    snap = RoutingSnapshot(np.array([[10.0, 0.0]]), np.array([[10, 0]]), np.array([10]))
    stats.fold(snap)
    d = math.exp(-1.0)  # 10 weight units over a horizon of 10
    expect0 = (5 * d + 10) / (10 * d + 10)
    assert stats.mass()[0, 0] == pytest.approx(expect0)
    assert stats.version == 1
    stats.fold(RoutingSnapshot(np.zeros((1, 2)), np.zeros((1, 2), np.int64), np.zeros(1, np.int64)))
    assert stats.version == 1  # nothing seen, nothing changes
    with pytest.raises(ValueError, match="snapshot shape"):
        stats.fold(RoutingSnapshot(np.zeros((2, 2)), np.zeros((2, 2), np.int64), np.zeros(2, np.int64)))


def test_ema_does_not_depend_on_batch_split():
    a = RoutingStats.from_masses(np.array([[0.25, 0.75]]), 8.0, 16.0)
    b = RoutingStats.from_masses(np.array([[0.25, 0.75]]), 8.0, 16.0)
    a.fold(RoutingSnapshot(np.array([[4.0, 0.0]]), np.zeros((1, 2), np.int64), np.array([4])))
    # the same 4 units in two halves decay the prior equally; only the order inside the batch differs
    b.fold(RoutingSnapshot(np.array([[2.0, 0.0]]), np.zeros((1, 2), np.int64), np.array([2])))
    b.fold(RoutingSnapshot(np.array([[2.0, 0.0]]), np.zeros((1, 2), np.int64), np.array([2])))
    assert abs(a.mass()[0, 0] - b.mass()[0, 0]) < 0.02


def test_bucket_thresholds_and_labels():
    x = np.array([0.1, 0.2, 0.5, 1.0, 1.0, 1.2, 2.0, 2.0])
    hot, cold = bucket_thresholds(x, hot_fraction=0.25, cold_fraction=0.25)
    assert (hot, cold) == (2.0, 0.5)
    cfg = BucketConfig(hot, cold, {"hot": 2.0, "warm": 1.0, "cold": 0.5}, default_floor_stages(2, 8))
    assert [cfg.bucket(v) for v in x] == ["cold", "cold", "warm", "warm", "warm", "warm", "hot", "hot"]
    mu = bucket_multipliers(x, hot, cold)
    assert mu == pytest.approx({"hot": 2.0, "warm": (0.5 + 1 + 1 + 1.2) / 4, "cold": 0.15})


def test_floor_stages_shape_and_validation():
    st = default_floor_stages(2, 8)
    assert st[0] == {"hot": 7, "warm": 6, "cold": 5}
    assert st[-1] == {"hot": 2, "warm": 2, "cold": 2}
    for a, b in zip(st, st[1:]):
        assert all(b[k] <= a[k] for k in a)
    with pytest.raises(ValueError, match="raises a floor"):
        BucketConfig(1, 0, {"hot": 1, "warm": 1, "cold": 1}, ({"hot": 3, "warm": 3, "cold": 3}, {"hot": 4, "warm": 2, "cold": 2}))
    with pytest.raises(ValueError, match="mu"):
        BucketConfig(1, 0, {"hot": 0, "warm": 1, "cold": 1}, st)


def test_block_buckets_move_with_online_mass():
    cfg = BucketConfig(1.5, 0.5, {"hot": 2, "warm": 1, "cold": 0.5}, default_floor_stages(2, 4))
    stats = RoutingStats.from_masses(np.array([[0.7, 0.2, 0.1, 0.0]]), prior_tokens=4.0, horizon_tokens=2.0)
    b = BlockBuckets.from_stats(cfg, stats.normalized_mass())
    assert [b.bucket(0, e) for e in range(4)] == ["hot", "warm", "cold", "cold"]
    assert b.bucket(0, 4) == "hot"  # a fused shared expert (index past the routed ones)
    stats.fold(RoutingSnapshot(np.array([[0.0, 0.0, 0.0, 100.0]]), np.zeros((1, 4), np.int64), np.array([100])))
    b = BlockBuckets.from_stats(cfg, stats.normalized_mass())
    assert b.bucket(0, 3) == "hot" and b.bucket(0, 0) == "cold"


# ---- prompt residual -------------------------------------------------------------------------------
def test_routed_input_features_hand_case():
    hidden = torch.tensor([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0]])  # norms 5, 1, 10
    ids = torch.tensor([[0, 1], [0, 2], [1, 0]])
    w = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]])
    sums = routed_input_sums(hidden, ids, w, 3)
    phi = features_from_sums(sums)
    # expert 0: weights (0.5, 1.0, 0.75) on norms (5, 1, 10)
    wsum = 2.25
    assert phi[0, 0] == pytest.approx((2.5 + 1 + 7.5) / wsum)
    assert phi[0, 1] == pytest.approx(math.sqrt((0.5 * 25 + 1 + 0.75 * 100) / wsum))
    assert phi[0, 2] == pytest.approx(10.0)
    # expert 2 has weight 0 only: no evidence
    assert np.isnan(phi[2]).all()


def test_observer_accumulates_across_batches_and_drains():
    obs = RoutingObserver(num_layers=2, num_experts=3)
    h = torch.tensor([[3.0, 4.0]])
    obs.record(1, h, torch.tensor([[0, 2]]), torch.tensor([[0.5, 0.5]]))
    obs.record(1, 2 * h, torch.tensor([[0, 1]]), torch.tensor([[1.0, 0.0]]))
    t = obs.drain()
    assert t.routing.weight_sums[1].tolist() == pytest.approx([1.5, 0.0, 0.5])
    assert t.routing.counts[1].tolist() == [2, 1, 1]
    assert t.routing.tokens.tolist() == [0, 2]
    assert t.phi_raw[1, 0].tolist() == pytest.approx([(2.5 + 10) / 1.5, math.sqrt((12.5 + 100) / 1.5), 10.0])
    assert np.isnan(t.phi_raw[0]).all()
    assert obs.drain().routing.weight_sums.sum() == 0  # reset


def test_fit_head_recovers_a_linear_law_and_confidence():
    rng = np.random.default_rng(0)
    phi = rng.uniform(0.5, 1.5, size=(40, 3))
    rho = 0.8 * phi[:, 0] + 1.2 * phi[:, 1] - 0.3 * phi[:, 2] - 1.0
    head = fit_head(phi, rho, ridge=0.0)
    assert head.w == pytest.approx((0.8, 1.2, -0.3), abs=1e-6)
    assert head.a == pytest.approx(-1.0, abs=1e-6)
    assert head.confidence == pytest.approx(1.0, abs=1e-9)
    noise = fit_head(phi, rng.normal(size=40))
    assert noise.confidence < 0.2  # no signal: leave-one-out R^2 near or below 0, clipped
    with pytest.raises(ValueError, match="at least 5"):
        fit_head(phi[:3], rho[:3])


def test_eta_eq6_hand_case():
    head = ResidualHead(w=(1.0, 0.0, 0.0), a=-1.0, confidence=0.5, rho_min=-0.5, rho_max=0.4, num_samples=10)
    phi = np.array([[1.2, 0, 0], [3.0, 0, 0], [0.0, 0, 0], [np.nan, np.nan, np.nan]])
    eta = head.eta(phi, alpha=2.0)
    # rho = 0.2, 2.0 -> clip 0.4, -1.0 -> clip -0.5, NaN -> eta 1
    assert eta.tolist() == pytest.approx([math.exp(2 * 0.5 * 0.2), math.exp(0.4), math.exp(-0.5), 1.0])
    model = PromptResidualModel({"w13:4->3": head}, np.ones((1, 1, 3)))
    assert model.eta("w2", 4, 3, phi[0], 2.0) == 1.0  # no head for that transition


# ---- calibration file ------------------------------------------------------------------------------
def _calib(bits=(2, 4)) -> CalibrationData:
    rng = np.random.default_rng(1)
    sens = {
        (l, e, p): SensitivityTable({b: float(rng.uniform(0, 1) * (bits[1] + 1 - b)) for b in range(bits[0], bits[1] + 1)})
        for l in range(2) for e in range(3) for p in ("w13", "w2")
    }
    ref = rng.uniform(1, 2, size=(2, 3, 3))
    ref[1, 2] = np.nan  # an expert never routed during calibration
    return CalibrationData(
        ap=APIdentity("bcq", bits[0], bits[1], "abc"),
        num_layers=2,
        num_experts=3,
        sensitivity=sens,
        routing_mass=np.full((2, 3), 1 / 3),
        buckets=BucketConfig(1.2, 0.8, {"hot": 1.5, "warm": 1.0, "cold": 0.5}, default_floor_stages(*bits)),
        residual=PromptResidualModel({"w2:4->3": ResidualHead((0.1, 0.2, 0.3), 0.0, 0.7, -1, 1, 9)}, ref),
        source={"text": "x"},
    )


def test_calibration_roundtrip_and_validation(tmp_path):
    c = _calib()
    path = c.save(tmp_path / "calibration.json")
    d = CalibrationData.load(tmp_path)
    assert d.sensitivity == c.sensitivity
    assert np.array_equal(np.isnan(d.residual.ref_norm), np.isnan(c.residual.ref_norm))
    assert d.residual.heads == c.residual.heads and d.buckets == c.buckets
    d.check_matches(APIdentity("bcq", 2, 4, "abc"))
    with pytest.raises(CalibrationError, match="config_sha256"):
        d.check_matches(APIdentity("bcq", 2, 4, "other"))

    raw = json.loads(path.read_text())
    raw["version"] = 99
    with pytest.raises(CalibrationError, match="version 99 is not supported"):
        CalibrationData.from_json(raw)
    raw["version"] = 1  # w13 sensitivities in gate/up units: refused with the reason and the fix
    with pytest.raises(CalibrationError, match=r"version 1 is not supported.*gate/up output units.*re-run `pagedweight calibrate`"):
        CalibrationData.from_json(raw)
    raw["version"] = 2  # unweighted expert-output errors: layers on different scales
    with pytest.raises(CalibrationError, match=r"version 2 is not supported.*grow ~100x with depth.*re-run `pagedweight calibrate`"):
        CalibrationData.from_json(raw)
    raw = json.loads(path.read_text())
    raw["sensitivity_units"] = "expert_output"
    with pytest.raises(CalibrationError, match="sensitivity_units"):
        CalibrationData.from_json(raw)
    raw = json.loads(path.read_text())
    del raw["routing"]
    with pytest.raises(CalibrationError, match="missing field 'routing'"):
        CalibrationData.from_json(raw)
    raw = json.loads(path.read_text())
    raw["sensitivity"][0]["s"].pop("3")
    with pytest.raises(CalibrationError, match="covers bits"):
        CalibrationData.from_json(raw)
    raw = json.loads(path.read_text())
    raw["routing"]["mass"] = [[0.5, 0.5]]
    with pytest.raises(CalibrationError, match="routing.mass has shape"):
        CalibrationData.from_json(raw)
    with pytest.raises(CalibrationError, match="no calibration file"):
        CalibrationData.load(tmp_path / "nope")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CalibrationError, match="not valid JSON"):
        CalibrationData.load(tmp_path / "bad.json")


def test_load_for_checkpoint_checks_the_manifest(tmp_path):
    _calib().save(tmp_path / "calibration.json")
    manifest = {"format": "pagedweight-ap", "table_kind": "bcq", "bits_min": 2, "bits_max": 4,
                "model": {"config_sha256": "abc"}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert load_for_checkpoint(tmp_path).num_experts == 3
    manifest["bits_max"] = 8
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CalibrationError, match="bits_max=4, this one has 8"):
        load_for_checkpoint(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(CalibrationError, match="not a valid AP manifest"):
        load_for_checkpoint(tmp_path)
