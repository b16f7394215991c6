"""A timeline of what a running server holds: KV capacity, weight bytes, committed bitwidths, GPU memory.

A background thread polls `/get_server_info` (SGLang's own `memory_usage` and, with PagedWeight, the
`paged_weight` state of the first scheduler) and keeps one compact `StateSample` per poll. The committed
bitwidth of every block is kept as a string of digits, one per block in the state endpoint's block order,
stored only when it changed since the previous sample (so a long quiet timeline stays small).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import requests


@dataclass
class StateSample:
    t_s: float  # seconds since the sampler started
    token_capacity: Optional[int]  # SGLang's KV capacity in tokens (max_total_num_tokens)
    kv_bytes: Optional[int] = None  # PagedWeight: bytes the KV side holds in the budget
    weight_bytes: Optional[int] = None  # PagedWeight: expert bytes resident on the device
    free_budget_bytes: Optional[int] = None
    mean_bits: Optional[float] = None  # mean committed bitwidth over blocks
    histogram: Optional[dict[str, int]] = None  # committed bits -> blocks
    transitions: Optional[int] = None
    queued_blocks: Optional[int] = None
    gpu_free_bytes: Optional[int] = None  # torch.cuda.mem_get_info() in the scheduler process
    block_bits: Optional[str] = None  # one digit per block; None when unchanged since the last sample
    # TP > 1: every rank's KV capacity and transitions (from the ranks' digests), and digest mismatches so far.
    tp_kv_capacity_tokens: Optional[list[int]] = None
    tp_transitions: Optional[list[int]] = None
    tp_digest_mismatches: Optional[int] = None


def summarize_state(info: dict[str, Any], t_s: float) -> StateSample:
    """One sample from a `/get_server_info` reply (works for stock SGLang and for PagedWeight)."""
    states = info.get("internal_states") or [{}]
    st = states[0]
    pw = st.get("paged_weight")
    capacity = None
    mem = st.get("memory_usage") or {}
    if "token_capacity" in mem:
        capacity = int(mem["token_capacity"])
    elif info.get("max_total_num_tokens") is not None:
        capacity = int(info["max_total_num_tokens"])
    sample = StateSample(t_s=round(t_s, 3), token_capacity=capacity)
    if not pw:
        return sample
    kv = pw.get("elastic_kv") or {}
    if kv.get("capacity_tokens") is not None:
        sample.token_capacity = int(kv["capacity_tokens"])
    budget = pw.get("budget") or {}
    sample.kv_bytes = (budget.get("used") or {}).get("kv")
    sample.free_budget_bytes = budget.get("free")
    sample.weight_bytes = pw.get("weights_resident_bytes")
    hist = {str(k): int(v) for k, v in (pw.get("committed_bits_histogram") or {}).items()}
    sample.histogram = hist
    n = sum(hist.values())
    sample.mean_bits = round(sum(int(b) * c for b, c in hist.items()) / n, 4) if n else None
    sample.transitions = (pw.get("counters") or {}).get("transitions")
    sample.queued_blocks = pw.get("queued_blocks")
    gpu = pw.get("gpu_memory") or {}
    sample.gpu_free_bytes = gpu.get("free_bytes")
    tp = pw.get("tp") or {}
    if tp.get("ranks"):
        sample.tp_kv_capacity_tokens = [d["kv_capacity_tokens"] for d in tp["ranks"]]
        sample.tp_transitions = [d["transitions"] for d in tp["ranks"]]
        sample.tp_digest_mismatches = tp.get("digest_mismatches")
    blocks = pw.get("blocks")
    if blocks:
        sample.block_bits = "".join(str(int(b[3])) for b in blocks)
    return sample


@dataclass
class StateSampler:
    """Poll `url`/get_server_info every `interval_s` seconds in a daemon thread until `stop()`."""

    url: str
    interval_s: float = 1.0
    on_sample: Optional[Callable[[StateSample], None]] = None  # called with every sample (the demo prints changes)
    samples: list[StateSample] = field(default_factory=list)
    errors: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: Optional[threading.Thread] = None
    _t0: float = 0.0
    _last_bits: Optional[str] = None

    def start(self) -> "StateSampler":
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="state-sampler", daemon=True)
        self._thread.start()
        return self

    def sample_now(self) -> Optional[StateSample]:
        try:
            info = requests.get(self.url + "/get_server_info", timeout=30).json()
        except (requests.RequestException, ValueError):
            self.errors += 1
            return None
        s = summarize_state(info, time.monotonic() - self._t0)
        if s.block_bits is not None:
            if s.block_bits == self._last_bits:
                s.block_bits = None
            else:
                self._last_bits = s.block_bits
        self.samples.append(s)
        if self.on_sample is not None:
            self.on_sample(s)
        return s

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_now()
            self._stop.wait(self.interval_s)

    def stop(self, final_sample: bool = True) -> list[dict[str, Any]]:
        """Stop polling; with `final_sample`, record the state at this moment as the last sample."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if final_sample:
            self.sample_now()
        return [asdict(s) for s in self.samples]
