"""Data files, fixtures and the predictions file: validation errors name the file and line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pagedweight.longbench.cli import main as cli_main
from pagedweight.longbench.data import LongBenchDataError, load_dataset
from pagedweight.longbench.fixtures import FixtureOptions, make_fixtures
from pagedweight.longbench.predictions import PredictionsFileError, PredictionsWriter, read_predictions
from pagedweight.longbench.scoring import length_bucket

GOOD = {
    "input": "q", "context": "c", "answers": ["a"], "length": 3, "dataset": "narrativeqa", "language": "en",
    "all_classes": None, "_id": "id-0",
}  # fmt: skip


def _write(path: Path, *records: object) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_missing_file_names_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(LongBenchDataError, match=r"narrativeqa\.jsonl does not exist.*make-fixtures"):
        load_dataset(tmp_path, "narrativeqa")


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", r"narrativeqa\.jsonl:2: not valid JSON"),
        (json.dumps([1, 2]), r"narrativeqa\.jsonl:2: expected a JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "answers"}), r":2: missing field\(s\) answers"),
        (json.dumps({**GOOD, "_id": "x", "answers": []}), r":2: field 'answers' must be a non-empty list"),
        (json.dumps({**GOOD, "_id": "x", "length": "long"}), r":2: field 'length' must be a non-negative integer"),
        (json.dumps({**GOOD, "_id": "x", "context": 5}), r":2: field 'context' must be a string"),
        (json.dumps(GOOD), r":2: _id 'id-0' repeats line 1"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    _write(tmp_path / "narrativeqa.jsonl", GOOD, bad_line)
    with pytest.raises(LongBenchDataError, match=message):
        load_dataset(tmp_path, "narrativeqa")


def test_classification_datasets_need_all_classes(tmp_path: Path) -> None:
    _write(tmp_path / "trec.jsonl", {**GOOD, "dataset": "trec"})
    with pytest.raises(LongBenchDataError, match=r"trec\.jsonl:1: dataset trec is scored by class"):
        load_dataset(tmp_path, "trec")


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "qmsum.jsonl").write_text("\n")
    with pytest.raises(LongBenchDataError, match="has no samples"):
        load_dataset(tmp_path, "qmsum")


def test_cli_without_data_files_explains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["score", "--data-dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no LongBench ('<dataset>.jsonl') data files in" in capsys.readouterr().err


def test_fixtures_are_deterministic_valid_longbench_files(tmp_path: Path) -> None:
    options = FixtureOptions(samples_per_file=3, retrieval_paragraphs=30, passkey_filler_repeats=10)
    first = make_fixtures(tmp_path / "a", options)
    second = make_fixtures(tmp_path / "b", options)
    other_seed = make_fixtures(tmp_path / "c", FixtureOptions(samples_per_file=3, seed=1))
    for dataset, path in first.items():
        assert path.read_bytes() == second[dataset].read_bytes()
        assert path.read_bytes() != other_seed[dataset].read_bytes()
        samples = load_dataset(tmp_path / "a", dataset)
        assert len(samples) == 3 and all(s.length == len(s.context.split()) for s in samples)
    retrieval = load_dataset(tmp_path / "a", "passage_retrieval_en")[0]
    assert retrieval.context.startswith("Paragraph 1: ") and "\n\nParagraph 30: " in retrieval.context
    target = int(retrieval.answers[0].removeprefix("Paragraph "))
    name = retrieval.input.split("describes ", 1)[1].split(",", 1)[0]
    assert f"Paragraph {target}: {name} is a small town" in retrieval.context
    assert retrieval.input not in retrieval.context  # a paraphrase, not a copied sentence
    passkey = load_dataset(tmp_path / "a", "passkey")[0]
    assert f"The pass key is {passkey.answers[0]}." in passkey.context
    buckets = [length_bucket(s.length) for s in load_dataset(tmp_path / "a", "passage_retrieval_en_e")]
    assert buckets == ["0-4k", "4-8k", "8k+"]


def test_make_fixtures_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["make-fixtures", "--out", str(tmp_path), "--samples", "2", "--paragraphs", "5"]) == 0
    assert len(load_dataset(tmp_path, "passage_retrieval_en")) == 2
    assert "passkey.jsonl" in capsys.readouterr().out


def _record(sample_id: str) -> dict[str, object]:
    return {
        "_id": sample_id, "dataset": "passkey", "pred": "1", "answers": ["1"], "all_classes": None, "length": 1,
        "prompt_tokens": 5, "original_prompt_tokens": 5, "truncated": False, "endpoint": "completions",
        "completion_tokens": 1, "finish_reason": "stop", "latency_s": 0.1, "ttft_s": None, "started_at": 0.0,
        "run_id": "r",
    }  # fmt: skip


def test_partial_last_prediction_line_is_dropped_and_repaired(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "passkey.jsonl"
    path.write_text(json.dumps(_record("a")) + "\n" + json.dumps(_record("b"))[:30])
    with caplog.at_level(logging.WARNING):
        assert set(read_predictions(path)) == {"a"}
    assert "partly written last line" in caplog.text
    with PredictionsWriter(path) as writer:
        from pagedweight.longbench.predictions import PredictionRecord

        writer.write(PredictionRecord(**_record("b")))
    assert set(read_predictions(path)) == {"a", "b"}
    assert len(path.read_text().splitlines()) == 2


def test_malformed_prediction_line_in_the_middle_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "passkey.jsonl"
    path.write_text("garbage\n" + json.dumps(_record("a")) + "\n")
    with pytest.raises(PredictionsFileError, match=r"passkey\.jsonl:1: not a prediction record"):
        read_predictions(path)


def test_score_without_predictions_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_fixtures(tmp_path / "data", FixtureOptions(samples_per_file=1, passkey_filler_repeats=2))
    assert cli_main(["score", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "out")]) == 2
    assert "no predictions for these datasets" in capsys.readouterr().err


def test_unknown_dataset_name_lists_the_known_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["score", "--data-dir", str(tmp_path), "--out", str(tmp_path), "--datasets", "narrative_qa"])
    err = capsys.readouterr().err
    assert "unknown LongBench dataset 'narrative_qa'" in err and "narrativeqa" in err
