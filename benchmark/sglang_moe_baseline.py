#!/usr/bin/env python3
# Copied unchanged (apart from these two comment lines) from /work/shared/bench/sglang_moe_baseline.py, the
# project-provided baseline script; kept here so benchmark results name the exact script that produced them.
"""Standalone microbenchmark of SGLang 0.5.17's own Triton fused-MoE path.

What is timed: one call of
    sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe.fused_experts(
        hidden_states, w1(=w13), w2, StandardTopKOutput, MoeRunnerConfig, **quant_kwargs)
i.e. exactly what the "none -> triton" MoE runner (moe_runner/triton.py:
fused_experts_none_to_triton) calls in production: moe_align_block_size (sgl_kernel)
-> gate/up GEMM (Triton) -> silu_and_mul -> down GEMM (Triton) -> top-k combine.
Routing/top-k selection itself is NOT timed (random routing is precomputed).

Weight formats (shapes follow SGLang's own weight-creation code):
  bf16       w13 [E,2I,H] bf16, w2 [E,H,I] bf16                 -> fused_moe_kernel
  int4_g128  moe_wna16 4-bit layout (quantization/moe_wna16.py):
             w13 [E,2I,H/2] uint8, w2 [E,H,I/2] uint8, two nibbles packed along K
             (the input dim): byte k//2, low nibble = even k, high nibble = odd k;
             symmetric, stored +8 (no zero-point tensor, kernel subtracts 8);
             scales bf16 w13_scale [E,2I,H/128], w2_scale [E,H,I/128];
             use_int4_w4a16=True, block_shape=[0,128]  -> fused_moe_kernel_gptq_awq
  int8_g128  moe_wna16 8-bit layout: w13 [E,2I,H] uint8, w2 [E,H,I] uint8, stored +128
             (kernel subtracts 128), scales as int4_g128;
             use_int8_w8a16=True, block_shape=[0,128]  -> fused_moe_kernel_gptq_awq
  int8_pc    int8 weight-only, per-output-channel fp32 scale: w13 [E,2I,H] int8,
             w2 [E,H,I] int8, w13_scale [E,2I] fp32, w2_scale [E,H] fp32;
             use_int8_w8a16=True, block_shape=None     -> fused_moe_kernel (w8a16 branch)
             (supported by the same entry point, but no SGLang 0.5.17 quant method
             produces it; moe_wna16 8-bit uses int8_g128.)

Timing: CUDA events around each call, L2 flushed (256 MB memset) before every rep
(outside the timed region), median of >= 50 reps after warm-up. Two numbers:
  graph_us : the call captured once in a CUDA graph and replayed (pure GPU time; this is
             how SGLang runs decode) -- used for TB/s, %roofline, TFLOP/s.
  eager_us : plain Python call (includes any CPU launch overhead that the GPU exposes).

Correctness (per model x format, M=--check-m): output vs (a) SGLang's own bf16 fused MoE run
on the dequantized weights (same routing/inputs) and (b) an fp32 torch reference.

Start-up: the JIT silu_and_mul kernel and the torch.compile'd top-k combine are built once in
this process, then (unless --prewarm-procs 0) one spawned process per (model, format) makes a
first call for every M so Triton's on-disk cache is filled in parallel; the timed loop then
only hits the cache. Compile/first-call times are recorded in the JSON.

Usage (GPU box):
  PYTHONPATH=/tmp/site python3 devrun/moe_kernel_bench.py --out $OUT/moe_kernel_bench.json
Options: --models qwen15moe,mixtral --formats bf16,int4_g128,int8_g128,int8_pc
         --ms 1,4,16,64,256,2048 --reps 200 --check-m 16 --prewarm-procs -1 (auto) ...
Needs no model files and no network.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings

import torch

# --------------------------------------------------------------------------------------
# Problem definitions
# --------------------------------------------------------------------------------------
MODELS = {
    # Qwen1.5-MoE-A2.7B: 60 routed experts, top-4, norm_topk_prob=False (no renormalize).
    "qwen15moe": dict(name="Qwen1.5-MoE-A2.7B", E=60, topk=4, H=2048, I=1408, renormalize=False),
    # Mixtral-8x7B: 8 experts, top-2, renormalize=True.
    "mixtral": dict(name="Mixtral-8x7B", E=8, topk=2, H=4096, I=14336, renormalize=True),
}
GROUP = 128
FORMATS = {
    "bf16": dict(quant=None, block_shape=None, kernel="fused_moe_kernel",
                 desc="bf16 weights (unquantized Triton fused MoE)"),
    "int4_g128": dict(quant="int4", block_shape=[0, GROUP], kernel="fused_moe_kernel_gptq_awq",
                      desc="int4 weight-only, group 128, symmetric (+8), moe_wna16 layout"),
    "int8_g128": dict(quant="int8", block_shape=[0, GROUP], kernel="fused_moe_kernel_gptq_awq",
                      desc="int8 weight-only, group 128, symmetric (+128 uint8), moe_wna16 8-bit layout"),
    "int8_pc": dict(quant="int8", block_shape=None, kernel="fused_moe_kernel",
                    desc="int8 weight-only, per-output-channel fp32 scale (use_int8_w8a16, no block_shape)"),
}
DEFAULT_MS = [1, 4, 16, 64, 256, 2048]
DEVICE = "cuda"  # (overridable only by the CPU dry-run test harness)
# std of the centred integer code, used to pick scales so that weights ~ N(0, 1/K)-ish
_QSTD = {"int4": math.sqrt((16 ** 2 - 1) / 12.0), "int8": math.sqrt((256 ** 2 - 1) / 12.0)}


def per_expert_bytes(fmt: str, H: int, I: int) -> dict:
    """Bytes of one expert's w13 + w2 (and their scales) in the given format."""
    n = 3 * I * H  # w13: 2I x H, w2: H x I
    grp_scales = 2 * I * (H // GROUP) + H * (I // GROUP)
    if fmt == "bf16":
        return dict(weight=2 * n, scale=0)
    if fmt == "int4_g128":
        return dict(weight=n // 2, scale=2 * grp_scales)  # bf16 scales
    if fmt == "int8_g128":
        return dict(weight=n, scale=2 * grp_scales)  # bf16 scales
    if fmt == "int8_pc":
        return dict(weight=n, scale=4 * (2 * I + H))  # fp32 per-channel scales
    raise ValueError(fmt)


def moe_flops(M: int, topk: int, H: int, I: int) -> int:
    return 2 * M * topk * 3 * I * H


# --------------------------------------------------------------------------------------
# Weights / routing / reference (device-agnostic; unit-testable on CPU)
# --------------------------------------------------------------------------------------
def build_weights(fmt: str, E: int, H: int, I: int, device, seed: int = 0, empty: bool = False) -> dict:
    """Returns dict(w1, w2, s1, s2, kw) where kw are the fused_experts quant kwargs."""
    spec = FORMATS[fmt]
    g = torch.Generator(device=device)
    g.manual_seed(seed)

    if fmt == "bf16":
        if empty:
            w1 = torch.empty((E, 2 * I, H), device=device, dtype=torch.bfloat16)
            w2 = torch.empty((E, H, I), device=device, dtype=torch.bfloat16)
        else:
            w1 = torch.randn((E, 2 * I, H), generator=g, device=device, dtype=torch.bfloat16).mul_(H ** -0.5)
            w2 = torch.randn((E, H, I), generator=g, device=device, dtype=torch.bfloat16).mul_(I ** -0.5)
        return dict(w1=w1, w2=w2, s1=None, s2=None, kw={})

    qstd = _QSTD[spec["quant"]]
    if fmt in ("int4_g128", "int8_g128"):
        pack = 2 if fmt == "int4_g128" else 1
        shp1, shp2 = (E, 2 * I, H // pack), (E, H, I // pack)
        if empty:
            w1 = torch.empty(shp1, device=device, dtype=torch.uint8)
            w2 = torch.empty(shp2, device=device, dtype=torch.uint8)
        else:
            # random bytes: for int4 each byte holds two independent uniform nibbles (k even
            # in the low nibble, k odd in the high nibble); for int8 uniform uint8 (= q+128)
            w1 = torch.randint(0, 256, shp1, generator=g, device=device, dtype=torch.uint8)
            w2 = torch.randint(0, 256, shp2, generator=g, device=device, dtype=torch.uint8)
        s1 = ((0.5 + torch.rand((E, 2 * I, H // GROUP), generator=g, device=device)) / (qstd * math.sqrt(H))).to(torch.bfloat16)
        s2 = ((0.5 + torch.rand((E, H, I // GROUP), generator=g, device=device)) / (qstd * math.sqrt(I))).to(torch.bfloat16)
        kw = dict(
            use_int4_w4a16=(fmt == "int4_g128"),
            use_int8_w8a16=(fmt == "int8_g128"),
            w1_scale=s1,
            w2_scale=s2,
            block_shape=[0, GROUP],
        )
        return dict(w1=w1, w2=w2, s1=s1, s2=s2, kw=kw)

    if fmt == "int8_pc":
        if empty:
            w1 = torch.empty((E, 2 * I, H), device=device, dtype=torch.int8)
            w2 = torch.empty((E, H, I), device=device, dtype=torch.int8)
        else:
            w1 = torch.randint(-128, 128, (E, 2 * I, H), generator=g, device=device, dtype=torch.int8)
            w2 = torch.randint(-128, 128, (E, H, I), generator=g, device=device, dtype=torch.int8)
        s1 = ((0.5 + torch.rand((E, 2 * I), generator=g, device=device)) / (qstd * math.sqrt(H))).float()
        s2 = ((0.5 + torch.rand((E, H), generator=g, device=device)) / (qstd * math.sqrt(I))).float()
        kw = dict(use_int8_w8a16=True, w1_scale=s1, w2_scale=s2, block_shape=None)
        return dict(w1=w1, w2=w2, s1=s1, s2=s2, kw=kw)
    raise ValueError(fmt)


def dequantize(fmt: str, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Dequantize one stacked weight [E, N, K(packed)] to bf16 [E, N, K], mirroring the
    kernels' arithmetic: gptq_awq computes ((code - zp) * scale_fp32).to(bf16)."""
    if fmt == "bf16":
        return q
    E, N = q.shape[0], q.shape[1]
    K = q.shape[2] * (2 if fmt == "int4_g128" else 1)
    out = torch.empty((E, N, K), dtype=torch.bfloat16, device=q.device)
    for e in range(E):
        qe = q[e]
        if fmt == "int4_g128":
            v = torch.stack((qe & 0xF, qe >> 4), dim=-1).reshape(N, K).float() - 8.0
        elif fmt == "int8_g128":
            v = qe.float() - 128.0
        else:  # int8_pc
            v = qe.float()
        if fmt == "int8_pc":
            out[e] = (v * s[e].float()[:, None]).to(torch.bfloat16)
        else:
            out[e] = (v * s[e].float().repeat_interleave(GROUP, dim=-1)).to(torch.bfloat16)
    return out


def make_routing(M: int, E: int, topk: int, renormalize: bool, seed: int, device):
    """Uniform random routing: iid N(0,1) router logits -> softmax -> top-k
    (every top-k expert set is equally likely); weights optionally renormalized."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    logits = torch.randn((M, E), generator=g, dtype=torch.float32)
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return (
        w.to(torch.float32).contiguous().to(device),
        ids.to(torch.int32).contiguous().to(device),
        logits.to(device),
    )


def torch_moe_reference(x, w1, w2, topk_w, topk_ids):
    """fp32 reference: out[t] = sum_j w[t,j] * W2[e] @ (silu(W1[e,:I] x) * (W1[e,I:] x))."""
    M, H = x.shape
    I = w2.shape[2]
    xf = x.float()
    out = torch.zeros((M, H), dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = xf[tok] @ w1[e].float().t()
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        y = a @ w2[e].float().t()
        out.index_add_(0, tok, y * topk_w[tok, slot].float()[:, None])
    return out


def err_stats(out, ref):
    o, r = out.float(), ref.float()
    d = (o - r).abs()
    return dict(
        max_abs_err=float(d.max()),
        rel_err=float((o - r).norm() / r.norm().clamp_min(1e-30)),
        max_abs_ref=float(r.abs().max()),
        finite=bool(torch.isfinite(o).all()),
    )


# --------------------------------------------------------------------------------------
# SGLang runtime glue
# --------------------------------------------------------------------------------------
_SGL = {}


def _quiet():
    warnings.filterwarnings("ignore")
    for name in ("sglang", "sgl_kernel", "torch._inductor", "torch._dynamo"):
        logging.getLogger(name).setLevel(logging.ERROR)


def setup_sglang(verbose: bool = False) -> dict:
    """Import SGLang's fused-MoE entry point and make it callable outside a server:
    - publish a default ServerArgs (model_path='dummy' boundary, as SGLang's own
      override_server_args() test hook does) so get_exec().moe/.deterministic/.comm resolve;
    - if no TP group exists, give fused_moe a world_size=1 stub for get_tp_group() (only used
      by use_symmetric_memory(), which is a nullcontext at TP=1 / symm-mem disabled)."""
    if _SGL:
        return _SGL
    if not verbose:
        _quiet()
    notes = []
    from sglang.srt.runtime_context import get_context, get_exec

    try:
        get_exec()
    except ValueError:
        _SGL["_override"] = get_context().override_server_args()
        _SGL["_override"].install()
        notes.append("published default ServerArgs(model_path='dummy') via get_context().override_server_args().install()")
    if not verbose:
        _quiet()  # sglang import may have reset levels

    from sglang.srt.layers.moe import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe as fm
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import (
        get_config_dtype_str,
        get_moe_configs,
        try_get_optimal_moe_config,
    )
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    try:
        fm.get_tp_group()
    except Exception:
        class _TP1Stub:
            world_size = 1
            rank_in_group = 0

        fm.get_tp_group = lambda: _TP1Stub()
        notes.append("fused_moe.get_tp_group patched to a world_size=1 stub (no TP group initialised)")

    ex = get_exec()
    _SGL.update(
        fm=fm,
        fused_experts=fm.fused_experts,
        MoeRunnerConfig=MoeRunnerConfig,
        StandardTopKOutput=StandardTopKOutput,
        try_get_optimal_moe_config=try_get_optimal_moe_config,
        get_config_dtype_str=get_config_dtype_str,
        get_moe_configs=get_moe_configs,
        notes=notes,
        exec_flags=dict(
            enable_fused_moe_sum_all_reduce=bool(ex.moe.enable_fused_moe_sum_all_reduce),
            enable_deterministic_inference=bool(ex.deterministic.enable_deterministic_inference),
            enable_symm_mem=bool(ex.comm.enable_symm_mem),
        ),
    )
    return _SGL


def runner_config(model: dict):
    sgl = setup_sglang()
    return sgl["MoeRunnerConfig"](
        num_experts=model["E"],
        num_local_experts=model["E"],  # == num_experts -> filter_expert=False (no EP), as in TP=1 serving
        hidden_size=model["H"],
        intermediate_size_per_partition=model["I"],
        layer_id=0,
        top_k=model["topk"],
        params_dtype=torch.bfloat16,
        activation="silu",
        is_gated=True,
        inplace=False,  # out-of-place so repeated calls see identical inputs
        no_combine=False,
        routed_scaling_factor=None,
    )


def describe_config(w, model: dict, fmt: str, M: int) -> dict:
    """The Triton config SGLang will pick (same call as _prepare_fused_moe_run)."""
    sgl = setup_sglang()
    spec = FORMATS[fmt]
    dtype_str = sgl["get_config_dtype_str"](
        dtype=torch.bfloat16,
        use_int8_w8a16=spec["quant"] == "int8",
        use_int4_w4a16=spec["quant"] == "int4",
    )
    bs = spec["block_shape"]
    cfg, (down_cfg, _) = sgl["try_get_optimal_moe_config"](
        tuple(w["w1"].shape), tuple(w["w2"].shape), model["topk"], dtype_str, M,
        block_shape=bs, per_channel_quant=False, return_down_config=True,
    )
    E, _, N = w["w2"].shape
    tuned = sgl["get_moe_configs"](E, N, dtype_str, bs[0] if bs else 0, bs[1] if bs else 0,
                                   per_channel_quant=False, down_moe=False) is not None
    return dict(config=dict(cfg), down_config=dict(down_cfg) if down_cfg else None,
                config_source="tuned-json" if tuned else "default-heuristic",
                config_dtype=dtype_str, kernel=spec["kernel"])


def make_call(w, x, topk_out, rc):
    fe = setup_sglang()["fused_experts"]
    w1, w2, kw = w["w1"], w["w2"], w["kw"]

    def call():
        return fe(x, w1, w2, topk_out, moe_runner_config=rc, **kw)

    return call


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------
def time_cuda(run, reps: int, flush: torch.Tensor) -> dict:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()  # evict L2 (50 MB on H200) so weights come from HBM, like layer-by-layer serving
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))  # microseconds
    n = len(ts)
    return dict(median=statistics.median(ts), min=ts[0], p10=ts[int(0.1 * (n - 1))],
                p90=ts[int(0.9 * (n - 1))], reps=n)


def capture_graph(call):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    torch.cuda.synchronize()
    return g, out


# --------------------------------------------------------------------------------------
# Parallel pre-warm (fills Triton's on-disk kernel cache using several processes)
# --------------------------------------------------------------------------------------
def _use_aot_silu(fm):
    import sgl_kernel

    def _aot_silu(inp, out=None, expert_ids=None, expert_step=1):
        assert expert_ids is None  # filter_expert=False path only
        return sgl_kernel.silu_and_mul(inp, out)

    fm.silu_and_mul = _aot_silu


def _prewarm_worker(model_key: str, fmt: str, ms: list, seed: int, verbose: bool, aot_silu: bool):
    try:
        _quiet() if not verbose else None
        torch.cuda.set_device(0)
        setup_sglang(verbose)
        if aot_silu:
            _use_aot_silu(setup_sglang()["fm"])
        model = MODELS[model_key]
        E, topk, H, I = model["E"], model["topk"], model["H"], model["I"]
        w = build_weights(fmt, E, H, I, DEVICE, seed, empty=True)
        rc = runner_config(model)
        StandardTopKOutput = setup_sglang()["StandardTopKOutput"]
        for M in ms:
            x = torch.randn((M, H), device=DEVICE, dtype=torch.bfloat16)
            tw, ti, lg = make_routing(M, E, topk, model["renormalize"], seed + M, DEVICE)
            make_call(w, x, StandardTopKOutput(tw, ti, lg), rc)()
        torch.cuda.synchronize()
    except Exception:  # main process will simply compile what is missing
        sys.stderr.write(f"[prewarm {model_key}/{fmt}] failed (non-fatal):\n{traceback.format_exc()}\n")
        sys.exit(3)


def prewarm(groups, ms, nprocs, seed, verbose, timeout_s, aot_silu=False):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    pending = list(groups)
    running = []
    t0 = time.time()
    codes = {}
    while pending or running:
        while pending and len(running) < nprocs:
            mk, fmt = pending.pop(0)
            p = ctx.Process(target=_prewarm_worker, args=(mk, fmt, ms, seed, verbose, aot_silu), daemon=True)
            p.start()
            running.append(((mk, fmt), p))
        time.sleep(0.2)
        for item in list(running):
            (key, p) = item
            if not p.is_alive():
                p.join()
                codes[f"{key[0]}/{key[1]}"] = p.exitcode
                running.remove(item)
        if time.time() - t0 > timeout_s:
            for key, p in running:
                p.terminate()
                p.join(5)
                codes[f"{key[0]}/{key[1]}"] = "terminated(timeout)"
            for key in pending:
                codes[f"{key[0]}/{key[1]}"] = "not-started(timeout)"
            break
    return time.time() - t0, codes


# --------------------------------------------------------------------------------------
# Main benchmark
# --------------------------------------------------------------------------------------
HDR = (f"{'model':<10} {'fmt':<10} {'M':>5} {'hit':>4} {'graph_us':>9} {'eager_us':>9} "
       f"{'wt_MB':>8} {'TB/s':>6} {'%roof':>6} {'TFLOP/s':>8}  {'cfg(BMxBNxBK,src)':<22} note")


def fmt_row(r):
    if r.get("status") != "ok":
        return (f"{r['model']:<10} {r['fmt']:<10} {r['M']:>5} {r.get('experts_hit', 0):>4} "
                f"{'-':>9} {'-':>9} {r.get('weight_bytes', 0) / 1e6:>8.1f} {'-':>6} {'-':>6} {'-':>8}  "
                f"{'-':<22} SKIPPED: {r.get('reason', '')}")
    c = r["config"]
    cfg = f"{c['BLOCK_SIZE_M']}x{c['BLOCK_SIZE_N']}x{c['BLOCK_SIZE_K']},{'T' if r['config_source'] == 'tuned-json' else 'D'}"
    g = r["graph_us"] if r["graph_us"] is not None else float("nan")
    return (f"{r['model']:<10} {r['fmt']:<10} {r['M']:>5} {r['experts_hit']:>4} {g:>9.1f} "
            f"{r['eager_us']:>9.1f} {r['weight_bytes'] / 1e6:>8.1f} {r['achieved_TBps']:>6.2f} "
            f"{100 * r['roofline_frac']:>5.1f}% {r['tflops']:>8.1f}  {cfg:<22} {r.get('note', '')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="./moe_kernel_bench.json")
    ap.add_argument("--models", default="qwen15moe,mixtral")
    ap.add_argument("--formats", default="bf16,int4_g128,int8_g128,int8_pc")
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--reps", type=int, default=200, help="max timed reps per mode (min 50 unless --min-reps)")
    ap.add_argument("--min-reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--case-budget-s", type=float, default=0.4, help="target GPU time per mode per case")
    ap.add_argument("--check-m", type=int, default=16, help="M for the correctness check (0 = skip)")
    ap.add_argument("--no-graph", action="store_true", help="skip CUDA-graph timing")
    ap.add_argument("--roofline-tbps", type=float, default=4.3)
    ap.add_argument("--max-case-s", type=float, default=10.0, help="skip a case whose single call exceeds this")
    ap.add_argument("--time-budget-s", type=float, default=270.0,
                    help="stop starting new cases after this much total wall time")
    ap.add_argument("--prewarm-procs", type=int, default=-1,
                    help="processes compiling Triton kernels in parallel first (-1 = auto, 0 = off)")
    ap.add_argument("--prewarm-timeout-s", type=float, default=150.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="keep SGLang/torch warnings and logs")
    args = ap.parse_args()

    T0 = time.time()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    fmts = [f.strip() for f in args.formats.split(",") if f.strip()]
    ms = [int(v) for v in args.ms.split(",") if v.strip()]
    for m in models:
        assert m in MODELS, f"unknown model {m}; choose from {list(MODELS)}"
    for f in fmts:
        assert f in FORMATS, f"unknown format {f}; choose from {list(FORMATS)}"
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.cuda.set_device(0)
    dev = torch.device(DEVICE)
    torch.manual_seed(args.seed)

    t = time.time()
    sgl = setup_sglang(args.verbose)
    fm = sgl["fm"]
    import_s = time.time() - t

    import triton

    try:
        import sglang

        sgl_ver = getattr(sglang, "__version__", "?")
    except Exception:
        sgl_ver = "?"
    try:
        import sgl_kernel

        sglk_ver = getattr(sgl_kernel, "__version__", "?")
    except Exception:
        sglk_ver = "?"
    props = torch.cuda.get_device_properties(0)
    meta = dict(
        gpu=torch.cuda.get_device_name(0), sm_count=props.multi_processor_count,
        gpu_mem_GiB=round(props.total_memory / 2 ** 30, 1),
        torch=torch.__version__, triton=triton.__version__, sglang=sgl_ver, sgl_kernel=sglk_ver,
        python=platform.python_version(), cuda=torch.version.cuda,
        entry_point="sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe.fused_experts "
                    "(StandardTopKOutput, MoeRunnerConfig(inplace=False, num_experts==num_local_experts))",
        roofline_TBps=args.roofline_tbps, group_size=GROUP,
        timing="CUDA events per call, L2 flushed (256MB memset) before each rep outside the timed region; "
               "median over reps; graph_us = single-call CUDA graph replay, eager_us = direct Python call",
        columns=dict(
            experts_hit="distinct experts selected by the random routing (= experts whose weights are read)",
            graph_us="median us per fused_experts call, CUDA-graph replay (GPU time only)",
            eager_us="median us per fused_experts call, eager (includes exposed CPU launch overhead)",
            weight_bytes="experts_hit * per-expert bytes (w13+w2 in the format) + their scales",
            achieved_TBps="weight_bytes / graph_us (eager_us if graph disabled/failed)",
            roofline_frac="achieved_TBps / roofline_TBps",
            tflops="2*M*topk*3*I*H / time",
        ),
        sglang_exec_flags=sgl["exec_flags"], sglang_setup_notes=list(sgl["notes"]),
        args=vars(args), models={k: MODELS[k] for k in models}, formats={k: FORMATS[k] for k in fmts},
    )
    results, checks = [], []

    def dump():
        meta["total_wall_s"] = round(time.time() - T0, 1)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results, correctness=checks), f, indent=1)

    # ---- one-time JIT warm-ups in this process (before any parallel workers) ----------
    t = time.time()
    aot_silu = False
    try:
        from sglang.kernels.ops.activation.activation import silu_and_mul as _jit_silu

        a = torch.randn((4, 256), device=dev, dtype=torch.bfloat16)
        o = torch.empty((4, 128), device=dev, dtype=torch.bfloat16)
        _jit_silu(a, o)
        torch.cuda.synchronize()
        ref = torch.nn.functional.silu(a[:, :128].float()) * a[:, 128:].float()
        assert (o.float() - ref).abs().max() < 5e-2
        meta["silu_and_mul"] = "sglang JIT (tvm-ffi) kernel, as in production"
    except Exception as e:
        try:
            _use_aot_silu(fm)
            aot_silu = True
            meta["silu_and_mul"] = f"FALLBACK to sgl_kernel.silu_and_mul (AOT) because the JIT kernel failed: {e!r}"[:400]
        except Exception as e2:
            meta["silu_and_mul"] = f"JIT silu_and_mul failed ({e!r}) and sgl_kernel fallback failed ({e2!r})"[:600]
        print(f"WARNING: {meta['silu_and_mul']}", file=sys.stderr, flush=True)
    meta["jit_activation_warm_s"] = round(time.time() - t, 1)

    t = time.time()
    try:  # torch.compile'd combine used for topk>2 and M<=32 (Qwen decode) -- compile once here
        for mk in models:
            mdl = MODELS[mk]
            if mdl["topk"] > 2:
                for M in sorted(set([v for v in ms if v <= 32] + ([args.check_m] if 0 < args.check_m <= 32 else []))):
                    fm.moe_sum_reduce_torch_compile(
                        torch.zeros((M, mdl["topk"], mdl["H"]), device=dev, dtype=torch.bfloat16),
                        torch.empty((M, mdl["H"]), device=dev, dtype=torch.bfloat16), 1.0)
        torch.cuda.synchronize()
    except Exception as e:
        meta["torch_compile_warm_error"] = repr(e)
    meta["torch_compile_warm_s"] = round(time.time() - t, 1)

    # ---- parallel Triton pre-compilation -----------------------------------------------
    nprocs = args.prewarm_procs
    if nprocs < 0:
        nprocs = max(0, min(8, (os.cpu_count() or 2) // 2))
    groups = [(mk, f) for f in fmts for mk in models]
    pm = sorted(set(ms + ([args.check_m] if args.check_m > 0 else [])))
    if nprocs > 0 and groups:
        print(f"# pre-compiling Triton kernels for {len(groups)} (model,format) groups with {min(nprocs, len(groups))} "
              f"processes ...", flush=True)
        t = time.time()
        try:
            pw_s, codes = prewarm(groups, pm, nprocs, args.seed, args.verbose, args.prewarm_timeout_s, aot_silu)
        except Exception as e:  # non-fatal: kernels then compile serially below
            pw_s, codes = time.time() - t, {"error": f"{type(e).__name__}: {e}"[:300]}
        meta["prewarm"] = dict(procs=min(nprocs, len(groups)), wall_s=round(pw_s, 1), exitcodes=codes)
    else:
        meta["prewarm"] = dict(procs=0)
    meta["setup_s"] = round(time.time() - T0, 1)
    print(f"# setup: import {import_s:.1f}s, jit-activation {meta['jit_activation_warm_s']}s, "
          f"torch.compile {meta['torch_compile_warm_s']}s, prewarm {meta['prewarm'].get('wall_s', 0)}s "
          f"(exit codes {meta['prewarm'].get('exitcodes', {})})", flush=True)
    print(f"# {meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | sglang {meta['sglang']} | "
          f"roofline {args.roofline_tbps} TB/s | notes: {'; '.join(sgl['notes']) or '-'}", flush=True)

    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=dev)
    StandardTopKOutput = sgl["StandardTopKOutput"]
    print("# graph_us/eager_us = median us per fused_experts call (CUDA-graph replay / eager), L2 flushed per rep; "
          "hit = distinct experts routed to; wt_MB = hit x per-expert weight+scale bytes (1e6); TB/s, %roof "
          f"(of {args.roofline_tbps} TB/s), TFLOP/s use graph_us; cfg = Triton BLOCK_M x BLOCK_N x BLOCK_K, "
          "T = tuned JSON / D = default heuristic", flush=True)
    print(HDR, flush=True)

    for fmt in fmts:
        for mk in models:
            model = MODELS[mk]
            E, topk, H, I = model["E"], model["topk"], model["H"], model["I"]
            pe = per_expert_bytes(fmt, H, I)
            rc = runner_config(model)
            w = None
            try:
                if time.time() - T0 > args.time_budget_s:
                    raise TimeoutError("time budget exhausted before building weights")
                w = build_weights(fmt, E, H, I, dev, seed=args.seed + 17)
                torch.cuda.synchronize()
            except Exception as e:
                for M in ms:
                    results.append(dict(model=mk, fmt=fmt, M=M, status="skipped",
                                        reason=f"weights: {type(e).__name__}: {e}"[:200]))
                    print(fmt_row(results[-1]), flush=True)
                dump()
                w = None
                torch.cuda.empty_cache()
                continue

            for M in ms:
                r = dict(model=mk, fmt=fmt, M=M, E=E, topk=topk, H=H, I=I)
                results.append(r)
                try:
                    x = torch.randn((M, H), device=dev, dtype=torch.bfloat16,
                                    generator=torch.Generator(device=dev).manual_seed(args.seed + M))
                    tw, ti, lg = make_routing(M, E, topk, model["renormalize"], args.seed * 1000 + M, dev)
                    hit = int(torch.unique(ti).numel())
                    r.update(experts_hit=hit, weight_bytes=hit * (pe["weight"] + pe["scale"]),
                             scale_bytes=hit * pe["scale"], flops=moe_flops(M, topk, H, I))
                    r.update(describe_config(w, model, fmt, M))
                    # --- guards: time budget, memory, predicted time
                    if time.time() - T0 > args.time_budget_s:
                        raise TimeoutError(f"total time budget {args.time_budget_s}s exhausted")
                    act = 2 * (2 * M * H + M * topk * (2 * I + I + H))
                    free, _ = torch.cuda.mem_get_info()
                    if 4 * act > 0.9 * free:
                        raise MemoryError(f"needs ~{4 * act / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
                    t_pred = r["flops"] / 100e12 + r["weight_bytes"] / 1e12
                    if t_pred > args.max_case_s:
                        raise TimeoutError(f"predicted {t_pred:.1f}s per call > {args.max_case_s}s")

                    call = make_call(w, x, StandardTopKOutput(tw, ti, lg), rc)
                    t = time.time()
                    call()
                    torch.cuda.synchronize()
                    r["first_call_s"] = round(time.time() - t, 3)  # includes any Triton JIT compile
                    t = time.time()
                    call()
                    torch.cuda.synchronize()
                    one = time.time() - t
                    if one > args.max_case_s:
                        raise TimeoutError(f"single call took {one:.1f}s > {args.max_case_s}s")
                    for _ in range(args.warmup):
                        call()
                    torch.cuda.synchronize()

                    def nreps(us):
                        return max(args.min_reps, min(args.reps, int(args.case_budget_s * 1e6 / (us + 150.0))))

                    eager = time_cuda(call, nreps(one * 1e6), flush)
                    r["eager_us"] = eager["median"]
                    r["eager_stats"] = eager
                    r["graph_us"] = None
                    if not args.no_graph:
                        g = None
                        try:
                            g, _ = capture_graph(call)
                            for _ in range(3):
                                g.replay()
                            torch.cuda.synchronize()
                            gs = time_cuda(g.replay, nreps(eager["median"]), flush)
                            r["graph_us"] = gs["median"]
                            r["graph_stats"] = gs
                        except Exception as e:
                            r["note"] = f"graph capture failed: {type(e).__name__}: {e}"[:160]
                            torch.cuda.synchronize()
                        finally:
                            del g
                    t_us = r["graph_us"] if r["graph_us"] is not None else r["eager_us"]
                    r["time_basis"] = "graph" if r["graph_us"] is not None else "eager"
                    r["achieved_TBps"] = r["weight_bytes"] / (t_us * 1e-6) / 1e12
                    r["roofline_frac"] = r["achieved_TBps"] / args.roofline_tbps
                    r["roofline_us"] = r["weight_bytes"] / (args.roofline_tbps * 1e12) * 1e6
                    r["tflops"] = r["flops"] / (t_us * 1e-6) / 1e12
                    r["status"] = "ok"
                except Exception as e:
                    r["status"] = "skipped"
                    r["reason"] = f"{type(e).__name__}: {e}"[:300]
                    if not isinstance(e, (TimeoutError, MemoryError)):
                        r["traceback"] = traceback.format_exc()[-3000:]
                    try:
                        torch.cuda.synchronize()
                    except Exception:
                        pass
                print(fmt_row(r), flush=True)
                dump()

            # ---- correctness check for this (model, format) ---------------------------
            if args.check_m > 0 and time.time() - T0 <= args.time_budget_s + 60:
                c = dict(model=mk, fmt=fmt, M=args.check_m)
                checks.append(c)
                try:
                    M = args.check_m
                    x = torch.randn((M, H), device=dev, dtype=torch.bfloat16,
                                    generator=torch.Generator(device=dev).manual_seed(args.seed + 999))
                    tw, ti, lg = make_routing(M, E, topk, model["renormalize"], args.seed * 1000 + 999, dev)
                    tko = StandardTopKOutput(tw, ti, lg)
                    out = make_call(w, x, tko, rc)().clone()
                    torch.cuda.synchronize()
                    if fmt == "bf16":
                        d1, d2 = w["w1"], w["w2"]
                    else:
                        d1, d2 = dequantize(fmt, w["w1"], w["s1"]), dequantize(fmt, w["w2"], w["s2"])
                        ref_bf16 = make_call(dict(w1=d1, w2=d2, kw={}), x, tko, rc)().clone()
                        c["vs_dequant_bf16_fused_moe"] = err_stats(out, ref_bf16)
                    ref32 = torch_moe_reference(x, d1, d2, tw, ti)
                    c["vs_torch_fp32_reference"] = err_stats(out, ref32)
                    rel_main = c.get("vs_dequant_bf16_fused_moe", c["vs_torch_fp32_reference"])["rel_err"]
                    c["pass"] = bool(c["vs_torch_fp32_reference"]["finite"] and rel_main < 2e-2
                                     and c["vs_torch_fp32_reference"]["rel_err"] < 3e-2)
                    del d1, d2
                except Exception as e:
                    c["error"] = f"{type(e).__name__}: {e}"[:300]
                    c["traceback"] = traceback.format_exc()[-3000:]
                    c["pass"] = False
                dump()
            del w
            torch.cuda.empty_cache()

    # ---- summary ------------------------------------------------------------------------
    if checks:
        print("\n# correctness: fused MoE output vs (a) SGLang's bf16 fused MoE run on the dequantized weights and "
              "(b) an fp32 torch reference; same inputs/routing, M=%d" % args.check_m)
        print(f"{'model':<10} {'fmt':<10} {'max|ref|':>9} {'maxabs(a)':>10} {'rel(a)':>9} "
              f"{'maxabs(b)':>10} {'rel(b)':>9} ok")
    for c in checks:
        a = c.get("vs_dequant_bf16_fused_moe", {})
        b = c.get("vs_torch_fp32_reference", {})
        if "error" in c:
            print(f"{c['model']:<10} {c['fmt']:<10} ERROR {c['error']}")
            continue

        def fa(k):
            return f"{a[k]:.3e}" if k in a else "n/a"

        print(f"{c['model']:<10} {c['fmt']:<10} {b['max_abs_ref']:>9.3e} {fa('max_abs_err'):>10} {fa('rel_err'):>9} "
              f"{b['max_abs_err']:>10.3e} {b['rel_err']:>9.3e} {'PASS' if c['pass'] else 'FAIL'}")
    n_ok = sum(r.get("status") == "ok" for r in results)
    skipped = [f"{r['model']}/{r['fmt']}/M={r['M']}: {r.get('reason', '')}" for r in results if r.get("status") != "ok"]
    dump()
    print(f"\n# {n_ok}/{len(results)} cases timed; total wall {time.time() - T0:.1f}s; JSON -> {os.path.abspath(args.out)}")
    if skipped:
        print("# skipped:\n#   " + "\n#   ".join(skipped))


if __name__ == "__main__":
    main()
