"""`<AP dir>/weight_errors.json`: the converter's own quantization error of every expert weight at every bitwidth.

The converter fits every block's planes and tables and knows, for each stored bitwidth b, the squared error
sum (W - W_b)^2 of what it fitted (QuantizedBlock.fit_sse; column-weighted when it was given --calib-text)
and the block's energy sum W^2. It writes both here, so a server without a planner calibration still knows
how much each block loses per bit: the uncalibrated policy (planner/uncalibrated_policy.py) ranks steps by
this weight-only sensitivity and picks its floor from the checkpoint-wide relative error.

    format, version     "pagedweight-weight-errors", 1
    table_kind, bits_min, bits_max   of the checkpoint it was written for (checked against the manifest)
    tensors             [{layer, expert, proj (gate|up|down), energy, sse: {bits: sum (W - W_b)^2}}]

Routed experts only (shared experts are served as dense layers). Small: one row per expert weight.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

WEIGHT_ERRORS_FILENAME = "weight_errors.json"
WEIGHT_ERRORS_FORMAT = "pagedweight-weight-errors"
WEIGHT_ERRORS_VERSION = 1
SOURCE_PROJS: tuple[str, ...] = ("gate", "up", "down")
# runtime block (pagedweight.runtime.blocks) -> the source weights it concatenates
RUNTIME_PROJS: Mapping[str, tuple[str, ...]] = {"w13": ("gate", "up"), "w2": ("down",)}

TensorKey = tuple[int, int, str]  # (layer, expert, gate|up|down)


class WeightErrorsError(ValueError):
    """weight_errors.json is missing, malformed, or written for another checkpoint."""


@dataclass(frozen=True)
class TensorError:
    """One expert weight: its energy sum W^2 and sum (W - W_b)^2 for every stored bitwidth."""

    energy: float
    sse: Mapping[int, float]

    def __post_init__(self) -> None:
        values = [self.energy, *self.sse.values()]
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise WeightErrorsError(f"energy and errors must be finite and >= 0, got {self.energy}, {dict(self.sse)}")


@dataclass(frozen=True)
class WeightErrors:
    table_kind: str
    bits_min: int
    bits_max: int
    tensors: Mapping[TensorKey, TensorError]

    def __post_init__(self) -> None:
        want = set(range(self.bits_min, self.bits_max + 1))
        for key, t in self.tensors.items():
            if key[2] not in SOURCE_PROJS:
                raise WeightErrorsError(f"tensor {key}: proj must be one of {SOURCE_PROJS}")
            if set(t.sse) != want:
                raise WeightErrorsError(f"tensor {key} has errors for bits {sorted(t.sse)}, expected {sorted(want)}")

    @property
    def bitwidths(self) -> tuple[int, ...]:
        return tuple(range(self.bits_min, self.bits_max + 1))

    def relative_error(self, bits: int) -> float:
        """Checkpoint-wide sum (W - W_b)^2 / sum W^2 at `bits` (what the converter logs)."""
        energy = sum(t.energy for t in self.tensors.values())
        return sum(t.sse[bits] for t in self.tensors.values()) / energy if energy > 0 else 0.0

    def runtime_relative(self) -> dict[tuple[int, int, str], dict[int, float]]:
        """Relative squared error by bitwidth of every runtime block (w13 = gate || up, w2 = down).

        Relative, so blocks of different scale (moefy folds an output scale into w2) rank on one scale: the
        fraction of the block's output energy its quantization error carries, for inputs of equal energy.
        """
        out: dict[tuple[int, int, str], dict[int, float]] = {}
        experts = sorted({(k[0], k[1]) for k in self.tensors})
        for layer, expert in experts:
            for proj, parts in RUNTIME_PROJS.items():
                rows = [self.tensors.get((layer, expert, p)) for p in parts]
                if any(r is None for r in rows):
                    continue
                energy = sum(r.energy for r in rows)
                out[(layer, expert, proj)] = {
                    b: (sum(r.sse[b] for r in rows) / energy if energy > 0 else 0.0) for b in self.bitwidths
                }
        return out

    # ---- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": WEIGHT_ERRORS_FORMAT,
            "version": WEIGHT_ERRORS_VERSION,
            "table_kind": self.table_kind,
            "bits_min": self.bits_min,
            "bits_max": self.bits_max,
            "tensors": [
                {"layer": k[0], "expert": k[1], "proj": k[2], "energy": t.energy,
                 "sse": {str(b): v for b, v in sorted(t.sse.items())}}
                for k, t in sorted(self.tensors.items(), key=lambda kv: (kv[0][0], kv[0][1], SOURCE_PROJS.index(kv[0][2])))
            ],
        }

    def save(self, ap_dir: str | os.PathLike) -> Path:
        """Write AP_DIR/weight_errors.json atomically (temp file + rename)."""
        path = Path(ap_dir) / WEIGHT_ERRORS_FILENAME
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), indent=0, allow_nan=False) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def from_json(cls, d: Mapping, where: str = WEIGHT_ERRORS_FILENAME) -> WeightErrors:
        try:
            if d.get("format") != WEIGHT_ERRORS_FORMAT or d.get("version") != WEIGHT_ERRORS_VERSION:
                raise WeightErrorsError(f"{where}: format {d.get('format')!r} version {d.get('version')!r}, expected "
                                        f"{WEIGHT_ERRORS_FORMAT!r} {WEIGHT_ERRORS_VERSION}; re-run `pagedweight convert`")
            tensors: dict[TensorKey, TensorError] = {}
            for e in d["tensors"]:
                key = (int(e["layer"]), int(e["expert"]), str(e["proj"]))
                if key in tensors:
                    raise WeightErrorsError(f"{where}: tensor {key} appears twice")
                tensors[key] = TensorError(float(e["energy"]), {int(b): float(v) for b, v in e["sse"].items()})
            return cls(str(d["table_kind"]), int(d["bits_min"]), int(d["bits_max"]), tensors)
        except WeightErrorsError as e:
            raise WeightErrorsError(f"{where}: {e}" if not str(e).startswith(where) else str(e)) from None
        except KeyError as e:
            raise WeightErrorsError(f"{where}: missing field {e}; re-run `pagedweight convert`") from None
        except (TypeError, ValueError) as e:
            raise WeightErrorsError(f"{where}: malformed ({e}); re-run `pagedweight convert`") from None

    @classmethod
    def load(cls, ap_dir: str | os.PathLike) -> WeightErrors:
        path = Path(ap_dir) / WEIGHT_ERRORS_FILENAME
        if not path.is_file():
            raise WeightErrorsError(f"no {WEIGHT_ERRORS_FILENAME} in {ap_dir}; `pagedweight convert` writes it")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise WeightErrorsError(f"{path} is not valid JSON ({e}); re-run `pagedweight convert`") from None
        return cls.from_json(d, where=str(path))

    def check_matches(self, table_kind: str, bits_min: int, bits_max: int) -> None:
        """Refuse errors written for another checkpoint (names the field)."""
        for name, theirs in (("table_kind", table_kind), ("bits_min", bits_min), ("bits_max", bits_max)):
            mine = getattr(self, name)
            if mine != theirs:
                raise WeightErrorsError(f"{WEIGHT_ERRORS_FILENAME} was written for {name}={mine!r}, the manifest has "
                                        f"{theirs!r}; re-run `pagedweight convert`")
