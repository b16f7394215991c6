#!/usr/bin/env python3
"""Launch-config sweep of the CUDA tensor-core MoE kernel (cuda_mma.py) at MoE decode sizes, H200.

    python3 benchmark/mma_sweep.py --out OUT.json [--ms 1,4,16,64] [--bits 4]   # needs a GPU; torch only

Per model (kernel_bench.MODELS) and M: the default MMAConfig pair, then variants of register budget
(min_blocks), K split and n-tiles, each timed as kernel_bench times a case (whole call in a CUDA graph,
L2 flushed, median), next to the LUT kernel's default (and its L2 prefetch-hint variants) on the same weights and
routing.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from pagedweight.kernels import ap_fused_moe
from pagedweight.kernels.cuda_mma import N_TILES, STEP, ap_fused_moe_mma, default_moe_mma_configs
from pagedweight.kernels.cuda_lut import ap_fused_moe_lut, default_moe_lut_configs
from pagedweight.kernels.testing import random_ap_projection

from kernel_bench import MODELS, graph_time, make_routing, shard_group  # benchmark/ is on sys.path as a script


def candidates(c13, c2):
    yield "default", (c13, c2)
    for pf in (128, 256):
        yield f"l2_prefetch={pf}", (replace(c13, l2_prefetch=pf), replace(c2, l2_prefetch=pf))
    for mb in (1, 2, 3):
        yield f"min_blocks={mb}", (replace(c13, min_blocks=mb), replace(c2, min_blocks=mb))
    for f, name in ((2, "split x2"), (0.5, "split /2")):
        k13 = max(STEP, int(c13.k_per_split / f) // STEP * STEP)
        k2 = max(STEP, int(c2.k_per_split / f) // STEP * STEP)
        yield name, (replace(c13, k_per_split=k13), replace(c2, k_per_split=k2))
    if not c13.direct:
        for nt in N_TILES:
            if nt != c13.n_tiles:
                yield f"n_tiles={nt}", (replace(c13, n_tiles=nt), replace(c2, n_tiles=nt))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="mixtral,qwen15moe")
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--candidates", default="", help="comma list of candidate names to time (default: all)")
    ap.add_argument("--profile-one", action="store_true",
                    help="3 eager calls of the first model and M, default configs, nothing else (for ncu)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.profile_one:
        mk, M = args.models.split(",")[0], int(args.ms.split(",")[0])
        md = MODELS[mk]
        E, topk, H, I = md["E"], md["topk"], md["H"], md["I"]
        group = shard_group(H, I)
        p13 = random_ap_projection(E, 2 * I, H, [args.bits] * E, table_kind="ubcq", group_size=group, bits_min=2, seed=1,
                                   device=dev)
        p2 = random_ap_projection(E, H, I, [args.bits] * E, table_kind="ubcq", group_size=group, bits_min=2, seed=2,
                                  device=dev)
        x = torch.randn((M, H), device=dev, dtype=torch.bfloat16)
        tw, ids = make_routing(M, E, topk, md["renormalize"], M, dev)
        for _ in range(3):
            ap_fused_moe_mma(x, tw, ids, p13.weights, p2.weights)
        torch.cuda.synchronize()
        return
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    rows = []
    for mk in args.models.split(","):
        md = MODELS[mk]
        E, topk, H, I = md["E"], md["topk"], md["H"], md["I"]
        group = shard_group(H, I)
        p13 = random_ap_projection(E, 2 * I, H, [args.bits] * E, table_kind="ubcq", group_size=group, bits_min=2, seed=1,
                                   device=dev)
        p2 = random_ap_projection(E, H, I, [args.bits] * E, table_kind="ubcq", group_size=group, bits_min=2, seed=2,
                                  device=dev)
        w13, w2 = p13.weights, p2.weights
        for M in (int(v) for v in args.ms.split(",")):
            x = torch.randn((M, H), device=dev, dtype=torch.bfloat16)
            tw, ids = make_routing(M, E, topk, md["renormalize"], M, dev)
            base = default_moe_mma_configs(M, topk, E, w13, w2, dev)
            wanted = {c for c in args.candidates.split(",") if c}
            lut_base = default_moe_lut_configs(M, topk, E, w13, w2, dev)
            luts = [(f"lut_l2_prefetch={pf}", tuple(replace(c, l2_prefetch=pf) for c in lut_base)) for pf in (128, 256)]
            for name, cfgs in [("lut", None)] + luts + list(candidates(*base)):
                if wanted and name not in wanted:
                    continue
                row = dict(model=mk, M=M, bits=args.bits, cand=name)
                if cfgs is not None:
                    row.update(cfg13=vars(cfgs[0]), cfg2=vars(cfgs[1]))
                try:
                    if cfgs is None:
                        call = lambda: ap_fused_moe(x, tw, ids, w13, w2, kernel="lut")  # noqa: E731
                    elif name.startswith("lut"):
                        call = lambda c=cfgs: ap_fused_moe_lut(x, tw, ids, w13, w2, configs=c)  # noqa: E731
                    else:
                        call = lambda c=cfgs: ap_fused_moe_mma(x, tw, ids, w13, w2, configs=c)  # noqa: E731
                    row["us"] = graph_time(call, args.reps, flush)["median"]
                except Exception as e:  # a config the kernel refuses: recorded, the sweep goes on
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                    torch.cuda.synchronize()
                rows.append(row)
                print(f"{mk:<10} M={M:<5} {name:<14} {row.get('us', float('nan')):9.1f} us {row.get('error', '')}",
                      flush=True)
        del p13, p2
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(0), bits=args.bits, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
