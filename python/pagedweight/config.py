"""PagedWeight's run-time configuration: one typed object, parsed from CLI flags or Engine kwargs.

It rides on SGLang's ServerArgs as the private attribute `_paged_weight` (ServerArgs is pickled whole into
every scheduler/TP process, private attributes included), so each process sees the same settings.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from pagedweight.planner import registry as policy_registry

SERVER_ARGS_ATTR = "_paged_weight"
AP_SUBDIR = "pagedweight"
SCOPES = ("experts", "all")


def policy_choices() -> tuple[str, ...]:
    """--paged-weight-policy's values: "auto" (quality when the AP checkpoint has a calibration file, else
    uncalibrated: the quality planner over the converter's weight errors, above a floor of known quality;
    planner/choice.py), then every policy of the registry (planner/registry.py)."""
    return ("auto", *policy_registry.POLICY_REGISTRY.names())


class PagedWeightConfigError(ValueError):
    """A PagedWeight flag or Engine argument is invalid; the message names the flag and the fix."""


@dataclass(frozen=True)
class PagedWeightConfig:
    enable: bool = False
    # AP checkpoint directory holding manifest.json; None -> <model_path>/pagedweight.
    path: Optional[str] = None
    # Initial committed bitwidth of every expert block; None -> the checkpoint's parent bitwidth.
    bits: Optional[int] = None
    # JSON file with a committed bitwidth per block (a /get_server_info snapshot's "blocks"); overrides `bits`.
    bits_map: Optional[str] = None
    policy: str = "auto"
    # Lowest bitwidth the policy may commit (None: the checkpoint's seed bitwidth; the uncalibrated policy
    # then derives its own floor from the weight errors).
    floor_bits: Optional[int] = None
    # KV pressure: offload when free KV blocks fall below low * capacity; reload once they stay above
    # high * capacity (hysteresis).
    kv_low_watermark: float = 0.05
    kv_high_watermark: float = 0.25
    # Count the first waiting request's unmet KV demand as pressure (off: free blocks only).
    queue_aware: bool = True
    # Back-pressure on host->device plane copies in flight.
    max_inflight_mib: int = 256
    # Hash every AP file against the manifest before serving (off: only sizes and headers are checked).
    verify: bool = True
    # Fill freed plane memory with NaN bytes before reuse, so a stale read shows up as NaN logits.
    debug_poison: bool = False
    # Which linears are served from AP: the MoE experts only, or also the dense linears the checkpoint
    # holds (attention projections from `convert --dense-linears`, shared experts).
    scope: str = "experts"
    # Fixed bitwidth of the dense AP linears under scope "all" (None: --paged-weight-bits, else the parent).
    # The planner moves expert blocks only; dense blocks keep this bitwidth.
    dense_bits: Optional[int] = None

    def __post_init__(self) -> None:
        if self.bits is not None and not 1 <= self.bits <= 8:
            raise PagedWeightConfigError(
                f"--paged-weight-bits must be between 1 and 8 (and inside the checkpoint's stored range), got {self.bits}"
            )
        if self.floor_bits is not None and not 1 <= self.floor_bits <= 8:
            raise PagedWeightConfigError(f"--paged-weight-min-bits must be between 1 and 8, got {self.floor_bits}")
        if self.floor_bits is not None and self.bits is not None and self.floor_bits > self.bits:
            raise PagedWeightConfigError(
                f"--paged-weight-min-bits {self.floor_bits} is above --paged-weight-bits {self.bits}; lower it"
            )
        if not 0.0 <= self.kv_low_watermark < self.kv_high_watermark <= 1.0:
            raise PagedWeightConfigError(
                "need 0 <= --paged-weight-kv-low-watermark < --paged-weight-kv-high-watermark <= 1, got "
                f"{self.kv_low_watermark} and {self.kv_high_watermark}"
            )
        if self.max_inflight_mib <= 0:
            raise PagedWeightConfigError(f"--paged-weight-max-inflight-mib must be positive, got {self.max_inflight_mib}")
        if self.policy not in policy_choices():
            raise PagedWeightConfigError(
                f"--paged-weight-policy must be one of {policy_choices()}, got {self.policy!r}")
        if not self.enable and (self.path is not None or self.bits is not None or self.bits_map is not None):
            raise PagedWeightConfigError(
                "--paged-weight-path/--paged-weight-bits/--paged-weight-bits-map were given without "
                "--enable-paged-weight; add it"
            )
        if self.bits_map is not None and self.bits is not None:
            raise PagedWeightConfigError(
                "--paged-weight-bits and --paged-weight-bits-map both set the initial bitwidths; give one"
            )
        if self.scope not in SCOPES:
            raise PagedWeightConfigError(f"--paged-weight-scope must be one of {SCOPES}, got {self.scope!r}")
        if self.dense_bits is not None and not 1 <= self.dense_bits <= 8:
            raise PagedWeightConfigError(f"--paged-weight-dense-bits must be between 1 and 8, got {self.dense_bits}")
        if self.dense_bits is not None and self.scope != "all":
            raise PagedWeightConfigError(
                "--paged-weight-dense-bits sets the bitwidth of dense AP linears, which only "
                "--paged-weight-scope all serves; add it or drop --paged-weight-dense-bits"
            )
        if self.bits_map is not None and not os.path.isfile(self.bits_map):
            raise PagedWeightConfigError(f"--paged-weight-bits-map {self.bits_map}: no such file")

    def resolve_ap_dir(self, model_path: str) -> str:
        """The directory that holds manifest.json."""
        if self.path is not None:
            cand = self.path
            if not os.path.exists(os.path.join(cand, "manifest.json")) and os.path.exists(
                os.path.join(cand, AP_SUBDIR, "manifest.json")
            ):
                cand = os.path.join(cand, AP_SUBDIR)
            return cand
        return os.path.join(model_path, AP_SUBDIR)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# (kwarg name, CLI flag) pairs; Engine(**kwargs) uses the kwarg names.
_KWARG_TO_FIELD = {
    "enable_paged_weight": "enable",
    "paged_weight_path": "path",
    "paged_weight_bits": "bits",
    "paged_weight_bits_map": "bits_map",
    "paged_weight_policy": "policy",
    "paged_weight_min_bits": "floor_bits",
    "paged_weight_kv_low_watermark": "kv_low_watermark",
    "paged_weight_kv_high_watermark": "kv_high_watermark",
    "paged_weight_queue_aware": "queue_aware",
    "paged_weight_max_inflight_mib": "max_inflight_mib",
    "paged_weight_debug_poison": "debug_poison",
    "paged_weight_verify": "verify",
    "paged_weight_scope": "scope",
    "paged_weight_dense_bits": "dense_bits",
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("PagedWeight (any-precision MoE experts with run-time bitwidths)")
    group.add_argument(
        "--enable-paged-weight",
        action="store_true",
        help="Serve every FusedMoE layer's experts from an Any-Precision (AP) bit-plane checkpoint.",
    )
    group.add_argument(
        "--paged-weight-path",
        type=str,
        default=None,
        help="AP checkpoint directory (with manifest.json). Default: <model-path>/pagedweight.",
    )
    group.add_argument(
        "--paged-weight-bits",
        type=int,
        default=None,
        help="Initial committed bitwidth of every expert block (default: the checkpoint's parent bitwidth).",
    )
    group.add_argument(
        "--paged-weight-bits-map",
        type=str,
        default=None,
        help="JSON file giving every expert block its initial bitwidth: the 'blocks' list of a /get_server_info "
        "snapshot ([layer, expert, proj, committed, desired] rows), e.g. to restart at a plan a running server "
        "reached (with --paged-weight-policy static to keep it).",
    )
    group.add_argument(
        "--paged-weight-policy",
        type=str,
        default="auto",
        choices=policy_choices(),
        help="Bitwidth policy under KV-cache pressure (auto: quality with a calibration file, else uncalibrated: "
        "the quality planner over the converter's weight errors, never below a floor of known quality; the "
        "startup log says which policy and floor are in force and why).",
    )
    group.add_argument(
        "--paged-weight-min-bits",
        type=int,
        default=None,
        help="Lowest bitwidth a policy may commit (default: the checkpoint's seed bitwidth; the uncalibrated "
        "policy's floor is then the lowest bitwidth whose relative weight error is <= 0.05).",
    )
    group.add_argument(
        "--paged-weight-kv-low-watermark",
        type=float,
        default=0.05,
        help="Offload expert planes when free KV blocks fall below this fraction of the KV capacity.",
    )
    group.add_argument(
        "--paged-weight-kv-high-watermark",
        type=float,
        default=0.25,
        help="Reload planes once free KV blocks stay above this fraction of the KV capacity.",
    )
    group.add_argument(
        "--paged-weight-queue-aware",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Count the KV blocks the first waiting request lacks as pressure, so long prompts that do not fit "
        "make the experts give memory back (--no-paged-weight-queue-aware: free blocks only).",
    )
    group.add_argument(
        "--paged-weight-max-inflight-mib",
        type=int,
        default=256,
        help="Cap on host-to-device plane copies in flight (MiB).",
    )
    group.add_argument(
        "--paged-weight-verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Check every AP file's SHA-256 against the manifest before serving (--no-paged-weight-verify "
        "checks only sizes and headers; hashing reads the whole checkpoint once at startup).",
    )
    group.add_argument(
        "--paged-weight-scope",
        type=str,
        default="experts",
        choices=SCOPES,
        help="experts: AP for the MoE experts only (default; measured faster). all: also the dense linears the "
        "checkpoint holds (attention projections from `pagedweight convert --dense-linears`, shared experts), "
        "at the fixed --paged-weight-dense-bits.",
    )
    group.add_argument(
        "--paged-weight-dense-bits",
        type=int,
        default=None,
        help="Bitwidth of the dense AP linears under --paged-weight-scope all (default: --paged-weight-bits, "
        "else the parent); fixed while serving.",
    )
    group.add_argument(
        "--paged-weight-debug-poison",
        action="store_true",
        help="Fill freed plane memory with NaN before reuse (debugging stale reads).",
    )


def from_namespace(ns: argparse.Namespace) -> PagedWeightConfig:
    values = {f: getattr(ns, k) for k, f in _KWARG_TO_FIELD.items() if hasattr(ns, k)}
    return PagedWeightConfig(**values)


def pop_kwargs(kwargs: dict[str, Any]) -> Optional[PagedWeightConfig]:
    """Remove PagedWeight's keys from Engine/ServerArgs kwargs; None if there were none."""
    found = {f: kwargs.pop(k) for k, f in _KWARG_TO_FIELD.items() if k in kwargs}
    return PagedWeightConfig(**found) if found else None


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(PagedWeightConfig))
