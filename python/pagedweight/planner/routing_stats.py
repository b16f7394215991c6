"""Routing statistics: routing mass per expert (eq. 1), its online EMA, and hot/warm/cold buckets.

PagedWeight eq. 1: the routing mass of expert e in layer l is its share of the routing weight,

    m_{l,e} = sum_{t,k} r_{l,t,k} 1{z_{l,t,k} = e} / sum_{t,k} r_{l,t,k}.

Online, the numerator and denominator are exponentially decayed sums with a horizon measured in routed
weight, about one unit per token (decay exp(-weight / horizon) per fold), so the estimate does not depend on how the traffic was
split into batches. Masses are compared across layers after normalising by the uniform share
(`m * E`; 1.0 = an average expert), and bucketed with thresholds fixed at calibration time, so an expert
whose traffic grows moves from cold to hot without recalibrating.

The device-side `RoutingRecorder` only accumulates with index_add_ (no host sync, CUDA-graph safe);
the planner drains it at a scheduler boundary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

BUCKETS: tuple[str, ...] = ("hot", "warm", "cold")


def routing_weight_sums(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Numerator of eq. 1 for one batch: [E] float32 sum of routing weights that selected each expert.

    Ids outside [0, E) (e.g. -1 for padded or expert-parallel-masked slots) are ignored.
    """
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} differ")
    ids = topk_ids.reshape(-1).long()
    w = topk_weights.reshape(-1).float()
    valid = (ids >= 0) & (ids < num_experts)
    out = torch.zeros(num_experts, dtype=torch.float32, device=w.device)
    return out.index_add_(0, torch.where(valid, ids, 0), torch.where(valid, w, 0.0))


def routing_mass(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Eq. 1 for one batch: [E] routing-weight share of each expert (zeros when no weight was routed)."""
    sums = routing_weight_sums(topk_weights, topk_ids, num_experts)
    total = sums.sum()
    return sums / total if float(total) > 0 else sums


@dataclass
class RoutingSnapshot:
    """What a RoutingRecorder saw since its last drain (host arrays, rows = MoE layers)."""

    weight_sums: np.ndarray  # [L, E] float64
    counts: np.ndarray  # [L, E] int64: how many (token, k) slots picked each expert
    tokens: np.ndarray  # [L] int64: tokens that passed each layer


class RoutingRecorder:
    """Device-side accumulator fed from the MoE forward: record(layer, topk_weights, topk_ids)."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str = "cpu") -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._weight_sums = torch.zeros(num_layers, num_experts, dtype=torch.float32, device=device)
        self._counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self._tokens = torch.zeros(num_layers, dtype=torch.int64, device=device)

    def record(self, layer: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        ids = topk_ids.reshape(-1).long()
        valid = (ids >= 0) & (ids < self.num_experts)
        safe = torch.where(valid, ids, 0)
        self._weight_sums[layer].add_(routing_weight_sums(topk_weights, topk_ids, self.num_experts))
        self._counts[layer].index_add_(0, safe, valid.long())
        self._tokens[layer] += topk_ids.shape[0]

    def drain(self) -> RoutingSnapshot:
        """Copy to host and reset (one sync; call it at a scheduler boundary)."""
        # clone: on a CPU device .cpu() is the same storage, which zero_() below would wipe
        snap = RoutingSnapshot(
            weight_sums=self._weight_sums.double().cpu().numpy(),
            counts=self._counts.cpu().clone().numpy(),
            tokens=self._tokens.cpu().clone().numpy(),
        )
        self._weight_sums.zero_()
        self._counts.zero_()
        self._tokens.zero_()
        return snap


@dataclass
class RoutingStats:
    """Online routing mass per (layer, expert): decayed sums of routing weight, seeded from calibration."""

    weight_sums: np.ndarray  # [L, E] decayed numerator of eq. 1
    totals: np.ndarray  # [L] decayed denominator
    horizon_tokens: float  # e-folding horizon of the EMA, in routed weight (~ tokens)
    version: int = 0  # bumped on every fold that changed something (plan caches key on it)

    def __post_init__(self) -> None:
        if self.weight_sums.ndim != 2 or self.totals.shape != (self.weight_sums.shape[0],):
            raise ValueError("weight_sums must be [L, E] and totals [L]")
        if not self.horizon_tokens > 0:
            raise ValueError(f"horizon_tokens must be > 0, got {self.horizon_tokens}")

    @classmethod
    def from_masses(cls, masses: np.ndarray, prior_tokens: float, horizon_tokens: float) -> RoutingStats:
        """Start from calibration masses [L, E], weighted as if `prior_tokens` tokens had been seen."""
        masses = np.asarray(masses, dtype=np.float64)
        if prior_tokens <= 0:
            raise ValueError(f"prior_tokens must be > 0, got {prior_tokens}")
        return cls(masses * prior_tokens, np.full(masses.shape[0], float(prior_tokens)), float(horizon_tokens))

    @property
    def num_experts(self) -> int:
        return self.weight_sums.shape[1]

    def fold(self, snapshot: RoutingSnapshot) -> None:
        """EMA step per layer: A <- exp(-w/H) A + batch sums, w = routing weight the layer saw.

        w is the token count when the top-k weights are normalised per token (Mixtral, Qwen3), a bit less
        otherwise; with count-only snapshots (every slot weight 1) it is the number of (token, k) slots.
        """
        if snapshot.weight_sums.shape != self.weight_sums.shape:
            raise ValueError(f"snapshot shape {snapshot.weight_sums.shape} != stats shape {self.weight_sums.shape}")
        n = snapshot.weight_sums.sum(axis=1)
        if not n.any():
            return
        decay = np.exp(-n / self.horizon_tokens)
        self.weight_sums = self.weight_sums * decay[:, None] + snapshot.weight_sums
        self.totals = self.totals * decay + snapshot.weight_sums.sum(axis=1)
        self.version += 1

    def mass(self) -> np.ndarray:
        """[L, E] current m_{l,e}; rows with no weight at all are uniform."""
        out = np.full_like(self.weight_sums, 1.0 / self.num_experts)
        ok = self.totals > 0
        out[ok] = self.weight_sums[ok] / self.totals[ok, None]
        return out

    def normalized_mass(self) -> np.ndarray:
        """[L, E] m * E: 1.0 is an expert with exactly the uniform share."""
        return self.mass() * self.num_experts


@dataclass(frozen=True)
class BucketConfig:
    """Routing buckets: thresholds on normalised mass, damage multipliers and bitwidth-floor stages.

    `floor_stages[s][bucket]` is the lowest bitwidth a block of that bucket may reach in stage s; stages
    are ordered from the most protective to the least, and each stage's floors are <= the previous one's.
    """

    hot_threshold: float  # normalised mass >= this -> hot
    cold_threshold: float  # normalised mass < this -> cold (and not hot)
    mu: Mapping[str, float]
    floor_stages: Sequence[Mapping[str, int]]

    def __post_init__(self) -> None:
        if not self.cold_threshold <= self.hot_threshold:
            raise ValueError(f"cold_threshold {self.cold_threshold} must be <= hot_threshold {self.hot_threshold}")
        for name in BUCKETS:
            if name not in self.mu or not self.mu[name] > 0:
                raise ValueError(f"mu[{name!r}] must be a positive damage multiplier, got {self.mu.get(name)}")
        if not self.floor_stages:
            raise ValueError("floor_stages needs at least one stage")
        prev = None
        for s, stage in enumerate(self.floor_stages):
            if set(stage) != set(BUCKETS):
                raise ValueError(f"floor stage {s} must give a floor for each of {BUCKETS}, got {sorted(stage)}")
            if prev is not None and any(stage[b] > prev[b] for b in BUCKETS):
                raise ValueError(f"floor stage {s} {dict(stage)} raises a floor of stage {s - 1} {dict(prev)}")
            prev = stage

    def bucket(self, normalized_mass: float) -> str:
        if normalized_mass >= self.hot_threshold:
            return "hot"
        if normalized_mass < self.cold_threshold:
            return "cold"
        return "warm"

    def floor(self, stage: int, bucket: str) -> int:
        return int(self.floor_stages[stage][bucket])

    @property
    def num_stages(self) -> int:
        return len(self.floor_stages)

    def to_json(self) -> dict:
        return {
            "hot_threshold": self.hot_threshold,
            "cold_threshold": self.cold_threshold,
            "mu": {b: float(self.mu[b]) for b in BUCKETS},
            "floor_stages": [{b: int(st[b]) for b in BUCKETS} for st in self.floor_stages],
        }

    @classmethod
    def from_json(cls, d: Mapping) -> BucketConfig:
        return cls(
            hot_threshold=float(d["hot_threshold"]),
            cold_threshold=float(d["cold_threshold"]),
            mu={b: float(d["mu"][b]) for b in BUCKETS},
            floor_stages=tuple({b: int(st[b]) for b in BUCKETS} for st in d["floor_stages"]),
        )


def bucket_thresholds(normalized_masses: np.ndarray, hot_fraction: float, cold_fraction: float) -> tuple[float, float]:
    """(hot, cold) thresholds so about `hot_fraction` of experts are hot and `cold_fraction` cold.

    Quantiles of the pooled normalised masses (all layers), using the 'lower'/'higher' sample so the
    threshold is an observed mass and the split is deterministic.
    """
    if not (0 <= hot_fraction <= 1 and 0 <= cold_fraction <= 1 and hot_fraction + cold_fraction <= 1):
        raise ValueError(f"need 0 <= hot_fraction, cold_fraction and their sum <= 1, got {hot_fraction}, {cold_fraction}")
    x = np.sort(np.asarray(normalized_masses, dtype=np.float64).reshape(-1))
    if x.size == 0:
        raise ValueError("no routing masses to take thresholds from")
    n_hot = int(round(hot_fraction * x.size))
    n_cold = int(round(cold_fraction * x.size))
    hot = x[x.size - n_hot] if n_hot > 0 else math.inf
    cold = x[n_cold] if n_cold > 0 else -math.inf
    if n_cold >= x.size:
        cold = math.inf
    return float(hot), float(min(cold, hot))


def bucket_multipliers(normalized_masses: np.ndarray, hot_threshold: float, cold_threshold: float) -> dict[str, float]:
    """Default mu per bucket: the mean normalised mass of the bucket's calibration experts.

    Expected damage over the traffic is proportional to an expert's share of it, and s^b is per routed
    token, so the bucket's mean share is the natural multiplier (1.0 for a bucket of average experts).
    An empty bucket gets its threshold (hot/cold) or 1.0 (warm).
    """
    x = np.asarray(normalized_masses, dtype=np.float64).reshape(-1)
    cfg = BucketConfig(hot_threshold, cold_threshold, {b: 1.0 for b in BUCKETS}, ({b: 1 for b in BUCKETS},))
    labels = np.array([cfg.bucket(v) for v in x])
    fallback = {"hot": hot_threshold, "warm": 1.0, "cold": cold_threshold}
    out = {}
    for b in BUCKETS:
        sel = x[labels == b]
        v = float(sel.mean()) if sel.size else float(fallback[b])
        out[b] = min(max(v, 0.05), 20.0) if math.isfinite(v) else 1.0  # keep every bucket's damage visible
    return out


def default_floor_stages(bits_min: int, bits_max: int) -> tuple[dict[str, int], ...]:
    """Protective stages from the parent bitwidth down to the seed.

    Stage 0 keeps hot blocks within one bit of the parent and warm within two; every later stage lowers
    each bucket's floor by one bit until all reach bits_min (hot > warm > cold while there is room).
    """
    stages: list[dict[str, int]] = []
    floors = {"hot": bits_max - 1, "warm": bits_max - 2, "cold": bits_max - 3}
    while True:
        stage = {b: max(bits_min, min(bits_max, floors[b])) for b in BUCKETS}
        if not stages or stage != stages[-1]:
            stages.append(stage)
        if all(v == bits_min for v in stage.values()):
            return tuple(stages)
        floors = {b: v - 1 for b, v in floors.items()}


@dataclass
class BlockBuckets:
    """Bucket of every (layer, expert) under the current routing masses.

    An expert index outside the routed range (a shared expert fused into the MoE layer after the routed
    ones) is hot: it sees every token.
    """

    config: BucketConfig
    labels: dict[tuple[int, int], str] = field(default_factory=dict)

    @classmethod
    def from_stats(cls, config: BucketConfig, normalized_mass: np.ndarray) -> BlockBuckets:
        labels = {
            (layer, e): config.bucket(float(normalized_mass[layer, e]))
            for layer in range(normalized_mass.shape[0])
            for e in range(normalized_mass.shape[1])
        }
        return cls(config, labels)

    def bucket(self, layer: int, expert: int) -> str:
        label = self.labels.get((layer, expert))
        return "hot" if label is None else label
