#!/usr/bin/env python3
"""AP fused MoE at decode sizes against the static kernels SGLang users run instead, H200.

    python3 benchmark/decode_bench.py --anchors-json A.json --out OUT.json [--models ..] [--ms 1,4,16,64]

Per model (kernel_bench.MODELS: Qwen1.5-MoE, Mixtral, Qwen3-30B-A3B and their --tp 2 shards), case (u3, u4,
u8, mix4: per-expert bitwidths cycling kernel_bench.MIX_PATTERN, mean 4) and M: the default `ap_fused_moe`
call and, for comparison in the same run, the call forced onto each CUDA kernel that can take it (fold,
mma, lut). Timing as kernel_bench: the whole call in one CUDA graph, L2 flushed before each replay, median.
`--anchors-json` is what ../shared/bench/sglang_moe_anchors.py wrote in the same device call (bf16, FP8
block128, Marlin W4A16 / W8A16); the headline holds the ratios issue #18 reads back:
speedup_vs_sglang_marlin_w4a16_4bit, speedup_vs_sglang_fp8_block128_8bit, speedup_vs_sglang_bf16_4bit,
speedup_vs_sglang_bf16_2p5x_tp2 (tp2 shards that Marlin cannot take), mix4_time_per_byte_vs_u4 and
u3_vs_u4_time. A correctness check per model (mix4, M = 16, against the fp32 reference) is in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

import torch

from pagedweight.kernels import ap_fused_moe
from pagedweight.kernels.api import auto_moe_kernel
from pagedweight.kernels.reference import ap_fused_moe_reference
from pagedweight.kernels.testing import random_ap_projection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import MODELS, ap_bytes, case_bits, graph_time, make_routing, measure_copy_tbps, shard_group  # noqa: E402

KERNELS = ("fold", "mma", "lut")


def default_kernel(M: int, topk: int, E: int, w13, w2) -> str:
    """What ap_fused_moe(kernel="auto") runs (api.auto_moe_kernel)."""
    return auto_moe_kernel(M, topk, w13, w2) or "triton"


def load_anchors(path: str | None) -> dict:
    """{model: {fmt: {M: us}}} from sglang_moe_anchors.py's JSON."""
    if not path:
        return {}
    with open(path) as f:
        doc = json.load(f)
    rows: dict = {}
    for r in doc.get("results", []):
        if r.get("status") == "ok":
            rows.setdefault(r["model"], {}).setdefault(r["fmt"], {})[str(r["M"])] = r["graph_us"]
    return rows


def mix4_check(mk: str, p13, p2, M: int, dev) -> dict:
    """The default ap_fused_moe call on the mix4 bitwidths at M tokens against the fp32 reference (rel err < 2e-2)."""
    model = MODELS[mk]
    E, topk, H = model["E"], model["topk"], model["H"]
    w13, w2 = p13.recommit(case_bits("mix4", E, "w13")), p2.recommit(case_bits("mix4", E, "w2"))
    x = torch.randn((M, H), device=dev, dtype=torch.bfloat16)
    tw, ids = make_routing(M, E, topk, model["renormalize"], 999, dev)
    c = dict(model=mk, M=M, case="mix4", kernel=default_kernel(M, topk, E, w13, w2))
    try:
        out = ap_fused_moe(x, tw, ids, w13, w2).float()
        ref = ap_fused_moe_reference(x.float(), tw, ids, w13, w2).float()
        c.update(rel_err=float((out - ref).norm() / ref.norm()), finite=bool(torch.isfinite(out).all()))
        c["pass"] = c["finite"] and c["rel_err"] < 2e-2
    except Exception as e:  # recorded in the results, the run goes on
        c.update(error=f"{type(e).__name__}: {e}"[:300], **{"pass": False})
    return c


def headline(results: list[dict], anchors: dict) -> dict:
    us = {}
    for r in results:
        if r.get("status") == "ok" and r["variant"] == "default":
            us[(r["model"], r["case"], r["M"])] = r
    h: dict = {k: {} for k in ("speedup_vs_sglang_marlin_w4a16_4bit", "speedup_vs_sglang_fp8_block128_8bit",
                              "speedup_vs_sglang_bf16_4bit", "speedup_vs_sglang_bf16_2p5x_tp2",
                              "mix4_time_per_byte_vs_u4", "u3_vs_u4_time")}
    for (mk, case, M), r in us.items():
        a = anchors.get(mk, {})
        key = str(M)
        if case == "u4":
            if key in a.get("marlin_w4a16_g128", {}):
                h["speedup_vs_sglang_marlin_w4a16_4bit"].setdefault(mk, {})[key] = round(a["marlin_w4a16_g128"][key] / r["us"], 3)
            if key in a.get("bf16", {}):
                h["speedup_vs_sglang_bf16_4bit"].setdefault(mk, {})[key] = round(a["bf16"][key] / r["us"], 3)
                if mk.endswith("_tp2") and key not in a.get("marlin_w4a16_g128", {}):
                    h["speedup_vs_sglang_bf16_2p5x_tp2"].setdefault(mk, {})[key] = round(a["bf16"][key] / r["us"], 3)
            u3 = us.get((mk, "u3", M))
            if u3:
                h["u3_vs_u4_time"].setdefault(mk, {})[key] = round(u3["us"] / r["us"], 3)
            mix = us.get((mk, "mix4", M))
            if mix:
                per_byte = (mix["us"] / mix["weight_bytes"]) / (r["us"] / r["weight_bytes"])
                h["mix4_time_per_byte_vs_u4"].setdefault(mk, {})[key] = round(per_byte, 3)
        if case == "u8" and key in a.get("fp8_block128", {}):
            h["speedup_vs_sglang_fp8_block128_8bit"].setdefault(mk, {})[key] = round(a["fp8_block128"][key] / r["us"], 3)
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--anchors-json", default=None)
    ap.add_argument("--models", default="qwen15moe,mixtral,qwen3moe,qwen15moe_tp2,mixtral_tp2,qwen3moe_tp2")
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--cases", default="u4,u8,u3,mix4")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="CUDA kernels also timed forced (same run)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--time-budget-s", type=float, default=400.0)
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    import triton

    roof = measure_copy_tbps(dev)
    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), measured_copy_TBps=round(roof, 3),
                command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                timing="whole ap_fused_moe call in one CUDA graph, L2 flushed per replay, median",
                bytes="planes + tables of the hit experts at their committed bitwidths (w13 and w2)")
    anchors = load_anchors(args.anchors_json)
    results, checks = [], []
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    kernels = [k for k in args.kernels.split(",") if k]

    def dump():
        meta["wall_s"] = round(time.time() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, headline=headline(results, anchors), results=results, correctness=checks,
                           anchors=anchors), f, indent=1)

    print(f"# {meta['gpu']} copy {roof:.2f} TB/s", flush=True)
    for mk in [m for m in args.models.split(",") if m]:
        model = MODELS[mk]
        E, topk, H, I = model["E"], model["topk"], model["H"], model["I"]
        group = shard_group(H, I)
        p13 = random_ap_projection(E, 2 * I, H, [8] * E, table_kind="ubcq", group_size=group, bits_min=2, seed=1, device=dev)
        p2 = random_ap_projection(E, H, I, [8] * E, table_kind="ubcq", group_size=group, bits_min=2, seed=2, device=dev)
        for case in [c for c in args.cases.split(",") if c]:
            b13, b2 = case_bits(case, E, "w13"), case_bits(case, E, "w2")
            w13, w2 = p13.recommit(b13), p2.recommit(b2)
            for M in [int(v) for v in args.ms.split(",") if v]:
                if time.time() - t0 > args.time_budget_s:
                    break
                x = torch.randn((M, H), device=dev, dtype=torch.bfloat16)
                tw, ids = make_routing(M, E, topk, model["renormalize"], M, dev)
                hit = sorted(set(ids.flatten().tolist()))
                base = dict(model=mk, case=case, M=M, experts_hit=len(hit), group=group,
                            weight_bytes=ap_bytes(b13, b2, hit, model, "ubcq", group), default_kernel=default_kernel(M, topk, E, w13, w2))
                variants = [("default", {})] + [(k, dict(kernel=k)) for k in kernels
                                                if k != base["default_kernel"] and (case == "u4" or k == "fold")]
                for vname, kw in variants:
                    r = dict(base, variant=vname)
                    try:
                        ap_fused_moe(x, tw, ids, w13, w2, **kw)
                        torch.cuda.synchronize()
                        st = graph_time(lambda: ap_fused_moe(x, tw, ids, w13, w2, **kw), args.reps, flush)
                        r.update(us=st["median"], stats=st, status="ok")
                        r["TBps"] = r["weight_bytes"] / (r["us"] * 1e-6) / 1e12
                    except Exception as e:
                        r.update(status="error", error=f"{type(e).__name__}: {e}"[:300], tb=traceback.format_exc()[-800:])
                        torch.cuda.synchronize()
                    results.append(r)
                    a = anchors.get(mk, {})
                    ref = "  ".join(f"{f[:6]} {a[f][str(M)]:.1f}" for f in ("bf16", "fp8_block128", "marlin_w4a16_g128")
                                    if str(M) in a.get(f, {}))
                    print(f"{mk:<14} {case:<5} M={M:<3} {vname:<8}({base['default_kernel']:<5}) {r.get('us', float('nan')):8.1f} us "
                          f"{r.get('TBps', 0):5.2f} TB/s | {ref} {r.get('error', '')}", flush=True)
                dump()
        # correctness: mix4 at M = 16 through the default path, against the fp32 reference
        c = mix4_check(mk, p13, p2, 16, dev)
        checks.append(c)
        print(f"# check {c}", flush=True)
        p13 = p2 = w13 = w2 = None  # free this model's planes before the next one
        torch.cuda.empty_cache()
        dump()
    dump()
    print(json.dumps(headline(results, anchors), indent=None)[:4000], flush=True)


if __name__ == "__main__":
    main()
