#!/usr/bin/env python3
"""Benchmark of the fused AP MoE kernel (pagedweight.kernels.ap_fused_moe) on the H200.

Shapes: Qwen1.5-MoE-A2.7B experts (E60 top4 H2048 I1408) and Mixtral-8x7B experts (E8 top2 H4096 I14336),
M in {1, 4, 16, 64, 256, 2048}; bitwidths: uniform 3/4/6/8 and a mixed per-block table averaging 4 bits;
table kinds bcq (binary-coded, default), ubcq (one scale + offset per group) and kmeans (LUT). Random planes/tables at real shapes (speed does
not depend on values); routing and inputs are drawn exactly as benchmark/sglang_moe_baseline.py draws
them (same seeds), so the same experts are hit as in SGLang's run.

Timing as in the SGLang baseline script: the whole call (alignment, both kernels, output cast) captured
once in a CUDA graph and replayed; L2 flushed (256 MB memset) before every rep, outside the timed
region; median of the reps. Bytes touched = planes + tables of the hit experts at their bitwidths.
Same run: a torch bf16 MoE (per hit expert: cuBLAS gate_up, silu*mul, cuBLAS down, index_add; graph
captured), so the numbers are meaningful without SGLang; --baseline-json adds SGLang's own kernels
(from sglang_moe_baseline.py run in the same device call) and writes the headline speedups.

Usage (GPU):  python3 benchmark/kernel_bench.py --out $OUT/kernel.json [--baseline-json $OUT/baseline.json]
              [--md $OUT/kernel.md] [--sweep] [--models ...] [--ms ...] [--cases u3,u4,u6,u8,mix4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import replace

import torch

from pagedweight.bench.cuda_timing import cuda_setup, graph_time, time_cuda  # noqa: F401 (scripts import them here)
from pagedweight.format.layout import DEFAULT_TABLE_KIND
from pagedweight.kernels import APKernelConfig, ap_fused_moe
from pagedweight.kernels.api import auto_moe_kernel
from pagedweight.kernels.config import default_moe_configs
from pagedweight.kernels.cuda_fold import fold_moe_unsupported
from pagedweight.kernels.sglang_dense_moe import sglang_moe_configs
from pagedweight.kernels.reference import ap_fused_moe_reference
from pagedweight.kernels.testing import random_ap_projection

MODELS = {
    "qwen15moe": dict(name="Qwen1.5-MoE-A2.7B", E=60, topk=4, H=2048, I=1408, renormalize=False),
    "mixtral": dict(name="Mixtral-8x7B", E=8, topk=2, H=4096, I=14336, renormalize=True),
    "qwen3moe": dict(name="Qwen3-30B-A3B", E=128, topk=8, H=2048, I=768, renormalize=True),
}
for _k in ("qwen15moe", "mixtral", "qwen3moe"):  # the per-rank expert shards at --tp 2 (intermediate halved)
    MODELS[_k + "_tp2"] = dict(MODELS[_k], name=MODELS[_k]["name"] + " (TP-2 shard)", I=MODELS[_k]["I"] // 2)
DEFAULT_MS = [1, 4, 16, 64, 256, 2048]
GROUP = 128
MIX_PATTERN = [2, 3, 4, 5, 6, 4, 3, 5]  # mean 4; used cyclically over experts (8 and 60 experts: mean 4 exactly)


def shard_group(hidden: int, intermediate: int) -> int:
    """The largest power-of-two group up to GROUP that divides both K of a layer (Qwen1.5-MoE's TP-2 shard:
    I = 704 -> 64)."""
    group = GROUP
    while hidden % group or intermediate % group:
        group //= 2
    return group


def case_bits(case: str, num_experts: int, proj: str) -> list[int]:
    if case.startswith("u"):
        return [int(case[1:])] * num_experts
    if case == "mix4":
        shift = 0 if proj == "w13" else 3  # w13 and w2 of one expert get different bitwidths
        pat = MIX_PATTERN if num_experts % len(MIX_PATTERN) == 0 else MIX_PATTERN[:6]  # [2,3,4,5,6,4]: mean 4
        return [pat[(e + shift) % len(pat)] for e in range(num_experts)]
    raise ValueError(f"unknown case {case!r}")


def make_routing(M: int, E: int, topk: int, renormalize: bool, seed: int, device):
    """Identical to sglang_moe_baseline.make_routing (same experts hit for the same seed)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    logits = torch.randn((M, E), generator=g, dtype=torch.float32)
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(torch.float32).contiguous().to(device), ids.to(torch.int32).contiguous().to(device)


def uniform_case(model: str, m: int, bits: int, device):
    """(x, topk weights, topk ids, w13, w2) of one MoE layer of `model` at uniform `bits`, ubcq, M = m tokens:
    the inputs of the one-call scripts that run under ncu."""
    md = MODELS[model]
    E, topk, H, I = md["E"], md["topk"], md["H"], md["I"]
    w13 = random_ap_projection(E, 2 * I, H, [bits] * E, table_kind="ubcq", group_size=shard_group(H, I), seed=1, device=device)
    w2 = random_ap_projection(E, H, I, [bits] * E, table_kind="ubcq", group_size=shard_group(H, I), seed=2, device=device)
    x = torch.randn((m, H), device=device, dtype=torch.bfloat16)
    tw, ids = make_routing(m, E, topk, md["renormalize"], m, device)
    return x, tw, ids, w13.weights, w2.weights


def nreps(us_guess: float, budget_s: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(budget_s * 1e6 / (us_guess + 100.0))))


def measure_copy_tbps(dev) -> float:
    """Device-to-device copy rate (bytes read + written), the roofline used for %."""
    a = torch.empty(2 * 2**30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        b.copy_(a)
    ev[1].record()
    torch.cuda.synchronize()
    t = ev[0].elapsed_time(ev[1]) / 1e3 / 10
    del a, b
    torch.cuda.empty_cache()
    return 2 * 2 * 2**30 / t / 1e12


def ap_bytes(w13_bits, w2_bits, hit, model, kind, group: int = GROUP) -> int:
    H, I = model["H"], model["I"]
    total = 0
    for e in hit:
        for q, n, k in ((w13_bits[e], 2 * I, H), (w2_bits[e], H, I)):
            planes = q * n * k // 8
            rows = {"bcq": q + 1, "ubcq": 2}.get(kind)  # grouped tables: rows of [N, K / G]; kmeans: [N, 2^q]
            table = rows * n * (k // group) * 2 if rows else n * 2**q * 2
            total += planes + table
    return total


class TorchBf16MoE:
    """bf16 MoE through cuBLAS, one matmul pair per hit expert; routing indices fixed at construction."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor):
        self.w13, self.w2 = w13, w2
        self.inter = w2.shape[2]
        self.groups = []
        ids_cpu = ids.cpu()
        for e in torch.unique(ids_cpu).tolist():
            tok, slot = (ids_cpu == e).nonzero(as_tuple=True)
            self.groups.append((e, tok.to(ids.device), tw[tok.to(ids.device), slot.to(ids.device)][:, None].to(torch.bfloat16)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, tok, rw in self.groups:
            h = x[tok] @ self.w13[e].t()
            a = torch.nn.functional.silu(h[:, : self.inter]) * h[:, self.inter :]
            out.index_add_(0, tok, (a @ self.w2[e].t()) * rw)
        return out


def sweep_candidates(base13: APKernelConfig, base2: APKernelConfig) -> list[tuple[str, APKernelConfig, APKernelConfig]]:
    """Launch-config variants (w2's split_k stays at the default's)."""
    from dataclasses import replace

    out = []
    if base13.block_m <= 32:  # decode
        variants = [
            dict(block_n=64, num_warps=4, num_stages=1, prefetch=True, maxnreg=128),
            dict(block_n=64, num_warps=4, num_stages=1, prefetch=True, maxnreg=96),
            dict(block_n=64, num_warps=4, num_stages=1, prefetch=False, maxnreg=128),
            dict(block_n=64, num_warps=4, num_stages=2, prefetch=False, maxnreg=128),
            dict(block_n=64, num_warps=4, num_stages=1, prefetch=True, maxnreg=None),
            dict(block_n=128, num_warps=8, num_stages=1, prefetch=True, maxnreg=128),
            dict(block_n=128, num_warps=4, num_stages=1, prefetch=True, maxnreg=None),  # fewest instr/weight (SASS)
            dict(block_n=64, num_warps=4, num_stages=1, prefetch=True, maxnreg=128, w13_split_k=1),
        ]
        fused = [dict(block_n=64, num_warps=4, num_stages=1, prefetch=True, maxnreg=None, fuse_gate_up=True),
                 dict(block_n=64, num_warps=4, num_stages=1, prefetch=True, maxnreg=128, fuse_gate_up=True)]
    else:  # prefill
        dq = dict(block_k=64, num_stages=3)
        variants = [
            dict(block_m=128, block_n=128, num_warps=8, dequant_chunk=2, **dq),
            dict(block_m=128, block_n=128, num_warps=8, dequant_chunk=64, **dq),
            dict(block_m=64, block_n=128, num_warps=4, dequant_chunk=16, **dq),
            dict(block_m=128, block_n=128, num_warps=8, num_stages=2, prefetch=False, maxnreg=None, dequant_chunk=0),
            dict(block_m=256, block_n=64, num_warps=8, num_stages=2, prefetch=False, maxnreg=None),
            dict(block_m=256, block_n=128, num_warps=8, num_stages=2, prefetch=False, maxnreg=None),
            dict(block_m=64, block_n=128, num_warps=4, num_stages=2, prefetch=False, maxnreg=None),
        ]
        fused = [dict(v, fuse_gate_up=True) for v in variants if not v.get("dequant_chunk")]
    for v in variants + fused:
        own13 = {"fuse_gate_up", "w13_split_k", "dequant_chunk"}
        kw13 = {k: val for k, val in v.items() if k not in own13}
        split13 = 1 if v.get("fuse_gate_up") else v.get("w13_split_k", base13.split_k)
        c13 = replace(base13, fuse_gate_up=bool(v.get("fuse_gate_up")), split_k=split13,
                      dequant_chunk=v.get("dequant_chunk", 0), **kw13)
        c2 = replace(base2, **kw13)
        name = ("fused:" if v.get("fuse_gate_up") else "split:") + ",".join(
            f"{k.replace('block_', 'b').replace('num_', '')}={val}" for k, val in v.items() if k != "fuse_gate_up")
        out.append((name, c13, c2))
    return out


def profile_one(args) -> None:
    """One eager call per kernel of one case, for `ncu` (no graphs, no flush)."""
    dev = torch.device("cuda")
    model = MODELS[args.models.split(",")[0]]
    E, topk, H, I = model["E"], model["topk"], model["H"], model["I"]
    M = int(args.ms.split(",")[0])
    kind = args.kinds.split(",")[0]
    case = args.cases.split(",")[0]
    p13 = random_ap_projection(E, 2 * I, H, case_bits(case, E, "w13"), table_kind=kind, group_size=shard_group(H, I), bits_min=2, device=dev)
    p2 = random_ap_projection(E, H, I, case_bits(case, E, "w2"), table_kind=kind, group_size=shard_group(H, I), bits_min=2, device=dev)
    x = torch.randn((M, H), device=dev, dtype=torch.bfloat16)
    tw, ids = make_routing(M, E, topk, model["renormalize"], M, dev)
    for _ in range(3):
        ap_fused_moe(x, tw, ids, p13.weights, p2.weights)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/kernel.json")
    ap.add_argument("--md", default=None, help="markdown table path (default: --out with .md)")
    ap.add_argument("--baseline-json", default=None, help="JSON written by sglang_moe_baseline.py in the same run")
    ap.add_argument("--models", default="qwen15moe,mixtral")
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--cases", default="u3,u4,u6,u8,mix4")
    ap.add_argument("--kinds", default=f"{DEFAULT_TABLE_KIND},bcq,kmeans",
                    help=f"table kinds; the headline is the converter's default ({DEFAULT_TABLE_KIND})")
    ap.add_argument("--sweep", action="store_true", help="also time alternative launch configs (bcq, 4 bits)")
    ap.add_argument("--sweep-ms", default="1,16,256,2048", help="M values the sweep covers")
    ap.add_argument("--no-asm-case", action="store_true", help="also time the plain-Triton (no inline PTX) build at 4 bits")
    ap.add_argument("--check-m", type=int, default=16)
    ap.add_argument("--case-budget-s", type=float, default=0.25)
    ap.add_argument("--min-reps", type=int, default=30)
    ap.add_argument("--max-reps", type=int, default=200)
    ap.add_argument("--time-budget-s", type=float, default=420.0, help="stop starting new cases after this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-one", action="store_true", help="3 eager calls of the first model/M/kind/case (for ncu)")
    args = ap.parse_args()
    if args.profile_one:
        return profile_one(args)
    T0 = time.time()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dev = torch.device("cuda")
    import triton

    models = [m for m in args.models.split(",") if m]
    ms = [int(v) for v in args.ms.split(",") if v]
    cases = [c for c in args.cases.split(",") if c]
    kinds = [k for k in args.kinds.split(",") if k]
    sweep_ms = {int(v) for v in args.sweep_ms.split(",") if v}
    roof = measure_copy_tbps(dev)
    props = torch.cuda.get_device_properties(0)
    meta = dict(
        gpu=torch.cuda.get_device_name(0), sm_count=props.multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, python=platform.python_version(), measured_copy_TBps=round(roof, 3),
        command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        timing="whole ap_fused_moe call (align + w13 + w2 + cast) in one CUDA graph, L2 flushed per rep, median",
        bytes="planes + tables of the hit experts at their committed bitwidths (w13 and w2)",
        mix4=f"per-expert bitwidths cycling {MIX_PATTERN} (w2 shifted by 3), mean 4",
        headline_table_kind=DEFAULT_TABLE_KIND,
    )
    results, sweeps, checks = [], [], []

    def dump():
        meta["total_wall_s"] = round(time.time() - T0, 1)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        doc = dict(meta=meta, headline=headline(results, args.baseline_json), results=results, sweep=sweeps,
                   correctness=checks)
        if args.baseline_json:
            doc["sglang_baseline"] = load_baseline(args.baseline_json)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        write_md(doc, args.md or os.path.splitext(args.out)[0] + ".md")

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    print(f"# {meta['gpu']} copy {roof:.2f} TB/s | torch {torch.__version__} triton {triton.__version__}", flush=True)
    print(f"{'model':<10} {'kind':<7} {'case':<6} {'M':>5} {'hit':>4} {'us':>9} {'MB':>8} {'TB/s':>6} {'%roof':>6}  cfg", flush=True)
    for mk in models:
        model = MODELS[mk]
        E, topk, H, I = model["E"], model["topk"], model["H"], model["I"]
        # torch bf16 reference weights (cuBLAS)
        g = torch.Generator(device=dev).manual_seed(args.seed + 17)
        w13_bf = torch.randn((E, 2 * I, H), generator=g, device=dev, dtype=torch.bfloat16).mul_(H**-0.5)
        w2_bf = torch.randn((E, H, I), generator=g, device=dev, dtype=torch.bfloat16).mul_(I**-0.5)
        for M in ms:
            x = torch.randn((M, H), device=dev, dtype=torch.bfloat16, generator=torch.Generator(device=dev).manual_seed(args.seed + M))
            tw, ids = make_routing(M, E, topk, model["renormalize"], args.seed * 1000 + M, dev)
            hit = sorted(set(ids.flatten().tolist()))
            r = dict(model=mk, impl="torch_bf16_cublas", M=M, experts_hit=len(hit), weight_bytes=len(hit) * 3 * H * I * 2)
            try:
                ref = TorchBf16MoE(w13_bf, w2_bf, ids, tw)
                st = graph_time(lambda: ref(x), nreps(200 + M, args.case_budget_s, args.min_reps, args.max_reps), flush)
                r.update(us=st["median"], stats=st, status="ok")
                r["TBps"] = r["weight_bytes"] / (r["us"] * 1e-6) / 1e12
                r["roofline_frac"] = r["TBps"] / roof
            except Exception as e:
                r.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
            results.append(r)
            print(f"{mk:<10} {'bf16':<7} {'torch':<6} {M:>5} {len(hit):>4} {r.get('us', float('nan')):>9.1f} "
                  f"{r['weight_bytes'] / 1e6:>8.1f} {r.get('TBps', 0):>6.2f} {100 * r.get('roofline_frac', 0):>5.1f}%", flush=True)
        del w13_bf, w2_bf
        torch.cuda.empty_cache()

        for kind in kinds:
            p13 = random_ap_projection(E, 2 * I, H, [8] * E, table_kind=kind, group_size=shard_group(H, I), bits_min=2, seed=args.seed + 1, device=dev)
            p2 = random_ap_projection(E, H, I, [8] * E, table_kind=kind, group_size=shard_group(H, I), bits_min=2, seed=args.seed + 2, device=dev)
            torch.cuda.synchronize()
            for case in cases:
                b13, b2 = case_bits(case, E, "w13"), case_bits(case, E, "w2")
                w13, w2 = p13.recommit(b13), p2.recommit(b2)
                for M in ms:
                    if time.time() - T0 > args.time_budget_s:
                        break
                    x = torch.randn((M, H), device=dev, dtype=torch.bfloat16, generator=torch.Generator(device=dev).manual_seed(args.seed + M))
                    tw, ids = make_routing(M, E, topk, model["renormalize"], args.seed * 1000 + M, dev)
                    hit = sorted(set(ids.flatten().tolist()))
                    c13, c2 = default_moe_configs(M, topk, E, I, H, (H, w13.bcq_group), (I, w2.bcq_group), num_sms=props.multi_processor_count)
                    r = dict(model=mk, impl="ap", kind=kind, case=case, M=M, experts_hit=len(hit),
                             avg_bits_hit=sum(b13[e] + b2[e] for e in hit) / (2 * len(hit)),
                             weight_bytes=ap_bytes(b13, b2, hit, model, kind, shard_group(H, I)), cfg13=vars(c13), cfg2=vars(c2))
                    # "default" is what ap_fused_moe picks by itself (the headline); the others are the same
                    # call on the other kernels, same run
                    fold_ok = kind == "ubcq" and fold_moe_unsupported(w13, w2) is None
                    auto = auto_moe_kernel(M, topk, w13, w2)  # what ap_fused_moe itself runs
                    fold_default, mma_default, lut_default = auto == "fold", auto == "mma", auto == "lut"
                    r["default_kernel"] = auto or ("dequant" if c13.dequant_chunk else "tiles")
                    variants = [("default", dict(), c13, c2)]
                    if auto in ("fold", "mma", "lut"):
                        variants.append(("tiles", dict(configs=(c13, c2)), c13, c2))
                    if fold_ok and not fold_default and c13.dequant_chunk == 0:
                        variants.append(("fold", dict(kernel="fold"), c13, c2))
                    if kind != "kmeans" and c13.dequant_chunk == 0 and not lut_default:
                        variants.append(("lut", dict(kernel="lut"), c13, c2))
                    if kind == "ubcq" and not mma_default:
                        variants.append(("mma", dict(kernel="mma"), c13, c2))
                    if c13.dequant_chunk == 0 and M >= 64:
                        # below the prefill threshold, same run: the dequantize-then-GEMM path forced (where the
                        # crossover DEQUANT_MIN_PAIRS_PER_EXPERT is read from)
                        q13, q2 = default_moe_configs(M, topk, E, I, H, (H, w13.bcq_group), (I, w2.bcq_group),
                                                      num_sms=props.multi_processor_count,
                                                      dequant_min_pairs_per_expert=0)
                        variants.append(("dequant", dict(configs=(q13, q2)), q13, q2))
                    if args.no_asm_case and case == "u4" and kind == "bcq":
                        variants.append(("noasm", dict(configs=(c13, c2), use_asm=False), c13, c2))
                    if c13.dequant_chunk > 0:
                        # prefill, same run: the dense GEMMs on the other kernel (ours / SGLang's), and the tile
                        # kernels (no dequantization) that smaller M uses
                        other = "sglang" if c13.dense_gemm == "triton" else "triton"
                        o13 = replace(c13, dense_gemm=other)
                        variants.append((f"dense_{other}", dict(configs=(o13, c2)), o13, c2))
                        t13, t2 = default_moe_configs(M, topk, E, I, H, (H, w13.bcq_group), (I, w2.bcq_group),
                                                      num_sms=props.multi_processor_count,
                                                      dequant_min_pairs_per_expert=float("inf"))
                        variants.append(("tiles", dict(configs=(t13, t2)), t13, t2))
                        # the scratch rebuilt by the Triton dequantization instead of the CUDA one; and the
                        # rebuild of chunk c + 1 overlapped with chunk c's GEMMs, at the same scratch bytes
                        # (two buffers of half the chunk) and at twice them
                        d13 = replace(c13, dequant_kernel="triton")
                        variants.append(("dequant_triton", dict(configs=(d13, c2)), d13, c2))
                        for name, ch in (("overlap", max(1, c13.dequant_chunk // 2)), ("overlap_2x", c13.dequant_chunk)):
                            v13 = replace(c13, dequant_overlap=True, dequant_chunk=ch)
                            variants.append((name, dict(configs=(v13, c2)), v13, c2))
                    for vname, kw, v13, v2 in variants:
                        rv = dict(r, variant=vname, cfg13=vars(v13), cfg2=vars(v2))
                        if vname in ("lut", "mma", "fold") or (vname == "default" and r["default_kernel"] in ("lut", "mma", "fold")):
                            del rv["cfg13"], rv["cfg2"]  # the tile configs do not apply to the LUT kernel
                        try:
                            if v13.dequant_chunk > 0 and v13.dense_gemm == "sglang":
                                # only this variant needs sglang: its execution context (default ServerArgs), as
                                # in a server, so SGLang picks its own config (tuned JSON for this GPU, if shipped)
                                from sglang_moe_baseline import setup_sglang

                                setup_sglang()
                                rv["sglang_gemm"] = vars(sglang_moe_configs(M, E, I, H, topk, torch.bfloat16))
                            t = time.time()
                            ap_fused_moe(x, tw, ids, w13, w2, **kw)
                            torch.cuda.synchronize()
                            rv["first_call_s"] = round(time.time() - t, 2)
                            st = graph_time(lambda: ap_fused_moe(x, tw, ids, w13, w2, **kw),
                                            nreps(100 + M, args.case_budget_s, args.min_reps, args.max_reps), flush)
                            rv.update(us=st["median"], stats=st, status="ok")
                            rv["TBps"] = rv["weight_bytes"] / (rv["us"] * 1e-6) / 1e12
                            rv["roofline_frac"] = rv["TBps"] / roof
                        except Exception as e:
                            rv.update(status="error", error=f"{type(e).__name__}: {e}"[:300], tb=traceback.format_exc()[-1500:])
                            torch.cuda.synchronize()
                        results.append(rv)
                        cfgs = f"{c13.block_m}x{c13.block_n}x{c13.block_k}/{c2.block_n}k{c2.split_k}"
                        print(f"{mk:<10} {kind:<7} {case:<6} {M:>5} {len(hit):>4} {rv.get('us', float('nan')):>9.1f} "
                              f"{rv['weight_bytes'] / 1e6:>8.1f} {rv.get('TBps', 0):>6.2f} {100 * rv.get('roofline_frac', 0):>5.1f}%  "
                              f"{cfgs} {vname} {rv.get('error', '')}", flush=True)
                    if (args.sweep and kind == "bcq" and case == "u4" and M in sweep_ms
                            and time.time() - T0 < args.time_budget_s):
                        for name, s13, s2 in sweep_candidates(c13, c2):
                            if s13.block_m * 2 > max(16, M * topk) * 2 and s13.block_m > c13.block_m:
                                continue  # wider blocks than the tokens per expert: pointless
                            sr = dict(model=mk, M=M, cand=name, cfg13=vars(s13), cfg2=vars(s2))
                            try:
                                ap_fused_moe(x, tw, ids, w13, w2, configs=(s13, s2))
                                st = graph_time(lambda: ap_fused_moe(x, tw, ids, w13, w2, configs=(s13, s2)),
                                                nreps(100 + M, 0.1, 20, 100), flush)
                                sr.update(us=st["median"], status="ok")
                            except Exception as e:
                                sr.update(status="error", error=f"{type(e).__name__}: {e}"[:200])
                                torch.cuda.synchronize()
                            sweeps.append(sr)
                            print(f"   sweep {mk} M={M} {name:<60} {sr.get('us', float('nan')):9.1f} us {sr.get('error', '')}", flush=True)
                    dump()
            # correctness at check_m, mixed bits, against the fp32 torch reference (dequantized experts)
            if args.check_m > 0:
                M = args.check_m
                c = dict(model=mk, kind=kind, M=M, case="mix4")
                try:
                    w13, w2 = p13.recommit(case_bits("mix4", E, "w13")), p2.recommit(case_bits("mix4", E, "w2"))
                    x = torch.randn((M, H), device=dev, dtype=torch.bfloat16, generator=torch.Generator(device=dev).manual_seed(999))
                    tw, ids = make_routing(M, E, topk, model["renormalize"], 999, dev)
                    out = ap_fused_moe(x, tw, ids, w13, w2).float()
                    ref = ap_fused_moe_reference(x.float(), tw, ids, w13, w2).float()
                    c.update(rel_err=float((out - ref).norm() / ref.norm()), max_abs_err=float((out - ref).abs().max()),
                             max_abs_ref=float(ref.abs().max()), finite=bool(torch.isfinite(out).all()))
                    c["pass"] = c["finite"] and c["rel_err"] < 2e-2
                except Exception as e:
                    c.update(error=f"{type(e).__name__}: {e}"[:300], tb=traceback.format_exc()[-1500:], **{"pass": False})
                checks.append(c)
                print(f"# check {mk} {kind} M={M} mix4: {c}", flush=True)
            del p13, p2
            torch.cuda.empty_cache()
            dump()
    dump()
    print(f"# done in {time.time() - T0:.0f}s -> {args.out}", flush=True)


def load_baseline(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    rows = {}
    for r in doc.get("results", []):
        if r.get("status") == "ok":
            rows.setdefault(r["model"], {}).setdefault(r["fmt"], {})[str(r["M"])] = r["graph_us"]
    return dict(meta={k: doc.get("meta", {}).get(k) for k in ("gpu", "sglang", "triton", "torch")}, graph_us=rows)


def _ap_us(results, model, M, kind=None, case="u4"):
    kind = kind or DEFAULT_TABLE_KIND
    for r in results:
        if (r.get("impl") == "ap" and r["model"] == model and r["M"] == M and r["kind"] == kind and r["case"] == case
                and r.get("variant") == "default" and r.get("status") == "ok"):
            return r["us"]
    return None


def headline(results, baseline_json) -> dict:
    h = {}
    torch_ref = {}
    for r in results:
        if r.get("impl") == "torch_bf16_cublas" and r.get("status") == "ok":
            torch_ref.setdefault(r["model"], {})[r["M"]] = r["us"]
    sp = {}
    for mk, d in torch_ref.items():
        for M, us in d.items():
            a = _ap_us(results, mk, M)
            if a:
                sp.setdefault(mk, {})[str(M)] = round(us / a, 3)
    h["speedup_vs_torch_bf16_4bit"] = sp
    if baseline_json:
        base = load_baseline(baseline_json)["graph_us"]
        for fmt, key in (("bf16", "speedup_vs_sglang_bf16_4bit"), ("int4_g128", "speedup_vs_sglang_int4_4bit"),
                         ("int8_g128", "speedup_vs_sglang_int8_4bit")):
            sp = {}
            for mk, fmts in base.items():
                for M, us in fmts.get(fmt, {}).items():
                    a = _ap_us(results, mk, int(M))
                    if a:
                        sp.setdefault(mk, {})[M] = round(us / a, 3)
            h[key] = sp
    return h


def _variant_label(r: dict) -> str:
    """'default (lut)' for what ap_fused_moe picks by itself, else the forced kernel."""
    v = r.get("variant", "")
    return f"default ({r['default_kernel']})" if v == "default" and "default_kernel" in r else v


def write_md(doc: dict, path: str) -> None:
    meta = doc["meta"]
    lines = [
        "# AP fused MoE kernel: H200 results",
        "",
        f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, measured copy rate "
        f"{meta['measured_copy_TBps']} TB/s (the roofline). Command: `{meta['command']}`.",
        f"Timing: {meta['timing']}. Bytes: {meta['bytes']}. mix4: {meta['mix4']}.",
        "",
    ]
    base = doc.get("sglang_baseline", {}).get("graph_us", {})
    for key, val in doc["headline"].items():
        lines.append(f"- **{key}**: " + "; ".join(f"{m}: " + ", ".join(f"M={k} {v}x" for k, v in d.items()) for m, d in val.items()))
    lines += ["", "| model | kind | bits | M | hit | us | MB read | TB/s | % roof | torch bf16 us | SGLang bf16 / int4 / int8 us |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    tref = {(r["model"], r["M"]): r.get("us") for r in doc["results"] if r.get("impl") == "torch_bf16_cublas"}
    for r in doc["results"]:
        if r.get("impl") != "ap":
            continue
        b = base.get(r["model"], {})
        sg = " / ".join(f"{b.get(f, {}).get(str(r['M'])):.0f}" if b.get(f, {}).get(str(r["M"])) else "-"
                        for f in ("bf16", "int4_g128", "int8_g128"))
        us = f"{r['us']:.1f}" if r.get("status") == "ok" else r.get("error", "error")[:40]
        tr = tref.get((r["model"], r["M"]))
        lines.append(
            f"| {r['model']} | {r['kind']} {_variant_label(r)} | {r['case']} | {r['M']} | "
            f"{r['experts_hit']} | {us} | {r['weight_bytes'] / 1e6:.1f} | {r.get('TBps', 0):.2f} | "
            f"{100 * r.get('roofline_frac', 0):.0f}% | {tr:.1f} | {sg} |" if tr else
            f"| {r['model']} | {r['kind']} {_variant_label(r)} | {r['case']} | {r['M']} | {r['experts_hit']} | {us} | "
            f"{r['weight_bytes'] / 1e6:.1f} | {r.get('TBps', 0):.2f} | {100 * r.get('roofline_frac', 0):.0f}% | - | {sg} |"
        )
    if doc.get("correctness"):
        lines += ["", "Correctness (GPU, mix4, vs fp32 torch reference): " + "; ".join(
            f"{c['model']}/{c['kind']} M={c['M']} rel {c.get('rel_err', float('nan')):.2e} {'PASS' if c.get('pass') else 'FAIL'}"
            for c in doc["correctness"])]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
