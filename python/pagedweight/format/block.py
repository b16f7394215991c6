"""The in-memory result of quantizing one linear block, shared by both table kinds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from pagedweight.format.layout import PLANE_DTYPE, TABLE_DTYPE, BlockSpec, dequantize, pack_bits

# Added to the normalized Hessian diagonal (mean 1) so inputs that calibration never saw (h_j = 0) are
# still fitted instead of being left to whatever minimizes the error elsewhere (cf. GPTQ's damping).
HESSIAN_DAMPING = 0.01


@dataclass
class QuantizedBlock:
    """Planes and per-bitwidth tables of one linear block W[N, K] (docs/format.md)."""

    spec: BlockSpec
    planes: torch.Tensor  # [bits_max, N, K // 8] uint8
    tables: dict[int, torch.Tensor]  # bits -> bcq [b + 1, N, K // G] / kmeans [N, 2**b], float16
    # bits -> sum (W - W_b)^2 of the model the quantizer fitted (its own float64 reconstruction from the
    # stored float16 tables); lets tests and reports check that the format decodes what was fitted.
    fit_sse: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.planes.dtype != PLANE_DTYPE or tuple(self.planes.shape) != self.spec.planes_shape():
            raise ValueError(
                f"planes {self.planes.dtype}{tuple(self.planes.shape)} do not match {self.spec} "
                f"(want uint8{self.spec.planes_shape()})"
            )
        if sorted(self.tables) != list(self.spec.bitwidths):
            raise ValueError(f"tables for bits {sorted(self.tables)}, spec wants {list(self.spec.bitwidths)}")
        for bits, table in self.tables.items():
            if table.dtype != TABLE_DTYPE or tuple(table.shape) != self.spec.table_shape(bits):
                raise ValueError(
                    f"table for {bits} bits is {table.dtype}{tuple(table.shape)}, want float16{self.spec.table_shape(bits)}"
                )

    def dequantize(self, bits: int) -> torch.Tensor:
        """W_b [N, K] float32, via the format's reference decoder."""
        self.spec.check_bits(bits)
        return dequantize(self.planes[:bits], self.tables[bits], bits, self.spec.table_kind, self.spec.group_size)


def checked_weight(weight: torch.Tensor) -> torch.Tensor:
    """W[N, K] as float64 on the CPU, the quantizers' working copy; refuses non-2-D or non-finite weights."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    w = weight.detach().to(torch.float64).cpu()
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN or Inf; the source checkpoint is corrupt")
    return w


# fit(w [n, groups, G] float64, h [groups, G], bits_min, bits_max) -> (+-1 signs [bits_max, n, groups, G],
# fp16 tables {b: [rows, n, groups]}, fitted SSE {b: float}): one chunk of rows of a grouped (bcq/ubcq) block
GroupedFit = Callable[[torch.Tensor, torch.Tensor, int, int],
                      tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, float]]]


def quantize_grouped(weight: torch.Tensor, spec_of: Callable[[int, int], BlockSpec],
                     hessian_diag: torch.Tensor | None, fit: GroupedFit) -> QuantizedBlock:
    """The grouped quantizers' shared frame: check W, then fit it chunk of rows by chunk (bounded RAM) and
    pack the signs into planes. `spec_of(N, K)` gives the block's spec (its kind and group size)."""
    w = checked_weight(weight)
    n_rows, k = w.shape
    spec = spec_of(n_rows, k)
    h = normalized_hessian_diag(hessian_diag, k).to(torch.float64).reshape(spec.num_groups, spec.group_size)
    plane_chunks: list[torch.Tensor] = []
    table_chunks: dict[int, list[torch.Tensor]] = {b: [] for b in spec.bitwidths}
    fit_sse = dict.fromkeys(spec.bitwidths, 0.0)
    for rows in row_chunks(n_rows, k * (spec.bits_max + 2)):
        signs, tables, sse = fit(w[rows].reshape(-1, spec.num_groups, spec.group_size), h, spec.bits_min,
                                 spec.bits_max)
        plane_chunks.append(pack_bits(signs.reshape(spec.bits_max, -1, k) > 0))
        for b, table in tables.items():
            table_chunks[b].append(table)
            fit_sse[b] += sse[b]
    planes = torch.cat(plane_chunks, dim=1)
    return QuantizedBlock(spec, planes, {b: torch.cat(t, dim=1) for b, t in table_chunks.items()}, fit_sse)


def normalized_hessian_diag(hessian_diag: torch.Tensor | None, in_features: int) -> torch.Tensor:
    """Per-input weights h_j for the least-squares fits: E[x_j^2] scaled to mean 1, plus HESSIAN_DAMPING.

    None means no calibration: uniform weights.
    """
    if hessian_diag is None:
        return torch.ones(in_features, dtype=torch.float32)
    h = hessian_diag.detach().to(torch.float32).flatten().cpu()
    if h.numel() != in_features:
        raise ValueError(f"hessian_diag has {h.numel()} entries, the block has in_features={in_features}")
    if not torch.isfinite(h).all() or (h < 0).any():
        raise ValueError("hessian_diag must be finite and non-negative (it is E[x_j^2] per input column)")
    mean = h.mean()
    h = h / mean if mean > 0 else torch.ones_like(h)
    return h + HESSIAN_DAMPING


def weighted_error(weight: torch.Tensor, approx: torch.Tensor, hessian_diag: torch.Tensor | None = None) -> float:
    """sum_{n,j} h_j (W - W_b)^2 with raw h (uniform 1 if None): the paper's sensitivity s^b of one block."""
    diff2 = (weight.float() - approx.float()).pow(2)
    if hessian_diag is None:
        return float(diff2.sum(dtype=torch.float64))
    return float((diff2 * hessian_diag.float().to(diff2.device)).sum(dtype=torch.float64))


def row_chunks(num_rows: int, row_cost: int, budget_elems: int = 1 << 24) -> list[slice]:
    """Row slices so that one chunk touches at most ~budget_elems intermediate elements (bounds peak RAM)."""
    step = max(1, budget_elems // max(1, row_cost))
    return [slice(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]
