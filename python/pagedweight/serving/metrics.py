"""Prometheus gauges for PagedWeight, exported through SGLang's /metrics when --enable-metrics is on.

SGLang runs prometheus_client in multiprocess mode (the HTTP server reads the scheduler processes' files), so
the gauges are created in the scheduler process with multiprocess_mode="mostrecent", like SGLang's own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# Gauges are refreshed at most this often (the values come from host-side bookkeeping: cheap, but not free).
REFRESH_S = 0.5
METRIC_PREFIX = "sglang:pagedweight_"
# gauge key (the metric is METRIC_PREFIX + key, label tp_rank) -> its help text; docs/grafana/ charts every one
GAUGES = {
    "weight_bytes": "Expert plane and table bytes resident on the device",
    "weight_desired_bytes": "Expert bytes the current plans ask for",
    "kv_capacity_tokens": "Token slots the KV cache may use now",
    "mean_committed_bits": "Mean committed bitwidth over expert blocks",
    "transitions_total": "Bitwidth transitions committed since start (offloads + reloads)",
    "queued_blocks": "Blocks whose desired bitwidth differs from the committed one",
    "budget_free_bytes": "Bytes of the PagedWeight budget not held by weights or the KV cache",
}


@dataclass
class PagedWeightMetrics:
    tp_rank: int
    _gauges: dict = field(default_factory=dict)
    _at: float = -1.0

    def __post_init__(self) -> None:
        from prometheus_client import Gauge

        for key, doc in GAUGES.items():
            self._gauges[key] = Gauge(
                name=METRIC_PREFIX + key,
                documentation=doc,
                labelnames=["tp_rank"],
                multiprocess_mode="mostrecent",
            )

    def update(self, state: Any, capacity_tokens: int) -> None:
        now = time.monotonic()
        if now - self._at < REFRESH_S:
            return
        self._at = now
        runtime = state.runtime
        table = runtime.table
        counters = runtime.pager.counters
        values = {
            "weight_bytes": table.resident_bytes(),
            "weight_desired_bytes": table.desired_bytes(),
            "kv_capacity_tokens": capacity_tokens,
            "mean_committed_bits": sum(r.committed_bits for r in table) / max(len(table), 1),
            "transitions_total": counters.transitions,
            "queued_blocks": sum(1 for r in table if r.desired_bits != r.committed_bits),
            "budget_free_bytes": runtime.budget.free,
        }
        for key, value in values.items():
            self._gauges[key].labels(tp_rank=str(self.tp_rank)).set(value)
