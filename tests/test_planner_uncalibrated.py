"""The uncalibrated default: the converter's weight errors, the floor derived from them, the policy that never
plans below it under any pressure, 'auto' choosing it without a calibration, and the startup line naming both."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedweight.config import PagedWeightConfig
from pagedweight.format.layout import BlockSpec
from pagedweight.format.weight_errors import WEIGHT_ERRORS_FILENAME, TensorError, WeightErrors, WeightErrorsError
from pagedweight.planner.choice import choose_policy
from pagedweight.planner.uncalibrated_policy import (
    UncalibratedOptions,
    UncalibratedPolicy,
    assumed_relative_error,
    choose_floor,
)
from pagedweight.runtime.blocks import BlockKey
from pagedweight.runtime.page_table import WeightPageTable
from pagedweight.runtime.planner_api import Observation, validate_plan
from pagedweight.serving.builder import make_runtime_policy_choice
from tests.support.fake_page_table import Row, Table

SPEC = BlockSpec(out_features=32, in_features=128, bits_min=2, bits_max=8, group_size=64, table_kind="ubcq")
OBS = Observation()


def errors_for(layers: int, experts: int, scale: dict | None = None) -> WeightErrors:
    """Relative error 2 * 4^-b per tensor, times scale[(layer, expert)] (default 1)."""
    scale = scale or {}
    tensors = {}
    for layer in range(layers):
        for e in range(experts):
            for p in ("gate", "up", "down"):
                k = scale.get((layer, e), 1.0)
                tensors[(layer, e, p)] = TensorError(10.0, {b: 10.0 * k * assumed_relative_error(b) for b in range(2, 9)})
    return WeightErrors("ubcq", 2, 8, tensors)


def make_table(layers: int, experts: int, bits: int = 8, floor: int = 2) -> Table:
    keys = [BlockKey(layer, e, p) for layer in range(layers) for e in range(experts) for p in ("w13", "w2")]
    return Table([Row(i, k, SPEC, bits, bits, floor, 8) for i, k in enumerate(keys)])


def policy_for(table: Table, errors: WeightErrors | None, **options) -> UncalibratedPolicy:
    rows = list(table)
    return UncalibratedPolicy.from_errors(errors, [tuple(r.key) for r in rows], 2, 8, min(r.floor_bits for r in rows),
                                          UncalibratedOptions(**options))


def test_converter_writes_weight_errors(tmp_path):
    from pagedweight.tools.convert import convert_checkpoint
    from pagedweight.tools.tiny_model import TinyMoESizes, make_tiny_moe

    model = make_tiny_moe(tmp_path / "hf", arch="mixtral", seed=0,
                          sizes=TinyMoESizes(num_layers=2, hidden_size=64, num_experts=4, top_k=2, moe_intermediate_size=64))
    out = convert_checkpoint(model, tmp_path / "ap", table_kind="ubcq", bits_min=2, bits_max=5, group_size=64, seed=0,
                             progress=False)
    errors = WeightErrors.load(out / "pagedweight")
    assert len(errors.tensors) == 2 * 4 * 3 and errors.bitwidths == (2, 3, 4, 5)
    rel = [errors.relative_error(b) for b in errors.bitwidths]
    assert all(a > b > 0 for a, b in zip(rel, rel[1:]))  # more bits, less error
    runtime = errors.runtime_relative()
    assert set(runtime) == {(layer, e, p) for layer in range(2) for e in range(4) for p in ("w13", "w2")}
    errors.check_matches("ubcq", 2, 5)
    with pytest.raises(WeightErrorsError, match="table_kind"):
        errors.check_matches("bcq", 2, 5)


def test_weight_errors_refuse_bad_files(tmp_path):
    with pytest.raises(WeightErrorsError, match="pagedweight convert"):
        WeightErrors.load(tmp_path)
    d = errors_for(1, 1).to_json()
    d["tensors"][0]["sse"].pop("5")
    (tmp_path / WEIGHT_ERRORS_FILENAME).write_text(json.dumps(d))
    with pytest.raises(WeightErrorsError, match="expected"):
        WeightErrors.load(tmp_path)
    assert WeightErrors.from_json(errors_for(1, 2).to_json()) == errors_for(1, 2)


def test_floor_is_the_lowest_bitwidth_under_the_threshold():
    rel = {b: assumed_relative_error(b) for b in range(2, 9)}  # 0.125, 0.031, ...
    f = choose_floor(rel, seed_bits=2, options=UncalibratedOptions(), source="test")
    assert f.bits == 3 and "<= 0.05" in f.reason and "2 bits has 0.12" in f.reason
    assert choose_floor(rel, 2, UncalibratedOptions(max_relative_error=0.01), "test").bits == 4
    assert choose_floor(rel, 5, UncalibratedOptions(), "test").bits == 5  # never below the table's floor
    explicit = choose_floor(rel, 2, UncalibratedOptions(floor_bits=2), "test")
    assert explicit.bits == 2 and "--paged-weight-min-bits 2" in explicit.reason


@pytest.mark.parametrize("errors", [None, "file"])
def test_never_plans_below_the_floor_under_any_pressure(errors):
    table = make_table(3, 4)
    policy = policy_for(table, errors_for(3, 4) if errors else None)
    assert policy.floor.bits == 3
    plan = policy.plan(table, 10**12, OBS)  # far more than every block at 2 bits would free
    validate_plan(table, plan, "offload")
    table.apply(plan)
    assert {r.desired_bits for r in table} == {3}  # everything the floor allows, nothing below it
    assert "INFEASIBLE" in plan.reason
    again = policy.plan(table, 10**6, Observation(now_s=5.0, routing_counts={(0, 0): 1e6}))
    assert not again.steps
    assert policy.stats.version == 0  # traffic is not folded: it could not change a plan


def test_blocks_that_lose_more_per_bit_keep_their_bits():
    table = make_table(2, 4)
    noisy = {(0, 1): 20.0, (1, 3): 20.0}  # these experts' weights lose 20x more per bit
    policy = policy_for(table, errors_for(2, 4, noisy))
    full = sum(r.bytes_at(8) for r in table)
    target = full - sum(r.bytes_at(5) for r in table)  # uniform 5 bits' worth
    plan = policy.plan(table, target, OBS)
    table.apply(plan)
    noisy_bits = [r.desired_bits for r in table if (r.key.layer, r.key.expert) in noisy]
    other_bits = [r.desired_bits for r in table if (r.key.layer, r.key.expert) not in noisy]
    assert min(noisy_bits) > max(other_bits) >= 3


def test_auto_chooses_quality_with_a_calibration_else_uncalibrated(tmp_path):
    none = choose_policy("auto", str(tmp_path))
    assert none.name == "uncalibrated" and "no calibration.json" in none.why and "pagedweight calibrate" in none.why
    assert choose_policy("auto", None).name == "uncalibrated"
    (tmp_path / "calibration.json").write_text("{}")
    found = choose_policy("auto", str(tmp_path))
    assert found.name == "quality" and found.calibration == str(tmp_path / "calibration.json")
    assert choose_policy("hotness", str(tmp_path)).why == "--paged-weight-policy hotness"


def _runtime(floor: int | None = None):
    blocks = [(BlockKey(layer, e, p), SPEC) for layer in range(2) for e in range(3) for p in ("w13", "w2")]
    return SimpleNamespace(table=WeightPageTable(blocks, initial_bits=8, floor_bits=floor))


def test_startup_line_names_policy_and_floor(tmp_path):
    errors_for(2, 3).save(tmp_path)
    policy, choice = make_runtime_policy_choice(PagedWeightConfig(enable=True), str(tmp_path), _runtime())
    line = choice.log_line()
    assert isinstance(policy, UncalibratedPolicy)
    assert line.startswith("PagedWeight: policy uncalibrated (auto: no calibration.json in")
    assert "floor 3 bits (lowest bitwidth whose relative weight error" in line and WEIGHT_ERRORS_FILENAME in line

    policy, choice = make_runtime_policy_choice(PagedWeightConfig(enable=True, floor_bits=4), str(tmp_path), _runtime(4))
    assert policy.floor.bits == 4 and "floor 4 bits (--paged-weight-min-bits 4)" in choice.log_line()

    _, choice = make_runtime_policy_choice(PagedWeightConfig(enable=True, policy="hotness"), str(tmp_path), _runtime())
    assert "policy hotness (--paged-weight-policy hotness); floor 2 bits (the checkpoint's seed)" in choice.log_line()


def test_startup_without_weight_errors_says_so(tmp_path):
    _, choice = make_runtime_policy_choice(PagedWeightConfig(enable=True), str(tmp_path), _runtime())
    assert "floor 3 bits" in choice.log_line() and "no weight_errors.json" in choice.log_line()
    with pytest.raises(WeightErrorsError, match="table_kind"):
        WeightErrors("bcq", 2, 8, errors_for(2, 3).tensors).save(tmp_path)
        make_runtime_policy_choice(PagedWeightConfig(enable=True), str(tmp_path), _runtime())
