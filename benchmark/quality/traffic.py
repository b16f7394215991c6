"""Routing traffic of served text: what the MoE forward feeds the planner while it serves.

`TrafficRecorder` hooks every fused experts module (pre-hook, as pagedweight.planner.moe_capture does)
and feeds a real `RoutingObserver` (routing weights + routed-input norms, for the quality policy) and
cumulative routing counts per (layer, expert) (`Observation.routing_counts`, for the hotness policy).
`ReplayObserver` hands the recorded traffic to any number of fresh policies: each drains a copy.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch

from pagedweight.planner.moe_capture import ExpertsPreHooks, find_moe_layers
from pagedweight.planner.observer import ObservedTraffic, RoutingObserver


class TrafficRecorder(ExpertsPreHooks):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(find_moe_layers(model))
        num_layers = int(model.config.num_hidden_layers)
        self.observer = RoutingObserver(num_layers, self.layers[0].num_experts)
        self.counts: dict[tuple[int, int], float] = defaultdict(float)
        self.tokens = 0

    def on_call(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self.observer.record(layer, hidden, topk_ids, topk_weights)
        for e, c in zip(*torch.unique(topk_ids, return_counts=True)):
            self.counts[(layer, int(e))] += float(c)
        if layer == self.layers[0].layer:
            self.tokens += hidden.shape[0]

    def snapshot(self) -> "RecordedTraffic":
        return RecordedTraffic(self.observer.drain(), dict(self.counts), self.tokens,
                               self.observer.num_layers, self.observer.num_experts)


class RecordedTraffic:
    def __init__(self, traffic: ObservedTraffic, counts: dict, tokens: int, num_layers: int, num_experts: int):
        self.traffic, self.counts, self.tokens = traffic, counts, tokens
        self.num_layers, self.num_experts = num_layers, num_experts

    def observer(self) -> "ReplayObserver":
        return ReplayObserver(self)


class ReplayObserver:
    """Quacks like RoutingObserver for QualityPolicy: one recorded drain, then nothing new."""

    def __init__(self, recorded: RecordedTraffic) -> None:
        self.num_layers, self.num_experts = recorded.num_layers, recorded.num_experts
        self._traffic = recorded.traffic
        self.records = 1

    def drain(self) -> ObservedTraffic:
        return copy.deepcopy(self._traffic)


@torch.inference_mode()
def record_traffic(model: torch.nn.Module, token_windows: torch.Tensor, progress: bool = True,
                   desc: str = "served text routing") -> RecordedTraffic:
    """Run the decoder over [n, seq] windows and record routing (no LM head)."""
    from tqdm.auto import tqdm

    decoder = getattr(model, "model", model)
    with TrafficRecorder(model) as rec:
        for w in tqdm(token_windows, desc=desc, disable=not progress, unit="window"):
            decoder(input_ids=w.unsqueeze(0), use_cache=False)
    return rec.snapshot()
