"""Converter refusals: each bad input gives a ConversionError that names the problem and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import pagedweight.tools.convert as convert_module
from pagedweight.tools.convert import ConversionError, convert_checkpoint
from pagedweight.format.checkpoint import APCheckpoint
from pagedweight.tools.tiny_model import TinyMoESizes, make_tiny_moe

SIZES = TinyMoESizes(num_layers=1, num_experts=2, vocab_size=320, moe_intermediate_size=32)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("src") / "mixtral", "mixtral", sizes=SIZES)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(model: Path, edit) -> None:
    state = load_file(str(model / "model.safetensors"))
    edit(state)
    save_file(state, str(model / "model.safetensors"))


def _rewrite_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))


def test_unsupported_model_type(tiny, tmp_path):
    model = _copy(tiny, tmp_path / "m")
    _rewrite_config(model, model_type="llama")
    with pytest.raises(ConversionError, match="model_type 'llama' is not supported.*mixtral, olmoe, qwen2_moe, qwen3_moe"):
        convert_checkpoint(model, tmp_path / "out", progress=False)


def test_checkpoint_without_moe_layers(tiny, tmp_path):
    model = _copy(tiny, tmp_path / "m")
    _rewrite_weights(model, lambda s: [s.pop(k) for k in list(s) if ".experts." in k])
    with pytest.raises(ConversionError, match="no MoE expert weights found"):
        convert_checkpoint(model, tmp_path / "out", progress=False)


def test_incomplete_experts(tiny, tmp_path):
    model = _copy(tiny, tmp_path / "m")
    _rewrite_weights(model, lambda s: s.pop("model.layers.0.block_sparse_moe.experts.1.w3.weight"))
    with pytest.raises(ConversionError, match="layer 0 lacks 1 expert weights, e.g. expert 1 up"):
        convert_checkpoint(model, tmp_path / "out", progress=False)


def test_fused_expert_layout_is_refused(tiny, tmp_path):
    model = _copy(tiny, tmp_path / "m")

    def fuse(state):
        w = [state.pop(f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight") for e in range(2)]
        state["model.layers.0.mlp.experts.gate_up_proj"] = torch.stack(w)

    _rewrite_weights(model, fuse)
    with pytest.raises(ConversionError, match="unsupported layout.*experts.gate_up_proj"):
        convert_checkpoint(model, tmp_path / "out", progress=False)


def test_missing_config_weights_and_bin_only(tiny, tmp_path):
    with pytest.raises(ConversionError, match="is not a directory"):
        convert_checkpoint(tmp_path / "nothing", tmp_path / "out", progress=False)
    model = _copy(tiny, tmp_path / "m")
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="no \\*.safetensors weight files.*safe_serialization=True"):
        convert_checkpoint(model, tmp_path / "out", progress=False)
    (model / "config.json").unlink()
    with pytest.raises(ConversionError, match="has no config.json"):
        convert_checkpoint(model, tmp_path / "out", progress=False)


def test_bad_options(tiny, tmp_path):
    out = tmp_path / "out"
    cases = [
        (dict(table_kind="gptq"), "--table-kind must be one of"),
        (dict(bits_min=4, bits_max=3), "--bits-min <= --bits-max"),
        (dict(bits_max=9), "--bits-max 9"),
        (dict(group_size=48), "--group-size must be a positive power of two"),
        (dict(calib_tokens=0), "--calib-tokens must be positive"),
        (dict(calib_text=tmp_path / "missing.txt"), "--calib-text .* is not a file"),
        (dict(bit_max=4), r"unknown conversion option\(s\) \['bit_max'\]"),
    ]
    for options, message in cases:
        with pytest.raises(ConversionError, match=message):
            convert_checkpoint(tiny, out, progress=False, **options)
    assert not out.exists()


def test_group_size_must_divide_in_features(tmp_path):
    model = make_tiny_moe(tmp_path / "m", "qwen3_moe", sizes=TinyMoESizes(num_layers=1, num_experts=2,
                                                                          vocab_size=320, moe_intermediate_size=48))
    with pytest.raises(ConversionError, match=r"down_proj.weight: in_features=48 is not a multiple of the group size 32"):
        convert_checkpoint(model, tmp_path / "out", group_size=32, progress=False)
    # kmeans has no groups, and a group size that divides every K works.
    assert APCheckpoint.open(convert_checkpoint(model, tmp_path / "km", table_kind="kmeans", bits_max=4, progress=False))
    assert APCheckpoint.open(convert_checkpoint(model, tmp_path / "g16", group_size=16, bits_max=4, progress=False))


def test_output_directory_rules(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    with pytest.raises(ConversionError, match="not empty; pass --force"):
        convert_checkpoint(tiny, out, bits_max=3, progress=False)
    assert (out / "precious.txt").exists()
    convert_checkpoint(tiny, out, bits_max=3, force=True, progress=False)
    assert not (out / "precious.txt").exists() and APCheckpoint.open(out).bits_max == 3
    with pytest.raises(ConversionError, match="is \\(or contains\\) the source model"):
        convert_checkpoint(tiny, tiny, force=True, progress=False)
    with pytest.raises(ConversionError, match="is \\(or contains\\) the source model"):
        convert_checkpoint(tiny, tiny.parent, force=True, progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match="not a directory"):
        convert_checkpoint(tiny, tmp_path / "file", progress=False)


def test_crash_leaves_nothing_that_looks_complete(tiny, tmp_path, monkeypatch):
    calls = []
    real = convert_module.quantize_block

    def crash_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_module, "quantize_block", crash_on_third)
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_checkpoint(tiny, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither OUT nor OUT.partial-<pid>

    # With --force over an existing conversion, a crash keeps the old output intact.
    monkeypatch.setattr(convert_module, "quantize_block", real)
    convert_checkpoint(tiny, tmp_path / "out", bits_max=3, progress=False)
    before = (tmp_path / "out" / "pagedweight" / "manifest.json").read_bytes()
    calls.clear()
    monkeypatch.setattr(convert_module, "quantize_block", crash_on_third)
    with pytest.raises(RuntimeError):
        convert_checkpoint(tiny, tmp_path / "out", force=True, progress=False)
    assert (tmp_path / "out" / "pagedweight" / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
