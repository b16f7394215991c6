"""Durations of a repeated operation (a scheduler iteration's PagedWeight step, its TP agreement), for the
state endpoint: count, mean and max over every sample, and exact percentiles over the most recent ones."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

RECENT = 4096  # samples the percentiles are taken over


@dataclass
class LatencyHistogram:
    count: int = 0
    total_us: float = 0.0
    max_us: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def add(self, us: float) -> None:
        self.count += 1
        self.total_us += us
        self.max_us = max(self.max_us, us)
        self.recent.append(us)

    def quantile(self, q: float) -> Optional[float]:
        """The q-quantile (0..1) of the recent samples, nearest rank; None before the first sample."""
        if not self.recent:
            return None
        xs = sorted(self.recent)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs) - 1e-9) - 1))]

    def state(self) -> dict:
        r = lambda v: None if v is None else round(v, 1)  # noqa: E731
        return {
            "count": self.count,
            "mean_us": r(self.total_us / self.count) if self.count else None,
            "p50_us": r(self.quantile(0.5)),
            "p99_us": r(self.quantile(0.99)),
            "max_us": r(self.max_us) if self.count else None,
            "window": len(self.recent),
        }
