#!/usr/bin/env python3
"""Config-only model directories at real shapes, for `--load-format dummy` speed runs.

    python benchmark/dummy_model.py --model qwen15moe --out out/qwen15moe-dummy

SGLang's dummy loader needs only config.json and tokenizer files; with --enable-paged-weight the experts get
random AP planes at the same shapes (speed does not depend on weight values). The tokenizer is the tiny
project tokenizer (its ids are a subset of the model's vocabulary).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Published configs (shapes only; values that do not change tensor shapes are kept as published).
CONFIGS = {
    "qwen15moe": {  # Qwen1.5-MoE-A2.7B
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
        "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 24, "num_experts": 60,
        "num_experts_per_tok": 4, "norm_topk_prob": False, "vocab_size": 151936, "max_position_embeddings": 8192,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": 32768, "max_window_layers": 21, "router_aux_loss_coef": 0.001, "attention_dropout": 0.0,
        "initializer_range": 0.02,
    },
    "mixtral": {  # Mixtral-8x7B-v0.1
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "sliding_window": None, "router_aux_loss_coef": 0.02,
        "attention_dropout": 0.0, "initializer_range": 0.02,
    },
    "qwen3moe": {  # Qwen3-30B-A3B: 128 experts top-8 of 768, 32 query / 4 KV heads of 128, QK norm, no shared expert
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
        "attention_bias": False, "attention_dropout": 0.0, "router_aux_loss_coef": 0.001, "initializer_range": 0.02,
    },
    "deepseek_v2_lite": {  # DeepSeek-V2-Lite: MLA (kv_lora_rank 512), 64 routed experts top-6 + 2 shared, first layer dense
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False, "scoring_func": "softmax",
        "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu", "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06, "rope_theta": 10000, "attention_bias": False, "attention_dropout": 0.0,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "vocab_size": 102400, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "initializer_range": 0.02,
    },
    "glm45_air": {  # GLM-4.5-Air: 128 routed experts top-8 + 1 shared, 96 query / 8 KV heads, first layer dense
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5, "rope_theta": 1000000,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "vocab_size": 151552, "attention_bias": True,
        "use_qk_norm": False, "num_nextn_predict_layers": 0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "attention_dropout": 0.0, "initializer_range": 0.02,
    },
}


# Gemma-4-26B-A4B's decoder (the text config of the published multimodal checkpoint): 128 experts top-8 with GELU
# gates beside a dense GELU MLP in every layer, 5 sliding-window layers (window 1024, head 256, 8 KV heads) per
# full-attention layer (head 512, 2 KV heads, K = V). The vision tower is the tiny one of tools/tiny_gemma4.py:
# SGLang builds it from the config, the text benchmarks never run it.
GEMMA4_26B_A4B_TEXT = {
    "hidden_size": 2816, "intermediate_size": 2112, "moe_intermediate_size": 704, "num_hidden_layers": 30,
    "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2, "head_dim": 256,
    "global_head_dim": 512, "num_experts": 128, "top_k_experts": 8, "enable_moe_block": True, "vocab_size": 262144,
    "vocab_size_per_layer_input": 262144, "sliding_window": 1024, "final_logit_softcapping": 30.0,
    "attention_bias": False, "attention_k_eq_v": True, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
}
GEMMA4_LAYER_PATTERN = ["sliding_attention"] * 5 + ["full_attention"]


def gemma4_26b_a4b_config(num_layers: int | None, bos: int, eos: int) -> dict:
    """The multimodal Gemma4Config (as the checkpoint ships it) around the 26B-A4B decoder, cut to `num_layers`
    (the layer types keep the published 5:1 pattern from the first layer)."""
    import transformers

    from pagedweight.tools.tiny_gemma4 import GEMMA4_VISION

    text = dict(GEMMA4_26B_A4B_TEXT)
    layers = num_layers or text["num_hidden_layers"]
    text["num_hidden_layers"] = layers
    text["layer_types"] = [GEMMA4_LAYER_PATTERN[i % len(GEMMA4_LAYER_PATTERN)] for i in range(layers)]
    text.update(bos_token_id=bos, eos_token_id=eos, pad_token_id=2, dtype="bfloat16")
    cfg = transformers.Gemma4Config(text_config=text, vision_config=dict(GEMMA4_VISION), audio_config=None,
                                    tie_word_embeddings=True).to_dict()
    cfg["architectures"] = ["Gemma4ForConditionalGeneration"]
    cfg["torch_dtype"] = "bfloat16"
    cfg["max_position_embeddings"] = text["max_position_embeddings"]  # for the tokenizer's max length below
    return cfg


MODELS = sorted([*CONFIGS, "gemma4_26b_a4b"])


def make_dummy_model(name: str, out: Path, num_layers: int | None = None) -> Path:
    from pagedweight.tools.tiny_model import BOS_TOKEN, EOS_TOKEN, SPECIAL_TOKENS, write_tokenizer

    bos, eos = SPECIAL_TOKENS.index(BOS_TOKEN), SPECIAL_TOKENS.index(EOS_TOKEN)
    if name == "gemma4_26b_a4b":
        cfg = gemma4_26b_a4b_config(num_layers, bos, eos)
    else:
        cfg = dict(CONFIGS[name])
        if num_layers is not None:
            cfg["num_hidden_layers"] = num_layers
    cfg["bos_token_id"] = bos
    cfg["eos_token_id"] = eos
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer(out, vocab_size=1000, max_length=cfg["max_position_embeddings"])
    if name == "gemma4_26b_a4b":  # launch_server (pressure_bench.py) loads the multimodal checkpoint's processor
        from pagedweight.tools.tiny_gemma4 import write_gemma4_processor

        write_gemma4_processor(out, cfg["text_config"]["vocab_size"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="qwen15moe")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-layers", type=int, default=None, help="override the layer count (smaller runs)")
    args = ap.parse_args()
    print(make_dummy_model(args.model, args.out, args.num_layers))


if __name__ == "__main__":
    main()
