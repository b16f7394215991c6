"""Balanced k-means: split an FFN's intermediate neurons into equally sized expert groups.

MoEfication (Zhang et al., 2022, "parameter clustering split") groups neurons whose input weight vectors
point the same way, since such neurons tend to fire on the same tokens; experts must be equally sized so
the result is an ordinary MoE with one intermediate size. Each Lloyd step therefore solves the balanced
assignment exactly: every centroid is repeated `n / k` times and `scipy.optimize.linear_sum_assignment`
finds the minimum-total-distance one-to-one matching of neurons to centroid slots.
"""

from __future__ import annotations

import numpy as np


def neuron_features(gate_proj: np.ndarray, up_proj: np.ndarray) -> np.ndarray:
    """One feature row per intermediate neuron: its gate and up weight rows, each scaled to unit length.

    Unit length makes the distance a cosine distance, so clusters follow direction (which tokens a neuron
    responds to) rather than weight magnitude.
    """
    if gate_proj.shape != up_proj.shape:
        raise ValueError(f"gate_proj {gate_proj.shape} and up_proj {up_proj.shape} differ in shape")

    def unit_rows(matrix: np.ndarray) -> np.ndarray:
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        return matrix / np.maximum(norms, 1e-12)

    return np.concatenate([unit_rows(gate_proj), unit_rows(up_proj)], axis=1).astype(np.float32)


def _squared_distances(points: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    return (
        (points**2).sum(1, keepdims=True) - 2.0 * points @ centroids.T + (centroids**2).sum(1)[None, :]
    ).clip(min=0.0)


def _kmeans_plus_plus(points: np.ndarray, num_clusters: int, rng: np.random.Generator) -> np.ndarray:
    centroids = [points[rng.integers(len(points))]]
    for _ in range(1, num_clusters):
        distances = _squared_distances(points, np.stack(centroids)).min(1)
        total = distances.sum()
        probabilities = distances / total if total > 0 else np.full(len(points), 1.0 / len(points))
        centroids.append(points[rng.choice(len(points), p=probabilities)])
    return np.stack(centroids)


def balanced_assignment(points: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Label each point with a centroid so that every centroid gets exactly n / k points, total distance min."""
    num_points, num_clusters = len(points), len(centroids)
    size = num_points // num_clusters
    # float64 costs: the assignment solver compares sums of many small differences.
    cost = np.repeat(_squared_distances(points, centroids).astype(np.float64), size, axis=1)  # [n, n]
    from scipy.optimize import linear_sum_assignment  # the moefy extra; imported here so the CLI builds without it

    rows, slots = linear_sum_assignment(cost)
    labels = np.empty(num_points, dtype=np.int64)
    labels[rows] = slots // size
    return labels


def balanced_kmeans(
    points: np.ndarray, num_clusters: int, iterations: int = 20, seed: int = 0
) -> np.ndarray:
    """Cluster `points` [n, d] into `num_clusters` groups of exactly n / num_clusters; returns labels [n].

    Deterministic for a seed. Stops early when an iteration changes no label.
    """
    points = np.asarray(points)
    if points.dtype not in (np.float32, np.float64):
        points = points.astype(np.float64)
    if points.ndim != 2:
        raise ValueError(f"points must be 2-D, got shape {points.shape}")
    if num_clusters < 1 or len(points) % num_clusters:
        raise ValueError(f"{len(points)} points cannot be split into {num_clusters} equal clusters")
    if num_clusters == 1:
        return np.zeros(len(points), dtype=np.int64)
    rng = np.random.default_rng(seed)
    labels = balanced_assignment(points, _kmeans_plus_plus(points, num_clusters, rng))
    for _ in range(iterations):
        # Balanced clusters all have n / k members, so every centroid is a one-hot matmul / size.
        one_hot = np.zeros((num_clusters, len(points)), dtype=points.dtype)
        one_hot[labels, np.arange(len(points))] = 1.0
        centroids = (one_hot @ points) / (len(points) // num_clusters)
        new_labels = balanced_assignment(points, centroids)
        if np.array_equal(new_labels, labels):
            break
        labels = new_labels
    return labels


def groups_from_labels(labels: np.ndarray, num_clusters: int) -> np.ndarray:
    """[num_clusters, n / num_clusters] neuron indices, each group sorted (keeps memory access regular)."""
    groups = [np.flatnonzero(labels == cluster) for cluster in range(num_clusters)]
    sizes = {len(group) for group in groups}
    if len(sizes) != 1:
        raise ValueError(f"clusters are not balanced: sizes {sorted(len(g) for g in groups)}")
    return np.stack(groups)
