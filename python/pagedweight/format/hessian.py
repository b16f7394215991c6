"""Calibration for the converter: per-input second moments h_j = E[x_j^2] of every expert linear.

Method. The source model runs in transformers on CPU (float32; the converter has an FP8 block source
dequantized as it loads, tools/source_format.load_source_model) over `num_tokens` tokens of the given text,
cut into windows of `window` tokens (a seeded random subset of windows when the text is longer). A forward
pre-hook on each MoE layer's experts module (planner/moe_capture.py) records what the experts consume: their input X_L and the router's
top-k choice per token, as the model computes it (so DeepSeek-V3's grouped sigmoid routing with its correction
bias and Gemma-4's router with its norm and scales count as they are, nothing is recomputed), and a pre-hook on
the shared expert (`mlp.shared_expert(s)`, Gemma-4's dense `mlp` beside the experts) records its own input S_L
(Gemma-4's is another norm of the residual than the experts'). Then

  routed expert e of layer L: tokens T_e = {t : e in top_k(t)};
      gate/up: h = mean_{t in T_e} X_L[t]^2;  down: h = mean_{t in T_e} a_t^2 with the expert's own
      intermediate activation a_t = act(X_L[t] W_gate^T) * (X_L[t] W_up^T), act the module's act_fn
      (SiLU; Gemma-4's GELU-tanh);
  shared expert: the same over all tokens of S_L, with the shared MLP's act_fn.

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


@dataclass
class LayerInputs:
    """What one MoE layer's experts consumed during the calibration forward (host, float32)."""

    routed: torch.Tensor  # [T, H] the experts module's input
    topk_ids: torch.Tensor  # [T, k] the router's choice per token
    act: Callable[[torch.Tensor], torch.Tensor]  # the routed experts' gating activation
    shared: torch.Tensor | None = None  # [T, H] the shared expert's input, when the layer has one
    shared_act: Callable[[torch.Tensor], torch.Tensor] | None = None


def collect_moe_inputs(model_dir: Path, text: str, num_tokens: int, seed: int, layers: list[int], window: int = 256,
                       load_model: Callable[[Path], torch.nn.Module] | None = None):
    """Run the model on the text; return ({layer: LayerInputs}, tokens used) for the MoE layers `layers`.
    `load_model(model_dir)`: the float32 transformers model (default: from_pretrained of a plain source; the
    converter passes tools/source_format.load_source_model, which also reads FP8 block sources)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedweight.planner.moe_capture import RoutedCapture, find_moe_layers, shared_expert_module

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    windows = calibration_windows(ids, num_tokens, window, seed)
    used = sum(len(w) for w in windows)
    if used == 0:
        raise ValueError("the calibration text produced no tokens; pass a non-empty --calib-text file")
    if load_model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        model = load_model(model_dir)
    model.eval()
    refs = {ref.layer: ref for ref in find_moe_layers(model)}
    if missing := sorted(set(layers) - set(refs)):
        raise RuntimeError(f"the transformers model has no experts module in decoder layer(s) {missing}")
    refs = [refs[layer] for layer in layers]
    shared_in: dict[int, list[torch.Tensor]] = {}
    shared_mod = {ref.layer: m for ref in refs if (m := shared_expert_module(model, ref)) is not None}
    handles = []
    for layer, module in shared_mod.items():
        def hook(_module, args, kwargs, layer=layer):
            x = args[0] if args else kwargs["hidden_states"]
            shared_in.setdefault(layer, []).append(x.detach().reshape(-1, x.shape[-1]).float().cpu())

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with RoutedCapture(refs) as cap, torch.no_grad():
            for window_ids in tqdm(windows, desc="calibration forward", unit="window"):
                model(torch.tensor([window_ids]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    out = {}
    for ref in refs:
        hidden, topk_ids, _, _ = cap.captured[ref.layer].cat()
        shared = torch.cat(shared_in[ref.layer]) if ref.layer in shared_in else None
        out[ref.layer] = LayerInputs(hidden, topk_ids, ref.act, shared,
                                     shared_mod[ref.layer].act_fn if shared is not None else None)
    del model
    return out, used


def expert_hessians(
    inputs: dict[int, LayerInputs],
    expert_weight: Callable[[BlockKey], torch.Tensor],
    experts_of_layer: dict[int, list[int | str]],
) -> tuple[dict[BlockKey, torch.Tensor], dict[BlockKey, int]]:
    """h for every (layer, expert, proj) from captured MoE inputs (see module docstring)."""
    hessian: dict[BlockKey, torch.Tensor] = {}
    counts: dict[BlockKey, int] = {}
    for layer, cap in inputs.items():
        for expert in experts_of_layer[layer]:
            if expert == SHARED:
                if cap.shared is None:
                    raise RuntimeError(f"layer {layer} has a shared expert in the checkpoint, but no shared expert "
                                       "module was found in the transformers model")
                tokens, act = cap.shared, cap.shared_act
            else:
                tokens, act = cap.routed[(cap.topk_ids == expert).any(-1)], cap.act
            keys = [BlockKey(layer, expert, p) for p in ("gate", "up", "down")]
            for key in keys:
                counts[key] = tokens.shape[0]
            if tokens.shape[0] == 0:
                continue
            gate = expert_weight(keys[0]).float()
            up = expert_weight(keys[1]).float()
            a = act(tokens @ gate.T) * (tokens @ up.T)
            h_in = tokens.square().mean(0)
            hessian[keys[0]] = h_in
            hessian[keys[1]] = h_in
            hessian[keys[2]] = a.square().mean(0)
    return hessian, counts
