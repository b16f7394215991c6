#!/usr/bin/env python3
"""One eager grouped-kernel MoE call on a real shape, for `ncu` (no graphs, no flush).

    ncu --kernel-name ap_grouped_gemm --launch-skip 2 --launch-count 2 --section SpeedOfLight ... \
        python3 benchmark/grouped_ncu.py --model mixtral --m 2048 [--config 2.4.r256.rv.ow.lag2.wg4.cs2]

`--config` takes grouped_sweep.py's tags; without it the default config for the shape runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from pagedweight.kernels.cuda_grouped import ap_fused_moe_grouped, default_grouped_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouped_sweep import parse_config  # noqa: E402
from kernel_bench import uniform_case  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mixtral")
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--config", default="", help="a grouped_sweep.py tag (e.g. 2.4.r256.rv.ow.lag2.wg4.cs2; the "
                                                 "warp-specialized 2.3.ws needs --kernel-name ap_grouped_ws_gemm); "
                                                 "empty: the default config")
    args = ap.parse_args()
    x, tw, ids, w13, w2 = uniform_case(args.model, args.m, args.bits, torch.device("cuda"))
    cfg = parse_config(args.config) if args.config else default_grouped_config(args.m, ids.shape[1], w13.num_experts)
    for _ in range(2):  # the first call compiles; ncu skips it with --launch-skip 2
        ap_fused_moe_grouped(x, tw, ids, w13, w2, config=cfg)
    torch.cuda.synchronize()
    print("config", cfg)


if __name__ == "__main__":
    main()
