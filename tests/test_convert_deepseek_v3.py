"""DeepSeek-V3 checkpoints: V2's expert names plus multi-token-prediction (MTP) layers after the last decoder layer
(`num_nextn_predict_layers`). The converter pages the decoder layers' experts and copies the MTP layer as it is
(SGLang's NextN draft loads it from the output model); an expert layer past both is still refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedweight.format.checkpoint import APCheckpoint
from pagedweight.tools.convert import ConversionError, convert_checkpoint
from pagedweight.tools.tiny_model import TinyMoESizes, make_tiny_moe

SIZES = TinyMoESizes(num_layers=2, hidden_size=64, num_experts=4, top_k=2, moe_intermediate_size=64,
                     shared_expert_intermediate_size=128, vocab_size=320)


def _as_v3(base: Path, out: Path, extra_layers: int, mtp_layers: int = 1) -> Path:
    """The tiny DeepSeek-V2 as a V3 config with `extra_layers` copies of its MoE layer after the last one."""
    out.mkdir()
    state = load_file(str(base / "model.safetensors"))
    last = SIZES.num_layers - 1
    for i in range(extra_layers):
        layer = SIZES.num_layers + i
        for name, tensor in list(state.items()):
            if name.startswith(f"model.layers.{last}."):
                state[name.replace(f"model.layers.{last}.", f"model.layers.{layer}.", 1)] = tensor * (i + 2)
        state[f"model.layers.{layer}.eh_proj.weight"] = torch.randn(64, 128, dtype=torch.bfloat16)
        state[f"model.layers.{layer}.enorm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    config.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=mtp_layers)
    (out / "config.json").write_text(json.dumps(config))
    for side in base.iterdir():
        if side.is_file() and side.suffix != ".safetensors" and side.name != "config.json":
            (out / side.name).write_bytes(side.read_bytes())
    return out


@pytest.fixture(scope="module")
def tiny_v2(tmp_path_factory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("dsv3") / "v2", "deepseek_v2", seed=5, sizes=SIZES)


def test_the_mtp_layer_is_copied_and_the_decoder_experts_are_paged(tiny_v2, tmp_path, caplog):
    v3 = _as_v3(tiny_v2, tmp_path / "v3", extra_layers=1)
    with caplog.at_level(logging.INFO, logger="pagedweight"):
        out = convert_checkpoint(v3, tmp_path / "ap", progress=False)
    ckpt = APCheckpoint.open(out)
    ckpt.verify(deep=True, progress=False)
    assert {k.layer for k in ckpt.blocks()} == {1}  # layer 0 is dense (first_k_dense_replace), 2 is the MTP layer
    src, written = load_file(str(v3 / "model.safetensors")), load_file(str(out / "model.safetensors"))
    mtp = {n: t for n, t in src.items() if n.startswith("model.layers.2.")}
    assert any(".mlp.experts." in n for n in mtp) and "model.layers.2.eh_proj.weight" in mtp
    for name, tensor in mtp.items():  # every MTP tensor, its experts included, as it was
        assert torch.equal(written[name], tensor), name
    assert not any(n.startswith("model.layers.1.mlp.experts.") for n in written)  # paged, not copied
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and "layer(s) 2" in lines[0], lines


def test_expert_layers_past_the_mtp_layers_are_refused(tiny_v2, tmp_path):
    v3 = _as_v3(tiny_v2, tmp_path / "v3", extra_layers=2, mtp_layers=1)
    with pytest.raises(ConversionError, match="expert tensors for layer 3, but config.json has 2 layers"):
        convert_checkpoint(v3, tmp_path / "ap", progress=False)
