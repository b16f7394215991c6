"""The one object the MoE forward feeds for the quality policy: routing weights and routed-input norms.

The runtime's Observation carries only cumulative routing counts. The quality policy also needs routing
*weights* (eq. 1 is a weight share) and the norms of the routed inputs (phi of the prompt residual), which
only the MoE forward has. The MoE method calls `record(...)` once per layer per forward; it only adds into
preallocated device tensors (no host sync, fixed addresses, so it is CUDA-graph safe). The policy calls
`drain()` at a scheduler boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedweight.planner.prompt_residual import RoutedInputAccumulator
from pagedweight.planner.routing_stats import RoutingRecorder, RoutingSnapshot


@dataclass
class ObservedTraffic:
    routing: RoutingSnapshot
    phi_raw: np.ndarray  # [L, E, 3]; NaN for experts that were not routed since the last drain


class RoutingObserver:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str = "cpu") -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._routing = RoutingRecorder(num_layers, num_experts, device)
        self._inputs = RoutedInputAccumulator(num_layers, num_experts, device)
        self.records = 0  # host-side count of record() calls (tells the policy whether it is wired)

    def record(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """hidden [T, H] is the MoE layer input; topk_ids/topk_weights [T, k] the router's choice."""
        self._routing.record(layer, topk_weights, topk_ids)
        self._inputs.record(layer, hidden, topk_ids, topk_weights)
        self.records += 1

    def drain(self) -> ObservedTraffic:
        return ObservedTraffic(self._routing.drain(), self._inputs.drain())
