"""Capture the routed inputs of every MoE layer of a Hugging Face (transformers 5) model.

Transformers 5 stores a layer's experts fused in one module (`...mlp.experts` / `...block_sparse_moe.experts`)
with 3-D parameters `gate_up_proj` [E, 2I, H] (gate rows first, then up) and `down_proj` [E, H, I], called as
`experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])` (qwen2_moe, qwen3_moe, mixtral, olmoe, glm4_moe,
deepseek_v2, deepseek_v3). Gemma-4 keeps them one level up, `...layers.N.experts` beside the dense MLP, with GELU
gating (`act_fn`). A forward pre-hook on that module sees exactly what the calibration needs: the experts' input
and the router's choice, per token, after whatever the router does (DeepSeek-V3's sigmoid scores with the
correction bias and grouped top-k, Gemma-4's router norm and per-expert scales, any normalisation and scaling of
the top-k weights).
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass, field

import torch
from torch import nn

_EXPERTS_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:(?:mlp|block_sparse_moe)\.)?experts")


@dataclass
class MoELayerRef:
    """One MoE layer's fused experts module and its full-precision weights."""

    layer: int
    name: str
    module: nn.Module

    @property
    def num_experts(self) -> int:
        return int(self.module.gate_up_proj.shape[0])

    def gate_up(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_gate [I, H], W_up [I, H]) in float32."""
        w = self.module.gate_up_proj[expert].detach().float()
        inter = w.shape[0] // 2
        return w[:inter], w[inter:]

    def down(self, expert: int) -> torch.Tensor:
        """W_down [H, I] in float32."""
        return self.module.down_proj[expert].detach().float()

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return self.module.act_fn(x)


def find_moe_layers(model: nn.Module) -> list[MoELayerRef]:
    """Every fused experts module, by decoder layer; clear error when the layout is not the expected one."""
    refs = []
    for name, module in model.named_modules():
        m = _EXPERTS_NAME.fullmatch(name)
        if m is None:
            continue
        gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3):
            raise ValueError(
                f"{name} ({type(module).__name__}) does not hold fused 3-D gate_up_proj/down_proj parameters; "
                "calibration supports the transformers 5 layout of qwen2_moe, qwen3_moe, mixtral, olmoe, glm4_moe, "
                "deepseek_v2, deepseek_v3 and gemma4"
            )
        if getattr(module, "is_transposed", False) or getattr(module, "has_gate", True) is False:
            raise ValueError(f"{name}: transposed or gate-less expert layouts are not supported by calibration")
        if gu.shape[1] != 2 * down.shape[2] or gu.shape[2] != down.shape[1]:
            raise ValueError(f"{name}: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} do not fit")
        refs.append(MoELayerRef(int(m[1]), name, module))
    if not refs:
        raise ValueError("the model has no MoE experts modules (layers.N.mlp.experts, layers.N.experts); is it an MoE model?")
    return sorted(refs, key=lambda r: r.layer)


def shared_expert_module(model: nn.Module, ref: MoELayerRef) -> nn.Module | None:
    """The shared expert beside `ref`'s experts: `mlp.shared_expert` (qwen2_moe), `mlp.shared_experts` (glm4_moe,
    deepseek_v2/v3), or Gemma-4's dense `mlp` beside `layers.N.experts`; None when the layer has none."""
    parent_name, _, _ = ref.name.rpartition(".")
    parent = model.get_submodule(parent_name)
    for attr in ("shared_expert", "shared_experts"):
        if isinstance(getattr(parent, attr, None), nn.Module):
            return getattr(parent, attr)
    if not parent_name.endswith((".mlp", ".block_sparse_moe")) and isinstance(getattr(parent, "mlp", None), nn.Module):
        return parent.mlp  # the experts hang off the decoder layer itself: the MLP beside them is the shared expert
    return None


@dataclass
class LayerCapture:
    """Everything routed through one MoE layer, concatenated over prompts (host, float32)."""

    hidden: list[torch.Tensor] = field(default_factory=list)  # [T, H]
    topk_ids: list[torch.Tensor] = field(default_factory=list)  # [T, k]
    topk_weights: list[torch.Tensor] = field(default_factory=list)  # [T, k]
    prompt: list[torch.Tensor] = field(default_factory=list)  # [T] prompt index of each token
    out_grad: list[torch.Tensor] = field(default_factory=list)  # [T, H] d(loss)/d(experts output), if captured

    def cat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.cat(self.hidden), torch.cat(self.topk_ids), torch.cat(self.topk_weights), torch.cat(self.prompt))

    def out_grad_cat(self) -> torch.Tensor | None:
        return torch.cat(self.out_grad) if self.out_grad else None


def routed_call_args(layer: int, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden, top_k_index, top_k_weights) of a call to a transformers fused-experts module, from a
    forward pre-hook's (args, kwargs)."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    vals = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if len(vals) < 3:
        raise RuntimeError(f"experts module of layer {layer} was called without (hidden, top_k_index, top_k_weights)")
    return vals[0], vals[1], vals[2]


class ExpertsPreHooks(abc.ABC):
    """Context manager: a forward pre-hook on every experts module; a subclass says what one call records in
    `on_call(layer, hidden [T, H] float, topk_ids [T, k] long, topk_weights [T, k] float)` (detached)."""

    def __init__(self, layers: list[MoELayerRef]) -> None:
        self.layers = layers
        self._handles: list = []

    def __enter__(self):
        for ref in self.layers:
            self._handles.append(ref.module.register_forward_pre_hook(self._hook(ref.layer), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def hook(module, args, kwargs):
            hidden, ids, weights = routed_call_args(layer, args, kwargs)
            hidden = hidden.detach().reshape(-1, hidden.shape[-1]).float()
            ids = ids.detach().reshape(hidden.shape[0], -1).long()
            self.on_call(layer, hidden, ids, weights.detach().reshape(ids.shape).float())
            return None

        return hook

    @abc.abstractmethod
    def on_call(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Record one routed call of `layer`'s experts."""


class RoutedCapture(ExpertsPreHooks):
    """Pre-hooks on every experts module record (hidden, ids, weights, prompt index) on the CPU."""

    def __init__(self, layers: list[MoELayerRef]) -> None:
        super().__init__(layers)
        self.captured: dict[int, LayerCapture] = {ref.layer: LayerCapture() for ref in layers}
        self.prompt_index = 0

    def on_call(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        cap = self.captured[layer]
        cap.hidden.append(hidden.cpu())
        cap.topk_ids.append(topk_ids.cpu())
        cap.topk_weights.append(topk_weights.cpu())
        cap.prompt.append(torch.full((hidden.shape[0],), self.prompt_index, dtype=torch.long))


class OutputGradCapture:
    """Context manager: the gradient of a loss with respect to every experts module's output (the routed MoE
    output y_l = sum_k r_k f_k(x), [T, H]). Parameters are frozen inside it and the embedding output is made
    to require grad, so backward runs through the activations only; `grads()` after `loss.backward()`."""

    def __init__(self, model: nn.Module, layers: list[MoELayerRef]) -> None:
        self.model, self.layers = model, layers
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles: list = []
        self._requires_grad: list[tuple[nn.Parameter, bool]] = []

    def __enter__(self) -> OutputGradCapture:
        self._requires_grad = [(p, p.requires_grad) for p in self.model.parameters()]
        for p, _ in self._requires_grad:
            p.requires_grad_(False)
        embed = self.model.get_input_embeddings()
        self._handles.append(embed.register_forward_hook(lambda mod, args, out: out.requires_grad_(True)))
        for ref in self.layers:
            self._handles.append(ref.module.register_forward_hook(self._hook(ref.layer)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p, flag in self._requires_grad:
            p.requires_grad_(flag)
        self._outputs.clear()

    def _hook(self, layer: int):
        def hook(module, args, output):
            if output.requires_grad:
                output.retain_grad()
            self._outputs[layer] = output
            return None

        return hook

    def grads(self) -> dict[int, torch.Tensor]:
        """[T, H] float32 per layer, for the last forward + backward (zeros where no gradient reached)."""
        out = {}
        for layer, y in self._outputs.items():
            g = y.grad if y.grad is not None else torch.zeros_like(y)
            out[layer] = g.detach().reshape(-1, g.shape[-1]).float().cpu()
        self._outputs.clear()
        return out
