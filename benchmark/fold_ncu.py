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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import uniform_case  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--model", default="mixtral")
ap.add_argument("--m", type=int, default=16)
ap.add_argument("--bits", type=int, default=4)
ap.add_argument("--calls", type=int, default=3)
args = ap.parse_args()
x, tw, ids, w13, w2 = uniform_case(args.model, args.m, args.bits, torch.device("cuda"))
for _ in range(args.calls):
    ap_fused_moe_fold(x, tw, ids, w13, w2)
torch.cuda.synchronize()
print("done", args)
