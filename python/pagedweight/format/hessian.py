"""Calibration for the converter: per-input second moments h_j = E[x_j^2] of every expert linear.

Method. The source model runs in transformers on CPU (float32) over `num_tokens` tokens of the given text,
cut into windows of `window` tokens (a seeded random subset of windows when the text is longer). A
forward pre-hook on each MoE layer's block (`model.layers[L].mlp`) records the block's input hidden states
X_L. Routing and expert activations are then recomputed from the checkpoint's own tensors, so nothing
depends on how the installed transformers lays out its expert modules:

  routed expert e of layer L: tokens T_e = {t : e in top_k(X_L[t] @ W_router^T)} (softmax is monotone,
      so every supported family routes by the top-k logits);
      gate/up: h = mean_{t in T_e} X_L[t]^2;  down: h = mean_{t in T_e} a_t^2 with the expert's own
      intermediate activation a_t = silu(X_L[t] W_gate^T) * (X_L[t] W_up^T);
  shared expert: the same over all tokens.

An expert that no calibration token reached gets no entry (the quantizer then uses uniform weights);
`HessianStats.tokens_per_block` records the counts so the report can say how many there were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pagedweight.format.arch import SHARED, BlockKey


@dataclass
class HessianStats:
    source: str
    num_tokens: int
    hessian: dict[BlockKey, torch.Tensor]  # h_j per input column, float32 [K]
    tokens_per_block: dict[BlockKey, int]

    def uncalibrated(self, keys: list[BlockKey]) -> list[BlockKey]:
        return [k for k in keys if k not in self.hessian]


def calibration_windows(token_ids: list[int], num_tokens: int, window: int, seed: int) -> list[list[int]]:
    """Windows of `window` tokens covering ~num_tokens tokens; a seeded random subset if the text is longer."""
    windows = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    needed = -(-num_tokens // window)
    if len(windows) > needed:
        generator = torch.Generator().manual_seed(seed)
        chosen = sorted(torch.randperm(len(windows), generator=generator)[:needed].tolist())
        windows = [windows[i] for i in chosen]
    out, total = [], 0
    for w in windows:
        take = w[: num_tokens - total]
        if len(take) >= 1:
            out.append(take)
            total += len(take)
        if total >= num_tokens:
            break
    return out


def collect_moe_inputs(model_dir: Path, text: str, num_tokens: int, seed: int, layers: list[int], window: int = 256):
    """Run the model on the text; return ({layer: X_L [T, H] float32}, tokens used)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    windows = calibration_windows(ids, num_tokens, window, seed)
    used = sum(len(w) for w in windows)
    if used == 0:
        raise ValueError("the calibration text produced no tokens; pass a non-empty --calib-text file")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    decoder_layers = model.model.layers
    captured: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    handles = []
    for layer in layers:
        names = [n for n in ("mlp", "block_sparse_moe") if hasattr(decoder_layers[layer], n)]
        if not names:
            raise RuntimeError(f"cannot find the MoE block of decoder layer {layer} (no .mlp / .block_sparse_moe)")
        block = getattr(decoder_layers[layer], names[0])

        def hook(_module, args, kwargs, layer=layer):
            x = args[0] if args else kwargs["hidden_states"]
            captured[layer].append(x.detach().reshape(-1, x.shape[-1]).float())

        handles.append(block.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            for window_ids in tqdm(windows, desc="calibration forward", unit="window"):
                model(torch.tensor([window_ids]))
    finally:
        for handle in handles:
            handle.remove()
    del model
    return {layer: torch.cat(xs) for layer, xs in captured.items()}, used


def expert_hessians(
    inputs: dict[int, torch.Tensor],
    top_k: int,
    router: Callable[[int], torch.Tensor],
    expert_weight: Callable[[BlockKey], torch.Tensor],
    experts_of_layer: dict[int, list[int | str]],
) -> tuple[dict[BlockKey, torch.Tensor], dict[BlockKey, int]]:
    """h for every (layer, expert, proj) from captured MoE inputs (see module docstring)."""
    hessian: dict[BlockKey, torch.Tensor] = {}
    counts: dict[BlockKey, int] = {}
    for layer, x in inputs.items():
        routed = [e for e in experts_of_layer[layer] if e != SHARED]
        chosen = (x @ router(layer).float().T).topk(top_k, dim=-1).indices if routed else None
        for expert in experts_of_layer[layer]:
            tokens = x if expert == SHARED else x[(chosen == expert).any(-1)]
            keys = [BlockKey(layer, expert, p) for p in ("gate", "up", "down")]
            for key in keys:
                counts[key] = tokens.shape[0]
            if tokens.shape[0] == 0:
                continue
            gate = expert_weight(keys[0]).float()
            up = expert_weight(keys[1]).float()
            act = torch.nn.functional.silu(tokens @ gate.T) * (tokens @ up.T)
            h_in = tokens.square().mean(0)
            hessian[keys[0]] = h_in
            hessian[keys[1]] = h_in
            hessian[keys[2]] = act.square().mean(0)
    return hessian, counts
