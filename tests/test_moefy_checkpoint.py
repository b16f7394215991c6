"""Mixtral checkpoint from a MoEfied tiny llama: names SGLang loads, transformers reload, top-k = all == dense."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from pagedweight.moefy.checkpoint import (
    METADATA_FILE,
    WEIGHTS_FILE,
    expected_tensor_names,
    set_served_top_k,
    write_mixtral_checkpoint,
)
from pagedweight.moefy.gguf_source import DenseLlamaWeights, LlamaShape, dense_llama_model
from pagedweight.moefy.moefier import MoefyLayerConfig, moefy_layer
from pagedweight.moefy.router import RouterFitConfig

SHAPE = LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
NUM_EXPERTS, TOP_K = 4, 2


def tiny_dense(seed: int = 0) -> DenseLlamaWeights:
    rng = np.random.default_rng(seed)
    h, i, kv = SHAPE.hidden_size, SHAPE.intermediate_size, SHAPE.num_key_value_heads * SHAPE.head_dim

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(SHAPE.vocab_size, h), "model.norm.weight": np.ones(h, np.float32)}
    for layer in range(SHAPE.num_hidden_layers):
        p = f"model.layers.{layer}"
        tensors |= {
            f"{p}.input_layernorm.weight": np.ones(h, np.float32),
            f"{p}.post_attention_layernorm.weight": np.ones(h, np.float32),
            f"{p}.self_attn.q_proj.weight": normal(h, h),
            f"{p}.self_attn.k_proj.weight": normal(kv, h),
            f"{p}.self_attn.v_proj.weight": normal(kv, h),
            f"{p}.self_attn.o_proj.weight": normal(h, h),
            f"{p}.mlp.gate_proj.weight": normal(i, h),
            f"{p}.mlp.up_proj.weight": normal(i, h),
            f"{p}.mlp.down_proj.weight": normal(h, i),
        }
    return DenseLlamaWeights(shape=SHAPE, tensors=tensors, source_types={}, gguf_path=Path("tiny.gguf"))


@pytest.fixture(scope="module")
def moefied(tmp_path_factory):
    dense = tiny_dense()
    config = MoefyLayerConfig(num_experts=NUM_EXPERTS, top_k_candidates=(TOP_K, NUM_EXPERTS), kmeans_iterations=3,
                              router=RouterFitConfig(steps=30))
    inputs = torch.randn(512, SHAPE.hidden_size, generator=torch.Generator().manual_seed(1))
    layers = []
    for index in range(SHAPE.num_hidden_layers):
        w = {n: torch.from_numpy(dense.tensors[f"model.layers.{index}.mlp.{n}.weight"]) for n in ("gate_proj", "up_proj", "down_proj")}
        layers.append(moefy_layer(w["gate_proj"], w["up_proj"], w["down_proj"], inputs, config, layer_seed=index))
    out = tmp_path_factory.mktemp("moefy") / "tiny-moefied"
    write_mixtral_checkpoint(out, dense, layers, TOP_K, dtype="float32", metadata={"note": "test"})
    return dense, layers, out


def test_checkpoint_names_and_config(moefied):
    _, _, out = moefied
    with safe_open(str(out / WEIGHTS_FILE), "pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("model.layers.1.block_sparse_moe.experts.3.w2.weight").shape == (32, 16)
        assert handle.get_tensor("model.layers.0.block_sparse_moe.gate.weight").shape == (NUM_EXPERTS, 32)
    assert names == expected_tensor_names(SHAPE.num_hidden_layers, NUM_EXPERTS)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 16)
    assert config["tie_word_embeddings"] is False
    record = json.loads((out / METADATA_FILE).read_text())
    assert record["top_k"] == TOP_K and len(record["expert_groups"]) == SHAPE.num_hidden_layers
    assert sorted(sum(record["expert_groups"][0], [])) == list(range(SHAPE.intermediate_size))


def test_expert_names_match_sglang_mixtral_loader(moefied):
    layer_module = pytest.importorskip("sglang.srt.layers.moe.fused_moe_triton.layer")
    mapping = layer_module.FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2", ckpt_up_proj_name="w3", num_experts=NUM_EXPERTS)
    _, _, out = moefied
    with safe_open(str(out / WEIGHTS_FILE), "pt") as handle:
        expert_names = [name for name in handle.keys() if ".experts." in name]
    for name in expert_names:  # SGLang's load_weights: first mapping entry whose weight_name is in the name
        assert any(weight_name in name for _, weight_name, _, _ in mapping), name


def test_transformers_reload_matches_dense_at_all_experts(moefied):
    from transformers import MixtralForCausalLM

    dense, layers, out = moefied
    model = MixtralForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    reference = dense_llama_model(dense)
    ids = torch.randint(0, SHAPE.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense_logits = reference(input_ids=ids).logits
        served = model(input_ids=ids).logits
        set_served_top_k(model, NUM_EXPERTS, layers, torch.float32)
        all_experts = model(input_ids=ids).logits
    assert not torch.allclose(served, dense_logits, atol=1e-3)  # top-2 of 4 is an approximation
    # Equal up to the flattened router's ~0.1% deviation from exactly uniform 1/E weights.
    assert ((all_experts - dense_logits).norm() / dense_logits.norm()).item() < 2e-3
    assert all(block.mlp.top_k == NUM_EXPERTS for block in model.model.layers)


def test_bad_dtype_is_rejected(moefied, tmp_path):
    dense, layers, _ = moefied
    with pytest.raises(ValueError, match="unknown dtype"):
        write_mixtral_checkpoint(tmp_path / "x", dense, layers, TOP_K, dtype="int4")
    with pytest.raises(ValueError, match="no w2 fitted"):
        write_mixtral_checkpoint(tmp_path / "y", dense, layers, 3, dtype="float32")
