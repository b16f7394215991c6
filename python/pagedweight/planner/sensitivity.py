"""Offline Hessian sensitivity of one linear block and the two quantities the planner derives from it.

PagedWeight (eq. 2-4): for block i and bitwidth b

    s_i^b = sum_{n,j} h_{i,j} (W_{i,nj} - W^b_{i,nj})^2          diagonal-Hessian weighted error
    g_i^{b->b'} = max(s_i^{b'} - s_i^b, 0)                       global damage of lowering b -> b'
    Delta_i^{b->b'} = M_i^b - M_i^{b'}                            bytes freed by lowering b -> b'

`h_j = E[x_j^2]` is the second moment of input column j over the tokens routed to the block's expert,
broadcast over the output rows n (the diagonal of the layer Hessian X^T X / T, as in GPTQ/OBQ).
With that normalisation s^b is the expected squared output error per routed token, ignoring the
cross terms of the full Hessian.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from pagedweight.format.layout import BlockSpec


def hessian_sensitivity(w_ref: torch.Tensor, w_quant: torch.Tensor, h: torch.Tensor) -> float:
    """s = sum_{n,j} h_j (W_nj - Wq_nj)^2 for W of shape [N, K] and h of shape [K]."""
    if w_ref.shape != w_quant.shape or w_ref.dim() != 2:
        raise ValueError(f"weights must be two matrices of one shape, got {tuple(w_ref.shape)} and {tuple(w_quant.shape)}")
    if h.shape != (w_ref.shape[1],):
        raise ValueError(f"h must have one entry per input column ({w_ref.shape[1]}), got shape {tuple(h.shape)}")
    if bool((h < 0).any()):
        raise ValueError("h holds second moments E[x_j^2] and cannot be negative")
    err = (w_ref.double() - w_quant.double()).pow(2).sum(dim=0)  # [K]: sum over rows n
    return float((err * h.double()).sum())


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
