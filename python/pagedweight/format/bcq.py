"""Binary-coded any-precision quantizer (AnyBCQ-style, table kind "bcq").

Per row n and group g of G consecutive inputs, the b-bit weight is

    W_b[n, j] = offset_b + sum_{p < b} alpha_b[p] * s_p[n, j],   s_p = 2 * bit_p - 1 in {-1, +1}

Planes are assigned progressively: starting from the 0-bit fit (the weighted group mean), plane p is the
sign of the residual W - W_p left by the p-bit model, and earlier planes are frozen, so every bitwidth is
a prefix of the parent's planes. After each new plane, all b + 1 coefficients of bitwidth b are refitted
by weighted least squares, min sum_j h_j (W_j - W_b,j)^2, with h_j = E[x_j^2] (normalized_hessian_diag).
Because the b + 1-bit basis contains the b-bit basis, the fitted error never grows with b.

The seed planes (p < bits_min) are first assigned the same way and then improved by alternating
optimization (_refine_seed) before the higher planes are frozen on top of them; the seed is the
bitwidth served under the most memory pressure, and greedy signs alone clip the tails of bell-shaped rows.

Planes from a uniform grid (init="uniform"): each group's parent code is its position on a uniform grid
over [min, max] that has 2^A levels (A = UNIFORM_ANCHOR_BITS) each split into 2^(bits_max - A) finer ones
(uniform_grid_signs); plane p is bit bits_max - 1 - p of the code (MSB first). So the top A planes
are exactly round-to-nearest A-bit uniform codes, b > A planes refine within each coarse level, b < A
merge neighbouring levels, and every bitwidth's coefficients are refitted by the same weighted least
squares. Measured on the MoEfied SmolLM2 (docs/results/quality.md): lower fit error than the greedy planes
at every b >= 3, and exact from 4 bits for weights that already lie on a 4-bit grid (GGUF Q4 sources).

The residual for the next plane is taken against the float16-rounded coefficients, i.e. against exactly
the model that is stored. Math is float64 (the normal equations of +-1 columns are ill-conditioned when two
planes agree almost everywhere); a pseudo-inverse handles exactly collinear planes (e.g. constant groups).
"""

from __future__ import annotations

import torch

from pagedweight.format.block import QuantizedBlock, quantize_grouped
from pagedweight.format.layout import TABLE_DTYPE, BlockSpec

_FP16_MAX = float(torch.finfo(torch.float16).max)

# Alternating refinement of the seed planes enumerates 2^bits_min sign patterns per weight, so it is
# applied for seeds of at most this many bits (the usual seeds are 2-3 bits).
SEED_REFINE_MAX_BITS = 4
SEED_REFINE_ITERS = 8

# How the sign planes are chosen: "greedy" (residual signs, alternating refinement of the seed) or "uniform"
# (codes of a uniform grid anchored at UNIFORM_ANCHOR_BITS; see the module docstring).
BCQ_INITS = ("greedy", "uniform")
UNIFORM_ANCHOR_BITS = 4


def quantize_bcq(
    weight: torch.Tensor,
    bits_min: int,
    bits_max: int,
    group_size: int,
    hessian_diag: torch.Tensor | None = None,
    init: str = "greedy",
) -> QuantizedBlock:
    """Quantize W[N, K] into bits_max binary planes and one [b + 1, N, K // G] table per bitwidth b."""
    if init not in BCQ_INITS:
        raise ValueError(f"bcq init must be one of {BCQ_INITS}, got {init!r}")
    return quantize_grouped(weight, lambda n, k: BlockSpec(n, k, bits_min, bits_max, "bcq", group_size),
                            hessian_diag, _fit_rows if init == "greedy" else _fit_rows_uniform)


def _fit_rows(
    w: torch.Tensor, h: torch.Tensor, bits_min: int, bits_max: int
) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, float]]:
    """w [n, groups, G] float64, h [groups, G] -> signs [bits_max, n, groups, G] (+-1), fp16 tables, SSE."""
    approx = ((w * h).sum(-1) / h.sum(-1)).unsqueeze(-1).expand_as(w)  # 0-bit model: weighted mean
    signs: list[torch.Tensor] = []
    tables: dict[int, torch.Tensor] = {}
    sse: dict[int, float] = {}
    for p in range(bits_max):
        signs.append(torch.where(w - approx >= 0, 1.0, -1.0).to(w.dtype))
        coef16, approx, err = _refit(signs, w, h)
        if p + 1 == bits_min and bits_min <= SEED_REFINE_MAX_BITS:
            signs, coef16, approx = _refine_seed(signs, coef16, approx, err, w, h)
        if p + 1 >= bits_min:
            tables[p + 1] = coef16.permute(2, 0, 1).contiguous()  # [bits + 1, n, groups]
            sse[p + 1] = float((w - approx).square().sum())
    return torch.stack(signs, dim=0), tables, sse


def _fit_rows_uniform(
    w: torch.Tensor, h: torch.Tensor, bits_min: int, bits_max: int
) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, float]]:
    """Same contract as _fit_rows, planes from the anchored uniform grid (module docstring)."""
    signs = uniform_grid_signs(w, bits_max, min(UNIFORM_ANCHOR_BITS, bits_max))
    tables: dict[int, torch.Tensor] = {}
    sse: dict[int, float] = {}
    for b in range(bits_min, bits_max + 1):
        coef16, approx, _ = _refit(signs[:b], w, h)
        tables[b] = coef16.permute(2, 0, 1).contiguous()
        sse[b] = float((w - approx).square().sum())
    return torch.stack(signs, dim=0), tables, sse


def uniform_grid_signs(w: torch.Tensor, bits: int, anchor: int, levels_on_fine_codes: bool = False
                       ) -> list[torch.Tensor]:
    """+-1 planes (MSB first) of each group's code on a uniform grid: 2^anchor levels spanning the group's
    [min, max], each split into 2^(bits - anchor) finer levels (a constant group gets one code).

    Default (bcq): the fine levels are centred on each coarse level, which puts the coarse level itself on
    the boundary between two fine codes; bcq's least-squares refit of every plane's scale absorbs that.
    levels_on_fine_codes (ubcq): the fine levels sit on multiples of step / 2^(bits - anchor) and coarse
    level i is the fine code i * 2^(bits - anchor) + 2^(bits - anchor - 1), rounded to nearest, so a weight
    on the coarse grid keeps one code at every bitwidth >= anchor as long as its rounding noise is below half
    a fine step (bf16 copies of GGUF Q4_1 weights: |w| <= ~8 steps, bf16 noise <= 8 * 2^-9 steps = 1/4 of a
    fine step at 8 bits). ubcq's two-number table cannot absorb a split: with the centred grid its
    5-bit error on such weights was 46x its 4-bit error (0.057 vs 0.0012 on a MoEfied SmolLM2 w1)."""
    lo = w.amin(-1, keepdim=True)
    span = w.amax(-1, keepdim=True) - lo
    fine = span / ((2**anchor - 1) * 2 ** (bits - anchor))
    fine = torch.where(fine > 0, fine, torch.ones_like(fine))
    pos = (w - lo) / fine
    if bits == anchor:
        code = torch.round(pos)
    elif levels_on_fine_codes:
        code = torch.round(pos) + 2 ** (bits - anchor - 1)
    else:
        code = torch.floor(pos + 2 ** (bits - anchor - 1))
    code = code.clamp(0, 2**bits - 1).to(torch.int64)
    return [(((code >> (bits - 1 - p)) & 1) * 2 - 1).to(w.dtype) for p in range(bits)]


def _refit(
    signs: list[torch.Tensor], w: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted least-squares scales + offset for frozen signs.

    Returns float16 coefficients [n, groups, b + 1] (scales, then offset), the model they store
    [n, groups, G] and its weighted error per group [n, groups].
    """
    x = torch.stack([*signs, torch.ones_like(w)], dim=-1)  # [n, groups, G, b + 1]
    xh = x * h.unsqueeze(-1)
    gram = xh.transpose(-1, -2) @ x
    rhs = xh.transpose(-1, -2) @ w.unsqueeze(-1)
    coef = (torch.linalg.pinv(gram, hermitian=True) @ rhs).squeeze(-1)
    if not torch.isfinite(coef).all() or coef.abs().max() > _FP16_MAX:
        raise ValueError(
            "BCQ scales overflow float16 (weights beyond +-65504 or a degenerate group); "
            "check the source weights or use --table-kind kmeans"
        )
    coef16 = coef.to(TABLE_DTYPE)
    approx = (x * coef16.to(w.dtype).unsqueeze(-2)).sum(-1)
    err = ((w - approx).pow(2) * h).sum(-1)
    return coef16, approx, err


def _refine_seed(
    signs: list[torch.Tensor],
    coef16: torch.Tensor,
    approx: torch.Tensor,
    err: torch.Tensor,
    w: torch.Tensor,
    h: torch.Tensor,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Alternating BCQ (Xu et al., 2018) on the seed planes, before any higher plane is frozen on top.

    Greedy residual signs clip the tails of bell-shaped rows; alternating (best of the 2^b sign
    combinations per weight, then refit) fixes much of that at the seed's bitwidth, where it matters
    most. A group keeps a new assignment only if its weighted error fell, so the seed never gets worse.
    """
    b = len(signs)
    combos = torch.tensor(
        [[1.0 if (c >> (b - 1 - p)) & 1 else -1.0 for p in range(b)] for c in range(2**b)], dtype=w.dtype
    )  # [2^b, b]
    for _ in range(SEED_REFINE_ITERS):
        coef = coef16.to(w.dtype)
        levels = coef[..., :b] @ combos.T + coef[..., b:]  # [n, groups, 2^b]
        best = (w.unsqueeze(-1) - levels.unsqueeze(-2)).abs().argmin(-1)  # [n, groups, G]
        new_signs = [combos[:, p][best] for p in range(b)]
        new_coef16, new_approx, new_err = _refit(new_signs, w, h)
        better = new_err < err  # [n, groups]
        if not better.any():
            break
        keep = better.unsqueeze(-1)
        signs = [torch.where(keep, ns, s) for ns, s in zip(new_signs, signs)]
        coef16 = torch.where(keep, new_coef16, coef16)
        approx = torch.where(keep, new_approx, approx)
        err = torch.where(better, new_err, err)
    return signs, coef16, approx
