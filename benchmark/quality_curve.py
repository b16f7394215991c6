"""Quality-memory evidence for PagedWeight on a MoE with real trained weights (issue 5, item 6).

    python benchmark/quality_curve.py [--cache-dir ~/.cache/pagedweight/quality] [--threads 2]

One command, end to end (artifacts are reused from the cache dir when complete):
1. `pagedweight moefy` (SmolLM2-135M-Instruct MoEfied into Mixtral), `pagedweight convert` to AP with
   both table kinds (bits 2..8), `pagedweight calibrate` on the calibration split;
2. perplexity and KL-to-bf16 on >= 32k held-out evaluation tokens for bf16, uniform AP (3..6 bits, every
   table kind), PagedWeight's quality policy at each uniform point's bytes of the planned kind and a few
   extra budgets, the uncalibrated default (what `--paged-weight-policy auto` serves without
   calibration.json) and the hotness policy at the same budgets, the ablation table at the 3-bit budget,
   and a workload shift;
3. writes docs/results/quality.json (headline with window-bootstrap 95% intervals in headline_ci95, curves,
   ablation, shift, commands, machine, date) and docs/results/quality.md.

Expert weights are swapped in place in a transformers model (benchmark/quality/swap.py); each
(table kind, tensor, bitwidth) is decoded once. Deterministic for a seed (CPU, fixed token windows,
deterministic policies).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import artifacts  # noqa: E402
from quality.experiment import ExperimentConfig, run_experiment  # noqa: E402
from quality.report import markdown  # noqa: E402

from pagedweight.format.layout import DEFAULT_TABLE_KIND, GROUPED_KINDS  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    threads = torch.get_num_threads()
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": threads, "memory_gib": mem,
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "summary": f"{cpu}, {threads} torch threads, CPU only, float32"}


DISCUSSION_MARKER = "<!-- discussion: hand-written analysis below this line is kept when the file is regenerated -->"


def _kept_discussion(md_path: Path) -> str:
    """The hand-written analysis of an earlier quality.md (everything from the marker on), if any."""
    if md_path.is_file():
        old = md_path.read_text()
        at = old.find(DISCUSSION_MARKER)
        if at >= 0:
            return "\n" + old[at:]
    return ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", type=Path,
                   default=Path(os.environ.get("PAGEDWEIGHT_CACHE", Path.home() / ".cache" / "pagedweight")) / "quality")
    p.add_argument("--model-dir", type=Path, default=None, help="use this MoE HF checkpoint instead of building one")
    p.add_argument("--calib-kind", choices=("wiki", "news"), default="wiki")
    p.add_argument("--shift-kind", choices=("wiki", "news", "none"), default="news",
                   help="text of the workload-shift section (none: skip it)")
    p.add_argument("--calib-tokens", type=int, default=4096, help="`pagedweight calibrate --tokens`")
    p.add_argument("--convert-calib-tokens", type=int, default=2048, help="`pagedweight convert --calib-tokens` (0: no --calib-text, uniform column weights)")
    p.add_argument("--table-kind", choices=GROUPED_KINDS, default=DEFAULT_TABLE_KIND,
                   help="the binary-coded table kind PagedWeight and hotness plan over (budgets are its uniform "
                   f"bytes; default {DEFAULT_TABLE_KIND}, the converter's); bcq and kmeans are converted too and "
                   "compared at uniform bitwidths")
    p.add_argument("--compare-kinds", default="bcq,kmeans",
                   help="table kinds converted and measured at uniform bitwidths beside the planned kind (comma "
                   "list; '' for none: a bcq conversion of the MoEfied SmolLM2 takes ~40 min on 2 cores)")
    p.add_argument("--bcq-init", choices=("greedy", "uniform"), default="greedy",
                   help="`pagedweight convert --bcq-init` of the bcq checkpoint (sign planes: greedy or uniform grid)")
    p.add_argument("--stage-slack", type=float, default=None,
                   help="quality policy: use a floor stage only if it could free (1 + slack) x the target "
                   "(default: QualityOptions' default)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-tokens", type=int, default=32768,
                   help="predicted evaluation tokens (at least; windows of --seq-len - 1 predicted tokens)")
    p.add_argument("--windows", type=int, default=None, help="evaluation windows of --seq-len tokens (overrides "
                   "--eval-tokens)")
    p.add_argument("--no-ablation", action="store_true", help="skip the ablation table (time)")
    p.add_argument("--no-hotness", action="store_true", help="skip the hotness policy on the curve (time)")
    p.add_argument("--resamples", type=int, default=2000, help="window-bootstrap resamples of the headline intervals")
    p.add_argument("--bits", default="3,4,5,6", help="uniform points (bits)")
    p.add_argument("--extra-bits", default="4.5,5.5,7",
                   help="extra PagedWeight budgets, as uniform-bcq-equivalent bits (bytes interpolated)")
    p.add_argument("--refine", type=int, default=1, help="bisection steps between the cheapest bf16-equivalent budget "
                   "and the next cheaper one")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-json", type=Path, default=REPO / "docs" / "results" / "quality.json")
    p.add_argument("--out-md", type=Path, default=REPO / "docs" / "results" / "quality.md")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--only-shift", action="store_true", help="measure only the workload shift (e.g. beside a main "
                   "run on another core; give it its own --out-json/--out-md)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    if args.windows is None:
        args.windows = -(-args.eval_tokens // (args.seq_len - 1))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    cache = args.cache_dir.expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    log = artifacts.ArtifactLog()
    model_dir = artifacts.ensure_model(cache, log, args.model_dir, args.threads)
    calib_text = artifacts.text_file(cache, args.calib_kind)
    ap, calib = artifacts.ensure_all(cache, log, model_dir, calib_text, args.calib_kind, args.convert_calib_tokens,
                                     args.calib_tokens, args.seed, args.bcq_init, args.table_kind,
                                     tuple(k for k in args.compare_kinds.split(",") if k.strip()))
    artifacts_s = time.perf_counter() - started

    config = ExperimentConfig(
        model_dir=model_dir, ap_dirs=ap, calibration=calib, calib_kind=args.calib_kind,
        shift_kind=None if args.shift_kind == "none" else args.shift_kind, ablation=not args.no_ablation,
        hotness=not args.no_hotness, resamples=args.resamples,
        calib_tokens=args.calib_tokens, seq_len=args.seq_len, windows=args.windows,
        bits=tuple(int(b) for b in args.bits.split(",")),
        extra_bits=tuple(float(b) for b in args.extra_bits.split(",") if b.strip()),
        refine=args.refine, progress=not args.quiet, memo_path=cache / ("measurements-shift.json" if args.only_shift else "measurements.json"),
        only_shift=args.only_shift, stage_slack=args.stage_slack, main_kind=args.table_kind,
    )
    given = sys.argv[1:] if argv is None else argv
    command = "python benchmark/quality_curve.py" + ("" if not given else " " + shlex.join(given))

    def write(partial: dict) -> dict:
        results = dict(partial)
        results = {
            "headline": results.pop("headline"),
            "headline_ci95": results.pop("headline_ci95", {}),
            "complete": bool(results.pop("complete", False)),
            "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(),
            "artifact_commands": log.commands,
            **results,
            "timings_s": {"artifacts": round(artifacts_s, 1), "total": round(time.perf_counter() - started, 1)},
        }
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps(results, indent=1) + "\n")
        if not args.only_shift:
            args.out_md.write_text(markdown(results) + _kept_discussion(args.out_md))
        return results

    results = write(run_experiment(config, on_section=write))
    print(json.dumps({k: [v, results["headline_ci95"].get(k)] for k, v in results["headline"].items()}, indent=1))
    print(f"wrote {args.out_json} and {args.out_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
