"""The policy registry: the one list of `--paged-weight-policy` names, and how a server builds each policy.

A new policy is its own module (a `Policy`: runtime/planner_api.py) plus one `PolicyEntry` in `POLICY_REGISTRY`;
the flag's choices (config.policy_choices), the serving loop and the offline `make_policy` read the names from here.
'auto' is not a policy but a choice between two of them (planner/choice.py).

This module stays light to import (the launcher validates flags with it): each builder imports its policy
when it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedweight.runtime.planner_api import Policy


@dataclass(frozen=True)
class PolicyInputs:
    """What a policy may be built from. A server passes its AP directory, its runtime (page table and stores) and
    the calibration file planner/choice.py found; offline use (tests, tools) passes what it has."""

    ap_dir: Optional[str] = None
    runtime: Any = None  # PagedRuntime, or None offline
    calibration: Any = None  # CalibrationData, or a calibration.json path / AP directory holding one
    floor_bits: Optional[int] = None  # --paged-weight-min-bits
    options: Mapping[str, Any] = field(default_factory=dict)  # the policy's own options dataclass fields
    observer: Any = None  # RoutingObserver the MoE forward feeds ('quality'; a server makes one from the runtime)


@dataclass(frozen=True)
class PolicyEntry:
    """One policy: its flag name, one line on what it does, and its builder (the policy and the floor it plans
    above, as the phrase of the startup log line)."""

    name: str
    summary: str
    build: Callable[[PolicyInputs], tuple[Policy, str]]


@dataclass(frozen=True)
class PolicyRegistry:
    entries: tuple[PolicyEntry, ...]

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names) or "auto" in names:
            raise ValueError(f"policy names must be unique and not 'auto', got {names}")

    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def entry(self, name: str) -> PolicyEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise ValueError(f"unknown policy {name!r}; choose one of {self.names()}")

    def build(self, name: str, inputs: PolicyInputs) -> tuple[Policy, str]:
        return self.entry(name).build(inputs)


def policy_options(cls: type, options: Mapping[str, Any] | None, policy: str) -> Any:
    """`cls(**options)`, refusing names that are not fields of the policy's options dataclass."""
    options = dict(options or {})
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for policy {policy!r}; valid options: {sorted(valid)}")
    return cls(**options)


@dataclass(frozen=True)
class NoOptions:
    """Policies without options."""


def _table_floor(inputs: PolicyInputs) -> str:
    seed = "the checkpoint's seed" if inputs.floor_bits is None else "--paged-weight-min-bits"
    floor = None if inputs.runtime is None else min(row.floor_bits for row in inputs.runtime.table)
    return f"{floor} bits ({seed})"


def _static(inputs: PolicyInputs) -> tuple[Policy, str]:
    from pagedweight.planner.static_policy import StaticPolicy

    policy_options(NoOptions, inputs.options, "static")
    return StaticPolicy(), "none needed: bitwidths are fixed"


def _scripted(inputs: PolicyInputs) -> tuple[Policy, str]:
    from pagedweight.planner.scripted_policy import ScriptedPolicy

    policy_options(NoOptions, inputs.options, "scripted")
    return ScriptedPolicy(), _table_floor(inputs)


def _hotness(inputs: PolicyInputs) -> tuple[Policy, str]:
    from pagedweight.planner.hotness_policy import HotnessOptions, HotnessPolicy

    policy = HotnessPolicy(policy_options(HotnessOptions, inputs.options, "hotness"))
    return policy, f"{_table_floor(inputs)}: cold experts go there under pressure"


def _quality(inputs: PolicyInputs) -> tuple[Policy, str]:
    from pagedweight.planner.calibration import CalibrationData
    from pagedweight.planner.quality_policy import QualityOptions, QualityPolicy

    if inputs.calibration is None:
        raise ValueError(
            "--paged-weight-policy quality needs a calibration: run `pagedweight calibrate --model HF_DIR --ap "
            "AP_DIR --text FILE` (writes AP_DIR/calibration.json) and pass it"
        )
    options = policy_options(QualityOptions, inputs.options, "quality")
    data = inputs.calibration
    if not isinstance(data, CalibrationData):
        data = CalibrationData.load(data)
    observer = inputs.observer
    if observer is None and inputs.runtime is not None:
        from pagedweight.planner.observer import RoutingObserver

        stores = inputs.runtime.stores
        observer = RoutingObserver(max(s.layer_id for s in stores) + 1, max(s.w13.num_experts for s in stores),
                                   stores[0].w13.page_table.device)
        for store in stores:
            store.observer = observer
    policy = QualityPolicy(data, options, observer)
    stages = " > ".join("/".join(str(v) for v in st.values()) for st in data.buckets.floor_stages)
    return policy, (f"hot/warm/cold stages {stages} bits as the pressure needs (calibration), never below "
                    f"{_table_floor(inputs)}")


def _uncalibrated(inputs: PolicyInputs) -> tuple[Policy, str]:
    import os

    from pagedweight.format.weight_errors import WEIGHT_ERRORS_FILENAME, WeightErrors
    from pagedweight.planner.uncalibrated_policy import UncalibratedOptions, UncalibratedPolicy

    if inputs.runtime is None:
        raise ValueError("the uncalibrated policy plans over the runtime's page table; pass the runtime")
    rows = list(inputs.runtime.table)
    errors = None
    if inputs.ap_dir is not None and os.path.isfile(os.path.join(inputs.ap_dir, WEIGHT_ERRORS_FILENAME)):
        errors = WeightErrors.load(inputs.ap_dir)
        spec = rows[0].spec
        errors.check_matches(spec.table_kind, spec.bits_min, spec.bits_max)
    options = policy_options(UncalibratedOptions, {"floor_bits": inputs.floor_bits, **inputs.options}, "uncalibrated")
    policy = UncalibratedPolicy.from_errors(
        errors, [tuple(row.key) for row in rows], min(r.spec.bits_min for r in rows),
        max(r.spec.bits_max for r in rows), min(r.floor_bits for r in rows), options,
    )
    return policy, f"{policy.floor.bits} bits ({policy.floor.reason})"


POLICY_REGISTRY = PolicyRegistry((
    PolicyEntry("static", "no plan changes: every block stays at its committed bitwidth", _static),
    PolicyEntry("quality", "lowest predicted damage per freed byte first (needs a calibration)", _quality),
    PolicyEntry("uncalibrated", "the quality planner over the converter's weight errors, above a floor of known "
                "quality", _uncalibrated),
    PolicyEntry("hotness", "cold experts (by routing traffic) go to the floor first", _hotness),
    PolicyEntry("scripted", "deterministic lowest-layer-first (tests, mechanism experiments)", _scripted),
))
