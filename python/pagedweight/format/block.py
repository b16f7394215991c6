"""The in-memory result of quantizing one linear block, shared by both table kinds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedweight.format.layout import PLANE_DTYPE, TABLE_DTYPE, BlockSpec, dequantize

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


def grouped_hessian(hessian_diag: torch.Tensor | None, spec: BlockSpec) -> torch.Tensor:
    """normalized_hessian_diag as float64 [groups, G] for the grouped quantizers (bcq, ubcq)."""
    h = normalized_hessian_diag(hessian_diag, spec.in_features)
    return h.to(torch.float64).reshape(spec.num_groups, spec.group_size)


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
