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
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedweight.format.layout import BlockSpec
    from pagedweight.planner.calibration_stats import CalibrateOptions

# ---- the AP checkpoint on disk -----------------------------------------------------------------------
def resolve_ap_dir(path: str | Path) -> Path:
    """The directory holding manifest.json: AP_DIR itself or AP_DIR/pagedweight."""
    p = Path(path)
    for cand in (p, p / "pagedweight"):
        if (cand / "manifest.json").is_file():
            return cand
    raise FileNotFoundError(f"no AP manifest under {p} (looked for manifest.json and pagedweight/manifest.json); "
                            "convert the model first with `pagedweight convert`")


class CheckpointBlocks:
    """APBlocks (calibration_stats) over an AP checkpoint directory (reader: pagedweight.format.checkpoint)."""

    def __init__(self, ap_dir: str | Path) -> None:
        from pagedweight.format.arch import BlockKey, adapter_for
        from pagedweight.format.checkpoint import APCheckpoint
        from pagedweight.planner.calibration import APIdentity

        self.dir = resolve_ap_dir(ap_dir)
        manifest = json.loads((self.dir / "manifest.json").read_text())
        self.ckpt = APCheckpoint.open(self.dir)
        model = manifest["model"]
        self.identity = APIdentity(manifest["table_kind"], int(manifest["bits_min"]), int(manifest["bits_max"]),
                                   str(model["config_sha256"]))
        adapter = adapter_for({"model_type": model["model_type"]})
        self._names: dict[tuple[int, int, str], str] = {}
        for name in manifest["tensors"]:
            key = adapter.classify(name + ".weight")
            if isinstance(key, BlockKey) and isinstance(key.expert, int):
                self._names[(key.layer, key.expert, key.proj)] = name
        self._planes_cache: tuple[str, torch.Tensor] | None = None

    def block_name(self, layer: int, expert: int, proj: str) -> str:
        try:
            return self._names[(layer, expert, proj)]
        except KeyError:
            raise ValueError(f"the AP checkpoint {self.dir} has no block for layer {layer} expert {expert} {proj}; "
                             "was it converted from this model?") from None

    def spec(self, name: str) -> BlockSpec:
        return self.ckpt.spec(name)

    def weight_at(self, name: str, bits: int) -> torch.Tensor:
        from pagedweight.format.layout import dequantize

        if self._planes_cache is None or self._planes_cache[0] != name:
            self._planes_cache = (name, self.ckpt.planes(name))  # one block's planes serve all its bitwidths
        spec = self.spec(name)
        planes = self._planes_cache[1]
        return dequantize(planes[:bits], self.ckpt.table(name, bits), bits, spec.table_kind, spec.group_size)


def _check_model_matches(model, blocks: CheckpointBlocks, model_dir: Path) -> None:
    manifest = json.loads((blocks.dir / "manifest.json").read_text())["model"]
    cfg = model.config
    for key, value in (("num_hidden_layers", cfg.num_hidden_layers), ("hidden_size", cfg.hidden_size)):
        if key in manifest and manifest[key] != value:
            raise ValueError(f"--model {model_dir} has {key}={value}, the AP checkpoint {blocks.dir} was made for "
                             f"{manifest[key]}: pass the model it was converted from")


def run_calibrate(model_dir: str, ap_dir: str, text_file: str, out: str | None = None,
                  options: CalibrateOptions | None = None, progress: bool = True) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedweight.planner.calibration import CALIBRATION_FILENAME
    from pagedweight.planner.calibration_stats import CalibrateOptions, calibrate_model

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
    model, info = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, output_loading_info=True)
    missing = [k for k in info.get("missing_keys", []) if ".experts" in k]
    if missing:
        raise ValueError(f"--model {model_dir} lacks expert weights ({missing[0]}, ...); pass the original Hugging "
                         "Face model, not the AP checkpoint directory")
    _check_model_matches(model, blocks, model_path)
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
    from pagedweight.planner.calibration_stats import CalibrateOptions

    options = CalibrateOptions(tokens=args.tokens, prompt_tokens=args.prompt_tokens, hot_fraction=args.hot_fraction,
                               cold_fraction=args.cold_fraction)
    path = run_calibrate(args.model, args.ap, args.text, args.out, options)
    print(f"wrote {path}")
    return 0
