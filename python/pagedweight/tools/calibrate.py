"""`pagedweight calibrate`: the offline statistics the quality policy needs, from calibration text.

    pagedweight calibrate --model HF_DIR --ap AP_DIR --text FILE [--tokens N] [--out AP_DIR/calibration.json]

Loads the Hugging Face model (transformers, CPU, float32) the AP checkpoint was converted from, runs it on
the text and writes sensitivity tables, routing masses, buckets and prompt-residual heads
(pagedweight.planner.calibration_stats; formulas in docs/planner.md) atomically next to the AP manifest.
The file is validated when the server loads it. Heavy imports (torch, transformers) happen inside the
functions so `pagedweight --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedweight.format.layout import BlockSpec
    from pagedweight.planner.calibration_stats import CalibrateOptions

# ---- the AP checkpoint on disk -----------------------------------------------------------------------
class CheckpointBlocks:
    """APBlocks (calibration_stats) over an AP checkpoint directory (reader: pagedweight.format.checkpoint)."""

    def __init__(self, ap_dir: str | Path) -> None:
        from pagedweight.format.checkpoint import APCheckpoint
        from pagedweight.planner.calibration import APIdentity

        self.ckpt = APCheckpoint.open(ap_dir)
        self.dir = self.ckpt.directory
        self.identity = APIdentity(self.ckpt.table_kind, self.ckpt.bits_min, self.ckpt.bits_max,
                                   self.ckpt.model.config_sha256)
        self._planes_cache: tuple[str, torch.Tensor] | None = None

    def block_name(self, layer: int, expert: int, proj: str) -> str:
        return self.ckpt.name_of(layer, expert, proj)

    def spec(self, name: str) -> BlockSpec:
        return self.ckpt.spec(name)

    def weight_at(self, name: str, bits: int) -> torch.Tensor:
        from pagedweight.format.layout import dequantize

        if self._planes_cache is None or self._planes_cache[0] != name:
            self._planes_cache = (name, self.ckpt.planes(name))  # one block's planes serve all its bitwidths
        spec = self.spec(name)
        planes = self._planes_cache[1]
        return dequantize(planes[:bits], self.ckpt.table(name, bits), bits, spec.table_kind, spec.group_size)


def run_calibrate(model_dir: str, ap_dir: str, text_file: str, out: str | None = None,
                  options: CalibrateOptions | None = None, progress: bool = True) -> Path:
    import torch
    from transformers import AutoTokenizer

    from pagedweight.planner.calibration import CALIBRATION_FILENAME
    from pagedweight.planner.calibration_stats import CalibrateOptions, calibrate_model
    from pagedweight.tools.source_format import load_source_model

    options = options or CalibrateOptions()
    model_path = Path(model_dir)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"--model {model_dir}: no config.json; pass a Hugging Face model directory")
    text_path = Path(text_file)
    if not text_path.is_file():
        raise FileNotFoundError(f"--text {text_file}: no such file")
    text = text_path.read_text(encoding="utf-8", errors="replace")
    blocks = CheckpointBlocks(ap_dir)
    torch.manual_seed(0)
    model, info = load_source_model(model_path)
    missing = [k for k in info.get("missing_keys", []) if ".experts" in k]
    if missing:
        raise ValueError(f"--model {model_dir} lacks expert weights ({missing[0]}, ...); pass the original Hugging "
                         "Face model, not the AP checkpoint directory")
    # refuse an AP checkpoint converted from another model (compares the shape-fixing config keys)
    blocks.ckpt.check_model_config(json.loads((model_path / "config.json").read_text()))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = calibrate_model(model, tokenizer, blocks, text, options,
                           source={"text": str(text_path), "model": str(model_path)}, progress=progress)
    return data.save(Path(out) if out else blocks.dir / CALIBRATION_FILENAME)


# ---- CLI -----------------------------------------------------------------------------------------------
def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="sensitivity, routing and prompt-residual statistics for --paged-weight-policy quality",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory the AP checkpoint was converted from")
    p.add_argument("--ap", required=True, help="AP checkpoint directory (holding manifest.json or pagedweight/)")
    p.add_argument("--text", required=True, help="UTF-8 calibration text file")
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=128,
                   help="tokens per calibration prompt (default %(default)s)")
    p.add_argument("--hot-fraction", type=float, default=0.25,
                   help="share of experts in the hot bucket (default %(default)s)")
    p.add_argument("--cold-fraction", type=float, default=0.25,
                   help="share of experts in the cold bucket (default %(default)s)")
    p.add_argument("--out", default=None, help="output file (default: AP_DIR/.../calibration.json next to the manifest)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from pagedweight.format.manifest import APCheckpointError
    from pagedweight.planner.calibration import CalibrationError
    from pagedweight.planner.calibration_stats import CalibrateOptions

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        options = CalibrateOptions(tokens=args.tokens, prompt_tokens=args.prompt_tokens,
                                   hot_fraction=args.hot_fraction, cold_fraction=args.cold_fraction)
        path = run_calibrate(args.model, args.ap, args.text, args.out, options)
    except (APCheckpointError, CalibrationError, FileNotFoundError, ValueError) as exc:
        print(f"pagedweight calibrate: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote calibration to {path}")
    return 0
