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

from pagedweight.planner.moe_capture import find_moe_layers, routed_call_args
from pagedweight.planner.observer import ObservedTraffic, RoutingObserver


class TrafficRecorder:
    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = find_moe_layers(model)
        num_layers = int(model.config.num_hidden_layers)
        self.observer = RoutingObserver(num_layers, self.layers[0].num_experts)
        self.counts: dict[tuple[int, int], float] = defaultdict(float)
        self.tokens = 0
        self._handles: list = []

    def __enter__(self) -> "TrafficRecorder":
        for ref in self.layers:
            self._handles.append(ref.module.register_forward_pre_hook(self._hook(ref.layer), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def hook(module, args, kwargs):
            hidden, ids, weights = routed_call_args(layer, args, kwargs)
            hidden = hidden.detach().reshape(-1, hidden.shape[-1]).float()
            ids = ids.detach().reshape(hidden.shape[0], -1).long()
            weights = weights.detach().reshape(ids.shape).float()
            self.observer.record(layer, hidden, ids, weights)
            for e, c in zip(*torch.unique(ids, return_counts=True)):
                self.counts[(layer, int(e))] += float(c)
            if layer == self.layers[0].layer:
                self.tokens += hidden.shape[0]
            return None

        return hook

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
