"""A dense SwiGLU FFN split into experts, and the Mixtral-style forward pass that serves it.

A dense FFN is `down @ (silu(gate @ x) * (up @ x))`. Partitioning the intermediate neurons into groups
G_1..G_E makes it an exact sum of experts, `sum_e f_e(x)` with `f_e(x) = w2_e @ (silu(w1_e @ x) * (w3_e @ x))`
and w1_e/w3_e the group's rows of gate/up, w2_e the group's columns of down.

Mixtral serves `sum_{e in topk} p_e * f'_e(x)` where p are the softmax router probabilities of the chosen
experts renormalized to sum to 1. Its weights are therefore always a convex combination, so the per-expert
output scale must be folded into w2: with `f'_e = c * f_e` and near-equal weights `p_e ~ 1/k`, the MoE
computes about `(c / k) * sum_{e in topk} f_e(x)`. The build fits `c` per layer by least squares against
the dense output (about k when the unchosen experts contribute little); with every expert chosen and
`c = E`, uniform weights give back the dense FFN exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExpertSplit:
    """One layer's FFN as E equal experts (before any output scale)."""

    w1: torch.Tensor  # [E, I_e, H]  gate_proj rows of each group
    w3: torch.Tensor  # [E, I_e, H]  up_proj rows
    w2: torch.Tensor  # [E, H, I_e]  down_proj columns
    groups: torch.Tensor  # [E, I_e]  the dense neuron indices of each expert

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]


def split_ffn(
    gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor, groups: torch.Tensor
) -> ExpertSplit:
    """Slice a dense FFN ([I, H], [I, H], [H, I]) into experts along the given neuron groups [E, I_e]."""
    intermediate = gate_proj.shape[0]
    flat = groups.reshape(-1)
    if flat.numel() != intermediate or not torch.equal(flat.sort().values, torch.arange(intermediate)):
        raise ValueError(f"groups must partition all {intermediate} neurons exactly once")
    return ExpertSplit(
        w1=gate_proj[groups].contiguous(),
        w3=up_proj[groups].contiguous(),
        w2=down_proj[:, groups].permute(1, 0, 2).contiguous(),
        groups=groups.clone(),
    )


def dense_ffn(x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate_proj.T) * (x @ up_proj.T)) @ down_proj.T


def expert_outputs(x: torch.Tensor, split: ExpertSplit) -> torch.Tensor:
    """Every expert's unscaled output for every token: [E, N, H] (calibration only: it runs all experts)."""
    hidden = F.silu(torch.einsum("nh,eih->eni", x, split.w1)) * torch.einsum("nh,eih->eni", x, split.w3)
    return torch.einsum("eni,ehi->enh", hidden, split.w2)


def mixtral_routing(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's routing (transformers and SGLang alike): softmax, top-k, renormalize. -> (weights, ids)."""
    probabilities = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def mixtral_moe_forward(
    x: torch.Tensor, split: ExpertSplit, router_weight: torch.Tensor, top_k: int, output_scale: torch.Tensor | float
) -> torch.Tensor:
    """What a Mixtral MoE block with w2 scaled by `output_scale` computes for tokens x [N, H]."""
    weights, ids = mixtral_routing(x @ router_weight.T, top_k)
    output = torch.zeros_like(x)
    for expert in range(split.num_experts):
        token_index, slot = torch.nonzero(ids == expert, as_tuple=True)
        if token_index.numel() == 0:
            continue
        tokens = x[token_index]
        hidden = F.silu(tokens @ split.w1[expert].T) * (tokens @ split.w3[expert].T)
        contribution = (hidden @ split.w2[expert].T) * output_scale
        output.index_add_(0, token_index, contribution * weights[token_index, slot, None].to(x.dtype))
    return output
