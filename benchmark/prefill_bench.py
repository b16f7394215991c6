#!/usr/bin/env python3
"""AP fused MoE at prefill sizes against SGLang's bf16 and FP8 block128 MoE kernels, H200.

    python3 benchmark/prefill_bench.py --anchors-json A.json --out OUT.json [--models ..] [--ms 256,512,2048,8192]

Per model (kernel_bench.MODELS: Qwen1.5-MoE, Mixtral, Qwen3-30B-A3B and their --tp 2 shards), case (u4, u8, mix4:
per-expert bitwidths cycling kernel_bench.MIX_PATTERN, mean 4) and M: the default `ap_fused_moe` call and, for
comparison in the same run, `--compare` kernels forced (default "tiles": the Triton path the default replaced, which
dequantizes every expert into a scratch at these sizes). Timing as kernel_bench: the whole call in one CUDA graph,
L2 flushed before each replay, median. Each row also records the call's transient device memory (peak allocated
during one eager call minus what was allocated before it) and, with `--stock-memory-dir` (the folder holding
../shared/bench/sglang_moe_baseline.py, on a machine with SGLang), SGLang's bf16 fused_experts' transient memory at
the same model and M, so the table can say how much more (or less) the AP path needs than what stock serving
allocates for the same call (`extra_vs_stock_bf16_bytes`). `--anchors-json` is what
../shared/bench/sglang_moe_anchors.py wrote in the same device call; the headline holds the ratios issue #19 reads
back: prefill_speedup_vs_sglang_bf16_4bit, prefill_speedup_vs_sglang_fp8_block128_4bit (time of SGLang / time of
ours), plus prefill_speedup_vs_sglang_bf16_8bit and prefill_mix4_time_vs_u4. A correctness check per model (mix4,
M = 256, against the fp32 reference) is in the output.
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
from pagedweight.kernels.testing import random_ap_projection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_bench import default_kernel, load_anchors, mix4_check  # noqa: E402
from kernel_bench import MODELS, ap_bytes, case_bits, graph_time, make_routing, shard_group  # noqa: E402

HEADLINE_KEYS = ("prefill_speedup_vs_sglang_bf16_4bit", "prefill_speedup_vs_sglang_fp8_block128_4bit",
                 "prefill_speedup_vs_sglang_bf16_8bit", "prefill_mix4_time_vs_u4")


def headline(results: list[dict], anchors: dict) -> dict:
    us = {(r["model"], r["case"], r["M"]): r["us"] for r in results
          if r.get("status") == "ok" and r["variant"] == "default"}
    h: dict = {k: {} for k in HEADLINE_KEYS}
    for (mk, case, M), t in us.items():
        a, key = anchors.get(mk, {}), str(M)
        if case == "u4":
            if key in a.get("bf16", {}):
                h["prefill_speedup_vs_sglang_bf16_4bit"].setdefault(mk, {})[key] = round(a["bf16"][key] / t, 3)
            if key in a.get("fp8_block128", {}):
                h["prefill_speedup_vs_sglang_fp8_block128_4bit"].setdefault(mk, {})[key] = round(
                    a["fp8_block128"][key] / t, 3)
            if (mk, "mix4", M) in us:
                h["prefill_mix4_time_vs_u4"].setdefault(mk, {})[key] = round(us[(mk, "mix4", M)] / t, 3)
        if case == "u8" and key in a.get("bf16", {}):
            h["prefill_speedup_vs_sglang_bf16_8bit"].setdefault(mk, {})[key] = round(a["bf16"][key] / t, 3)
    return h


def transient_bytes(call) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return int(peak - before)


def stock_transient_bytes(bench_dir: str, mk: str, ms: list[int], dev) -> dict[int, int]:
    """{M: transient bytes} of SGLang's bf16 fused_experts on this model's shapes (its intermediate caches and output),
    measured as transient_bytes measures ours; bf16 weights built and freed here."""
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    import sglang_moe_baseline as sb

    model = MODELS[mk]
    rc = sb.runner_config(model)
    sgl = sb.setup_sglang()
    w = sb.build_weights("bf16", model["E"], model["H"], model["I"], dev, empty=True)
    out = {}
    for M in ms:
        x = torch.randn((M, model["H"]), device=dev, dtype=torch.bfloat16)
        tw, ids, logits = sb.make_routing(M, model["E"], model["topk"], model["renormalize"], M, dev)
        topk_out = sgl["StandardTopKOutput"](tw, ids, logits)
        call = sb.make_call(w, x, topk_out, rc)
        call()  # the first call compiles; its caches are not the steady state's
        out[M] = transient_bytes(call)
        del x, tw, ids, logits, topk_out, call
    del w
    torch.cuda.empty_cache()
    return out


def memory_table(results: list[dict]) -> dict:
    """{model: {M: {ours, stock_bf16, extra}}} in MiB for the default u4 call, where the stock side was measured."""
    def mib(nbytes: int) -> float:
        return round(nbytes / 2**20, 1)

    t: dict = {}
    for r in results:
        if r.get("variant") == "default" and r.get("case") == "u4" and "stock_bf16_transient_bytes" in r:
            t.setdefault(r["model"], {})[str(r["M"])] = dict(
                ours_mib=mib(r["transient_bytes"]), stock_bf16_mib=mib(r["stock_bf16_transient_bytes"]),
                extra_vs_stock_bf16_mib=mib(r["extra_vs_stock_bf16_bytes"]))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--anchors-json", default=None)
    ap.add_argument("--models", default="qwen15moe,mixtral,qwen3moe,qwen15moe_tp2,mixtral_tp2,qwen3moe_tp2")
    ap.add_argument("--ms", default="256,512,2048,8192")
    ap.add_argument("--cases", default="u4,u8,mix4")
    ap.add_argument("--compare", default="tiles", help="kernels also timed forced at u4 (same run); '' for none")
    ap.add_argument("--compare-max-m", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--time-budget-s", type=float, default=400.0)
    ap.add_argument("--stock-memory-dir", default=None,
                    help="folder with sglang_moe_baseline.py: also measure SGLang bf16's transient memory per M")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                timing="whole ap_fused_moe call in one CUDA graph, L2 flushed per replay, median",
                transient="peak allocated during one eager call minus allocated before it (bytes)")
    anchors = load_anchors(args.anchors_json)
    results, checks = [], []
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    compare = [k for k in args.compare.split(",") if k]

    def dump():
        meta["wall_s"] = round(time.time() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, headline=headline(results, anchors), memory=memory_table(results),
                           results=results, correctness=checks, anchors=anchors), f, indent=1)

    for mk in [m for m in args.models.split(",") if m]:
        if time.time() - t0 > args.time_budget_s:
            break
        model = MODELS[mk]
        E, topk, H, I = model["E"], model["topk"], model["H"], model["I"]
        group = shard_group(H, I)
        ms = [int(v) for v in args.ms.split(",") if v]
        stock_mem: dict[int, int] = {}
        if args.stock_memory_dir:
            try:
                stock_mem = stock_transient_bytes(args.stock_memory_dir, mk, ms, dev)
            except Exception as e:  # the timing still runs; the reason goes into the output, not only the log
                why = f"{type(e).__name__}: {e}"[:300]
                meta.setdefault("stock_memory_errors", {})[mk] = why
                print(f"# {mk}: SGLang bf16 memory not measured: {why}", flush=True)
        p13 = random_ap_projection(E, 2 * I, H, [8] * E, table_kind="ubcq", group_size=group, bits_min=2, seed=1,
                                   device=dev)
        p2 = random_ap_projection(E, H, I, [8] * E, table_kind="ubcq", group_size=group, bits_min=2, seed=2,
                                  device=dev)
        for case in [c for c in args.cases.split(",") if c]:
            b13, b2 = case_bits(case, E, "w13"), case_bits(case, E, "w2")
            w13, w2 = p13.recommit(b13), p2.recommit(b2)
            for M in ms:
                if time.time() - t0 > args.time_budget_s:
                    break
                x = torch.randn((M, H), device=dev, dtype=torch.bfloat16)
                tw, ids = make_routing(M, E, topk, model["renormalize"], M, dev)
                hit = sorted(set(ids.flatten().tolist()))
                base = dict(model=mk, case=case, M=M, experts_hit=len(hit), group=group,
                            weight_bytes=ap_bytes(b13, b2, hit, model, "ubcq", group),
                            default_kernel=default_kernel(M, topk, E, w13, w2))
                variants = [("default", {})]
                if case == "u4" and M <= args.compare_max_m:
                    variants += [(k, dict(kernel=k)) for k in compare if k != base["default_kernel"]]
                for vname, kw in variants:
                    r = dict(base, variant=vname)
                    try:
                        r["transient_bytes"] = transient_bytes(lambda: ap_fused_moe(x, tw, ids, w13, w2, **kw))
                        if M in stock_mem:
                            r["stock_bf16_transient_bytes"] = stock_mem[M]
                            r["extra_vs_stock_bf16_bytes"] = r["transient_bytes"] - stock_mem[M]
                        st = graph_time(lambda: ap_fused_moe(x, tw, ids, w13, w2, **kw), args.reps, flush)
                        r.update(us=st["median"], stats=st, status="ok")
                    except Exception as e:
                        r.update(status="error", error=f"{type(e).__name__}: {e}"[:300], tb=traceback.format_exc()[-800:])
                        torch.cuda.synchronize()
                    results.append(r)
                    a = anchors.get(mk, {})
                    ref = "  ".join(f"{f[:6]} {a[f][str(M)]:.1f}" for f in ("bf16", "fp8_block128")
                                    if str(M) in a.get(f, {}))
                    print(f"{mk:<14} {case:<5} M={M:<5} {vname:<8}({base['default_kernel']:<7}) "
                          f"{r.get('us', float('nan')):9.1f} us  {r.get('transient_bytes', 0) / 2**20:7.1f} MiB | "
                          f"{ref} {r.get('error', '')}", flush=True)
                dump()
        c = mix4_check(mk, p13, p2, 256, dev)
        checks.append(c)
        print(f"# check {c}", flush=True)
        p13 = p2 = w13 = w2 = None  # free this model's planes before the next one
        torch.cuda.empty_cache()
        dump()
    dump()
    print(json.dumps(headline(results, anchors))[:4000], flush=True)


if __name__ == "__main__":
    main()
