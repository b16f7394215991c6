"""FP8 block-quantized sources (DeepSeek-V3 style `weight_scale_inv` tensors): the converter dequantizes them on
the fly, and the AP checkpoint equals the one made from the dequantized float32 twin, block for block."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedweight.format.checkpoint import APCheckpoint
from pagedweight.tools.convert import ConversionError, convert_checkpoint
from pagedweight.tools.source_format import SCALE_SUFFIX
from pagedweight.tools.tiny_model import TinyMoESizes, make_tiny_moe

SIZES = TinyMoESizes(num_layers=2, hidden_size=64, num_experts=4, top_k=2, moe_intermediate_size=64,
                     shared_expert_intermediate_size=128, vocab_size=320)
BLOCK = (48, 40)  # partial last blocks in both directions on 64- and 128-wide weights
FP8_MAX = 448.0


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 values, float32 scale_inv per block, the float32 weight they stand for), block by block."""
    n, k = w.shape
    bn, bk = BLOCK
    rows, cols = -(-n // bn), -(-k // bk)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows, cols, dtype=torch.float32)
    deq = torch.empty(n, k, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = max(tile.abs().max().item(), 1e-8) / FP8_MAX
            qt = (tile / s).to(torch.float8_e4m3fn)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qt
            scale[i, j] = s
            deq[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qt.float() * s
    return q, scale, deq


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
    """(an FP8 block source with its scales in a second shard, its dequantized float32 twin)."""
    root = tmp_path_factory.mktemp("fp8")
    base = make_tiny_moe(root / "base", "qwen2_moe", seed=3, sizes=SIZES)
    state = load_file(str(base / "model.safetensors"))
    fp8_dir, twin_dir = root / "fp8", root / "twin"
    for d in (fp8_dir, twin_dir):
        shutil.copytree(base, d, ignore=shutil.ignore_patterns("*.safetensors"))
    weights, scales, twin = {}, {}, {}
    for name, tensor in state.items():
        if name.endswith("_proj.weight"):  # experts, shared expert, attention: FP8 like DeepSeek-V3
            q, s, deq = _fp8_blocks(tensor)
            weights[name], scales[name + SCALE_SUFFIX], twin[name] = q, s, deq
        else:
            weights[name], twin[name] = tensor, tensor
    save_file(weights, str(fp8_dir / "model-00001-of-00002.safetensors"))
    save_file(scales, str(fp8_dir / "model-00002-of-00002.safetensors"))
    save_file(twin, str(twin_dir / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "fmt": "e4m3",
                                     "activation_scheme": "dynamic"}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, twin_dir


def test_fp8_source_equals_its_dequantized_twin(sources, tmp_path):
    fp8_dir, twin_dir = sources
    out = convert_checkpoint(fp8_dir, tmp_path / "from_fp8", progress=False)
    ref = convert_checkpoint(twin_dir, tmp_path / "from_twin", progress=False)
    a, b = APCheckpoint.open(out), APCheckpoint.open(ref)
    a.verify(deep=True, progress=False)
    assert set(a.blocks()) == set(b.blocks()) and len(a.blocks()) == 2 * (4 + 1) * 3
    for key in a.blocks():
        name = a.name_of(key.layer, key.expert, key.proj)
        x, y = a.block(name), b.block(name)
        assert torch.equal(x.planes, y.planes), name
        for bits in a.bitwidths:
            assert torch.equal(x.dequantize(bits), y.dequantize(bits)), (name, bits)
    manifest = json.loads((out / "pagedweight" / "manifest.json").read_text())
    assert manifest["source_format"] == "fp8_block48x40"
    assert "source_format" not in json.loads((ref / "pagedweight" / "manifest.json").read_text())
    # The servable model: dequantized weights in the model dtype, no scales, a config without quantization
    dense, twin = load_file(str(out / "model.safetensors")), load_file(str(twin_dir / "model.safetensors"))
    assert not [n for n in dense if n.endswith(SCALE_SUFFIX)]
    shared = "model.layers.1.mlp.shared_expert.down_proj.weight"
    for name in (shared, "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        assert dense[name].dtype == torch.bfloat16 and torch.equal(dense[name], twin[name].to(torch.bfloat16)), name
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    a.check_model_config(config)


def _broken(sources, tmp_path, edit) -> Path:
    fp8_dir, _ = sources
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    edit(bad)
    return bad


def test_fp8_source_refusals(sources, tmp_path, capsys):
    def other_method(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
        (d / "config.json").write_text(json.dumps(cfg))

    with pytest.raises(ConversionError, match="quant_method 'awq'.*convert from the unquantized checkpoint"):
        convert_checkpoint(_broken(sources, tmp_path / "a", other_method), tmp_path / "o1", progress=False)

    def no_config(d):
        cfg = json.loads((d / "config.json").read_text())
        del cfg["quantization_config"]
        (d / "config.json").write_text(json.dumps(cfg))

    with pytest.raises(ConversionError, match="no FP8 quantization_config"):
        convert_checkpoint(_broken(sources, tmp_path / "b", no_config), tmp_path / "o2", progress=False)

    def wrong_scale(d):
        shard = d / "model-00002-of-00002.safetensors"
        scales = load_file(str(shard))
        name = "model.layers.0.mlp.experts.1.up_proj.weight" + SCALE_SUFFIX
        scales[name] = scales[name][:1]
        save_file(scales, str(shard))

    with pytest.raises(ConversionError, match=r"up_proj.weight_scale_inv: shape \(1, 2\), expected \(2, 2\)"):
        convert_checkpoint(_broken(sources, tmp_path / "c", wrong_scale), tmp_path / "o3", progress=False)
    assert not (tmp_path / "o3").exists() and not list(tmp_path.glob("o3.partial-*"))  # nothing half-written

    def lost_scale(d):
        shard = d / "model-00002-of-00002.safetensors"
        scales = load_file(str(shard))
        del scales["model.layers.1.self_attn.o_proj.weight" + SCALE_SUFFIX]
        save_file(scales, str(shard))

    with pytest.raises(ConversionError, match="o_proj.weight: float8 weights without a"):
        convert_checkpoint(_broken(sources, tmp_path / "d", lost_scale), tmp_path / "o4", progress=False)
