#!/usr/bin/env python3
"""One eager grouped-kernel MoE call on a real shape, for `ncu` (no graphs, no flush).

    ncu --kernel-name ap_grouped_gemm --launch-skip 2 --launch-count 2 --section SpeedOfLight ... \
        python3 benchmark/grouped_ncu.py --model mixtral --m 2048 [--wn 2 --stages 3 --wgmma 1 --ws 0 --rows 128 --red-v4 0 --ow 0 --lag 1]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from pagedweight.kernels.cuda_grouped import GroupedConfig, ap_fused_moe_grouped, default_grouped_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import uniform_case  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--model", default="mixtral")
ap.add_argument("--m", type=int, default=2048)
ap.add_argument("--bits", type=int, default=4)
ap.add_argument("--wn", type=int, default=0, help="0: the default config")
ap.add_argument("--stages", type=int, default=3)
ap.add_argument("--wgmma", type=int, default=1)
ap.add_argument("--ws", type=int, default=0, help="1: the warp-specialized kernel (--kernel-name ap_grouped_ws_gemm)")
ap.add_argument("--rows", type=int, default=128, help="weight rows per block: 128 or 256")
ap.add_argument("--red-v4", type=int, default=0, help="1: w2 adds its staged results with 16-byte vector reductions")
ap.add_argument("--ow", type=int, default=0, help="1: offset_in_weights (each weight pair built whole, no offset pass)")
ap.add_argument("--lag", type=int, default=1, help="2: refill the slot read two chunks ago (refill_lag)")
args = ap.parse_args()
x, tw, ids, w13, w2 = uniform_case(args.model, args.m, args.bits, torch.device("cuda"))
topk, E = ids.shape[1], w13.num_experts
cfg = (default_grouped_config(args.m, topk, E) if args.wn == 0
       else GroupedConfig(args.wn, args.stages, wgmma=bool(args.wgmma), ws=bool(args.ws), rows=args.rows,
                     red_v4=bool(args.red_v4), offset_in_weights=bool(args.ow),
                     refill_lag=args.lag))
for _ in range(2):  # the first call compiles; ncu skips it with --launch-skip 2
    ap_fused_moe_grouped(x, tw, ids, w13, w2, config=cfg)
torch.cuda.synchronize()
print("config", cfg)
