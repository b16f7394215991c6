#!/usr/bin/env python3
"""Launch-config sweep of the grouped prefill kernel (cuda_grouped.py) on real MoE shapes, H200.

    python3 benchmark/grouped_sweep.py --out OUT.json [--models mixtral,qwen3moe] [--ms 256,2048] [--cases u4]

Per (model, case, M): the whole ap_fused_moe_grouped call for every GroupedConfig of --configs (block width wn,
pipeline stages, wgmma or mma.sync, warp-specialized or not) and, with --tiles, the dequantize-then-GEMM path
(ap_fused_moe kernel="tiles"), timed as kernel_bench (one CUDA graph, L2 flushed per replay, median); for the
default config and every warp-specialized one the time of each kernel of the call (torch profiler, one eager
call after warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from pagedweight.kernels import ap_fused_moe
from pagedweight.kernels.cuda_grouped import (GroupedConfig, ap_fused_moe_grouped, default_grouped_config,
                                              prebuild_grouped)
from pagedweight.kernels.testing import random_ap_projection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import MODELS, case_bits, graph_time, make_routing, shard_group  # noqa: E402


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


def block_fill(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> float:
    """Real pairs over the pair slots of the token blocks the alignment makes (each expert padded to whole blocks of
    block_m): a block costs its whole decode and wgmma N however few of its slots are real."""
    ids = topk_ids.flatten().long()
    ids = ids[ids >= 0]  # -1: an expert of another rank
    counts = torch.bincount(ids, minlength=num_experts)
    blocks = int(((counts + block_m - 1) // block_m).sum())
    return ids.numel() / max(1, blocks * block_m)


def parse_config(text: str) -> GroupedConfig:
    """wn.stages[.mma|.ws|.r256][.rv][.ow][.lag2][.p][.pf128|.pf256][.csN][.d2] (wn 4: 128 rows x 256 pairs): mma.sync
    instead of wgmma, the warp-specialized kernel, or 256-row blocks; w2's vector reductions (red_v4); the offset
    inside the weights (offset_in_weights); refills of the slot read two chunks ago (refill_lag=2); one block per SM
    walking the tiles (persistent); the L2 prefetch size of the copies; the refill copies issued after k16 step N
    (copy_step); two k16 steps of MMAs left in flight (mma_depth=2); 64 rows per warpgroup (.wg4 at 256 x 128, .wg2 at
    128 x 64: row_warpgroups)."""
    wn, stages, *tags = text.split(".")
    pf = [int(t[2:]) for t in tags if t.startswith("pf")]
    cs = [int(t[2:]) for t in tags if t.startswith("cs")]
    wg = [int(t[2:]) for t in tags if t.startswith("wg")]
    kind = [t for t in tags if not t.startswith(("pf", "cs", "wg")) and t not in ("rv", "ow", "lag2", "p", "d2")]
    return GroupedConfig(int(wn), int(stages), wgmma=kind != ["mma"], ws=kind == ["ws"], l2_prefetch=pf[0] if pf else 0,
                         rows=256 if kind == ["r256"] else 128, red_v4="rv" in tags, offset_in_weights="ow" in tags,
                         refill_lag=2 if "lag2" in tags else 1, persistent="p" in tags,
                         copy_step=cs[0] if cs else -1, mma_depth=2 if "d2" in tags else 1,
                         row_warpgroups=wg[0] if wg else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="mixtral,qwen3moe,qwen15moe")
    ap.add_argument("--ms", default="256,2048")
    ap.add_argument("--cases", default="u4")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--time-budget-s", type=float, default=200.0)
    ap.add_argument("--configs", default="1.3,1.4,2.3,2.4,2.3.mma",
                    help="comma list of wn.stages[.mma|.ws|.r256][.rv][.ow][.lag2][.pf128|.pf256] (e.g. 2.3.ws: "
                         "128 pairs, 3 stages, warp-specialized; 2.3.r256.rv: 256 rows x 128 pairs, w2's vector "
                         "reductions; 4.3: 128 rows x 256 pairs; .ow: the offset inside the weights; .lag2: refills "
                         "two chunks back; .cs3: the refill after k16 step 3; .d2: two steps of MMAs in flight; .wg4 / .wg2: 64 "
                         "rows per warpgroup)")
    ap.add_argument("--tiles", action="store_true", help="also time the dequantize-then-GEMM path")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    rows = []
    configs = [parse_config(c) for c in args.configs.split(",")]
    for mk in args.models.split(","):
        m = MODELS[mk]
        E, topk, H, I = m["E"], m["topk"], m["H"], m["I"]
        group = shard_group(H, I)  # 64 on Qwen1.5-MoE's TP-2 shard (I = 704)
        p13 = random_ap_projection(E, 2 * I, H, [8] * E, table_kind="ubcq", group_size=group, bits_min=2, seed=1, device=dev)
        p2 = random_ap_projection(E, H, I, [8] * E, table_kind="ubcq", group_size=group, bits_min=2, seed=2, device=dev)
        for case in args.cases.split(","):
            w13, w2 = p13.recommit(case_bits(case, E, "w13")), p2.recommit(case_bits(case, E, "w2"))
            tb = time.time()
            for line in prebuild_grouped(configs, w13, w2, torch.bfloat16):
                print(f"{mk} {case}: skipped {line}", flush=True)
            print(f"{mk} {case}: kernels built in {time.time() - tb:.0f} s", flush=True)
            for M in [int(v) for v in args.ms.split(",")]:
                x = torch.randn((M, H), device=dev, dtype=torch.bfloat16)
                tw, ids = make_routing(M, E, topk, m["renormalize"], M, dev)
                default = default_grouped_config(M, topk, E)
                # every config's output against the dequantize-then-GEMM path (a fast wrong kernel shows here)
                ref = ap_fused_moe(x, tw, ids, w13, w2, kernel="tiles").float()
                for cfg in [*configs, *(["tiles"] if args.tiles else [])]:
                    if time.time() - t0 > args.time_budget_s:
                        break
                    if cfg == "tiles":
                        r = dict(model=mk, case=case, M=M, kernel="tiles")
                        call = lambda: ap_fused_moe(x, tw, ids, w13, w2, kernel="tiles")  # noqa: E731
                    else:
                        r = dict(model=mk, case=case, M=M, wn=cfg.wn, stages=cfg.stages, wgmma=cfg.wgmma, ws=cfg.ws,
                                 rows=cfg.rows, red_v4=cfg.red_v4, offset_in_weights=cfg.offset_in_weights,
                                 refill_lag=cfg.refill_lag, persistent=cfg.persistent, copy_step=cfg.copy_step,
                                 mma_depth=cfg.mma_depth, row_warpgroups=cfg.row_warpgroups, default=cfg == default,
                                 block_fill=block_fill(ids, E, cfg.block_m))
                        call = lambda: ap_fused_moe_grouped(x, tw, ids, w13, w2, config=cfg)  # noqa: E731
                    try:
                        out = call().float()
                        r["rel_err_vs_tiles"] = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
                        r["us"] = graph_time(call, args.reps, flush)["median"]
                        if r.get("default") or r.get("ws") or r.get("rows") == 256 or r.get("wn") == 4:
                            r["kernels"] = kernel_times(call)
                    except Exception as e:  # a config that cannot run on this shape is recorded, not fatal
                        r["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(r)
                    name = ("tiles" if cfg == "tiles" else
                            f"wn={cfg.wn} st={cfg.stages} wgmma={int(cfg.wgmma)} ws={int(cfg.ws)} rows={cfg.rows} "
                            f"rv={int(cfg.red_v4)} ow={int(cfg.offset_in_weights)} lag={cfg.refill_lag} "
                            f"p={int(cfg.persistent)} cs={cfg.copy_step} d={cfg.mma_depth} wg={cfg.row_warpgroups} "
                            f"fill={r['block_fill']:.2f}")
                    print(f"{mk:<10} {case} M={M:<5} {name} {r.get('us', float('nan')):9.1f} us "
                          f"err {r.get('rel_err_vs_tiles', float('nan')):.1e} {r.get('error', '')} {r.get('kernels', '')}",
                          flush=True)
                ref = None
                with open(args.out, "w") as f:
                    json.dump(dict(command=" ".join(sys.argv), rows=rows), f, indent=1)
        p13 = p2 = w13 = w2 = None  # free this model's planes before the next one
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
