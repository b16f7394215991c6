"""Scoring predictions the way THUDM/LongBench eval.py does, plus request timing statistics.

eval.py `scorer`: for each sample, optionally keep only the first line of the prediction, score it
against every ground truth with the dataset's metric, keep the max; the dataset score is
round(100 * mean, 2). `scorer_e` does the same per LongBench-E length bucket: length < 4000 -> "0-4k",
< 8000 -> "4-8k", else "8k+" (`length` is the data file's field, not a token count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedweight.longbench.data import LongBenchSample
from pagedweight.longbench.datasets import DatasetSpec, is_longbench_e
from pagedweight.longbench.metrics import METRICS
from pagedweight.longbench.predictions import PredictionRecord

LENGTH_BUCKETS: tuple[str, ...] = ("0-4k", "4-8k", "8k+")


def length_bucket(length: int) -> str:
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


def postprocess_prediction(spec: DatasetSpec, prediction: str) -> str:
    if spec.score_first_line:
        return prediction.lstrip("\n").split("\n")[0]
    return prediction


def score_sample(spec: DatasetSpec, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None) -> float:
    """Max over ground truths of the dataset's metric, in [0, 1]."""
    metric = METRICS[spec.metric]
    prediction = postprocess_prediction(spec, prediction)
    score = 0.0
    for ground_truth in answers:
        score = max(score, metric(prediction, ground_truth, all_classes=all_classes))
    return score


@dataclass(frozen=True)
class DatasetScore:
    dataset: str
    metric: str
    official: bool
    n_scored: int
    n_samples: int  # samples in the data file (more than n_scored under --limit or an unfinished run)
    score: float | None  # 100 x mean, rounded to 2 decimals; None when nothing is scored
    length_buckets: dict[str, float | None] | None  # LongBench-E only
    bucket_counts: dict[str, int] | None


def score_dataset(
    spec: DatasetSpec, samples: Sequence[LongBenchSample], predictions: dict[str, PredictionRecord]
) -> DatasetScore:
    """Score the samples of the data file that have a prediction (answers come from the data file)."""
    per_bucket: dict[str, list[float]] = {bucket: [] for bucket in LENGTH_BUCKETS}
    scores: list[float] = []
    for sample in samples:
        record = predictions.get(sample.sample_id)
        if record is None:
            continue
        value = score_sample(spec, record.pred, sample.answers, sample.all_classes)
        scores.append(value)
        per_bucket[length_bucket(sample.length)].append(value)
    buckets = counts = None
    if is_longbench_e(spec.name):
        buckets = {b: (round(100 * float(np.mean(v)), 2) if v else None) for b, v in per_bucket.items()}
        counts = {b: len(v) for b, v in per_bucket.items()}
    return DatasetScore(
        dataset=spec.name,
        metric=spec.metric,
        official=spec.official,
        n_scored=len(scores),
        n_samples=len(samples),
        score=round(100 * sum(scores) / len(scores), 2) if scores else None,
        length_buckets=buckets,
        bucket_counts=counts,
    )


def average_score(scores: Sequence[DatasetScore]) -> float | None:
    """Unweighted mean over datasets of the official LongBench datasets that have a score."""
    values = [s.score for s in scores if s.official and s.score is not None]
    return round(sum(values) / len(values), 2) if values else None


@dataclass(frozen=True)
class RequestStats:
    """Timing of the requests one harness invocation sent (resumed earlier runs are not mixed in)."""

    n_requests: int
    wall_s: float  # first request sent -> last response received
    output_tokens: int | None  # None if the backend did not report completion tokens for every request
    output_throughput_tok_s: float | None
    request_throughput_per_s: float
    latency_mean_s: float
    latency_p99_s: float
    ttft_mean_s: float | None  # streaming runs only
    ttft_p99_s: float | None
    truncated_prompts: int


def request_stats(records: Sequence[PredictionRecord]) -> RequestStats | None:
    if not records:
        return None
    start = min(r.started_at for r in records)
    end = max(r.started_at + r.latency_s for r in records)
    wall = max(end - start, 1e-9)
    latencies = np.array([r.latency_s for r in records])
    ttfts = np.array([r.ttft_s for r in records if r.ttft_s is not None])
    token_counts = [r.completion_tokens for r in records]
    output_tokens = None if any(c is None for c in token_counts) else sum(token_counts)
    return RequestStats(
        n_requests=len(records),
        wall_s=round(wall, 4),
        output_tokens=output_tokens,
        output_throughput_tok_s=round(output_tokens / wall, 3) if output_tokens is not None else None,
        request_throughput_per_s=round(len(records) / wall, 4),
        latency_mean_s=round(float(latencies.mean()), 4),
        latency_p99_s=round(float(np.percentile(latencies, 99)), 4),
        ttft_mean_s=round(float(ttfts.mean()), 4) if ttfts.size else None,
        ttft_p99_s=round(float(np.percentile(ttfts, 99)), 4) if ttfts.size else None,
        truncated_prompts=sum(r.truncated for r in records),
    )
