#!/usr/bin/env python3
"""Where the warp-specialized grouped kernel's time goes: its kernels timed with a stage left out (H200).

    python3 benchmark/grouped_ws_diag.py --out OUT.json [--models mixtral,qwen3moe] [--m 2048] [--wn 2]

cuda_grouped_ws.cu's DIAG knob (measurement only, the outputs are then wrong): 0 the kernel as served, 1 the
producer skips the decode (loads, hand-offs and MMAs remain), 2 the consumers skip the MMAs (loads, decode and
hand-offs remain), 3 both (loads and hand-offs only). Per variant the w13 and w2 kernel times of one eager call
(torch profiler, after a warm-up call), so the differences place the time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from pagedweight.kernels import cuda_grouped
from pagedweight.kernels.cuda_grouped import GroupedConfig, ap_fused_moe_grouped
from pagedweight.kernels.testing import random_ap_projection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouped_sweep import kernel_times  # noqa: E402
from kernel_bench import GROUP, MODELS, make_routing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="mixtral,qwen3moe")
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--wn", type=int, default=2)
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = GroupedConfig(args.wn, args.stages, ws=True)
    base_defines = cuda_grouped.gemm_defines
    rows = []
    for mk in args.models.split(","):
        m = MODELS[mk]
        E, topk, H, I = m["E"], m["topk"], m["H"], m["I"]
        w13 = random_ap_projection(E, 2 * I, H, [4] * E, table_kind="ubcq", group_size=GROUP, seed=1, device=dev).weights
        w2 = random_ap_projection(E, H, I, [4] * E, table_kind="ubcq", group_size=GROUP, seed=2, device=dev).weights
        x = torch.randn((args.m, H), device=dev, dtype=torch.bfloat16)
        tw, ids = make_routing(args.m, E, topk, m["renormalize"], args.m, dev)
        for diag in (0, 1, 2, 3):
            cuda_grouped.gemm_defines = lambda *a, d=diag: [*base_defines(*a), f"-DDIAG={d}"]
            times = [us for name, us in kernel_times(lambda: ap_fused_moe_grouped(x, tw, ids, w13, w2, config=cfg))
                     if name.startswith("ap_grouped_ws_gemm")]
            rows.append(dict(model=mk, M=args.m, config=str(cfg), diag=diag, w13_us=times[0], w2_us=times[1]))
            print(rows[-1], flush=True)
        cuda_grouped.gemm_defines = base_defines
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
