"""The policy registry is the one list of policy names: a new policy is its class plus one registry entry, and the
flag parser, the config check, the serving loop's builder and the offline make_policy all take it from there."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from pagedweight import config as pw_config
from pagedweight.format.layout import BlockSpec
from pagedweight.planner import registry
from pagedweight.planner.factory import make_policy
from pagedweight.planner.registry import POLICY_REGISTRY, PolicyEntry, PolicyInputs, PolicyRegistry, policy_options
from pagedweight.planner.scripted_policy import ScriptedPolicy
from pagedweight.planner.static_policy import StaticPolicy
from pagedweight.runtime.blocks import BlockKey
from pagedweight.runtime.page_table import WeightPageTable
from pagedweight.runtime.planner_api import Observation, Plan, PlanStep, validate_plan
from pagedweight.serving.builder import make_runtime_policy_choice
from tests.test_planner_policies import make_calib

SPEC = BlockSpec(out_features=32, in_features=128, bits_min=2, bits_max=8, group_size=64, table_kind="ubcq")


def _runtime():
    blocks = [(BlockKey(layer, e, p), SPEC) for layer in range(2) for e in range(3) for p in ("w13", "w2")]
    return SimpleNamespace(table=WeightPageTable(blocks, initial_bits=8, floor_bits=3))


@dataclass(frozen=True)
class LastLayerOptions:
    step_bits: int = 1


class LastLayerFirstPolicy:
    """A test policy: lowers the last layer's blocks first, `step_bits` at a time."""

    def __init__(self, options: LastLayerOptions):
        self.options = options

    def plan(self, table, target_bytes, observation):
        rows = sorted(table, key=lambda r: (-r.key.layer, r.key.sort_key()))
        steps, freed = [], 0
        for r in rows:
            if freed >= target_bytes:
                break
            bits = max(r.floor_bits, r.desired_bits - self.options.step_bits)
            if bits < r.desired_bits:
                steps.append(PlanStep(r.block_id, bits))
                freed += r.bytes_at(r.desired_bits) - r.bytes_at(bits)
        return Plan(tuple(steps), f"last layer first: {freed} B")

    def plan_reload(self, table, budget_bytes, observation):
        return Plan((), "no reloads")

    def refresh(self, table, observation):
        return None


def _last_layer_entry() -> PolicyEntry:
    def build(inputs: PolicyInputs):
        return LastLayerFirstPolicy(policy_options(LastLayerOptions, inputs.options, "last-layer")), "the table's floor"
    return PolicyEntry("last-layer", "the last layer's blocks first (a test policy)", build)


def test_the_flag_config_and_registry_agree():
    assert pw_config.policy_choices() == ("auto", *POLICY_REGISTRY.names())
    assert set(POLICY_REGISTRY.names()) == {"static", "quality", "uncalibrated", "hotness", "scripted"}
    for name in POLICY_REGISTRY.names():
        assert pw_config.PagedWeightConfig(enable=True, policy=name).policy == name
    with pytest.raises(pw_config.PagedWeightConfigError, match="must be one of"):
        pw_config.PagedWeightConfig(enable=True, policy="fastest")


def test_registry_refuses_duplicate_names_and_auto():
    entry = POLICY_REGISTRY.entry("static")
    with pytest.raises(ValueError, match="unique"):
        PolicyRegistry((entry, entry))
    with pytest.raises(ValueError, match="not 'auto'"):
        PolicyRegistry((PolicyEntry("auto", "", entry.build),))
    with pytest.raises(ValueError, match="unknown policy 'fastest'; choose one of"):
        POLICY_REGISTRY.entry("fastest")


def test_every_registered_policy_builds_on_a_runtime(tmp_path):
    runtime = _runtime()
    make_calib(2, 3).save(tmp_path / "calibration.json")
    for name in POLICY_REGISTRY.names():
        if name == "quality":
            continue  # needs stores for its observer; built offline below
        policy, floor = POLICY_REGISTRY.build(name, PolicyInputs(ap_dir=str(tmp_path), runtime=runtime))
        plan = policy.plan(runtime.table, 1, Observation())
        validate_plan(runtime.table, plan, "offload")
        assert floor
    assert isinstance(make_policy("static"), StaticPolicy) and isinstance(make_policy("scripted"), ScriptedPolicy)
    q = make_policy("quality", tmp_path / "calibration.json")
    assert q.calib.num_layers == 2
    with pytest.raises(ValueError, match="pass the runtime"):
        make_policy("uncalibrated")
    with pytest.raises(ValueError, match="unknown option"):
        make_policy("static", options={"x": 1})


def test_a_new_policy_is_one_class_and_one_registry_entry(monkeypatch):
    extended = PolicyRegistry(POLICY_REGISTRY.entries + (_last_layer_entry(),))
    monkeypatch.setattr(registry, "POLICY_REGISTRY", extended)
    # the flag parser and the config check take it
    parser = argparse.ArgumentParser()
    pw_config.add_cli_args(parser)
    args = parser.parse_args(["--paged-weight-policy", "last-layer"])
    cfg = pw_config.PagedWeightConfig(enable=True, policy=args.paged_weight_policy)
    # the serving loop builds it, names it in the startup line, and its plan is valid on the page table
    runtime = _runtime()
    policy, choice = make_runtime_policy_choice(cfg, None, runtime)
    assert isinstance(policy, LastLayerFirstPolicy)
    assert choice.log_line() == ("PagedWeight: policy last-layer (--paged-weight-policy last-layer); "
                                 "floor the table's floor")
    plan = policy.plan(runtime.table, 1, Observation())
    validate_plan(runtime.table, plan, "offload")
    assert [runtime.table.row(s.block_id).key.layer for s in plan.steps] == [1]
    # the offline builder takes its options
    assert make_policy("last-layer", options={"step_bits": 2}).options.step_bits == 2
