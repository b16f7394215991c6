#!/usr/bin/env python3
"""moe_align_block_size on CUDA: the single-program Triton kernel against the one-block CUDA kernel, H200.

    python3 benchmark/align_bench.py --out OUT.json

Per (pairs, experts, block size): each launch alone in a CUDA graph, median of --reps replays (no L2 flush:
the ids are tiny). align.CUDA_ALIGN_MIN_PAIRS is set from this table (docs/results/kernel.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from pagedweight.kernels.cuda_align import moe_align_block_size_cuda
from pagedweight.kernels.triton_align import moe_align_block_size_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import graph_time  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(1, dtype=torch.int8, device=dev)
    rows = []
    for experts, topk in ((8, 2), (60, 4), (128, 8)):
        for tokens in (1, 4, 16, 64, 256, 2048):
            pairs = tokens * topk
            ids = torch.stack([torch.randperm(experts)[:topk] for _ in range(tokens)]).to(torch.int32).to(dev)
            for bs in (16, 64):
                r = dict(experts=experts, topk=topk, tokens=tokens, pairs=pairs, block_size=bs)
                for name, fn in (("triton", moe_align_block_size_triton), ("cuda", moe_align_block_size_cuda)):
                    out = fn(ids, bs, experts)
                    r[name + "_us"] = round(graph_time(lambda: fn(ids, bs, experts), args.reps, flush)["median"], 2)
                    r[name + "_out"] = out
                r["equal"] = all(torch.equal(a, b) for a, b in zip(r.pop("triton_out"), r.pop("cuda_out")))
                rows.append(r)
                print(r, flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
