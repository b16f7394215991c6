"""`make_policy`: build the policy named by `--paged-weight-policy quality|hotness|static`.

'uncalibrated' plans over the runtime's page table and the checkpoint's weight errors, so a server builds it in
`serving_loop.make_runtime_policy_choice` (planner/uncalibrated_policy.py); 'auto' is resolved by planner/choice.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from pagedweight.planner.calibration import CalibrationData
from pagedweight.planner.hotness_policy import HotnessOptions, HotnessPolicy
from pagedweight.planner.observer import RoutingObserver
from pagedweight.planner.quality_policy import QualityOptions, QualityPolicy
from pagedweight.planner.static_policy import StaticPolicy
from pagedweight.runtime.planner_api import Policy

POLICY_NAMES: tuple[str, ...] = ("quality", "hotness", "static")


def _options(cls: type, options: Mapping[str, Any] | None, policy: str) -> Any:
    options = dict(options or {})
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for policy {policy!r}; valid options: {sorted(valid)}")
    return cls(**options)


def make_policy(
    name: str,
    calib: CalibrationData | str | os.PathLike | None = None,
    options: Mapping[str, Any] | None = None,
    observer: RoutingObserver | None = None,
) -> Policy:
    """`calib`: loaded data, or a calibration.json path / AP directory holding one (needed by 'quality').

    `observer`: for 'quality', the RoutingObserver the MoE forward feeds (routing weights and routed-input
    norms); without one the policy uses Observation.routing_counts and no prompt residual.
    """
    if name == "static":
        _options(StaticOptions, options, name)
        return StaticPolicy()
    if name == "hotness":
        return HotnessPolicy(_options(HotnessOptions, options, name))
    if name == "quality":
        if calib is None:
            raise ValueError(
                "--paged-weight-policy quality needs a calibration: run `pagedweight calibrate --model HF_DIR --ap "
                "AP_DIR --text FILE` (writes AP_DIR/calibration.json) and pass it"
            )
        data = calib if isinstance(calib, CalibrationData) else CalibrationData.load(calib)
        return QualityPolicy(data, _options(QualityOptions, options, name), observer)
    raise ValueError(f"unknown policy {name!r}; choose one of {POLICY_NAMES}")


@dataclasses.dataclass(frozen=True)
class StaticOptions:
    """The static policy has no options."""
