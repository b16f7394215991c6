"""BCQ, uniform BCQ and k-means quantizers: monotone error, prefix property, exact fits, reference decoding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pagedweight.format.bcq import quantize_bcq
from pagedweight.format.block import HESSIAN_DAMPING, QuantizedBlock, weighted_error
from pagedweight.format.kmeans import quantize_kmeans
from pagedweight.format.layout import BlockSpec, codes_from_planes, dequantize, unpack_bits
from pagedweight.format.quantize import effective_group_size, quantize_block
from pagedweight.format.ubcq import quantize_ubcq


def _matrix(kind: str, n: int = 24, k: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(n, k, generator=g) * 0.02
    # Heavy tails (Student-t, 2 dof) plus a few large outliers, like real LLM weight rows.
    normal = torch.randn(n, k, generator=g)
    chi2 = torch.randn(n, k, 2, generator=g).square().sum(-1)
    w = normal / (chi2 / 2).sqrt() * 0.01
    w[torch.randint(0, n, (4,), generator=g), torch.randint(0, k, (4,), generator=g)] = 0.5
    return w


def _hessian(k: int, seed: int = 1) -> torch.Tensor:
    return torch.rand(k, generator=torch.Generator().manual_seed(seed)).pow(3) * 5


def _quantize(table_kind: str, w: torch.Tensor, bits_min: int, bits_max: int, h=None, group_size: int = 32):
    if table_kind == "bcq":
        return quantize_bcq(w, bits_min, bits_max, group_size, h)
    if table_kind == "ubcq":
        return quantize_ubcq(w, bits_min, bits_max, group_size, h)
    return quantize_kmeans(w, bits_min, bits_max, h)


@pytest.mark.parametrize("table_kind", ["bcq", "ubcq", "kmeans"])
@pytest.mark.parametrize("kind", ["gauss", "heavy"])
@pytest.mark.parametrize("bits_min", [1, 2, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_error_falls_monotonically_with_bits(table_kind, kind, bits_min, weighted):
    w = _matrix(kind)
    h = _hessian(w.shape[1]) if weighted else None
    block = _quantize(table_kind, w, bits_min, 8, h)
    errors = [weighted_error(w, block.dequantize(b), h) for b in block.spec.bitwidths]
    assert all(a >= b for a, b in zip(errors, errors[1:])), errors
    total = weighted_error(w, torch.zeros_like(w), h)
    assert errors[0] < total  # the seed is a real fit, not zeros
    # 8 bits must be a close approximation, far better than the seed.
    assert errors[-1] < 0.02 * total and errors[-1] < 0.2 * errors[0]


@pytest.mark.parametrize("table_kind", ["bcq", "ubcq", "kmeans"])
def test_reference_decoder_reproduces_the_fitted_model(table_kind):
    w = _matrix("heavy", n=16, k=64)
    block = _quantize(table_kind, w, 2, 6, _hessian(64))
    for b in block.spec.bitwidths:
        decoded = dequantize(block.planes[:b], block.tables[b], b, table_kind, block.spec.group_size)
        assert torch.equal(decoded, block.dequantize(b))
        assert weighted_error(w, decoded) == pytest.approx(block.fit_sse[b], rel=1e-5)


def test_bcq_tables_are_weighted_least_squares_for_their_planes():
    w = _matrix("heavy", n=6, k=32, seed=3)
    h = _hessian(32, seed=4)
    block = quantize_bcq(w, 2, 5, 16, h)
    hn = (h / h.mean() + HESSIAN_DAMPING).double().numpy()
    signs = np.stack([unpack_bits(block.planes[p]).double().numpy() * 2 - 1 for p in range(5)])
    for b in range(2, 6):
        table = block.tables[b].double().numpy()
        for n, g in itertools.product(range(6), range(2)):
            cols = slice(16 * g, 16 * g + 16)
            x = np.concatenate([signs[:b, n, cols].T, np.ones((16, 1))], axis=1)
            sw = np.sqrt(hn[cols])[:, None]
            coef, *_ = np.linalg.lstsq(x * sw, w[n, cols].double().numpy() * sw[:, 0], rcond=None)
            fitted = x @ coef
            stored = x @ table[:, n, g]
            # Same model up to float16 rounding of the coefficients (coefficients themselves can differ when
            # two planes are collinear inside a group).
            assert np.abs(fitted - stored).max() <= 2e-3 * np.abs(coef).sum() + 1e-7


def test_bcq_planes_above_the_seed_code_the_residual_sign():
    w = _matrix("gauss", n=8, k=64, seed=5)
    block = quantize_bcq(w, 2, 6, 32)
    for p in range(2, 6):
        residual = w - block.dequantize(p)
        bit = unpack_bits(block.planes[p]).bool()
        clear = residual.abs() > 1e-6  # float32 decode vs float64 fit may disagree exactly at zero
        assert torch.equal(bit[clear], (residual >= 0)[clear])


def test_kmeans_prefix_property_and_weighted_centroids():
    w = _matrix("heavy", n=10, k=96, seed=6)
    h = _hessian(96, seed=7)
    block = quantize_kmeans(w, 2, 7, h)
    hn = h / h.mean() + HESSIAN_DAMPING
    parent = codes_from_planes(block.planes, 7)
    for b in block.spec.bitwidths:
        code = codes_from_planes(block.planes, b)
        assert torch.equal(code, parent >> (7 - b))  # top b bits of the parent code
        lut = block.tables[b].float()
        for n in range(10):
            for c in code[n].unique().tolist():
                members = code[n] == c
                centroid = (w[n, members] * hn[members]).sum() / hn[members].sum()
                assert lut[n, c] == pytest.approx(float(centroid), abs=1e-3 * float(w[n].abs().max()))
        # Each cluster is a contiguous value range (optimal 1-D clusters are intervals).
        for n in range(10):
            order = torch.argsort(w[n], stable=True)
            assert torch.all(code[n, order].diff() >= 0)


def _sse_1d(values: np.ndarray, weights: np.ndarray) -> float:
    if len(values) == 0:
        return 0.0
    mean = (values * weights).sum() / weights.sum()
    return float((weights * (values - mean) ** 2).sum())


def test_kmeans_splits_are_optimal_two_means():
    # Every upscaling step must split each cluster at the SSE-optimal point (brute force over all splits).
    w = _matrix("gauss", n=3, k=40, seed=8)
    h = _hessian(40, seed=9)
    hn = (h / h.mean() + HESSIAN_DAMPING).double().numpy()
    block = quantize_kmeans(w, 1, 4, h)
    for b in range(1, 4):
        code_b = codes_from_planes(block.planes, b).numpy()
        code_next = codes_from_planes(block.planes, b + 1).numpy()
        for n in range(3):
            for c in np.unique(code_b[n]):
                members = np.where(code_b[n] == c)[0]
                order = members[np.argsort(w[n, members].double().numpy(), kind="stable")]
                vals, wts = w[n, order].double().numpy(), hn[order]
                best = min(_sse_1d(vals[:t], wts[:t]) + _sse_1d(vals[t:], wts[t:]) for t in range(len(vals) + 1))
                left = code_next[n, order] == 2 * c
                got = _sse_1d(vals[left], wts[left]) + _sse_1d(vals[~left], wts[~left])
                assert got == pytest.approx(best, rel=1e-9, abs=1e-15)


def test_kmeans_seed_is_a_lloyd_fixed_point():
    w = _matrix("heavy", n=5, k=64, seed=10)
    block = quantize_kmeans(w, 3, 3)
    lut = block.tables[3].double()
    code = codes_from_planes(block.planes, 3)
    # Every weight sits in the cluster of its nearest centroid (up to midpoint ties).
    dist = (w.double().unsqueeze(-1) - lut.unsqueeze(1)).abs()
    own = dist.gather(2, code.long().unsqueeze(-1)).squeeze(-1)
    assert torch.all(own <= dist.min(-1).values + 1e-3 * w.abs().max())


def test_quantizers_are_deterministic():
    w = _matrix("heavy", n=12, k=64)
    for kind in ("bcq", "ubcq", "kmeans"):
        a, b = (_quantize(kind, w, 2, 8, _hessian(64)) for _ in range(2))
        assert torch.equal(a.planes, b.planes)
        assert all(torch.equal(a.tables[x], b.tables[x]) for x in a.tables)


def test_degenerate_rows_are_exact():
    w = torch.zeros(4, 16)
    w[1] = 0.25  # constant row
    w[2, :8] = -1.0  # two values
    for kind in ("bcq", "ubcq", "kmeans"):
        block = _quantize(kind, w, 2, 4, group_size=16)
        for b in block.spec.bitwidths:
            assert torch.allclose(block.dequantize(b), w, atol=1e-3), (kind, b)


def test_uncalibrated_inputs_still_get_fitted():
    # h_j = 0 for half the columns (never seen in calibration): damping keeps them fitted.
    w = _matrix("gauss", n=8, k=64)
    h = torch.cat([torch.zeros(32), torch.ones(32)])
    for kind in ("bcq", "ubcq", "kmeans"):
        block = _quantize(kind, w, 2, 8, h)
        err_unseen = (w[:, :32] - block.dequantize(8)[:, :32]).square().sum()
        assert err_unseen < 0.05 * w[:, :32].square().sum()


def test_bad_inputs():
    w = torch.randn(4, 64)
    with pytest.raises(ValueError, match="2-D"):
        quantize_bcq(w[0], 2, 8, 32)
    with pytest.raises(ValueError, match="NaN"):
        quantize_kmeans(torch.full((2, 8), float("nan")), 2, 4)
    with pytest.raises(ValueError, match="in_features must be a multiple of 8"):
        quantize_kmeans(torch.randn(2, 12), 2, 4)
    with pytest.raises(ValueError, match="hessian_diag has 3 entries"):
        quantize_bcq(w, 2, 4, 32, torch.ones(3))
    with pytest.raises(ValueError, match="non-negative"):
        quantize_bcq(w, 2, 4, 32, -torch.ones(64))
    with pytest.raises(ValueError, match="bits_min <= bits_max"):
        quantize_kmeans(w, 5, 4)
    with pytest.raises(ValueError, match="multiple of the group size 64.*e.g. --group-size 32"):
        effective_group_size(96, 64)
    with pytest.raises(ValueError, match="e.g. --group-size 64"):
        effective_group_size(192, 128)
    assert effective_group_size(64, 128) == 64 and effective_group_size(384, 128) == 128
    with pytest.raises(ValueError, match="table_kind"):
        quantize_block(w, "gptq", 2, 4)
    with pytest.raises(ValueError, match="planes"):
        QuantizedBlock(BlockSpec(4, 64, 2, 4, "kmeans"), torch.zeros(3, 4, 8, dtype=torch.uint8), {})


# ------------------------------------------------------------------ bcq planes from a uniform grid


@pytest.mark.parametrize("kind", ["gauss", "heavy"])
@pytest.mark.parametrize("weighted", [False, True])
def test_uniform_init_is_monotone_and_beats_greedy_from_4_bits(kind, weighted):
    w = _matrix(kind, n=32, k=128, seed=3)
    h = _hessian(128) if weighted else None
    uni = quantize_bcq(w, 2, 8, 32, h, init="uniform")
    greedy = quantize_bcq(w, 2, 8, 32, h, init="greedy")
    eu = [weighted_error(w, uni.dequantize(b), h) for b in uni.spec.bitwidths]
    eg = [weighted_error(w, greedy.dequantize(b), h) for b in greedy.spec.bitwidths]
    assert all(a >= b for a, b in zip(eu, eu[1:])), eu
    # b = 4..8 always; at 3 bits the outliers of the heavy-tailed rows stretch the grid and greedy wins
    first = 1 if kind == "gauss" else 2
    assert all(u < g for u, g in zip(eu[first:], eg[first:])), (eu, eg)


def test_uniform_init_is_exact_on_a_4bit_grid():
    """Weights already on a 4-bit grid per group (GGUF Q4_1-style: min + d * q, bell-shaped codes with both
    ends used, as a scale-and-min quantizer leaves them) come back exactly at 4 bits and above: the top four
    planes are the source codes. Greedy residual signs split at the mean, not on the grid, and do not."""
    g = torch.Generator().manual_seed(5)
    n, k, group = 16, 128, 32
    codes = (7.5 + 3.0 * torch.randn(n * k // group, group, generator=g)).round().clamp(0, 15)
    codes[:, 0], codes[:, 1] = 0, 15
    codes = codes.long().reshape(n, k)
    d = torch.rand(n, k // group, 1, generator=g) * 0.01 + 1e-3
    lo = torch.randn(n, k // group, 1, generator=g) * 0.02
    w = (lo + d * codes.reshape(n, k // group, group)).reshape(n, k).to(torch.bfloat16).float()
    block = quantize_bcq(w, 2, 8, group, init="uniform")
    for b in range(4, 9):
        rel = float((block.dequantize(b) - w).norm() / w.norm())
        assert rel < 2e-3, (b, rel)  # fp16 tables and bf16 weights, nothing else
    top4 = codes_from_planes(block.planes, 4)
    assert torch.equal(top4, codes.to(top4.dtype))
    greedy = quantize_bcq(w, 2, 8, group, init="greedy")
    assert float((greedy.dequantize(4) - w).norm() / w.norm()) > 10 * 2e-3


def test_uniform_init_degenerate_groups_and_bad_init():
    w = torch.zeros(4, 16)
    w[1] = 0.25
    w[2, :8] = -1.0
    block = quantize_bcq(w, 2, 4, 16, init="uniform")
    for b in block.spec.bitwidths:
        assert torch.allclose(block.dequantize(b), w, atol=1e-3), b
    with pytest.raises(ValueError, match="bcq init must be one of"):
        quantize_bcq(w, 2, 4, 16, init="random")


def _on_4bit_grid(n=16, k=128, group=32, seed=5):
    """Weights on a 4-bit grid per group (GGUF Q4_1 of zero-centred rows: min + d * q with min ~ -8 d,
    bell-shaped codes with both ends used), stored in bf16 like the MoEfied SmolLM2's experts; and their
    codes."""
    g = torch.Generator().manual_seed(seed)
    codes = (7.5 + 3.0 * torch.randn(n * k // group, group, generator=g)).round().clamp(0, 15)
    codes[:, 0], codes[:, 1] = 0, 15
    codes = codes.long().reshape(n, k)
    d = torch.rand(n, k // group, 1, generator=g) * 0.01 + 1e-3
    lo = -d * (6 + 3 * torch.rand(n, k // group, 1, generator=g))
    w = (lo + d * codes.reshape(n, k // group, group)).reshape(n, k).to(torch.bfloat16).float()
    return w, codes


# ------------------------------------------------------------------ ubcq: two numbers per group and bitwidth


def test_ubcq_is_bcq_with_a_power_of_two_ladder_and_its_own_least_squares_line():
    """W_b = offset + scale * sum_p 2^(b-1-p) s_p, with (scale, offset) the weighted least-squares line
    through (x_b, W) per group."""
    w = _matrix("heavy", n=6, k=64, seed=3)
    h = _hessian(64, seed=4)
    block = quantize_ubcq(w, 2, 6, 16, h)
    hn = (h / h.mean() + HESSIAN_DAMPING).double().numpy()
    signs = np.stack([unpack_bits(block.planes[p]).double().numpy() * 2 - 1 for p in range(6)])
    for b in range(2, 7):
        table = block.tables[b]
        assert tuple(table.shape) == (2, 6, 4) and block.spec.table_bytes(b) == 2 * 6 * 4 * 2
        ladder = np.array([2.0 ** (b - 1 - p) for p in range(b)])
        for n, g in itertools.product(range(6), range(4)):
            cols = slice(16 * g, 16 * g + 16)
            x = ladder @ signs[:b, n, cols]
            a = np.stack([x, np.ones(16)], axis=1)
            sw = np.sqrt(hn[cols])[:, None]
            coef, *_ = np.linalg.lstsq(a * sw, w[n, cols].double().numpy() * sw[:, 0], rcond=None)
            stored = a @ table[:, n, g].double().numpy()
            assert np.abs(a @ coef - stored).max() <= 2e-3 * np.abs(a @ coef).max() + 1e-7
        # the reference decoder equals bcq's with the ladder expanded into b scales
        expanded = torch.cat([table[0].float().unsqueeze(0) * torch.tensor(ladder, dtype=torch.float32)[:, None, None],
                              table[1].float().unsqueeze(0)])
        bcq_decoded = dequantize(block.planes[:b], expanded, b, "bcq", 16)
        torch.testing.assert_close(block.dequantize(b), bcq_decoded, rtol=0, atol=1e-7)


def test_ubcq_is_exact_on_a_4bit_grid_at_every_bitwidth_from_4():
    """GGUF Q4 sources: exact from 4 bits up with two numbers per group. The grid keeps a coarse level's
    weights on one fine code whatever their bf16 rounding (bcq.uniform_grid_signs), so 5..8 bits are as
    exact as 4 (with the old grid, bf16 noise split them between two codes: ~5% error at 5 bits)."""
    w, codes = _on_4bit_grid()
    block = quantize_ubcq(w, 2, 8, 32)
    for b in range(4, 9):
        rel = float((block.dequantize(b) - w).norm() / w.norm())
        assert rel < 2e-3, (b, rel)
    assert torch.equal(codes_from_planes(block.planes, 4), codes.to(torch.int32))
    assert block.spec.bytes_at(4) == 16 * 128 * (4 + 1) // 8  # 4 bits + 2 fp16 per 32 weights = 5 bits per weight


def test_ubcq_tables_are_smaller_and_its_refusals():
    spec = BlockSpec(64, 256, 2, 8, "ubcq", 32)
    bcq = BlockSpec(64, 256, 2, 8, "bcq", 32)
    for b in range(2, 9):
        assert spec.table_shape(b) == (2, 64, 8) and spec.bytes_at(b) < bcq.bytes_at(b)
    with pytest.raises(ValueError, match="bcq_init applies to table kind bcq only"):
        quantize_block(torch.randn(4, 64), "ubcq", 2, 4, 32, bcq_init="uniform")
    with pytest.raises(ValueError, match="ubcq table shape"):
        dequantize(torch.zeros(4, 4, 8, dtype=torch.uint8), torch.zeros(5, 4, 2, dtype=torch.float16), 4, "ubcq", 32)
