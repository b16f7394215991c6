"""Policy 'uncalibrated': the quality policy's planner without a planner calibration, above a known floor.

Without `calibration.json` there are no Hessian sensitivities, routing buckets or prompt-residual heads. What
every converted checkpoint does have is the converter's own quantization error of every expert weight at
every bitwidth (`weight_errors.json`, format/weight_errors.py). This policy stands that in for the Hessian
terms: s^b of a block is its relative squared weight error sum (W - W_b)^2 / sum W^2 (w13 sums gate and up),
so g^{b->b-1} = s^{b-1} - s^b is the share of the block's energy one more bit loses, and the quality
policy's greedy plan (damage per freed byte) decides which blocks give up bits. All blocks are one bucket
(mu = 1), there is no prompt residual (eta = 1), and there is one floor stage:

    floor = the lowest stored bitwidth whose checkpoint-wide relative weight error is <= max_relative_error

(never below the table's floor, i.e. the checkpoint's seed or --paged-weight-min-bits). The point is that
the floor's quality is known before serving: on the MoEfied SmolLM2 the ubcq checkpoint's 3-bit error is
under the default threshold and 2-bit's is not, and uniform 3-bit is a measured point (docs/results/quality.md)
while the 2-bit prefix is what made the hotness policy's 25%-budget perplexity 1713. An explicit floor
(`floor_bits`, from --paged-weight-min-bits) replaces the derived one.

A checkpoint converted before weight_errors.json existed gets the uniform-quantizer rule instead (each bit
quarters the squared error: s^b = 2 * 4^-b, the ubcq error of Gaussian weights to within ~1.6x), i.e. every
block's step costs the same per bit and bytes decide; the floor follows from the same threshold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from pagedweight.format.weight_errors import WeightErrors
from pagedweight.planner.calibration import APIdentity, CalibrationData
from pagedweight.planner.prompt_residual import PromptResidualModel
from pagedweight.planner.quality_policy import QualityOptions, QualityPolicy
from pagedweight.planner.routing_stats import BUCKETS, BucketConfig
from pagedweight.planner.sensitivity import SensitivityTable
from pagedweight.runtime.planner_api import Observation

# Checkpoint-wide relative squared weight error the floor may reach. MoEfied SmolLM2, ubcq (group 32): 3 bits
# is under it and 2 bits over it (weight_errors.json; docs/results/quality.md).
DEFAULT_MAX_RELATIVE_ERROR = 0.05


def assumed_relative_error(bits: int) -> float:
    """The uniform-quantizer rule used without weight_errors.json: each bit quarters the squared error."""
    return 2.0 * 4.0 ** -bits


@dataclass(frozen=True)
class UncalibratedOptions:
    max_relative_error: float = DEFAULT_MAX_RELATIVE_ERROR
    floor_bits: int | None = None  # explicit floor (--paged-weight-min-bits); None: derived from the errors

    def __post_init__(self) -> None:
        if not 0 < self.max_relative_error < 1:
            raise ValueError(f"max_relative_error must be in (0, 1), got {self.max_relative_error}")
        if self.floor_bits is not None and not 1 <= self.floor_bits <= 8:
            raise ValueError(f"floor_bits must be between 1 and 8, got {self.floor_bits}")


@dataclass(frozen=True)
class FloorChoice:
    """The floor in force and the sentence that says why (goes into the startup log line)."""

    bits: int
    reason: str


def choose_floor(relative_error: Mapping[int, float], seed_bits: int, options: UncalibratedOptions,
                 source: str) -> FloorChoice:
    """The uncalibrated floor: explicit, else the lowest bitwidth whose relative error is under the threshold."""
    bits = sorted(relative_error)
    if options.floor_bits is not None:
        f = min(max(options.floor_bits, seed_bits), bits[-1])
        return FloorChoice(f, f"--paged-weight-min-bits {options.floor_bits}")
    ok = [b for b in bits if relative_error[b] <= options.max_relative_error]
    f = max(seed_bits, ok[0] if ok else bits[-1])
    below = [b for b in bits if b < f]
    tail = f", {below[-1]} bits has {relative_error[below[-1]]:.2g}" if below else ""
    return FloorChoice(f, f"lowest bitwidth whose relative weight error ({relative_error[f]:.2g}) is <= "
                          f"{options.max_relative_error:g}{tail}; from {source}")


class UncalibratedPolicy(QualityPolicy):
    """Policy 'uncalibrated'. Built from the checkpoint's weight errors (or the assumed rule) and a floor."""

    def __init__(self, calib: CalibrationData, floor: FloorChoice, source: str) -> None:
        # one bucket and no residual: only the weight-only sensitivity, bytes and the floor decide
        super().__init__(calib, QualityOptions(use_prompt_residual=False))
        self.floor = floor
        self.source = source

    def _ingest(self, observation: Observation) -> None:
        """Traffic changes nothing here (one bucket, no residual): never fold it, so it never rebuilds the queue."""

    @classmethod
    def from_errors(cls, errors: WeightErrors | None, blocks: Iterable[tuple[int, int, str]], bits_min: int,
                    bits_max: int, seed_bits: int, options: UncalibratedOptions | None = None) -> UncalibratedPolicy:
        """`blocks`: the page table's (layer, expert, proj) keys; `errors` None: the assumed rule."""
        options = options or UncalibratedOptions()
        keys = sorted(set(blocks))
        if not keys:
            raise ValueError("the uncalibrated policy needs at least one expert block")
        bitwidths = range(bits_min, bits_max + 1)
        if errors is not None:
            rel = errors.runtime_relative()
            missing = [k for k in keys if k not in rel]
            if missing:
                raise ValueError(f"weight_errors.json has no errors for block {missing[0]} ({len(missing)} missing); "
                                 "re-run `pagedweight convert`")
            by_block = {k: {b: rel[k][b] for b in bitwidths} for k in keys}
            overall = {b: errors.relative_error(b) for b in bitwidths}
            source = "the converter's weight errors (weight_errors.json)"
        else:
            by_block = {k: {b: assumed_relative_error(b) for b in bitwidths} for k in keys}
            overall = {b: assumed_relative_error(b) for b in bitwidths}
            source = "the uniform-quantizer rule 2 * 4^-b (no weight_errors.json: convert again to use the checkpoint's own)"
        floor = choose_floor(overall, seed_bits, options, source)
        return cls(synthetic_calibration(by_block, bits_min, bits_max, floor.bits), floor, source)


def synthetic_calibration(by_block: Mapping[tuple[int, int, str], Mapping[int, float]], bits_min: int, bits_max: int,
                          floor_bits: int) -> CalibrationData:
    """A CalibrationData holding only sensitivities: uniform routing, every expert warm (mu 1), one floor stage,
    no residual heads."""
    num_layers = max(k[0] for k in by_block) + 1
    num_experts = max(k[1] for k in by_block) + 1
    buckets = BucketConfig(hot_threshold=math.inf, cold_threshold=-math.inf, mu={b: 1.0 for b in BUCKETS},
                           floor_stages=({b: floor_bits for b in BUCKETS},))
    return CalibrationData(
        ap=APIdentity("uncalibrated", bits_min, bits_max, ""),
        num_layers=num_layers,
        num_experts=num_experts,
        sensitivity={k: SensitivityTable(dict(v)) for k, v in by_block.items()},
        routing_mass=np.full((num_layers, num_experts), 1.0 / num_experts),
        buckets=buckets,
        residual=PromptResidualModel(heads={}, ref_norm=np.full((num_layers, num_experts, 3), np.nan)),
        source={"kind": "uncalibrated", "floor_bits": floor_bits},
    )
