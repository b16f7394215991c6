"""The run report: per-dataset scores, average, request timing, run settings and server info (JSON + markdown)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedweight.longbench.scoring import LENGTH_BUCKETS, DatasetScore, RequestStats


@dataclass(frozen=True)
class LongBenchReport:
    created_at: str
    run_id: str | None  # None for a scoring-only invocation
    settings: dict[str, Any]
    backend: dict[str, Any] | None
    server: dict[str, Any] | None
    metric_backends: dict[str, str]
    scores: list[DatasetScore]
    average: float | None
    this_run: RequestStats | None  # requests sent by this invocation
    this_run_by_dataset: dict[str, RequestStats]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["scores"] = {s.dataset: asdict(s) for s in self.scores}
        return data


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def to_markdown(report: LongBenchReport) -> str:
    has_buckets = any(s.length_buckets for s in report.scores)
    header = ["dataset", "metric", "n", "score"] + (list(LENGTH_BUCKETS) if has_buckets else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in report.scores:
        name = s.dataset if s.official else f"{s.dataset} (synthetic)"
        n = f"{s.n_scored}" if s.n_scored == s.n_samples else f"{s.n_scored}/{s.n_samples}"
        row = [name, s.metric, n, _fmt(s.score)]
        if has_buckets:
            row += [_fmt((s.length_buckets or {}).get(b)) for b in LENGTH_BUCKETS]
        lines.append("| " + " | ".join(row) + " |")
    lines.append(f"| **average** (official datasets) | | | **{_fmt(report.average)}** |" + " |" * (len(header) - 4))
    out = [f"# LongBench results ({report.created_at})", "", *lines, ""]
    if report.this_run is not None:
        t = report.this_run
        out += [
            "## Requests sent by this run",
            "",
            f"- requests: {t.n_requests} in {t.wall_s:.1f} s ({t.request_throughput_per_s:.3f} req/s)",
            f"- output throughput: {_fmt(t.output_throughput_tok_s)} tok/s ({t.output_tokens} tokens)",
            f"- latency mean / P99: {t.latency_mean_s:.3f} s / {t.latency_p99_s:.3f} s",
            f"- time to first token mean / P99: {_fmt(t.ttft_mean_s)} s / {_fmt(t.ttft_p99_s)} s"
            + ("" if t.ttft_mean_s is not None else " (run with --stream to measure)"),
            f"- prompts truncated in the middle: {t.truncated_prompts}",
            "",
        ]
    model = (report.server or {}).get("model_info", {}).get("model_path") or (report.backend or {}).get("model")
    if model:
        out += [f"Model: `{model}`", ""]
    return "\n".join(out)


def write_report(report: LongBenchReport, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    json_path.write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    md_path.write_text(to_markdown(report), encoding="utf-8")
    return json_path, md_path
