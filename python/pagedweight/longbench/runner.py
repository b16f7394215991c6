"""One LongBench run: load and validate the data, ask for every unanswered sample, save, score, report.

Resuming: predictions are appended to `{out_dir}/predictions/{dataset}.jsonl` as they arrive, and the
samples already there are skipped on the next run. The prompt settings are stored in
`{out_dir}/settings.json`; resuming with different ones is refused, since mixing predictions made
from different prompts would make the scores meaningless.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pagedweight.longbench.backend import GenerationBackend
from pagedweight.longbench.data import LongBenchSample, load_dataset
from pagedweight.longbench.datasets import DatasetSpec, get_spec
from pagedweight.longbench.metrics import ZH_METRICS, MetricDependencyError, code_sim_backend, jieba_available
from pagedweight.longbench.predictions import PredictionRecord, PredictionsWriter, predictions_path, read_predictions
from pagedweight.longbench.prompts import PromptOptions, build_request
from pagedweight.longbench.report import LongBenchReport
from pagedweight.longbench.request import GenerationRequest
from pagedweight.longbench.scoring import DatasetScore, average_score, request_stats, score_dataset
from pagedweight.longbench.server_info import ServerInfo


class SettingsMismatchError(ValueError):
    pass


@dataclass(frozen=True)
class LongBenchRunConfig:
    data_dir: Path
    out_dir: Path
    datasets: tuple[str, ...]
    prompt: PromptOptions
    tokenizer: str  # name or path the tokenizer was loaded from
    model: str  # served model name (or engine description)
    limit: int | None = None  # first N samples of each dataset (quick runs)

    def __post_init__(self) -> None:
        if not self.datasets:
            raise ValueError("no datasets selected")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be at least 1, got {self.limit}")

    def prompt_settings(self) -> dict[str, Any]:
        """The settings that decide what is sent; a resumed run must use the same ones."""
        return {"model": self.model, "tokenizer": self.tokenizer, **asdict(self.prompt)}


def check_metric_dependencies(specs: Sequence[DatasetSpec]) -> None:
    zh = [s.name for s in specs if s.metric in ZH_METRICS]
    if zh and not jieba_available():
        raise MetricDependencyError(
            f"datasets {', '.join(zh)} are scored with jieba word segmentation, which is not installed; "
            "`pip install jieba` or leave these datasets out (--datasets)"
        )


def _check_settings(out_dir: Path, settings: dict[str, Any]) -> None:
    path = out_dir / "settings.json"
    if path.exists():
        stored = json.loads(path.read_text(encoding="utf-8"))
        changed = {k: (stored.get(k), v) for k, v in settings.items() if stored.get(k) != v}
        if changed:
            detail = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise SettingsMismatchError(
                f"{out_dir} holds predictions made with other settings ({detail}). "
                "Use a new --out directory, or run with the stored settings to resume."
            )
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def _requests(
    spec: DatasetSpec,
    samples: Sequence[LongBenchSample],
    tokenizer: Any,
    options: PromptOptions,
    max_model_len: int | None,
) -> Iterator[GenerationRequest]:
    for sample in samples:
        request = build_request(spec, sample, tokenizer, options)
        if max_model_len is not None and request.prompt_token_ids is not None:
            needed = len(request.prompt_token_ids) + request.max_new_tokens
            if needed > max_model_len:
                raise ValueError(
                    f"{spec.name} sample {sample.sample_id}: {len(request.prompt_token_ids)} prompt tokens + "
                    f"{request.max_new_tokens} new tokens exceed the server's context length {max_model_len}; "
                    "lower --max-prompt-tokens (the chat template adds tokens after truncation)"
                )
        yield request


def load_selected(config: LongBenchRunConfig) -> dict[str, list[LongBenchSample]]:
    """Every selected data file, validated before any request is sent."""
    return {name: load_dataset(config.data_dir, name) for name in config.datasets}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _score_all(
    out_dir: Path, data: dict[str, list[LongBenchSample]]
) -> tuple[list[DatasetScore], dict[str, dict[str, PredictionRecord]]]:
    scores, all_predictions = [], {}
    for name, samples in data.items():
        predictions = read_predictions(predictions_path(out_dir, name))
        all_predictions[name] = predictions
        scores.append(score_dataset(get_spec(name), samples, predictions))
    return scores, all_predictions


def run_longbench(
    config: LongBenchRunConfig,
    backend: GenerationBackend,
    tokenizer: Any,
    server: ServerInfo | None = None,
    show_progress: bool = True,
) -> LongBenchReport:
    specs = [get_spec(name) for name in config.datasets]
    check_metric_dependencies(specs)
    data = load_selected(config)
    _check_settings(config.out_dir, config.prompt_settings())
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    max_model_len = server.max_model_len if server is not None else None

    for spec in specs:
        samples = data[spec.name][: config.limit] if config.limit else data[spec.name]
        path = predictions_path(config.out_dir, spec.name)
        answered = read_predictions(path)
        todo = [s for s in samples if s.sample_id not in answered]
        by_id = {s.sample_id: s for s in todo}
        with PredictionsWriter(path) as writer, tqdm(
            total=len(samples), initial=len(samples) - len(todo), desc=spec.name, unit="req", disable=not show_progress
        ) as progress:
            for request, result in backend.run(_requests(spec, todo, tokenizer, config.prompt, max_model_len)):
                writer.write(PredictionRecord.from_result(by_id[request.sample_id], request, result, run_id))
                progress.update(1)

    scores, predictions = _score_all(config.out_dir, data)
    this_run = {
        name: [r for r in records.values() if r.run_id == run_id] for name, records in predictions.items()
    }
    by_dataset = {name: stats for name, recs in this_run.items() if (stats := request_stats(recs)) is not None}
    return LongBenchReport(
        created_at=_now(),
        run_id=run_id,
        settings={**config.prompt_settings(), "data_dir": str(config.data_dir), "datasets": list(config.datasets), "limit": config.limit},
        backend=backend.describe(),
        server=asdict(server) if server is not None else None,
        metric_backends=_metric_backends(specs),
        scores=scores,
        average=average_score(scores),
        this_run=request_stats([r for recs in this_run.values() for r in recs]),
        this_run_by_dataset=by_dataset,
    )


def score_only(data_dir: Path, out_dir: Path, datasets: Sequence[str]) -> LongBenchReport:
    """Score existing predictions without sending anything (e.g. after a metric fix)."""
    specs = [get_spec(name) for name in datasets]
    check_metric_dependencies(specs)
    scores, _ = _score_all(out_dir, {name: load_dataset(data_dir, name) for name in datasets})
    return LongBenchReport(
        created_at=_now(),
        run_id=None,
        settings={"data_dir": str(data_dir), "datasets": list(datasets)},
        backend=None,
        server=None,
        metric_backends=_metric_backends(specs),
        scores=scores,
        average=average_score(scores),
        this_run=None,
        this_run_by_dataset={},
    )


def _metric_backends(specs: Sequence[DatasetSpec]) -> dict[str, str]:
    metrics = {s.metric for s in specs}
    backends = {}
    if "code_sim_score" in metrics:
        backends["code_sim_score"] = code_sim_backend()
    if metrics & {"rouge_score", "rouge_zh_score"}:
        backends["rouge"] = f"rouge {importlib.metadata.version('rouge')} (Rouge().get_scores, rouge-l f)"
    if metrics & ZH_METRICS:
        backends["zh_segmentation"] = "jieba (precise mode)"
    return backends


__all__ = ["LongBenchRunConfig", "run_longbench", "score_only"]
