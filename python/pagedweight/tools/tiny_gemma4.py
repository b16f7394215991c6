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


# Gemma-4's media tokens, named as its processor reads them off the tokenizer (Gemma4Processor.__init__)
GEMMA4_MEDIA_TOKENS = {"image_token": "<|image|>", "boi_token": "<|boi|>", "eoi_token": "<|eoi|>",
                       "audio_token": "<|audio|>", "boa_token": "<|boa|>", "eoa_token": "<|eoa|>"}
# the ids the processor adds to a tokenizer: the media tokens and the video token Gemma4Processor adds itself
GEMMA4_PROCESSOR_TOKENS = len(GEMMA4_MEDIA_TOKENS) + 1


def write_gemma4_processor(out_dir: Any, vocab_size: int) -> None:
    """Write the processor files a Gemma-4 checkpoint ships (processor_config.json with transformers' default image,
    video and audio processors) beside the tokenizer in `out_dir`, which gains the media tokens as named special
    tokens. `sglang.launch_server` builds this processor for the multimodal architecture whatever the requests hold
    (it has no flag to skip it); text-only tests and benchmarks never send media. The new token ids must stay inside
    the model's vocabulary (`vocab_size`)."""
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    out = Path(out_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out), extra_special_tokens=dict(GEMMA4_MEDIA_TOKENS))
    processor = Gemma4Processor(Gemma4AudioFeatureExtractor(), Gemma4ImageProcessor(), tokenizer,
                                Gemma4VideoProcessor())
    if len(tokenizer) > vocab_size:
        raise ValueError(f"Gemma-4 media tokens need {len(tokenizer)} ids; the model's vocabulary has {vocab_size}")
    processor.save_pretrained(str(out))
