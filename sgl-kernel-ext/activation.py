"""The gate activation of gated MoE experts: act = gate_act(gate) * up.

"silu" (SwiGLU: Mixtral, Qwen, DeepSeek, GLM, OLMoE) and "gelu" (Gemma-4; the erf form, as SGLang's gelu_and_mul
and its Triton MoE runner compute it). Every kernel forms the activation where it already did SiLU: the CUDA
kernels compile it in (gate_act.cuh, `-DACT=`), the Triton kernels take it as a constexpr, the reference in torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATE_ACTIVATIONS = ("silu", "gelu")


def check_activation(activation: str) -> None:
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"AP experts take the gate activations {list(GATE_ACTIVATIONS)}, got {activation!r}")


def act_code(activation: str) -> int:
    """The kernels' code for an activation: 0 silu, 1 gelu."""
    check_activation(activation)
    return GATE_ACTIVATIONS.index(activation)


def act_defines(activation: str) -> list[str]:
    """NVRTC defines of gate_act.cuh; none for SiLU, so the SwiGLU variants compile (and cache) as before."""
    code = act_code(activation)
    return [f"-DACT={code}"] if code else []


def gate_act(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """The reference: gate_act(gate) in torch (float32 in, float32 out)."""
    check_activation(activation)
    return F.silu(gate) if activation == "silu" else F.gelu(gate)
