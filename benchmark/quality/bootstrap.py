"""Window-bootstrap 95% intervals of the quality headline: resample the evaluation windows, recompute each figure.

Every measured point carries its per-window NLL sums (`evaluate(per_window=True)`). One resample draws the
windows with replacement, once, and every point is re-scored on those same windows, so differences between
points (gap closed, "is A worse than B") are paired and their intervals are those of the difference, not of
two independent samples. Windows of one text are the resampling unit: tokens inside a window are not
independent, windows of held-out documents nearly are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


def resample_indices(n_windows: int, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """[resamples, n_windows] window indices drawn with replacement (deterministic for a seed)."""
    if n_windows < 2:
        raise ValueError(f"a window bootstrap needs at least 2 windows, got {n_windows}")
    return np.random.default_rng(seed).integers(0, n_windows, size=(resamples, n_windows))


def ppl_samples(point: Mapping, idx: np.ndarray) -> np.ndarray:
    """Perplexity of `point` on every resample (windows of equal length: the mean NLL is a mean of sums)."""
    w = np.asarray(point["window_nll"], dtype=np.float64)
    tokens_per_window = point["tokens"] / len(w)
    return np.exp(w[idx].mean(axis=1) / tokens_per_window)


def interval(samples: np.ndarray, level: float = LEVEL) -> list[float] | None:
    """Central percentile interval of the finite samples; None if fewer than half are finite."""
    s = np.asarray(samples, dtype=np.float64)
    s = s[np.isfinite(s)]
    if s.size * 2 < len(samples):
        return None
    a = (1.0 - level) / 2
    return [float(np.quantile(s, a)), float(np.quantile(s, 1.0 - a))]


def gap_closed_samples(uniform: np.ndarray, pw: np.ndarray, bf16: np.ndarray) -> np.ndarray:
    gap = uniform - bf16
    return np.where(gap > 0, (uniform - pw) / np.where(gap > 0, gap, 1.0), np.nan)


def saving_samples(points: list[Mapping], bf16: Mapping, bf16_bytes: int, idx: np.ndarray,
                   tolerance: float = 0.01) -> np.ndarray:
    """Memory saving of the cheapest point within (1 + tolerance) x bf16 ppl, per resample (NaN: none is)."""
    ref = ppl_samples(bf16, idx)
    order = sorted(points, key=lambda p: p["bytes"])
    out = np.full(idx.shape[0], np.nan)
    for p in reversed(order):  # cheapest last, so it wins where several qualify
        ok = ppl_samples(p, idx) <= (1.0 + tolerance) * ref
        out[ok] = 1.0 - p["bytes"] / bf16_bytes
    return out


def headline_intervals(figures: Mapping[str, Callable[[np.ndarray], np.ndarray]], n_windows: int,
                       resamples: int = RESAMPLES, seed: int = 0) -> dict[str, list[float] | None]:
    """{name: [lo, hi]} for every figure, each a function of the same resampled window indices."""
    idx = resample_indices(n_windows, resamples, seed)
    return {name: interval(f(idx)) for name, f in figures.items()}
