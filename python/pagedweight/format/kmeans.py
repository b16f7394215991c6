"""Any-Precision LLM quantizer (table kind "kmeans"): per-row weighted 1-D k-means + incremental upscaling.

Implementation: our own torch code, vectorised over rows (flash1dkmeans, the field's library, works one
row at a time through numba; this needs no extra dependency and processes a chunk of rows per call).
Every row is sorted once; because optimal 1-D clusters are contiguous runs of the sorted values, a
clustering is a list of boundaries into the sorted row, and all cluster sums come from prefix sums of
h, h*w and h*w^2 (float64, h_j = E[x_j^2] from normalized_hessian_diag).

1. Seed (2^bits_min clusters): start from one cluster, split every cluster optimally in two `bits_min`
   times, then refine with weighted Lloyd iterations (boundaries at centroid midpoints) until no boundary
   moves (at most LLOYD_MAX_ITERS). Lloyd never increases the weighted SSE.
2. Upscaling: each further bit splits every cluster c into children 2c and 2c + 1 by the *exact* weighted
   1-D 2-means of that cluster (the split point minimizing SSE(left) + SSE(right), found by evaluating
   every split position through the prefix sums). The (b+1)-bit code is (b-bit code << 1) | side, so the
   top b bits of the parent code are the b-bit code, and SSE never increases with b.
3. LUT_b[n, c] = weighted centroid of b-bit cluster c (float16). A cluster left empty (a cluster of one
   weight splits into itself and nothing) gets its parent's centroid, so the table stays well defined.
"""

from __future__ import annotations

import torch

from pagedweight.format.block import QuantizedBlock, checked_weight, normalized_hessian_diag, row_chunks
from pagedweight.format.layout import TABLE_DTYPE, BlockSpec, pack_bits

LLOYD_MAX_ITERS = 100
_FP16_MAX = float(torch.finfo(torch.float16).max)


def quantize_kmeans(
    weight: torch.Tensor,
    bits_min: int,
    bits_max: int,
    hessian_diag: torch.Tensor | None = None,
) -> QuantizedBlock:
    """Quantize W[N, K] into bits_max code planes and one [N, 2**b] LUT per bitwidth b."""
    w = checked_weight(weight)
    n_rows, k = w.shape
    spec = BlockSpec(n_rows, k, bits_min, bits_max, "kmeans")
    if w.abs().max() > _FP16_MAX:
        raise ValueError("weights beyond +-65504 cannot be stored in float16 LUTs; check the source weights")
    h = normalized_hessian_diag(hessian_diag, k).to(torch.float64)

    plane_chunks: list[torch.Tensor] = []
    lut_chunks: dict[int, list[torch.Tensor]] = {b: [] for b in spec.bitwidths}
    fit_sse = dict.fromkeys(spec.bitwidths, 0.0)
    shifts = torch.arange(bits_max - 1, -1, -1)  # plane 0 = most significant bit
    for rows in row_chunks(n_rows, k * 12):
        codes, luts = _cluster_rows(w[rows], h, bits_min, bits_max)
        plane_chunks.append(pack_bits(((codes.unsqueeze(0) >> shifts.view(-1, 1, 1)) & 1).to(torch.uint8)))
        for b, lut in luts.items():
            lut_chunks[b].append(lut)
            approx = lut.to(torch.float64).gather(1, codes >> (bits_max - b))
            fit_sse[b] += float((w[rows] - approx).square().sum())
    planes = torch.cat(plane_chunks, dim=1)
    return QuantizedBlock(spec, planes, {b: torch.cat(t, dim=0) for b, t in lut_chunks.items()}, fit_sse)


class _SortedRows:
    """Rows sorted ascending with prefix sums of h, h*w, h*w^2 ([n, K + 1], float64)."""

    def __init__(self, w: torch.Tensor, h: torch.Tensor) -> None:
        self.values, self.perm = torch.sort(w, dim=1, stable=True)
        hs = h[self.perm]
        zero = torch.zeros(w.shape[0], 1, dtype=w.dtype)
        self.pw = torch.cat([zero, hs.cumsum(1)], dim=1)
        self.px = torch.cat([zero, (hs * self.values).cumsum(1)], dim=1)
        self.pxx = torch.cat([zero, (hs * self.values.square()).cumsum(1)], dim=1)

    @property
    def length(self) -> int:
        return self.values.shape[1]

    def sums(self, start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weight, weighted sum and weighted sum of squares of sorted positions [start, end) per row."""
        g = lambda p: p.gather(1, end) - p.gather(1, start)  # noqa: E731
        return g(self.pw), g(self.px), g(self.pxx)

    def split_cost(self, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """SSE(start, t) + SSE(t, end) for every t = 1..K-1 ([n, K - 1]); prefix values at t are slices."""
        at_t = [p[:, 1:-1] for p in (self.pw, self.px, self.pxx)]
        at_start = [p.gather(1, start) for p in (self.pw, self.px, self.pxx)]
        at_end = [p.gather(1, end) for p in (self.pw, self.px, self.pxx)]

        def sse(lo: list[torch.Tensor], hi: list[torch.Tensor]) -> torch.Tensor:
            sw, sx, sxx = (b - a for a, b in zip(lo, hi))
            return torch.where(sw > 0, sxx - sx.square() / sw.clamp_min(1e-300), 0.0).clamp_min(0.0)

        return sse(at_start, at_t) + sse(at_t, at_end)

    def centroids(self, bounds: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
        """Weighted mean of each cluster [n, C]; `fallback` for empty clusters."""
        sw, sx, _ = self.sums(bounds[:, :-1], bounds[:, 1:])
        return torch.where(sw > 0, sx / sw.clamp_min(1e-300), fallback)


def _cluster_ids(bounds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Index of the cluster holding each sorted position: bounds[c] <= pos < bounds[c + 1]."""
    return torch.searchsorted(bounds, positions, right=True) - 1


def _split_all(rows: _SortedRows, bounds: torch.Tensor) -> torch.Tensor:
    """Split every cluster at its optimal 2-means point: bounds [n, C + 1] -> [n, 2C + 1]."""
    n, num_clusters = bounds.shape[0], bounds.shape[1] - 1
    k = rows.length
    t = torch.arange(1, k, dtype=torch.int64).expand(n, k - 1).contiguous()  # candidate split positions
    cid = _cluster_ids(bounds, t)
    start, end = bounds.gather(1, cid), bounds.gather(1, cid + 1)
    interior = t > start  # t < end holds by construction
    cost = torch.where(interior, rows.split_cost(start, end), torch.inf)
    best_cost = torch.full((n, num_clusters), torch.inf, dtype=cost.dtype).scatter_reduce(
        1, cid, cost, reduce="amin", include_self=True
    )
    is_best = interior & (cost == best_cost.gather(1, cid))
    # First optimal position per cluster (deterministic ties); a cluster without an interior position
    # (size <= 1) "splits" at its end: everything stays in the left child.
    split = bounds[:, 1:].clone().scatter_reduce(
        1, cid, torch.where(is_best, t, k), reduce="amin", include_self=True
    )
    out = torch.empty(n, 2 * num_clusters + 1, dtype=torch.int64)
    out[:, 0:-1:2] = bounds[:, :-1]
    out[:, 1::2] = split
    out[:, -1] = k
    return out


def _lloyd(rows: _SortedRows, bounds: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted Lloyd iterations on sorted rows; stops when no boundary moves."""
    n, k = rows.values.shape
    edge = lambda: (torch.zeros(n, 1, dtype=torch.int64), torch.full((n, 1), k, dtype=torch.int64))  # noqa: E731
    for _ in range(LLOYD_MAX_ITERS):
        centroids = torch.sort(centroids, dim=1).values
        mids = (centroids[:, :-1] + centroids[:, 1:]) / 2
        first, last = edge()
        new_bounds = torch.cat([first, torch.searchsorted(rows.values, mids), last], dim=1)
        if torch.equal(new_bounds, bounds):
            break
        bounds = new_bounds
        centroids = rows.centroids(bounds, centroids)
    return bounds, rows.centroids(bounds, centroids)


def _cluster_rows(
    w: torch.Tensor, h: torch.Tensor, bits_min: int, bits_max: int
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """w [n, K] float64 -> parent codes [n, K] int64 and {b: LUT [n, 2**b] fp16}."""
    rows = _SortedRows(w, h)
    n, k = w.shape
    bounds = torch.tensor([0, k], dtype=torch.int64).expand(n, 2).contiguous()
    centroids = rows.centroids(bounds, torch.zeros(n, 1, dtype=w.dtype))
    for _ in range(bits_min):
        bounds = _split_all(rows, bounds)
        centroids = rows.centroids(bounds, centroids.repeat_interleave(2, dim=1))
    bounds, centroids = _lloyd(rows, bounds, centroids)

    luts = {bits_min: centroids.to(TABLE_DTYPE)}
    for b in range(bits_min + 1, bits_max + 1):
        bounds = _split_all(rows, bounds)
        centroids = rows.centroids(bounds, centroids.repeat_interleave(2, dim=1))
        luts[b] = centroids.to(TABLE_DTYPE)

    positions = torch.arange(k, dtype=torch.int64).expand(n, k).contiguous()
    sorted_codes = _cluster_ids(bounds, positions)
    codes = torch.empty_like(sorted_codes).scatter_(1, rows.perm, sorted_codes)
    return codes, luts
