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


# SGLang 0.5.17's counter (python/sglang/srt/observability/metrics_collector.py: `num_retracted_reqs_total`
# is the attribute, `sglang:num_retracted_requests_total` the exported name).
RETRACTED_COUNTER = "sglang:num_retracted_requests_total"


def retracted_requests(metrics: dict[str, float]) -> int:
    """Requests SGLang retracted (decode ran out of KV) since start."""
    if RETRACTED_COUNTER in metrics:
        return int(metrics[RETRACTED_COUNTER])
    # A labelled counter is exported only after its first increment: none yet means zero retractions.
    # Check `retractions_in_log` against it: a renamed counter would otherwise read as zero.
    if any(k.startswith("sglang:") for k in metrics):
        return 0
    raise KeyError(f"{RETRACTED_COUNTER} is not in /metrics: was the server started with --enable-metrics?")


def retractions_in_log(lines: list[str]) -> int:
    """Requests retracted according to the scheduler's log ("KV cache pool is full. Retract requests.
    #retracted_reqs: N"), the cross-check of the counter."""
    total = 0
    for line in lines:
        if "Retract requests" in line and "#retracted_reqs:" in line:
            total += int(line.split("#retracted_reqs:", 1)[1].split(",", 1)[0])
    return total
