"""Which bitwidth policy and floor a server runs, and the one startup log line that says why.

`--paged-weight-policy auto` (the default) takes the quality policy when the AP checkpoint holds a planner
calibration (`calibration.json`), else the uncalibrated policy: the quality policy's planner over the
converter's weight errors, above a floor whose quality is known (planner/uncalibrated_policy.py). It used
to take the hotness policy there, whose cold experts go to the checkpoint's seed bitwidth (2 bits by
default): perplexity 1713 against bf16's 38 at a 25% budget on the MoEfied SmolLM2 (docs/results/quality.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from pagedweight.planner.calibration import CALIBRATION_FILENAME

CALIBRATION_SUBPATHS: tuple[str, ...] = (CALIBRATION_FILENAME, os.path.join("pagedweight", CALIBRATION_FILENAME))


@dataclass(frozen=True)
class PolicyChoice:
    """The policy in force (`name`), why it was chosen, and (once built) the floor it plans above and why."""

    name: str
    why: str
    calibration: Optional[str] = None  # the calibration file the quality policy reads
    floor: str = ""

    def with_floor(self, floor: str) -> PolicyChoice:
        return PolicyChoice(self.name, self.why, self.calibration, floor)

    def log_line(self) -> str:
        return f"PagedWeight: policy {self.name} ({self.why}); floor {self.floor or 'unset'}"


def find_calibration(ap_dir: Optional[str]) -> Optional[str]:
    """AP_DIR/calibration.json (or AP_DIR/pagedweight/calibration.json), if there is one."""
    if ap_dir is None:
        return None
    for sub in CALIBRATION_SUBPATHS:
        cand = os.path.join(ap_dir, sub)
        if os.path.isfile(cand):
            return cand
    return None


def choose_policy(requested: str, ap_dir: Optional[str]) -> PolicyChoice:
    """Resolve 'auto'; an explicit name is taken as given (the quality policy then needs a calibration)."""
    calib = find_calibration(ap_dir)
    if requested != "auto":
        return PolicyChoice(requested, f"--paged-weight-policy {requested}", calib)
    if calib is not None:
        return PolicyChoice("quality", f"auto: calibration file {calib}", calib)
    where = "--load-format dummy has no checkpoint" if ap_dir is None else f"no {CALIBRATION_FILENAME} in {ap_dir}"
    return PolicyChoice("uncalibrated", f"auto: {where}; `pagedweight calibrate` enables the quality policy")
