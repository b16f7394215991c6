"""The tiny random Gemma-4 MoE config (`pagedweight make-tiny --arch gemma4`), shaped like Gemma-4-26B-A4B.

What it keeps of the released model, so that a test of it covers the same SGLang code paths:
- the multimodal checkpoint (`Gemma4ForConditionalGeneration`, model_type `gemma4`, decoder under
  `model.language_model`) with a one-layer vision tower (SGLang's CPU engine reads the vision config);
- every layer a dense GELU MLP (the shared expert) beside the routed experts, which the checkpoint stores fused
  (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), and a router with its own norm and scales;
- sliding-window layers (window 16, shorter than the test prompts) before one full-attention layer with its own
  head size and KV heads, so SGLang builds its hybrid sliding-window KV pool;
- tied embeddings and the final logit soft-cap.
"""

from __future__ import annotations

from typing import Any

GEMMA4_SLIDING_WINDOW = 16
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, position_embedding_size=64, max_position_embeddings=256)


def gemma4_config(sizes: Any, dtype: str):
    """A transformers Gemma4Config with the tiny sizes (`sizes`: tiny_model.TinyMoESizes, not imported here, since
    tiny_model imports this module; token ids as the tiny tokenizer places them)."""
    import transformers

    head = sizes.hidden_size // sizes.num_heads
    layer_types = ["sliding_attention"] * (sizes.num_layers - 1) + ["full_attention"]
    text = dict(
        vocab_size=sizes.vocab_size,
        vocab_size_per_layer_input=sizes.vocab_size,
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.shared_expert_intermediate_size,  # the dense MLP beside the experts
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_heads,
        num_key_value_heads=sizes.num_kv_heads,
        head_dim=head,
        global_head_dim=2 * head,
        num_global_key_value_heads=1,
        max_position_embeddings=sizes.max_position_embeddings,
        sliding_window=GEMMA4_SLIDING_WINDOW,
        layer_types=layer_types,
        hidden_size_per_layer_input=0,  # no per-layer embeddings (the MoE models have none)
        enable_moe_block=True,
        num_experts=sizes.num_experts,
        top_k_experts=sizes.top_k,
        moe_intermediate_size=sizes.moe_intermediate_size,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        dtype=dtype,
    )
    config = transformers.Gemma4Config(text_config=text, vision_config=dict(GEMMA4_VISION), audio_config=None,
                                       tie_word_embeddings=True)
    config.dtype = dtype
    return config
