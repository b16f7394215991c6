"""One entry point for quantizing a linear block with either table kind."""

from __future__ import annotations

import torch

from pagedweight.format.bcq import quantize_bcq
from pagedweight.format.block import QuantizedBlock
from pagedweight.format.kmeans import quantize_kmeans
from pagedweight.format.layout import TABLE_KINDS, is_grouped
from pagedweight.format.ubcq import quantize_ubcq


def effective_group_size(in_features: int, group_size: int) -> int:
    """BCQ group size used for a block with `in_features` inputs: min(group_size, in_features).

    Raises ValueError naming the fix when that does not divide in_features or is not a power of two.
    """
    if group_size <= 0 or group_size & (group_size - 1):
        raise ValueError(f"--group-size must be a power of two, got {group_size}")
    g = min(group_size, in_features)
    if in_features % g or g & (g - 1):
        fitting = in_features & -in_features  # largest power of two dividing in_features
        raise ValueError(
            f"in_features={in_features} is not a multiple of the group size {g}; "
            f"pass a power-of-two --group-size that divides {in_features}, e.g. --group-size {min(fitting, group_size)}"
        )
    return g


def quantize_block(
    weight: torch.Tensor,
    table_kind: str,
    bits_min: int,
    bits_max: int,
    group_size: int = 128,
    hessian_diag: torch.Tensor | None = None,
    bcq_init: str = "greedy",
) -> QuantizedBlock:
    """Quantize W[N, K] to an AP block. `group_size` (bcq, ubcq) is clipped to K (effective_group_size);
    `bcq_init` (bcq only) picks how sign planes are chosen (pagedweight.format.bcq); ubcq planes are always
    the uniform grid's (pagedweight.format.ubcq)."""
    if is_grouped(table_kind):
        g = effective_group_size(weight.shape[-1], group_size)
        if table_kind == "ubcq":
            if bcq_init != "greedy":
                raise ValueError("bcq_init applies to table kind bcq only (ubcq planes are always the uniform grid)")
            return quantize_ubcq(weight, bits_min, bits_max, g, hessian_diag)
        return quantize_bcq(weight, bits_min, bits_max, g, hessian_diag, init=bcq_init)
    if table_kind == "kmeans":
        return quantize_kmeans(weight, bits_min, bits_max, hessian_diag)
    raise ValueError(f"table_kind must be one of {TABLE_KINDS}, got {table_kind!r}")
