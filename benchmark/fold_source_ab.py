#!/usr/bin/env python3
"""The fold MoE call timed with this tree's kernel source and with a git revision's, alternately in one process,
so that a kernel change is measured against its parent on the same machine and in the same call.

    python3 benchmark/fold_source_ab.py --rev 4ecc2b7 --models mixtral --cases u4,u8,mix4 --ms 4,16 --out OUT.json

Both sources must take the same launch arguments (cuda_fold.py of this tree launches them); the launch configs
are this tree's defaults for each shape. Writes every timing and, per (model, case, M), the median of the
revision's times over the median of this tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import pagedweight.kernels.cuda_fold as cuda_fold
from pagedweight.kernels.testing import random_ap_projection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import MODELS, case_bits, cuda_setup, graph_time, make_routing  # noqa: E402

SOURCE_IN_REPO = "sgl-kernel-ext/cuda_fold_gemv.cu"


def git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout


def revision_source(rev: str, workdir: Path) -> Path:
    """The revision's kernel source in `workdir`, with the headers it includes from that revision beside it."""
    text = git_show(rev, SOURCE_IN_REPO)
    folder = os.path.dirname(SOURCE_IN_REPO)
    for header in re.findall(r'^#include "([\w.]+)"$', text, re.M):
        (workdir / header).write_text(git_show(rev, f"{folder}/{header}"))
    path = workdir / os.path.basename(SOURCE_IN_REPO)
    path.write_text(text)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True, help="git revision whose cuda_fold_gemv.cu is timed against this tree's")
    ap.add_argument("--models", default="mixtral")
    ap.add_argument("--cases", default="u4,u8,mix4")
    ap.add_argument("--ms", default="4,16")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of (this tree, revision)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, sms, flush = cuda_setup()
    here = cuda_fold._SOURCE
    rows, summary = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"tree": here, args.rev: revision_source(args.rev, Path(tmp))}
        for model in args.models.split(","):
            md = MODELS[model]
            E, topk, H, I = md["E"], md["topk"], md["H"], md["I"]
            for case in args.cases.split(","):
                w13 = random_ap_projection(E, 2 * I, H, case_bits(case, E, "w13"), table_kind="ubcq", bits_min=2,
                                           seed=1, device=dev).weights
                w2 = random_ap_projection(E, H, I, case_bits(case, E, "w2"), table_kind="ubcq", bits_min=2, seed=2,
                                          device=dev).weights
                for m in [int(v) for v in args.ms.split(",")]:
                    x = torch.randn((m, H), device=dev, dtype=torch.bfloat16)
                    tw, ids = make_routing(m, E, topk, md["renormalize"], m, dev)
                    configs = cuda_fold.default_fold_configs(m, topk, w13, w2, sms)
                    times = {name: [] for name in sources}
                    for _ in range(args.rounds):
                        for name, src in sources.items():
                            cuda_fold._SOURCE = src
                            cuda_fold._compiled.cache_clear()
                            call = lambda: cuda_fold.ap_fused_moe_fold(x, tw, ids, w13, w2, configs=configs)  # noqa: E731
                            call()
                            us = graph_time(call, args.reps, flush)["median"]
                            times[name].append(us)
                            rows.append(dict(model=model, case=case, M=m, source=name, us=us))
                    ratio = statistics.median(times[args.rev]) / statistics.median(times["tree"])
                    summary[f"{model}/{case}/M={m}"] = round(ratio, 3)
                    print(f"{model:<10} {case:<5} M={m:<3} tree {statistics.median(times['tree']):8.1f} us  "
                          f"{args.rev} {statistics.median(times[args.rev]):8.1f} us  rev/tree {ratio:.3f}", flush=True)
                    with open(args.out, "w") as f:
                        json.dump(dict(rev=args.rev, rows=rows, rev_over_tree=summary), f, indent=1)
                del w13, w2
                torch.cuda.empty_cache()
    cuda_fold._SOURCE = here
    cuda_fold._compiled.cache_clear()


if __name__ == "__main__":
    main()
