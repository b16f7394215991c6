"""Calibration activations: the input of every layer's FFN in the dense model, on calibration text.

The router of layer l is fitted on the inputs the dense model feeds its FFN (after post_attention_layernorm),
as in MoEfication; all layers are captured in one pass over the text. Stored as float16 to keep memory
small (30 layers x 8192 tokens x 576 = 280 MB) and returned as float32 per layer on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


@dataclass
class FFNInputs:
    """Per-layer FFN inputs [tokens, hidden] of the dense model."""

    per_layer: list[torch.Tensor]  # float16

    @property
    def num_tokens(self) -> int:
        return self.per_layer[0].shape[0]

    def layer(self, index: int) -> torch.Tensor:
        return self.per_layer[index].float()


@torch.inference_mode()
def collect_ffn_inputs(model, token_ids: torch.Tensor, progress: bool = True) -> FFNInputs:
    """Run the dense llama on [windows, seq_len] tokens, recording each `layers[i].mlp` input."""
    layers = model.model.layers
    captured: list[list[torch.Tensor]] = [[] for _ in layers]

    def recorder(index: int):
        def hook(_module, args):
            captured[index].append(args[0].reshape(-1, args[0].shape[-1]).to("cpu", torch.float16))

        return hook

    handles = [layer.mlp.register_forward_pre_hook(recorder(i)) for i, layer in enumerate(layers)]
    try:
        for window in tqdm(token_ids, desc="calibration activations", disable=not progress, unit="window"):
            model(input_ids=window.unsqueeze(0), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return FFNInputs(per_layer=[torch.cat(chunks) for chunks in captured])
