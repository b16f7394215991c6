"""`pagedweight convert --workers N`: a process pool over expert blocks writes the same bytes for any N."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from pagedweight.cli import main as cli_main
from pagedweight.tools.convert import ConversionError, convert_checkpoint
from pagedweight.tools.tiny_model import TINY_CORPUS, TinyMoESizes, make_tiny_moe

SIZES = TinyMoESizes(num_layers=2, num_experts=4, vocab_size=320, moe_intermediate_size=64)


def _tree_digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    # qwen2_moe has a shared expert, which is both quantized and kept dense.
    return make_tiny_moe(tmp_path_factory.mktemp("src") / "qwen2_moe", "qwen2_moe", seed=3, sizes=SIZES)


@pytest.mark.parametrize("kind", ["bcq", "kmeans"])
def test_workers_give_identical_bytes(source, tmp_path, kind):
    text = tmp_path / "calib.txt"
    text.write_text(TINY_CORPUS * 3)
    options = dict(table_kind=kind, group_size=32, calib_text=text, calib_tokens=200, max_shard_bytes=60_000,
                   progress=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the in-process run uses 2 threads, pool workers 1 each
    try:
        single = _tree_digest(convert_checkpoint(source, tmp_path / "w1", workers=1, **options))
    finally:
        torch.set_num_threads(previous)
    assert sum(name.startswith("pagedweight/ap-") for name in single) > 1  # several AP shards: order matters
    for workers in (2, 3):
        assert _tree_digest(convert_checkpoint(source, tmp_path / f"w{workers}", workers=workers, **options)) == single


def test_workers_must_be_positive(source, tmp_path):
    with pytest.raises(ConversionError, match="--workers"):
        convert_checkpoint(source, tmp_path / "bad", workers=0, progress=False)


def test_cli_workers(source, tmp_path):
    out_pool, out_single = tmp_path / "pool", tmp_path / "single"
    assert cli_main(["convert", "--model", str(source), "--out", str(out_pool), "--workers", "2", "--group-size", "32"]) == 0
    assert cli_main(["convert", "--model", str(source), "--out", str(out_single), "--group-size", "32"]) == 0
    assert _tree_digest(out_pool) == _tree_digest(out_single)
