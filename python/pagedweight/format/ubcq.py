"""Uniform binary-coded quantizer (table kind "ubcq"): bcq planes of a uniform grid, two numbers per group.

The planes are uniform-grid sign planes like bcq's init="uniform" (format/bcq.py: each group's code on a
grid over [min, max] anchored at UNIFORM_ANCHOR_BITS), with the coarse levels on fine codes
(uniform_grid_signs(levels_on_fine_codes=True)). On such planes the binary-coded scales of a b-bit
model are a power-of-two ladder, alpha_p = scale_b * 2^(b-1-p), so the b-bit table only needs the scale
and the offset of each group:

    W_b[n, j] = offset_b + scale_b * sum_{p < b} 2^(b-1-p) * s_p[n, j],   s_p = 2 * bit_p - 1

i.e. W_b = offset_b + scale_b * x_b with x_b = 2 * code_b - (2^b - 1), an affine map of the top-b-bit code.
Why: at group 32 a bcq table costs (b + 1) fp16 per 32 weights (2.5 bits per weight at 4 bits, 38% of the
4-bit block), a ubcq table 2 fp16 (1 bit per weight) at every bitwidth. The price is the freedom of the
least-squares refit of every plane's scale; on grid-shaped weights (GGUF Q4 sources) nothing is lost.

Each bitwidth's (scale, offset) is the Hessian-weighted least-squares line through (x_b, W) per group
(closed form, float64); the offset is refitted after the scale is rounded to float16, so the stored pair is
the best offset for the stored scale.
"""

from __future__ import annotations

import torch

from pagedweight.format.bcq import UNIFORM_ANCHOR_BITS, uniform_grid_signs
from pagedweight.format.block import QuantizedBlock, quantize_grouped
from pagedweight.format.layout import TABLE_DTYPE, BlockSpec

_FP16_MAX = float(torch.finfo(torch.float16).max)


def quantize_ubcq(
    weight: torch.Tensor,
    bits_min: int,
    bits_max: int,
    group_size: int,
    hessian_diag: torch.Tensor | None = None,
) -> QuantizedBlock:
    """Quantize W[N, K] into bits_max uniform-grid sign planes and one [2, N, K // G] table per bitwidth."""
    return quantize_grouped(weight, lambda n, k: BlockSpec(n, k, bits_min, bits_max, "ubcq", group_size),
                            hessian_diag, _fit_rows)


def _fit_rows(
    w: torch.Tensor, h: torch.Tensor, bits_min: int, bits_max: int
) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, float]]:
    """w [n, groups, G] float64, h [groups, G] -> signs [bits_max, n, groups, G] (+-1), fp16 tables, SSE."""
    signs = uniform_grid_signs(w, bits_max, min(UNIFORM_ANCHOR_BITS, bits_max), levels_on_fine_codes=True)
    tables: dict[int, torch.Tensor] = {}
    sse: dict[int, float] = {}
    x = torch.zeros_like(w)
    for b in range(1, bits_max + 1):
        x = 2 * x + signs[b - 1]  # x_b = sum_{p<b} 2^(b-1-p) s_p
        if b >= bits_min:
            tables[b], approx = _fit_line(x, w, h)
            sse[b] = float((w - approx).square().sum())
    return torch.stack(signs), tables, sse


def _fit_line(x: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted least squares w ~ scale * x + offset per group: fp16 table [2, n, groups] and the model it
    stores [n, groups, G] (float64). A group whose codes are all equal gets scale 0 and its weighted mean."""
    hs = h.sum(-1)
    xm = (h * x).sum(-1) / hs
    wm = (h * w).sum(-1) / hs
    xc = x - xm.unsqueeze(-1)
    var = (h * xc.square()).sum(-1)
    cov = (h * xc * (w - wm.unsqueeze(-1))).sum(-1)
    scale = torch.where(var > 0, cov / torch.where(var > 0, var, torch.ones_like(var)), torch.zeros_like(var))
    scale16 = scale.to(TABLE_DTYPE)
    offset = wm - scale16.to(w.dtype) * xm  # best offset for the stored scale
    if not (torch.isfinite(scale16).all() and offset.abs().max() <= _FP16_MAX):
        raise ValueError(
            "ubcq scale or offset overflows float16 (weights beyond +-65504 or a degenerate group); "
            "check the source weights or use --table-kind kmeans"
        )
    offset16 = offset.to(TABLE_DTYPE)
    approx = offset16.to(w.dtype).unsqueeze(-1) + scale16.to(w.dtype).unsqueeze(-1) * x
    return torch.stack([scale16, offset16]).contiguous(), approx
