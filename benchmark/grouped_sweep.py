#!/usr/bin/env python3
"""Launch-config sweep of the grouped prefill kernel (cuda_grouped.py) on real MoE shapes, H200.

    python3 benchmark/grouped_sweep.py --out OUT.json [--models mixtral,qwen3moe] [--ms 256,2048] [--cases u4]

Per (model, case, M): the whole ap_fused_moe_grouped call for every GroupedConfig (block width wn, pipeline
stages, wgmma or mma.sync), timed as kernel_bench (one CUDA graph, L2 flushed per replay, median), and for
the default config the time of each kernel of the call (torch profiler, one eager call after warm-up).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

from pagedweight.kernels.cuda_grouped import GroupedConfig, ap_fused_moe_grouped, default_grouped_config
from pagedweight.kernels.testing import random_ap_projection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import GROUP, MODELS, case_bits, graph_time, make_routing  # noqa: E402


def kernel_times(call) -> list[tuple[str, float]]:
    """(kernel name, us) of one eager call, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return [(e.name[:40], round(e.device_time, 1)) for e in sorted(events, key=lambda e: e.time_range.start)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="mixtral,qwen3moe,qwen15moe")
    ap.add_argument("--ms", default="256,2048")
    ap.add_argument("--cases", default="u4")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--time-budget-s", type=float, default=200.0)
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    rows = []
    configs = [GroupedConfig(wn, st) for wn, st in itertools.product((1, 2), (3, 4))] + [GroupedConfig(2, 3, False)]
    for mk in args.models.split(","):
        m = MODELS[mk]
        E, topk, H, I = m["E"], m["topk"], m["H"], m["I"]
        p13 = random_ap_projection(E, 2 * I, H, [8] * E, table_kind="ubcq", group_size=GROUP, bits_min=2, seed=1, device=dev)
        p2 = random_ap_projection(E, H, I, [8] * E, table_kind="ubcq", group_size=GROUP, bits_min=2, seed=2, device=dev)
        for case in args.cases.split(","):
            w13, w2 = p13.recommit(case_bits(case, E, "w13")), p2.recommit(case_bits(case, E, "w2"))
            for M in [int(v) for v in args.ms.split(",")]:
                x = torch.randn((M, H), device=dev, dtype=torch.bfloat16)
                tw, ids = make_routing(M, E, topk, m["renormalize"], M, dev)
                default = default_grouped_config(M, topk, E)
                for cfg in configs:
                    if time.time() - t0 > args.time_budget_s:
                        break
                    r = dict(model=mk, case=case, M=M, wn=cfg.wn, stages=cfg.stages, wgmma=cfg.wgmma,
                             default=cfg == default)
                    try:
                        call = lambda: ap_fused_moe_grouped(x, tw, ids, w13, w2, config=cfg)  # noqa: E731
                        r["us"] = graph_time(call, args.reps, flush)["median"]
                        if cfg == default:
                            r["kernels"] = kernel_times(call)
                    except Exception as e:  # a config that cannot run on this shape is recorded, not fatal
                        r["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(r)
                    print(f"{mk:<10} {case} M={M:<5} wn={cfg.wn} st={cfg.stages} wgmma={int(cfg.wgmma)} "
                          f"{r.get('us', float('nan')):9.1f} us {r.get('error', '')} {r.get('kernels', '')}", flush=True)
                with open(args.out, "w") as f:
                    json.dump(dict(command=" ".join(sys.argv), rows=rows), f, indent=1)
        p13 = p2 = w13 = w2 = None  # free this model's planes before the next one
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
