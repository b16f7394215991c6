"""Read counters from a server's Prometheus text (`/metrics`, needs `--enable-metrics`)."""

from __future__ import annotations

import math

import requests


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value summed over its label sets (comment lines and histograms' buckets included
    under their own names)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            v = float(value)
        except ValueError:
            continue
        if math.isnan(v):
            continue
        out[name] = out.get(name, 0.0) + v
    return out


def scrape(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    r = requests.get(url + "/metrics", timeout=timeout_s)
    r.raise_for_status()
    return parse_prometheus(r.text)


def retracted_requests(metrics: dict[str, float]) -> int:
    """Requests SGLang retracted (decode ran out of KV) since start: `sglang:num_retracted_reqs_total`."""
    for name in ("sglang:num_retracted_reqs_total", "sglang:num_retracted_reqs_total_total"):
        if name in metrics:
            return int(metrics[name])
    # A labelled counter is exported only after its first increment: none yet means zero retractions.
    if any(k.startswith("sglang:") for k in metrics):
        return 0
    raise KeyError("sglang:num_retracted_reqs_total is not in /metrics: was the server started with --enable-metrics?")
