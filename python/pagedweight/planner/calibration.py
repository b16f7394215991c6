"""The calibration file the quality policy reads: `<AP dir>/calibration.json` (written by `pagedweight calibrate`).

Versioned JSON, validated on load: every problem is reported with the field that is wrong and the fix
(re-run the calibration for this checkpoint). Contents:

    format, version          "pagedweight-calibration", 3 (older versions are refused: 1 stored w13 in gate/up
                             output units, 2 stored unweighted expert-output errors; see _OLD_VERSIONS)
    ap                       table_kind, bits_min, bits_max, config_sha256 of the AP checkpoint it was made for
    source                   calibration text, tokens, prompts
    num_layers, num_experts  shape of the per-expert arrays (rows = decoder layer index)
    sensitivity              [{layer, expert, proj, s: {bits: s^b}}] per runtime block (w13 = gate + up, w2 = down),
                             loss-weighted squared error of the expert's output per routed token (SENSITIVITY_UNITS)
    routing.mass             [L][E] routing mass m_{l,e} over the calibration text (eq. 1)
    buckets                  hot/cold thresholds on m*E, mu per bucket, bitwidth-floor stages
    prompt_residual          ref_norm [L][E][3] and heads {"proj:b->b'": {w, a, confidence, rho_min, rho_max}}
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedweight.planner.prompt_residual import PromptResidualModel, ResidualHead
from pagedweight.planner.routing_stats import BucketConfig
from pagedweight.planner.sensitivity import SensitivityTable

CALIBRATION_FORMAT = "pagedweight-calibration"
CALIBRATION_VERSION = 3
# s^b of every projection: the expert's output error weighted by the loss's output Fisher (docs/planner.md)
SENSITIVITY_UNITS = "loss_weighted_expert_output"
# Why an older version is refused (each names the fix: re-run `pagedweight calibrate`).
_OLD_VERSIONS = {
    1: "its w13 sensitivities are in gate/up output units while w2's are in expert-output units, so the planner "
       "would rank the two projections on different scales",
    2: "its sensitivities are unweighted expert-output errors, which grow ~100x with depth while the loss they "
       "cause does not, so the planner would rank layers on different scales",
}
CALIBRATION_FILENAME = "calibration.json"
PROJS: tuple[str, ...] = ("w13", "w2")  # runtime block projections: gate||up, down

BlockKey = tuple[int, int, str]  # (layer, expert, proj) as in pagedweight.runtime.blocks.BlockKey


class CalibrationError(ValueError):
    """The calibration file is missing, malformed, or made for another checkpoint."""


@dataclass(frozen=True)
class APIdentity:
    """What a calibration must agree with in the AP checkpoint it is used with."""

    table_kind: str
    bits_min: int
    bits_max: int
    config_sha256: str

    def to_json(self) -> dict:
        return {"table_kind": self.table_kind, "bits_min": self.bits_min, "bits_max": self.bits_max,
                "config_sha256": self.config_sha256}


@dataclass
class CalibrationData:
    ap: APIdentity
    num_layers: int
    num_experts: int
    sensitivity: dict[BlockKey, SensitivityTable]
    routing_mass: np.ndarray  # [L, E]
    buckets: BucketConfig
    residual: PromptResidualModel
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.routing_mass = np.asarray(self.routing_mass, dtype=np.float64)
        if self.routing_mass.shape != (self.num_layers, self.num_experts):
            raise CalibrationError(
                f"routing.mass has shape {self.routing_mass.shape}, expected [{self.num_layers}, {self.num_experts}]"
            )
        if self.residual.ref_norm.shape != (self.num_layers, self.num_experts, 3):
            raise CalibrationError(
                f"prompt_residual.ref_norm has shape {self.residual.ref_norm.shape}, "
                f"expected [{self.num_layers}, {self.num_experts}, 3]"
            )
        want = tuple(range(self.ap.bits_min, self.ap.bits_max + 1))
        for key, table in self.sensitivity.items():
            layer, expert, proj = key
            if proj not in PROJS or not 0 <= layer < self.num_layers or not 0 <= expert < self.num_experts:
                raise CalibrationError(f"sensitivity entry {key} is outside the model (layers, experts, projs {PROJS})")
            if table.bitwidths != want:
                raise CalibrationError(f"sensitivity of {key} covers bits {table.bitwidths}, expected {want}")
        for stage in self.buckets.floor_stages:
            for b, v in stage.items():
                if not self.ap.bits_min <= v <= self.ap.bits_max:
                    raise CalibrationError(f"floor {v} for bucket {b!r} outside {self.ap.bits_min}..{self.ap.bits_max}")

    def check_matches(self, ap: APIdentity) -> None:
        """Refuse a calibration made for another checkpoint (names the mismatching field)."""
        for name in ("table_kind", "bits_min", "bits_max", "config_sha256"):
            mine, theirs = getattr(self.ap, name), getattr(ap, name)
            if mine != theirs:
                raise CalibrationError(
                    f"calibration was made for an AP checkpoint with {name}={mine!r}, this one has {theirs!r}; "
                    "re-run `pagedweight calibrate` for this checkpoint"
                )

    # ---- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": CALIBRATION_FORMAT,
            "version": CALIBRATION_VERSION,
            "sensitivity_units": SENSITIVITY_UNITS,
            "ap": self.ap.to_json(),
            "source": self.source,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "sensitivity": [
                {"layer": k[0], "expert": k[1], "proj": k[2], "s": {str(b): v for b, v in sorted(t.by_bits.items())}}
                for k, t in sorted(self.sensitivity.items())
            ],
            "routing": {"mass": self.routing_mass.tolist()},
            "buckets": self.buckets.to_json(),
            "prompt_residual": {
                "ref_norm": _finite_list(self.residual.ref_norm),
                "heads": {k: h.to_json() for k, h in sorted(self.residual.heads.items())},
            },
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temp file + rename) so a crash never leaves a half-written calibration."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=False, allow_nan=False))
        os.replace(tmp, path)
        return path

    @classmethod
    def from_json(cls, d: Mapping, where: str = "calibration") -> CalibrationData:
        try:
            if d.get("format") != CALIBRATION_FORMAT:
                raise CalibrationError(f"{where}: 'format' is {d.get('format')!r}, expected {CALIBRATION_FORMAT!r}")
            if d.get("version") != CALIBRATION_VERSION:
                why = _OLD_VERSIONS.get(d.get("version"))
                raise CalibrationError(
                    f"{where}: version {d.get('version')!r} is not supported (this build reads version "
                    f"{CALIBRATION_VERSION}{'; ' + why if why else ''}); re-run `pagedweight calibrate` for this "
                    "checkpoint"
                )
            if d.get("sensitivity_units") != SENSITIVITY_UNITS:
                raise CalibrationError(f"{where}: sensitivity_units is {d.get('sensitivity_units')!r}, expected "
                                       f"{SENSITIVITY_UNITS!r}; re-run `pagedweight calibrate`")
            ap = d["ap"]
            sens = {}
            for entry in d["sensitivity"]:
                key = (int(entry["layer"]), int(entry["expert"]), str(entry["proj"]))
                if key in sens:
                    raise CalibrationError(f"{where}: sensitivity entry {key} appears twice")
                sens[key] = SensitivityTable({int(b): float(v) for b, v in entry["s"].items()})
            pr = d["prompt_residual"]
            return cls(
                ap=APIdentity(str(ap["table_kind"]), int(ap["bits_min"]), int(ap["bits_max"]), str(ap["config_sha256"])),
                num_layers=int(d["num_layers"]),
                num_experts=int(d["num_experts"]),
                sensitivity=sens,
                routing_mass=np.asarray(d["routing"]["mass"], dtype=np.float64),
                buckets=BucketConfig.from_json(d["buckets"]),
                residual=PromptResidualModel(
                    heads={str(k): ResidualHead.from_json(h) for k, h in pr["heads"].items()},
                    ref_norm=np.asarray(_nan_list(pr["ref_norm"]), dtype=np.float64),
                ),
                source=dict(d.get("source", {})),
            )
        except CalibrationError:
            raise
        except KeyError as e:
            raise CalibrationError(f"{where}: missing field {e}; re-run `pagedweight calibrate`") from None
        except (TypeError, ValueError) as e:
            raise CalibrationError(f"{where}: malformed ({e}); re-run `pagedweight calibrate`") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> CalibrationData:
        path = Path(path)
        if path.is_dir():
            path = path / CALIBRATION_FILENAME
        if not path.is_file():
            raise CalibrationError(
                f"no calibration file at {path}; create it with `pagedweight calibrate --model HF_DIR --ap AP_DIR "
                "--text FILE`"
            )
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{path} is not valid JSON ({e}); re-run `pagedweight calibrate`") from None
        return cls.from_json(d, where=str(path))


def ap_identity_from_manifest(ap_dir: str | os.PathLike) -> APIdentity:
    """The identity fields of an AP checkpoint's manifest.json (docs/format.md)."""
    path = Path(ap_dir) / "manifest.json"
    try:
        m = json.loads(path.read_text())
        return APIdentity(str(m["table_kind"]), int(m["bits_min"]), int(m["bits_max"]), str(m["model"]["config_sha256"]))
    except FileNotFoundError:
        raise CalibrationError(f"no AP manifest at {path}") from None
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{path} is not a valid AP manifest ({e!r})") from None


def load_for_checkpoint(ap_dir: str | os.PathLike, path: str | os.PathLike | None = None) -> CalibrationData:
    """Load `path` (default: AP_DIR/calibration.json) and refuse it if it was made for another checkpoint."""
    data = CalibrationData.load(Path(path) if path is not None else Path(ap_dir) / CALIBRATION_FILENAME)
    data.check_matches(ap_identity_from_manifest(ap_dir))
    return data


def _finite_list(a: np.ndarray) -> list:
    """NaN (experts never routed during calibration) is stored as null: JSON has no NaN."""
    return np.where(np.isfinite(a), a, None).tolist()


def _nan_list(x: Any) -> Any:
    if isinstance(x, list):
        return [_nan_list(v) for v in x]
    return math.nan if x is None else float(x)
