"""The per-dataset predictions file: one JSON line per answered sample, appended as results arrive.

It is what makes runs resumable (answered _ids are skipped on the next run) and what scoring reads, so
the official fields (pred, answers, all_classes, length) are kept next to timing fields. Lines are
flushed one by one; a run killed mid-write leaves at most a partial last line, which is dropped with a
warning (that sample is simply asked again). A malformed line anywhere else is an error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from pagedweight.longbench.data import LongBenchSample
from pagedweight.longbench.request import GenerationRequest, GenerationResult

logger = logging.getLogger(__name__)


class PredictionsFileError(ValueError):
    """A predictions file cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class PredictionRecord:
    _id: str
    dataset: str
    pred: str
    answers: list[str]
    all_classes: list[str] | None
    length: int
    prompt_tokens: int | None  # as sent, after truncation and chat template
    original_prompt_tokens: int  # the dataset prompt before truncation
    truncated: bool
    endpoint: str
    completion_tokens: int | None
    finish_reason: str | None
    latency_s: float
    ttft_s: float | None
    started_at: float
    run_id: str

    @classmethod
    def from_result(
        cls, sample: LongBenchSample, request: GenerationRequest, result: GenerationResult, run_id: str
    ) -> PredictionRecord:
        sent_tokens = len(request.prompt_token_ids) if request.prompt_token_ids is not None else result.prompt_tokens
        return cls(
            _id=sample.sample_id,
            dataset=sample.dataset,
            pred=result.text,
            answers=list(sample.answers),
            all_classes=list(sample.all_classes) if sample.all_classes is not None else None,
            length=sample.length,
            prompt_tokens=sent_tokens,
            original_prompt_tokens=request.original_prompt_tokens,
            truncated=request.truncated,
            endpoint=request.endpoint,
            completion_tokens=result.completion_tokens,
            finish_reason=result.finish_reason,
            latency_s=result.latency_s,
            ttft_s=result.ttft_s,
            started_at=result.started_at,
            run_id=run_id,
        )


def predictions_path(out_dir: Path, dataset: str) -> Path:
    return Path(out_dir) / "predictions" / f"{dataset}.jsonl"


def read_predictions(path: Path) -> dict[str, PredictionRecord]:
    """Answered samples by _id (empty if the file does not exist yet)."""
    if not path.exists():
        return {}
    records: dict[str, PredictionRecord] = {}
    raw = path.read_text(encoding="utf-8")
    lines = raw.split("\n")
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        is_unterminated_last_line = line_no == len(lines) and not raw.endswith("\n")
        try:
            fields: dict[str, Any] = json.loads(line)
            record = PredictionRecord(**fields)
        except (json.JSONDecodeError, TypeError) as e:
            if is_unterminated_last_line:
                logger.warning("%s:%d: dropping a partly written last line (interrupted run): %s", path, line_no, e)
                continue
            raise PredictionsFileError(
                f"{path}:{line_no}: not a prediction record ({e}); delete the line or the file to re-ask those samples"
            ) from None
        records[record._id] = record
    return records


class PredictionsWriter:
    """Appends records to a predictions file, one flushed line each."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._repair_unterminated_tail(path)
        self._file: IO[str] = path.open("a", encoding="utf-8")

    @staticmethod
    def _repair_unterminated_tail(path: Path) -> None:
        # Appending after a partial last line would glue two records together; cut the partial line off
        # (read_predictions already ignored it, so its sample is being asked again).
        if not path.exists() or path.stat().st_size == 0:
            return
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            path.write_bytes(data[: data.rfind(b"\n") + 1])

    def write(self, record: PredictionRecord) -> None:
        self._file.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> PredictionsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
