"""`--load-format dummy` under PagedWeight: RMSNorm weights at 1 so the experts' bitwidths are observable.

SGLang's dummy loader draws every weight from U(-1e-3, 1e-3), RMSNorm weights included. Every normalized
activation is then ~1e-3 in size, the experts' output (~1e-7 at Qwen1.5-MoE shapes) rounds away against the
residual in bf16, and the final norm leaves logits of ~1e-5: a server with its experts at 3 bits answers,
logprob for logprob, exactly as one at 8 (docs/results/tp2.md). No "same outputs at the same plan" check on
such a model could fail. With unit norm weights (what a trained model's norms are near) the experts' output
and the logits have working sizes, so bitwidths show in the logprobs. Speed does not depend on the values,
and SGLang's other dummy weights stay as SGLang drew them.
"""

from __future__ import annotations

import torch


def unit_norm_weights(model: torch.nn.Module) -> int:
    """Set the weight of every SGLang RMSNorm in `model` to 1; returns how many were set."""
    from sglang.srt.layers.layernorm import RMSNorm

    count = 0
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, RMSNorm) and isinstance(weight, torch.Tensor):
                weight.fill_(1.0)
                count += 1
    return count
