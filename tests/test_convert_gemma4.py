"""Gemma-4 MoE conversion (issue #23): the fused 3-D expert tensors of a tiny random `gemma4` checkpoint become one
AP block per (layer, expert, proj), the dense GELU MLP beside them is the layer's shared expert, and everything
else (router, norms, attention, the vision tower) is copied into the servable model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pagedweight.format.arch import SHARED, BlockKey
from pagedweight.format.checkpoint import APCheckpoint, APCheckpointError
from pagedweight.tools.convert import ConversionError, convert_checkpoint
from pagedweight.tools.tiny_model import TinyMoESizes, make_tiny_moe

SIZES = TinyMoESizes(num_layers=2, num_experts=4, moe_intermediate_size=32)
LAYER = "model.language_model.layers"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("src") / "gemma4", "gemma4", sizes=SIZES)


@pytest.fixture(scope="module")
def ap(tiny, tmp_path_factory) -> Path:
    return convert_checkpoint(tiny, tmp_path_factory.mktemp("out") / "ap", bits_min=2, bits_max=8, progress=False)


def test_fixture_is_the_multimodal_checkpoint_with_fused_experts(tiny):
    config = json.loads((tiny / "config.json").read_text())
    assert config["model_type"] == "gemma4" and config["architectures"] == ["Gemma4ForConditionalGeneration"]
    text = config["text_config"]
    assert text["enable_moe_block"] and text["num_experts"] == 4
    assert "sliding_attention" in text["layer_types"] and text["layer_types"][-1] == "full_attention"
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        assert list(f.get_slice(f"{LAYER}.0.experts.gate_up_proj").get_shape()) == [4, 64, 64]
        assert list(f.get_slice(f"{LAYER}.0.experts.down_proj").get_shape()) == [4, 64, 32]


def test_fixture_reloads_in_transformers(tiny):
    import transformers

    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(str(tiny)).eval()
    saved = load_file(str(tiny / "model.safetensors"))
    assert torch.equal(model.model.language_model.layers[1].experts.down_proj, saved[f"{LAYER}.1.experts.down_proj"])
    ids = transformers.AutoTokenizer.from_pretrained(str(tiny))("The river ran quietly.").input_ids
    assert ids[0] == 0  # BOS, as text_config.bos_token_id says
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512) and torch.isfinite(logits).all()


def test_blocks_are_the_fused_experts_split_per_expert(tiny, ap):
    source = load_file(str(tiny / "model.safetensors"))
    with APCheckpoint.open(ap / "pagedweight") as ckpt:
        assert set(ckpt.blocks()) == {BlockKey(layer, e, p) for layer in (0, 1) for e in (*range(4), SHARED)
                                      for p in ("gate", "up", "down")}
        assert ckpt.name_of(1, 3, "up") == f"{LAYER}.1.experts.3.up_proj"
        assert ckpt.name_of(0, SHARED, "down") == f"{LAYER}.0.mlp.down_proj"
        for layer in (0, 1):
            gate_up = source[f"{LAYER}.{layer}.experts.gate_up_proj"].float()
            down = source[f"{LAYER}.{layer}.experts.down_proj"].float()
            for e in range(4):
                want = {"gate": gate_up[e, :32], "up": gate_up[e, 32:], "down": down[e]}
                for proj, w in want.items():
                    got = ckpt.block(ckpt.name_of(layer, e, proj)).dequantize(8)
                    err = float((got - w).square().sum() / w.square().sum())
                    assert err < 1e-3, (layer, e, proj, err)
                # gate rows come first: the other half is far off (a swapped split would pass the loop above only here)
                swapped = ckpt.block(ckpt.name_of(layer, e, "gate")).dequantize(8)
                assert float((swapped - want["up"]).square().sum() / want["up"].square().sum()) > 0.5
            mlp = ckpt.block(ckpt.name_of(layer, SHARED, "gate")).dequantize(8)
            ref = source[f"{LAYER}.{layer}.mlp.gate_proj.weight"].float()
            assert float((mlp - ref).square().sum() / ref.square().sum()) < 1e-3


def test_servable_model_keeps_dense_tensors_and_drops_routed_experts(tiny, ap):
    source = set(load_file(str(tiny / "model.safetensors")))
    kept = set(load_file(str(ap / "model.safetensors")))
    fused = {n for n in source if ".experts." in n}
    assert len(fused) == 4 and not kept & fused
    assert kept == source - fused  # the MLP (bf16 copy for --paged-weight-scope experts), router, vision tower
    assert f"{LAYER}.0.router.per_expert_scale" in kept and any(n.startswith("model.vision_tower.") for n in kept)


def test_manifest_model_reads_the_text_config(tiny, ap):
    with APCheckpoint.open(ap / "pagedweight") as ckpt:
        assert (ckpt.model.model_type, ckpt.model.num_hidden_layers, ckpt.model.num_experts) == ("gemma4", 2, 4)
        assert ckpt.model.hidden_size == 64
        config = json.loads((tiny / "config.json").read_text())
        ckpt.check_model_config(config)
        config["text_config"]["moe_intermediate_size"] = 64
        with pytest.raises(APCheckpointError, match="moe_intermediate_size"):
            ckpt.check_model_config(config)


def test_fused_tensor_of_the_wrong_expert_count_is_refused(tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    state = load_file(str(bad / "model.safetensors"))
    name = f"{LAYER}.1.experts.down_proj"
    state[name] = state[name][:3].clone()
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"experts\.down_proj: shape \[3, 64, 32\], expected \[4 experts"):
        convert_checkpoint(bad, tmp_path / "out", progress=False)


def test_text_only_gemma4_checkpoint_converts(tiny, tmp_path):
    """`gemma4_text` (Gemma4ForCausalLM: the decoder under model.layers) takes the same split."""
    text = tmp_path / "text"
    text.mkdir()
    config = json.loads((tiny / "config.json").read_text())["text_config"]
    (text / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma4ForCausalLM"]}))
    state = {n.replace("model.language_model.", "model."): t for n, t in load_file(str(tiny / "model.safetensors")).items()
             if n.startswith("model.language_model.")}
    save_file(state, str(text / "model.safetensors"), metadata={"format": "pt"})
    out = convert_checkpoint(text, tmp_path / "out", progress=False)
    with APCheckpoint.open(out / "pagedweight") as ckpt:
        assert ckpt.model.model_type == "gemma4_text" and len(ckpt.blocks()) == 2 * 5 * 3
        w = state["model.layers.0.experts.down_proj"][2].float()
        got = ckpt.block(ckpt.name_of(0, 2, "down")).dequantize(8)
        assert float((got - w).square().sum() / w.square().sum()) < 1e-3
    assert torch.is_tensor(load_file(str(out / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"])


def test_dense_linears_are_the_text_layers_attention(tiny, tmp_path):
    """`--dense-linears` on the multimodal checkpoint: the text layers' q/k/v/o under model.language_model.layers,
    not the vision tower's attention (model.vision_tower.encoder.layers.N.self_attn.*), and no lm_head (tied)."""
    out = convert_checkpoint(tiny, tmp_path / "ap", bits_min=2, bits_max=4, dense_linears=True, progress=False)
    ckpt = APCheckpoint.open(out)
    assert ckpt.dense_names() == [f"{LAYER}.{i}.self_attn.{p}_proj" for i in range(SIZES.num_layers) for p in "koqv"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        src = load_file(str(tiny / "model.safetensors"))
        for name in ckpt.dense_names():  # the bf16 originals stay in the servable model, for scope experts
            assert torch.equal(f.get_tensor(f"{name}.weight"), src[f"{name}.weight"])
        assert "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight" in f.keys()
    spec = ckpt.spec(f"{LAYER}.1.self_attn.q_proj")  # the full-attention layer's wider heads
    assert (spec.out_features, spec.in_features) == tuple(src[f"{LAYER}.1.self_attn.q_proj.weight"].shape)
