"""Write a MoEfied llama as a Mixtral-architecture Hugging Face checkpoint that stock SGLang serves.

On-disk tensor names are the classic per-expert Mixtral ones, which SGLang 0.5.17's
`MixtralForCausalLM.load_weights` maps onto its fused MoE (`ckpt_gate_proj_name="w1"`, down "w2", up
"w3") and which transformers 5 fuses on load (its conversion mapping for "mixtral"):

    model.layers.L.block_sparse_moe.gate.weight            [E, H]
    model.layers.L.block_sparse_moe.experts.X.w1.weight    [I_e, H]   (gate_proj rows)
    model.layers.L.block_sparse_moe.experts.X.w3.weight    [I_e, H]   (up_proj rows)
    model.layers.L.block_sparse_moe.experts.X.w2.weight    [H, I_e]   (down_proj columns, times c_k)

SGLang's Mixtral has no tied-embedding path (its lm_head is always a separate parameter), so the tied
SmolLM2 embedding is written twice, as `model.embed_tokens.weight` and `lm_head.weight`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedweight.moefy.gguf_source import DenseLlamaWeights, LlamaShape
from pagedweight.moefy.moefier import MoefiedLayer

WEIGHTS_FILE = "model.safetensors"
METADATA_FILE = "moefy.json"
ATTENTION_NAMES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def expert_tensor_names(layer: int, num_experts: int) -> list[str]:
    prefix = f"model.layers.{layer}.block_sparse_moe"
    names = [f"{prefix}.gate.weight"]
    for expert in range(num_experts):
        names += [f"{prefix}.experts.{expert}.{w}.weight" for w in ("w1", "w2", "w3")]
    return names


def expected_tensor_names(num_layers: int, num_experts: int) -> set[str]:
    """Every tensor name the Mixtral checkpoint must contain (what SGLang's loader expects)."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        names |= {f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"}
        names |= {f"{prefix}.self_attn.{name}.weight" for name in ATTENTION_NAMES}
        names |= set(expert_tensor_names(layer, num_experts))
    return names


def mixtral_config(shape: LlamaShape, num_experts: int, top_k: int, expert_size: int, dtype: str):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=expert_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        sliding_window=None,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        output_router_logits=False,
        tie_word_embeddings=False,
        bos_token_id=shape.bos_token_id,
        eos_token_id=shape.eos_token_id,
        hidden_act="silu",
        dtype=dtype,
        architectures=["MixtralForCausalLM"],  # SGLang picks the model class from this list
    )


def mixtral_tensors(
    dense: DenseLlamaWeights, layers: list[MoefiedLayer], top_k: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """All checkpoint tensors for the model served at `top_k` (its scaled or refitted w2)."""
    if len(layers) != dense.shape.num_hidden_layers:
        raise ValueError(f"{len(layers)} MoEfied layers for a {dense.shape.num_hidden_layers}-layer model")
    source = dense.tensors

    def tensor(array) -> torch.Tensor:
        return torch.as_tensor(array).to(dtype).contiguous()

    embedding = tensor(source["model.embed_tokens.weight"])
    tensors = {
        "model.embed_tokens.weight": embedding,
        "model.norm.weight": tensor(source["model.norm.weight"]),
        # A separate copy: safetensors refuses tensors that share memory.
        "lm_head.weight": tensor(source.get("lm_head.weight", source["model.embed_tokens.weight"])).clone(),
    }
    for index, layer in enumerate(layers):
        if top_k not in layer.down_by_top_k:
            raise ValueError(f"layer {index} has no w2 fitted for top-k {top_k} (fitted: {sorted(layer.down_by_top_k)})")
        prefix = f"model.layers.{index}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = tensor(source[f"{prefix}.{norm}.weight"])
        for name in ATTENTION_NAMES:
            tensors[f"{prefix}.self_attn.{name}.weight"] = tensor(source[f"{prefix}.self_attn.{name}.weight"])
        moe = f"{prefix}.block_sparse_moe"
        tensors[f"{moe}.gate.weight"] = tensor(layer.router)
        down = layer.down_by_top_k[top_k]
        for expert in range(layer.split.num_experts):
            tensors[f"{moe}.experts.{expert}.w1.weight"] = tensor(layer.split.w1[expert])
            tensors[f"{moe}.experts.{expert}.w3.weight"] = tensor(layer.split.w3[expert])
            tensors[f"{moe}.experts.{expert}.w2.weight"] = tensor(down[expert])
    return tensors


def write_mixtral_checkpoint(
    out_dir: Path,
    dense: DenseLlamaWeights,
    layers: list[MoefiedLayer],
    top_k: int,
    dtype: str = "bfloat16",
    metadata: dict | None = None,
) -> Path:
    """Write config.json, generation_config.json, model.safetensors and moefy.json into out_dir."""
    from transformers import GenerationConfig

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_experts = layers[0].split.num_experts
    expert_size = layers[0].split.w1.shape[1]
    config = mixtral_config(dense.shape, num_experts, top_k, expert_size, dtype)
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=dense.shape.bos_token_id, eos_token_id=dense.shape.eos_token_id).save_pretrained(out_dir)
    tensors = mixtral_tensors(dense, layers, top_k, DTYPES[dtype])
    missing = expected_tensor_names(dense.shape.num_hidden_layers, num_experts) - tensors.keys()
    if missing:
        raise AssertionError(f"checkpoint would lack {sorted(missing)[:3]}")
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    record = {
        "top_k": top_k,
        "num_experts": num_experts,
        "expert_size": expert_size,
        # Scale c_k per layer for every fitted top-k (w2 = c_k * dense columns, before any refit).
        "output_scales": {str(k): [layer.output_scales[k] for layer in layers] for k in layers[0].output_scales},
        "expert_groups": [layer.split.groups.tolist() for layer in layers],
        **(metadata or {}),
    }
    (out_dir / METADATA_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return out_dir


def set_served_top_k(model, top_k: int, layers: list[MoefiedLayer], checkpoint_dtype: torch.dtype) -> None:
    """Re-target a loaded transformers Mixtral to another fitted top-k: routing width and w2, in place.

    w2 is rounded through `checkpoint_dtype` first, so the model equals what loading a checkpoint written
    for that top-k would give.
    """
    with torch.no_grad():
        for index, (decoder_layer, layer) in enumerate(zip(model.model.layers, layers, strict=True)):
            if top_k not in layer.down_by_top_k:
                raise ValueError(f"layer {index} has no w2 fitted for top-k {top_k}")
            block = decoder_layer.mlp
            block.top_k = top_k
            block.gate.top_k = top_k
            block.experts.down_proj.copy_(layer.down_by_top_k[top_k].to(checkpoint_dtype))
    model.config.num_experts_per_tok = top_k
