"""Prompt residual: how much more (or less) a transition hurts on the current prompts than on average.

PagedWeight eq. 5-6. For block i = (l, e, u) and transition b -> b',

    rho_hat = w_u^T phi_i + a_u                            one linear head per (proj u, b -> b')
    eta     = exp(alpha * c_u * clip(rho_hat, rho_min, rho_max))

phi_i holds three statistics of the inputs routed to expert e of layer l in the current batch:
routing-weighted mean input norm, routing-weighted RMS input norm, max input norm. Each is divided by
the same statistic's calibration value for that expert (`ref_norm`), so one head serves every layer:
phi = (1, 1, ~1) is "typical traffic for this expert". The head's target at calibration is
log(damage measured on one prompt / global damage g). `c_u` is the head's confidence: its
leave-one-out R^2 clipped to [0, 1], so a head that does not generalise switches itself off.

`RoutedInputAccumulator` computes the sums behind phi on the device with index_add_/scatter_reduce (no
host sync), from the routed inputs the MoE layer already has.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

NUM_FEATURES = 3
FEATURE_NAMES: tuple[str, ...] = ("weighted_mean_norm", "weighted_rms_norm", "max_norm")


def routed_input_sums(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """[E, 4] per expert: (sum r*|x|, sum r*|x|^2, sum r, max |x|) over the (token, k) slots routed to it.

    hidden [T, H], topk_ids/topk_weights [T, k]. Invalid ids (< 0 or >= E) are skipped. Experts with no
    slot get zeros (their max is 0, not -inf, so the sums can be accumulated across batches).
    """
    if hidden.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"need hidden [T, H] and topk [T, k] with one T, got {tuple(hidden.shape)}, {tuple(topk_ids.shape)}, "
            f"{tuple(topk_weights.shape)}"
        )
    norm = hidden.float().norm(dim=-1)  # [T]
    k = topk_ids.shape[1]
    norm_k = norm.unsqueeze(1).expand(-1, k).reshape(-1)
    ids = topk_ids.reshape(-1).long()
    w = topk_weights.reshape(-1).float()
    valid = (ids >= 0) & (ids < num_experts)
    safe = torch.where(valid, ids, 0)
    w = torch.where(valid, w, 0.0)
    out = torch.zeros(num_experts, 4, dtype=torch.float32, device=hidden.device)
    out[:, 0].index_add_(0, safe, w * norm_k)
    out[:, 1].index_add_(0, safe, w * norm_k * norm_k)
    out[:, 2].index_add_(0, safe, w)
    out[:, 3].scatter_reduce_(0, safe, torch.where(valid, norm_k, 0.0), reduce="amax", include_self=True)
    return out


def features_from_sums(sums: np.ndarray | torch.Tensor) -> np.ndarray:
    """[..., 4] sums -> [..., 3] raw phi (mean, RMS, max norm); NaN where no routing weight was seen."""
    s = np.asarray(sums.cpu() if isinstance(sums, torch.Tensor) else sums, dtype=np.float64)
    wsum = s[..., 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.where(wsum > 0, s[..., 0] / wsum, np.nan)
        rms = np.where(wsum > 0, np.sqrt(np.maximum(s[..., 1], 0) / wsum), np.nan)
    mx = np.where(wsum > 0, s[..., 3], np.nan)
    return np.stack([mean, rms, mx], axis=-1)


class RoutedInputAccumulator:
    """Device-side sums behind phi for every (layer, expert) since the last drain."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str = "cpu") -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._sums = torch.zeros(num_layers, num_experts, 4, dtype=torch.float32, device=device)

    def record(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        batch = routed_input_sums(hidden, topk_ids, topk_weights, self.num_experts)
        row = self._sums[layer]
        row[:, :3].add_(batch[:, :3])
        row[:, 3].copy_(torch.maximum(row[:, 3], batch[:, 3]))

    def drain(self) -> np.ndarray:
        """[L, E, 3] raw phi since the last drain (NaN for unrouted experts), then reset."""
        phi = features_from_sums(self._sums.cpu().clone())
        self._sums.zero_()
        return phi


@dataclass(frozen=True)
class ResidualHead:
    """rho_hat = w^T phi + a for one (proj, b -> b'), with its confidence and clip range."""

    w: tuple[float, float, float]
    a: float
    confidence: float  # c in [0, 1]
    rho_min: float
    rho_max: float
    num_samples: int

    def __post_init__(self) -> None:
        if len(self.w) != NUM_FEATURES:
            raise ValueError(f"a head needs {NUM_FEATURES} weights, got {len(self.w)}")
        if not 0.0 <= self.confidence <= 1.0:
            raise ValueError(f"confidence must be in [0, 1], got {self.confidence}")
        if not self.rho_min <= self.rho_max:
            raise ValueError(f"rho_min {self.rho_min} > rho_max {self.rho_max}")
        if not all(math.isfinite(v) for v in (*self.w, self.a, self.rho_min, self.rho_max)):
            raise ValueError("head parameters must be finite")

    def predict(self, phi: np.ndarray) -> np.ndarray:
        """rho_hat for [..., 3] normalised features."""
        return np.asarray(phi, dtype=np.float64) @ np.asarray(self.w) + self.a

    def eta(self, phi: np.ndarray, alpha: float) -> np.ndarray:
        """eq. 6; NaN features (expert not routed in this batch) give eta = 1 (no evidence either way)."""
        rho = np.clip(self.predict(phi), self.rho_min, self.rho_max)
        out = np.exp(alpha * self.confidence * rho)
        return np.where(np.isnan(out), 1.0, out)

    def to_json(self) -> dict:
        return {"w": list(self.w), "a": self.a, "confidence": self.confidence, "rho_min": self.rho_min,
                "rho_max": self.rho_max, "num_samples": self.num_samples}

    @classmethod
    def from_json(cls, d: Mapping) -> ResidualHead:
        return cls(tuple(float(v) for v in d["w"]), float(d["a"]), float(d["confidence"]), float(d["rho_min"]),
                   float(d["rho_max"]), int(d["num_samples"]))


def fit_head(
    phi: np.ndarray, rho: np.ndarray, ridge: float = 1e-3, clip_quantiles: tuple[float, float] = (0.05, 0.95)
) -> ResidualHead:
    """Least squares rho ~ w^T phi + a (tiny ridge on w only, for collinear features).

    Confidence = leave-one-out R^2 clipped to [0, 1] (closed form through the hat matrix). The clip
    range is the [5%, 95%] quantile range of the observed targets, so extrapolation stays bounded.
    """
    phi = np.asarray(phi, dtype=np.float64)
    rho = np.asarray(rho, dtype=np.float64)
    if phi.ndim != 2 or phi.shape[1] != NUM_FEATURES or rho.shape != (phi.shape[0],):
        raise ValueError(f"need phi [n, {NUM_FEATURES}] and rho [n], got {phi.shape} and {rho.shape}")
    keep = np.isfinite(phi).all(axis=1) & np.isfinite(rho)
    phi, rho = phi[keep], rho[keep]
    n = rho.size
    if n < NUM_FEATURES + 2:
        raise ValueError(f"need at least {NUM_FEATURES + 2} finite samples to fit a head, got {n}")
    x = np.concatenate([phi, np.ones((n, 1))], axis=1)
    reg = np.diag([ridge] * NUM_FEATURES + [0.0])
    gram_inv = np.linalg.pinv(x.T @ x + reg)
    coef = gram_inv @ x.T @ rho
    resid = rho - x @ coef
    lev = np.einsum("ij,jk,ik->i", x, gram_inv, x)
    loo = resid / np.maximum(1.0 - lev, 1e-9)
    sst = float(((rho - rho.mean()) ** 2).sum())
    r2_loo = 1.0 - float((loo**2).sum()) / sst if sst > 0 else 0.0
    lo, hi = np.quantile(rho, clip_quantiles)
    return ResidualHead(
        w=tuple(float(v) for v in coef[:NUM_FEATURES]),
        a=float(coef[NUM_FEATURES]),
        confidence=float(min(max(r2_loo, 0.0), 1.0)),
        rho_min=float(lo),
        rho_max=float(hi),
        num_samples=int(n),
    )


def normalize_features(phi_raw: np.ndarray, ref_norm: np.ndarray) -> np.ndarray:
    """Divide raw phi [L, E, 3] by the calibration reference [L, E, 3]; NaN where the reference is 0."""
    ref = np.asarray(ref_norm, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ref > 0, np.asarray(phi_raw, dtype=np.float64) / ref, np.nan)


def transition_key(proj: str, bits_from: int, bits_to: int) -> str:
    """Key of the head for projection `proj` and transition bits_from -> bits_to (e.g. "w2:5->4")."""
    return f"{proj}:{bits_from}->{bits_to}"


@dataclass(frozen=True)
class PromptResidualModel:
    """All heads plus the per-expert reference features they are normalised by."""

    heads: Mapping[str, ResidualHead]  # transition_key -> head
    ref_norm: np.ndarray  # [L, E, 3]; calibration phi of each routed expert (shared experts get eta = 1)

    def eta(self, proj: str, bits_from: int, bits_to: int, phi_norm: np.ndarray, alpha: float) -> np.ndarray:
        """eta for the normalised features phi_norm [..., 3]; 1 where no head exists for the transition."""
        head = self.heads.get(transition_key(proj, bits_from, bits_to))
        if head is None:
            return np.ones(np.asarray(phi_norm).shape[:-1])
        return head.eta(phi_norm, alpha)
