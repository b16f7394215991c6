#!/usr/bin/env python3
"""Eager fold-kernel MoE calls on a real shape, for `ncu` (no graphs, no flush).

    ncu --kernel-name ap_fold_gemv --launch-skip 4 --launch-count 2 --section SpeedOfLight ... \
        python3 benchmark/fold_ncu.py --model mixtral --m 16
Each call launches the kernel twice (w13, then w2); the first two calls compile and warm up.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from pagedweight.kernels.cuda_fold import ap_fused_moe_fold
from pagedweight.kernels.testing import random_ap_projection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import GROUP, MODELS, make_routing  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--model", default="mixtral")
ap.add_argument("--m", type=int, default=16)
ap.add_argument("--bits", type=int, default=4)
ap.add_argument("--calls", type=int, default=3)
args = ap.parse_args()
m = MODELS[args.model]
E, topk, H, I = m["E"], m["topk"], m["H"], m["I"]
dev = torch.device("cuda")
w13 = random_ap_projection(E, 2 * I, H, [args.bits] * E, table_kind="ubcq", group_size=GROUP, seed=1, device=dev).weights
w2 = random_ap_projection(E, H, I, [args.bits] * E, table_kind="ubcq", group_size=GROUP, seed=2, device=dev).weights
x = torch.randn((args.m, H), device=dev, dtype=torch.bfloat16)
tw, ids = make_routing(args.m, E, topk, m["renormalize"], args.m, dev)
for _ in range(args.calls):
    ap_fused_moe_fold(x, tw, ids, w13, w2)
torch.cuda.synchronize()
print("done", args)
