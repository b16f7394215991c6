"""Per-layer router for a MoEfied FFN: a bias-free linear map, as Mixtral's `gate` is.

Target (MoEfication): the experts that carry the most of the FFN's output for a token. On calibration
tokens we know every expert's output norm ||f_e(x)||; the router is fitted to rank experts by it:

1. least squares from x to the per-token standardized norms (a good, deterministic start), then
2. a few hundred full-batch Adam steps on the cross-entropy between softmax(router(x)) and the norms'
   share per token, which optimizes the ranking rather than the raw values.

Only the ranking is used at serving time. Mixtral weights the chosen experts by their renormalized softmax
probabilities; measured on SmolLM2 layers, near-uniform weights approximate the dense FFN better than the
fitted probabilities (the output scale is folded into w2 instead, see moe_ffn.py), so the fitted logits are
shrunk to a tiny spread (`flatten_router`): the order, and so the top-k choice, is unchanged while the
weights become 1/k to within about 0.1%.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RouterFitConfig:
    steps: int = 300
    learning_rate: float = 1e-2
    seed: int = 0


def fit_router(inputs: torch.Tensor, expert_norms: torch.Tensor, config: RouterFitConfig = RouterFitConfig()) -> torch.Tensor:
    """Fit a router [E, H] from FFN inputs [N, H] and each expert's output norm per token [N, E]."""
    if inputs.dim() != 2 or expert_norms.dim() != 2 or inputs.shape[0] != expert_norms.shape[0]:
        raise ValueError(f"inputs {tuple(inputs.shape)} and expert_norms {tuple(expert_norms.shape)} do not match")
    inputs = inputs.float()
    norms = expert_norms.float()
    standardized = (norms - norms.mean(1, keepdim=True)) / norms.std(1, keepdim=True).clamp_min(1e-12)
    # Normal equations in float64 (torch.linalg.lstsq is not bitwise reproducible run to run on CPU).
    gram = inputs.double().T @ inputs.double()
    gram += 1e-6 * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)
    weight = torch.linalg.solve(gram, inputs.double().T @ standardized.double()).T.float().contiguous()  # [E, H]
    share = norms / norms.sum(1, keepdim=True).clamp_min(1e-12)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)  # Adam is deterministic on CPU; the seed pins anything else
    try:
        weight.requires_grad_(True)
        optimizer = torch.optim.Adam([weight], lr=config.learning_rate)
        with torch.enable_grad():
            for _ in range(config.steps):
                loss = -(share * torch.log_softmax(inputs @ weight.T, dim=-1)).sum(1).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.random.set_rng_state(generator_state)
    return weight.detach()


def flatten_router(weight: torch.Tensor, inputs: torch.Tensor, logit_std: float = 1e-3) -> torch.Tensor:
    """Scale a router so its logits have standard deviation `logit_std` on `inputs` (same expert order)."""
    logits = inputs.float() @ weight.T
    spread = (logits - logits.mean(1, keepdim=True)).std().item()
    if spread == 0.0:
        raise ValueError("router logits are constant on the calibration inputs; cannot rank experts")
    return weight * (logit_std / spread)


def selection_recall(router_logits: torch.Tensor, expert_norms: torch.Tensor, top_k: int) -> float:
    """Share of the truly largest-norm top-k experts that the router also picks (1.0 = oracle)."""
    chosen = torch.zeros_like(expert_norms, dtype=torch.bool).scatter_(1, router_logits.topk(top_k, -1).indices, True)
    oracle = torch.zeros_like(chosen).scatter_(1, expert_norms.topk(top_k, -1).indices, True)
    return (chosen & oracle).sum().item() / oracle.sum().item()
