"""Reading LongBench data files: one JSONL per dataset, one sample per line.

The official layout (THUDM/LongBench data.zip, or the HF dataset THUDM/LongBench exported to JSONL) has
fields input, context, answers, length, dataset, language, all_classes, _id. Every line is validated here
so that a malformed file fails with its path and line number, not deep inside prompt building or scoring.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedweight.longbench.datasets import get_spec

REQUIRED_FIELDS: tuple[str, ...] = ("input", "context", "answers", "length", "all_classes", "_id")


class LongBenchDataError(ValueError):
    """A data file is missing or malformed; the message names the file (and line)."""


@dataclass(frozen=True)
class LongBenchSample:
    sample_id: str
    dataset: str
    input: str
    context: str
    answers: tuple[str, ...]
    all_classes: tuple[str, ...] | None
    length: int
    language: str | None


def dataset_file(data_dir: Path, dataset: str) -> Path:
    return Path(data_dir) / f"{dataset}.jsonl"


def _parse_line(record: Any, path: Path, line_no: int, dataset: str) -> LongBenchSample:
    where = f"{path}:{line_no}"
    if not isinstance(record, dict):
        raise LongBenchDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [field for field in REQUIRED_FIELDS if field not in record]
    if missing:
        raise LongBenchDataError(
            f"{where}: missing field(s) {', '.join(missing)}; a LongBench line needs {', '.join(REQUIRED_FIELDS)}"
        )
    for field in ("input", "context", "_id"):
        if not isinstance(record[field], str):
            raise LongBenchDataError(f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}")
    answers = record["answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise LongBenchDataError(f"{where}: field 'answers' must be a non-empty list of strings, got {answers!r:.80}")
    all_classes = record["all_classes"]
    if all_classes is not None and (
        not isinstance(all_classes, list) or not all(isinstance(c, str) for c in all_classes)
    ):
        raise LongBenchDataError(f"{where}: field 'all_classes' must be null or a list of strings")
    if get_spec(dataset).metric == "classification_score" and not all_classes:
        raise LongBenchDataError(f"{where}: dataset {dataset} is scored by class and needs a non-empty 'all_classes'")
    length = record["length"]
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise LongBenchDataError(f"{where}: field 'length' must be a non-negative integer, got {length!r}")
    return LongBenchSample(
        sample_id=record["_id"],
        dataset=dataset,
        input=record["input"],
        context=record["context"],
        answers=tuple(answers),
        all_classes=tuple(all_classes) if all_classes is not None else None,
        length=length,
        language=record.get("language"),
    )


def load_dataset(data_dir: Path, dataset: str) -> list[LongBenchSample]:
    """All samples of `{data_dir}/{dataset}.jsonl`, in file order."""
    get_spec(dataset)  # unknown names fail before touching the file system
    path = dataset_file(data_dir, dataset)
    if not path.is_file():
        raise LongBenchDataError(
            f"LongBench data file {path} does not exist. Put the official files (one '<dataset>.jsonl' per "
            f"dataset, e.g. unzipped from THUDM/LongBench's data.zip) in {Path(data_dir)}, or make small test "
            "files with `python -m pagedweight.longbench make-fixtures --out DIR`."
        )
    samples: list[LongBenchSample] = []
    seen_ids: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise LongBenchDataError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
            sample = _parse_line(record, path, line_no, dataset)
            if sample.sample_id in seen_ids:
                # Resuming skips answered ids, so ids must be unique within a file.
                raise LongBenchDataError(
                    f"{path}:{line_no}: _id {sample.sample_id!r} repeats line {seen_ids[sample.sample_id]}"
                )
            seen_ids[sample.sample_id] = line_no
            samples.append(sample)
    if not samples:
        raise LongBenchDataError(f"{path}: the file has no samples")
    return samples


def discover_datasets(data_dir: Path, names: tuple[str, ...]) -> list[str]:
    """Those of `names` that have a file in data_dir, in the order of `names`."""
    return [name for name in names if dataset_file(data_dir, name).is_file()]
