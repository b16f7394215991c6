"""A burst of concurrent long requests against SGLang's native `/generate`, streamed, with per-request timing.

Each request sends token ids (no tokenizer in the loop), greedy, `ignore_eos` so it produces exactly
`output_len` tokens, and asks for the log-probabilities of its output tokens: a NaN (or a null, which is
how SGLang's JSON encoder writes a NaN) there means the model read garbage, the signal poison mode
(`--paged-weight-debug-poison`) is built to produce when a freed plane is read.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Optional

import requests


@dataclass(frozen=True)
class BurstSpec:
    num_requests: int
    input_len: int
    output_len: int
    vocab_size: int
    seed: int = 0
    concurrency: int = 0  # 0: all at once

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        # Stay clear of the low ids where special tokens usually sit.
        lo = min(1000, self.vocab_size // 4)
        return [[rng.randrange(lo, self.vocab_size) for _ in range(self.input_len)] for _ in range(self.num_requests)]


@dataclass
class RequestOutcome:
    ok: bool
    completion_tokens: int
    ttft_s: Optional[float]
    latency_s: float
    started_s: float  # relative to the burst's start
    nan_logprobs: int  # output tokens whose log-probability was NaN / null
    error: Optional[str] = None


def _is_bad(v: Any) -> bool:
    return v is None or (isinstance(v, float) and not math.isfinite(v))


def _count_bad_logprobs(meta: dict[str, Any]) -> int:
    return sum(1 for item in meta.get("output_token_logprobs") or [] if _is_bad(item[0]))


def one_request(url: str, input_ids: list[int], output_len: int, t0: float, timeout_s: float) -> RequestOutcome:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    }
    start = time.monotonic()
    ttft = None
    meta: dict[str, Any] = {}
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=timeout_s) as r:
            r.raise_for_status()
            for raw in r.iter_lines():
                if not raw or not raw.startswith(b"data:"):
                    continue
                payload = raw[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                meta = chunk.get("meta_info") or {}
                if ttft is None and meta.get("completion_tokens", 0) > 0:
                    ttft = time.monotonic() - start
        # SGLang streams cumulative output (without --incremental-streaming-output): the last chunk holds
        # every output log-probability.
        bad = _count_bad_logprobs(meta)
    except (requests.RequestException, ValueError) as e:
        return RequestOutcome(False, int(meta.get("completion_tokens", 0)), ttft, time.monotonic() - start,
                              start - t0, _count_bad_logprobs(meta), f"{type(e).__name__}: {e}")
    done = int(meta.get("completion_tokens", 0))
    finish = (meta.get("finish_reason") or {}).get("type") if isinstance(meta.get("finish_reason"), dict) else None
    ok = done == output_len and finish != "abort"
    err = None if ok else f"finished with {done}/{output_len} tokens, finish_reason={meta.get('finish_reason')}"
    return RequestOutcome(ok, done, ttft, time.monotonic() - start, start - t0, bad, err)


@dataclass
class BurstResult:
    requests: int
    completed: int
    failed: int
    output_tokens: int
    wall_s: float
    output_tok_per_s: float
    ttft_mean_s: Optional[float]
    ttft_p99_s: Optional[float]
    latency_median_s: Optional[float]
    nan_logprobs: int
    errors: list[str]
    # Sum over completed requests of (tokens - 1) / (latency - TTFT): the decode rate while all run together.
    decode_tok_per_s: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    k = min(len(s) - 1, max(0, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]


def run_burst(url: str, spec: BurstSpec, timeout_s: float = 1800.0) -> BurstResult:
    prompts = spec.prompts()
    workers = spec.concurrency or spec.num_requests
    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        outs = list(pool.map(lambda p: one_request(url, p, spec.output_len, t0, timeout_s), prompts))
    wall = time.monotonic() - t0
    ttfts = [o.ttft_s for o in outs if o.ttft_s is not None]
    tokens = sum(o.completion_tokens for o in outs)
    return BurstResult(
        requests=len(outs),
        completed=sum(o.ok for o in outs),
        failed=sum(not o.ok for o in outs),
        output_tokens=tokens,
        wall_s=round(wall, 3),
        output_tok_per_s=round(tokens / wall, 2) if wall > 0 else 0.0,
        ttft_mean_s=round(statistics.fmean(ttfts), 4) if ttfts else None,
        ttft_p99_s=round(percentile(ttfts, 99), 4) if ttfts else None,
        latency_median_s=round(statistics.median(o.latency_s for o in outs), 4) if outs else None,
        nan_logprobs=sum(o.nan_logprobs for o in outs),
        errors=[o.error for o in outs if o.error][:10],
        decode_tok_per_s=_decode_rate(outs),
    )


def _decode_rate(outs: list[RequestOutcome]) -> Optional[float]:
    rates = [
        (o.completion_tokens - 1) / (o.latency_s - o.ttft_s)
        for o in outs
        if o.ok and o.ttft_s is not None and o.completion_tokens > 1 and o.latency_s > o.ttft_s
    ]
    return round(sum(rates), 2) if rates else None
