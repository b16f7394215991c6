#!/usr/bin/env python3
"""Launch-config sweep of the CUDA fold MoE kernel (cuda_fold.py) at decode sizes, H200.

    python3 benchmark/fold_sweep.py --out OUT.json [--models mixtral,qwen15moe] [--ms 1,16] [--bits 4]

Per model (kernel_bench.MODELS) and M: the kernels' own times in the default call (torch.profiler over CUDA
graph replays: prep, w13, w2, alignment), then the whole call (kernel_bench timing) for the default
FoldConfig pair and for variants of ring size, stage width, register budget, w13's warp K split and w2's K
slices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

from pagedweight.kernels.cuda_fold import (DEFAULT_MIN_BLOCKS, FoldConfig, ap_fused_moe_fold, default_fold_configs,
                                           device_launch_facts)
from pagedweight.kernels.testing import random_ap_projection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import MODELS, case_bits, graph_time, make_routing  # noqa: E402


def both(c13, c2, **kw):
    return replace(c13, **kw), replace(c2, **kw)


def candidates(c13, c2, w2, names=None):
    if names:  # registers / occupancy variants only
        table = {
            "ss1": both(c13, c2, scale_stages=1),
            "ss1_bpf0": both(c13, c2, scale_stages=1, act_prefetch=False),
            "mb5_ss1_bpf0": both(c13, c2, scale_stages=1, act_prefetch=False, min_blocks=5),
            "mb5_ss1_bpf0_wk1": (replace(c13, scale_stages=1, act_prefetch=False, min_blocks=5, wk=1),
                                 replace(c2, scale_stages=1, act_prefetch=False, min_blocks=5)),
            "kb12": both(c13, c2, ring_kb=12),
            "kb16": both(c13, c2, ring_kb=16),
            "wk1": (replace(c13, wk=1), c2),
            "pf0": both(c13, c2, l2_prefetch=0),
            # row tiles per warp: each chunk's activations feed 2 / 4 tiles (fewer blocks per SM for the registers)
            "rt2_mb3": both(c13, c2, row_tiles=2, min_blocks=3),
            "rt2_kb16_mb3": both(c13, c2, row_tiles=2, ring_kb=16, min_blocks=3),
            "rt2_mb4": both(c13, c2, row_tiles=2),
            "rt4_kb16_mb2": both(c13, c2, row_tiles=4, ring_kb=16, min_blocks=2),
            "rt2w2_mb3": (c13, replace(c2, row_tiles=2, min_blocks=3)),
            # against a default that already gives w2 two row tiles (two n-tiles): back to one, and neighbours
            "rt1w2": (c13, replace(c2, row_tiles=1, min_blocks=DEFAULT_MIN_BLOCKS)),
            "rt2w2_mb4": (c13, replace(c2, row_tiles=2, min_blocks=4)),
            "rt2w2_mb2": (c13, replace(c2, row_tiles=2, min_blocks=2)),
            "rt2w2_kb16_mb3": (c13, replace(c2, row_tiles=2, ring_kb=16, min_blocks=3)),
            "rt4w2_kb16_mb2": (c13, replace(c2, row_tiles=4, ring_kb=16, min_blocks=2)),
            "pf128": both(c13, c2, l2_prefetch=128),
            "pf256": both(c13, c2, l2_prefetch=256),
            "sc8_kb16_mb3": both(c13, c2, stage_chunks=8, ring_kb=16, min_blocks=3),
            "sc8_kb16_mb3_pf256": both(c13, c2, stage_chunks=8, ring_kb=16, min_blocks=3, l2_prefetch=256),
            "pf256_mb3_kb12": both(c13, c2, l2_prefetch=256, min_blocks=3, ring_kb=12),
            # programmatic dependent launches (each kernel copies its first planes while the one before finishes)
            "pdl": both(c13, c2, pdl=True),
            "nopdl": both(c13, c2, pdl=False),
        }
        if not c13.direct:  # the activations through a block-shared ring (w13 with 1 / 2 / 4 warps per K range)
            table.update({
                "sa": both(c13, c2, shared_act=True),
                "nosa_wk2": (replace(c13, shared_act=False, sums_in_ring=False, wk=2), replace(c2, shared_act=False, sums_in_ring=False)),  # the rule before it
                "sa13": (replace(c13, shared_act=True), c2),
                "sa2": (c13, replace(c2, shared_act=True)),
                "sa_wk1": (replace(c13, shared_act=True, wk=1), replace(c2, shared_act=True)),
                "sa_wk4": (replace(c13, shared_act=True, wk=4), replace(c2, shared_act=True)),
                "sa_mb3": both(c13, c2, shared_act=True, min_blocks=3),
                "sa_mb5": both(c13, c2, shared_act=True, min_blocks=5),
                "sa_rt2": (replace(c13, shared_act=True, wk=1, row_tiles=2, min_blocks=3),
                           replace(c2, shared_act=True, row_tiles=2, min_blocks=3)),
                "sa_wk1_pf0": (replace(c13, shared_act=True, wk=1, l2_prefetch=0), replace(c2, shared_act=True, l2_prefetch=0)),
                "sa_wk1_kb16": (replace(c13, shared_act=True, wk=1, ring_kb=16), replace(c2, shared_act=True, ring_kb=16)),
                "sa_wk1_w2rt2": (replace(c13, shared_act=True, wk=1), replace(c2, shared_act=True, row_tiles=2, min_blocks=3)),
                # on the default (shared_act): two mma chains per code word, a third ring stage, wider stages
                "split": both(c13, c2, split_chains=True),
                "sa3_kb12": both(c13, c2, sa_stages=3, ring_kb=12),
                "sa3_kb12_mb3": both(c13, c2, sa_stages=3, ring_kb=12, min_blocks=3),
                "sa3_kb12_split": both(c13, c2, sa_stages=3, ring_kb=12, split_chains=True),
                "sa_sc8_kb32": both(c13, c2, stage_chunks=8, ring_kb=32, min_blocks=1),
                # two row tiles per warp under the ring (each activation stage feeds twice the rows; 16 KB rings)
                "sa_rt2_kb16": both(c13, c2, row_tiles=2, ring_kb=16, min_blocks=2),
                "sa_rt2_kb16_mb3": both(c13, c2, row_tiles=2, ring_kb=16, min_blocks=3),
                "sa13_rt2_kb16": (replace(c13, row_tiles=2, ring_kb=16, min_blocks=2), c2),
                "sa13_rt2_kb16_mb3": (replace(c13, row_tiles=2, ring_kb=16, min_blocks=3), c2),
                "sa_rt4_kb32": both(c13, c2, row_tiles=4, ring_kb=32, min_blocks=1),
                # 8 / 16 warps per block on one activation ring (the same 16 warps per SM; w2 at one row tile)
                "w8": both(c13, c2, warps=8, min_blocks=2, row_tiles=1),
                "w16": both(c13, c2, warps=16, min_blocks=1, row_tiles=1),
                "w8_13": (replace(c13, warps=8, min_blocks=2), c2),
                "w16_13": (replace(c13, warps=16, min_blocks=1), c2),
                "w8_2": (c13, replace(c2, warps=8, min_blocks=2, row_tiles=1)),
                "w16_2": (c13, replace(c2, warps=16, min_blocks=1, row_tiles=1)),
            })
        # w2 at more blocks per SM (short K, e.g. Qwen3's I = 384 / 768: each warp's K range is one or two ring stages,
        # so more resident warps are what can hide its copies): no activation ring and 4 KB plane rings (16 KB a block)
        table["w2_nosa_kb4_mb6"] = (c13, replace(c2, shared_act=False, sums_in_ring=False, ring_kb=4, min_blocks=6))
        table["w2_nosa_kb4_mb8"] = (c13, replace(c2, shared_act=False, sums_in_ring=False, ring_kb=4, min_blocks=8))
        # where each stage's group sums come from: the activation ring (shared_act) or L2 a stage ahead (direct)
        if c13.shared_act:
            table["sumr"] = both(c13, c2, sums_in_ring=True)
            table["nosumr"] = both(c13, c2, sums_in_ring=False)
            # narrow stages: 3 / 4 ring stages of two chunks in the shared memory of two of four
            table["sc2_sa4"] = both(c13, c2, stage_chunks=2, sa_stages=4)
            table["sc2_sa3"] = both(c13, c2, stage_chunks=2, sa_stages=3)
            table["sc2_sa4_sumr"] = both(c13, c2, stage_chunks=2, sa_stages=4, sums_in_ring=True)
            table["sc2_sa4_13"] = (replace(c13, stage_chunks=2, sa_stages=4), c2)
            table["sc2_sa4_2"] = (c13, replace(c2, stage_chunks=2, sa_stages=4))
            # two row tiles per warp on narrow stages (twice the rows per activation read; 12 KB rings, 3 blocks per SM)
            table["sc2_sa3_rt2_kb12_mb3"] = both(c13, c2, stage_chunks=2, sa_stages=3, row_tiles=2, ring_kb=12, min_blocks=3)
        else:
            table["sah"] = both(c13, c2, sums_ahead=True)
            table["nosah"] = both(c13, c2, sums_ahead=False)
            table["sc2"] = both(c13, c2, stage_chunks=2)  # four plane stages of two chunks in each warp's ring
            table["sc2_sah"] = both(c13, c2, stage_chunks=2, sums_ahead=True)
        kps = c2.k_per_split or w2.K
        if kps < w2.K:  # w2 in half the K slices
            table["w2h"] = (c13, replace(c2, k_per_split=min(w2.K, 2 * kps)))
        for f in (2, 4):  # w2 cut into f times as many K slices (more blocks when there are few pairs)
            k = max(w2.group_size, kps // f // w2.group_size * w2.group_size)
            if k < kps:
                table[f"w2s{f}"] = (c13, replace(c2, k_per_split=k))
                table[f"sumr_w2s{f}"] = (table.get("sumr", table.get("sah"))[0],
                                         replace(table.get("sumr", table.get("sah"))[1], k_per_split=k))
        if not c13.direct:
            table["nt1"] = both(c13, c2, n_tiles=1)
            table["nt2"] = both(c13, c2, n_tiles=2)
        yield "default", (c13, c2)
        for n in names:
            if n in table and not (n.startswith("nt") and table[n][0] == c13):
                yield n, table[n]
        return
    yield "default", (c13, c2)
    yield "min_blocks=4", (replace(c13, min_blocks=4), replace(c2, min_blocks=4))
    for kb in (8, 12, 24):
        yield f"ring_kb={kb}", (replace(c13, ring_kb=kb), replace(c2, ring_kb=kb))
        yield f"ring_kb={kb} min_blocks=4", (replace(c13, ring_kb=kb, min_blocks=4), replace(c2, ring_kb=kb, min_blocks=4))
    for sd in (1, 2):
        yield f"scale_stages={sd}", (replace(c13, scale_stages=sd), replace(c2, scale_stages=sd))
    yield "stage_chunks=8 ring_kb=16", both(c13, c2, stage_chunks=8, ring_kb=16)
    for wk in (1, 2, 4):
        if wk != c13.wk:
            yield f"w13 wk={wk}", (replace(c13, wk=wk), c2)
    kps = c2.k_per_split or w2.K
    for f in (2, 0.5):
        k = max(w2.group_size, int(kps / f) // w2.group_size * w2.group_size)
        if k != kps and k <= w2.K:
            yield f"w2 k_per_split={k}", (c13, replace(c2, k_per_split=k))


def changed(cfg: FoldConfig) -> dict:
    """The fields of a config that differ from FoldConfig()'s (the rows stay small; the rest is the code's default)."""
    base = FoldConfig()
    return {k: v for k, v in vars(cfg).items() if v != getattr(base, k)}


def kernel_times(call) -> dict:
    g = torch.cuda.CUDAGraph()
    call()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        call()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0)
        if us and e.count:
            out[e.key[:60]] = round(us, 2)  # average per call, us
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="mixtral,qwen15moe")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--bits-max", type=int, default=8, help="planes stored per expert (the parent bitwidth)")
    ap.add_argument("--case", default="", help="kernel_bench case (u3, u8, mix4, ...); overrides --bits")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--candidates", default="", help="comma list of named variants (ss1, ss1_bpf0, mb5_ss1_bpf0, ...)")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    rows = []
    for mk in args.models.split(","):
        md = MODELS[mk]
        E, topk, H, I = md["E"], md["topk"], md["H"], md["I"]
        case = args.case or f"u{args.bits}"
        p13 = random_ap_projection(E, 2 * I, H, case_bits(case, E, "w13"), table_kind="ubcq", bits_min=2,
                                   bits_max=args.bits_max, seed=1, device=dev)
        p2 = random_ap_projection(E, H, I, case_bits(case, E, "w2"), table_kind="ubcq", bits_min=2,
                                  bits_max=args.bits_max, seed=2, device=dev)
        w13, w2 = p13.weights, p2.weights
        for M in [int(v) for v in args.ms.split(",")]:
            x = torch.randn((M, H), device=dev, dtype=torch.bfloat16)
            tw, ids = make_routing(M, E, topk, md["renormalize"], M, dev)
            sms, pdl = device_launch_facts(dev)
            c13, c2 = default_fold_configs(M, topk, w13, w2, sms, pdl=pdl)
            if not args.no_profile:
                kt = kernel_times(lambda: ap_fused_moe_fold(x, tw, ids, w13, w2, configs=(c13, c2)))
                rows.append(dict(model=mk, M=M, cand="kernels", kernel_us=kt, cfg13=changed(c13), cfg2=changed(c2)))
                print(f"{mk} M={M} kernels: {kt}", flush=True)
            for name, cfgs in candidates(c13, c2, w2, [c for c in args.candidates.split(",") if c]):
                r = dict(model=mk, case=case, M=M, cand=name, cfg13=changed(cfgs[0]), cfg2=changed(cfgs[1]))
                try:
                    ap_fused_moe_fold(x, tw, ids, w13, w2, configs=cfgs)
                    r["us"] = graph_time(lambda: ap_fused_moe_fold(x, tw, ids, w13, w2, configs=cfgs), args.reps, flush)["median"]
                except Exception as e:
                    r["error"] = f"{type(e).__name__}: {e}"[:200]
                    torch.cuda.synchronize()
                rows.append(r)
                print(f"{mk:<10} M={M:<3} {name:<28} {r.get('us', float('nan')):8.1f} us {r.get('error', '')}", flush=True)
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
        del p13, p2, w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
