"""Offline Hessian sensitivity of one linear block and the two quantities the planner derives from it.

PagedWeight (eq. 2-4): for block i and bitwidth b

    s_i^b = sum_{n,j} h_{i,j} (W_{i,nj} - W^b_{i,nj})^2          diagonal-Hessian weighted error
    g_i^{b->b'} = max(s_i^{b'} - s_i^b, 0)                       global damage of lowering b -> b'
    Delta_i^{b->b'} = M_i^b - M_i^{b'}                            bytes freed by lowering b -> b'

`h` is a diagonal Hessian in **expert-output units** (both projections of a SwiGLU expert
f(x) = W_down (act(W_gate x) * (W_up x)) on one scale), averaged over the tokens routed to the expert:

    down (w2):   h_{nj} = E[a_j^2]                                  a = act(W_gate x) * (W_up x)
    gate:        h_{nk} = c_n E[(act'(g_n) u_n)^2 x_k^2]           g = W_gate x, u = W_up x
    up:          h_{nk} = c_n E[act(g_n)^2 x_k^2]                  c_n = ||W_down[:, n]||^2

For the down projection this is the diagonal of X^T X / T of its input (GPTQ/OBQ). For gate and up the
error of intermediate unit n is carried to the expert's output to first order (SiLU-gate Jacobian, then
the full-precision down projection's column n), dropping cross terms between units, between input
columns and between gate and up. s^b is then the expected squared error of the expert's output per
routed token for every block, so w13 and w2 damages are comparable. Calibration passes a per-token,
per-output-dimension loss weight F_tm = r_t^2 (dL/dy_tm)^2 (`out_weight`), which replaces c_n by
c_tn = sum_m F_tm W_down[m, n]^2 and makes down's h [H, I]: the damage is then in loss units and layers
share one scale too (docs/planner.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from pagedweight.format.layout import BlockSpec


def hessian_sensitivity(w_ref: torch.Tensor, w_quant: torch.Tensor, h: torch.Tensor) -> float:
    """s = sum_{n,j} h_nj (W_nj - Wq_nj)^2 for W of shape [N, K] and h of shape [K] (broadcast over rows) or
    [N, K] (one weight per element, e.g. `expert_output_hessians`)."""
    if w_ref.shape != w_quant.shape or w_ref.dim() != 2:
        raise ValueError(f"weights must be two matrices of one shape, got {tuple(w_ref.shape)} and {tuple(w_quant.shape)}")
    if h.shape not in ((w_ref.shape[1],), tuple(w_ref.shape)):
        raise ValueError(f"h must have one entry per input column ({w_ref.shape[1]}) or per weight "
                         f"{tuple(w_ref.shape)}, got shape {tuple(h.shape)}")
    if bool((h < 0).any()):
        raise ValueError("h holds second moments E[x_j^2] and cannot be negative")
    err = (w_ref.double() - w_quant.double()).pow(2)
    return float((err * h.double()).sum())


def activation_derivative(act: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """act'(z) elementwise by a float64 central difference (any smooth activation module or function)."""
    z = z.double()
    step = 1e-5 * z.abs().clamp(min=1.0)
    return (act(z + step) - act(z - step)) / (2 * step)


@dataclass(frozen=True)
class ExpertHessians:
    """Diagonal Hessians of one SwiGLU expert in expert-output units (module docstring)."""

    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [I] (input columns of W_down, broadcast over its H rows) or [H, I] (loss-weighted)


def expert_output_hessians(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                           act: Callable[[torch.Tensor], torch.Tensor],
                           out_weight: torch.Tensor | None = None) -> ExpertHessians:
    """h of gate, up and down for the routed inputs x [T, H] of an expert f(x) = W_down (act(W_gate x) * W_up x).

    w_gate, w_up [I, H], w_down [H, I] (full precision). Means over the T tokens, float64. `out_weight`
    [T, H] >= 0 weights each token's squared output error per output dimension m (the loss weighting
    F_tm = r_t^2 (dL/dy_tm)^2, docs/planner.md); None = 1 (plain expert-output error). With it, c_n becomes
    per token, c_tn = sum_m F_tm W_down[m, n]^2, and down's h is [H, I]: h_mj = E[F_tm a_j^2].
    """
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"x must be [T > 0, H], got {tuple(x.shape)}")
    if w_gate.shape != w_up.shape or w_down.shape != (w_gate.shape[1], w_gate.shape[0]) or x.shape[1] != w_gate.shape[1]:
        raise ValueError(f"shapes do not form an expert: x {tuple(x.shape)}, gate {tuple(w_gate.shape)}, "
                         f"up {tuple(w_up.shape)}, down {tuple(w_down.shape)}")
    if out_weight is not None and (out_weight.shape != (x.shape[0], w_down.shape[0]) or bool((out_weight < 0).any())):
        raise ValueError(f"out_weight must be [T, H] = {(x.shape[0], w_down.shape[0])} and >= 0, got "
                         f"{tuple(out_weight.shape)}")
    x = x.double()
    g, u = x @ w_gate.double().T, x @ w_up.double().T  # [T, I]
    act_g = act(g)
    a2 = (act_g * u).pow(2)
    x2 = x.pow(2) / x.shape[0]
    if out_weight is None:
        c = w_down.double().pow(2).sum(dim=0).expand_as(g)  # c_n = ||W_down[:, n]||^2 for every token
        down = a2.mean(dim=0)  # [I], broadcast over down's rows
    else:
        f = out_weight.double()
        c = f @ w_down.double().pow(2)  # [T, I]
        down = f.T @ a2 / x.shape[0]  # [H, I]
    return ExpertHessians(
        gate=(c * (activation_derivative(act, g) * u).pow(2)).T @ x2,
        up=(c * act_g.pow(2)).T @ x2,
        down=down,
    )


def sensitivity_by_bits(
    w_ref: torch.Tensor,
    h: torch.Tensor,
    bitwidths: Iterable[int],
    weight_at: Callable[[int], torch.Tensor],
) -> dict[int, float]:
    """s^b for every b in `bitwidths`; `weight_at(b)` returns the b-bit weight (e.g. layout.dequantize)."""
    return {int(b): hessian_sensitivity(w_ref, weight_at(int(b)), h) for b in bitwidths}


def freed_bytes(spec: BlockSpec, bits_from: int, bits_to: int) -> int:
    """Delta^{b->b'} = M^b - M^{b'} (eq. 3); positive when lowering."""
    spec.check_bits(bits_from)
    spec.check_bits(bits_to)
    return spec.bytes_at(bits_from) - spec.bytes_at(bits_to)


@dataclass(frozen=True)
class SensitivityTable:
    """s^b of one block for every stored bitwidth b (one runtime block: w13 sums gate and up)."""

    by_bits: Mapping[int, float]

    def __post_init__(self) -> None:
        if not self.by_bits:
            raise ValueError("a sensitivity table needs at least one bitwidth")
        for b, s in self.by_bits.items():
            if not (s >= 0.0) or s == float("inf"):
                raise ValueError(f"sensitivity at {b} bits must be finite and >= 0, got {s}")

    @property
    def bitwidths(self) -> tuple[int, ...]:
        return tuple(sorted(self.by_bits))

    def s(self, bits: int) -> float:
        try:
            return self.by_bits[bits]
        except KeyError:
            raise KeyError(f"no sensitivity stored for {bits} bits (have {self.bitwidths})") from None

    def global_damage(self, bits_from: int, bits_to: int) -> float:
        """g^{b->b'} = max(s^{b'} - s^b, 0) (eq. 4); symmetric use for reloads (damage removed)."""
        return max(self.s(bits_to) - self.s(bits_from), 0.0)

    def __add__(self, other: SensitivityTable) -> SensitivityTable:
        """Sum over concatenated rows (gate + up -> w13): s is additive over output rows."""
        if self.bitwidths != other.bitwidths:
            raise ValueError(f"cannot add sensitivity tables over {self.bitwidths} and {other.bitwidths}")
        return SensitivityTable({b: self.by_bits[b] + other.by_bits[b] for b in self.bitwidths})
