"""`make_policy`: a policy by name outside a server (tests, tools), built by the registry (planner/registry.py).

A server builds its policy in `serving.builder.make_runtime_policy_choice`, from the same registry, with its runtime
(the uncalibrated policy plans over the runtime's page table, the quality policy gets a RoutingObserver the MoE
forward feeds).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pagedweight.planner.calibration import CalibrationData
from pagedweight.planner.observer import RoutingObserver
from pagedweight.planner import registry as policy_registry
from pagedweight.planner.registry import PolicyInputs
from pagedweight.runtime.planner_api import Policy


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
    inputs = PolicyInputs(calibration=calib, options=dict(options or {}), observer=observer)
    return policy_registry.POLICY_REGISTRY.build(name, inputs)[0]
