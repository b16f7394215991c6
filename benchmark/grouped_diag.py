#!/usr/bin/env python3
"""Where a grouped kernel's time goes: its w13 and w2 kernels timed with stages left out.

    python3 benchmark/grouped_diag.py --out OUT.json [--models mixtral,qwen3moe] [--m 2048] [--config 2.3.r256]
        [--diags 0,1,2,4,8,16,24]

`--config` as in grouped_sweep.py. The DIAG knob (measurement only, the outputs are then wrong), bits:
- the single-role kernel (cuda_grouped_gemm.cu): 1 no plane reads from shared memory and no decode, 2 no MMAs,
  4 no w2 output reductions, 8 no group offset terms (nor their drain of the MMAs), 16 no drain before a chunk's
  refill;
- the warp-specialized kernel (cuda_grouped_ws.cu, `--config 2.3.ws`): 1 the producer skips the decode, 2 the
  consumers skip the MMAs.
Per variant the w13 and w2 kernel times of one eager call (torch profiler, after a warm-up call), so the
differences place the time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from pagedweight.kernels import cuda_grouped
from pagedweight.kernels.cuda_grouped import ap_fused_moe_grouped
from pagedweight.kernels.testing import random_ap_projection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouped_sweep import kernel_times, parse_config  # noqa: E402
from kernel_bench import GROUP, MODELS, make_routing  # noqa: E402

WS_DIAG_BITS = 3  # the warp-specialized kernel knows bits 1 and 2
SINGLE_DIAG_BITS = 31


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="mixtral,qwen3moe")
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--config", default="2.3.r256", help="wn.stages[.mma|.ws|.r256][.rv] (grouped_sweep.py)")
    ap.add_argument("--diags", default="0,1,2,4,8,16,24", help="comma list of DIAG values")
    ap.add_argument("--bits", type=int, default=4)
    args = ap.parse_args()
    cfg = parse_config(args.config)
    diags = [int(d) for d in args.diags.split(",")]
    allowed = WS_DIAG_BITS if cfg.ws else SINGLE_DIAG_BITS
    bad = [d for d in diags if d < 0 or d & ~allowed]
    if bad:
        sys.exit(f"grouped_diag: DIAG {bad} not known to {cfg.kernel_name} (bits {allowed}): see --help")
    dev = torch.device("cuda")
    base_defines = cuda_grouped.gemm_defines
    rows = []
    for mk in args.models.split(","):
        m = MODELS[mk]
        E, topk, H, I = m["E"], m["topk"], m["H"], m["I"]
        w13 = random_ap_projection(E, 2 * I, H, [args.bits] * E, table_kind="ubcq", group_size=GROUP, seed=1,
                                   device=dev).weights
        w2 = random_ap_projection(E, H, I, [args.bits] * E, table_kind="ubcq", group_size=GROUP, seed=2,
                                  device=dev).weights
        x = torch.randn((args.m, H), device=dev, dtype=torch.bfloat16)
        tw, ids = make_routing(args.m, E, topk, m["renormalize"], args.m, dev)
        try:
            for diag in diags:
                cuda_grouped.gemm_defines = lambda *a, d=diag: [*base_defines(*a), f"-DDIAG={d}"]
                times = [us for name, us in kernel_times(lambda: ap_fused_moe_grouped(x, tw, ids, w13, w2, config=cfg))
                         if name.startswith(cfg.kernel_name)]
                rows.append(dict(model=mk, M=args.m, config=args.config, diag=diag, w13_us=times[0], w2_us=times[1]))
                print(rows[-1], flush=True)
        finally:
            cuda_grouped.gemm_defines = base_defines
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
