"""Probe (not product code): does an activation-side lookup table make the binary-coded GEMV cheaper in Triton?

The shipped decode kernels rebuild every weight from its planes (~11 thread instructions per weight at
4 bits, docs/kernels.md): issue-bound far above the HBM time. LUT-GEMM / T-MAC reorder the sum instead:

    y[n] = sum_g ( offset[n,g] * S_g(x) + sum_p alpha_p[n,g] * sum_{j in g} T_j[nibble_p(n, j)] )
    T_j[c] = sum_{i<4} (2 * bit_i(c) - 1) * x[4j + i]            (16 signed sums per 4 inputs)

so each plane nibble (4 weights) costs one table load and one add, with no per-weight arithmetic. Here the
tables go to global memory (a few KB per token, L1/L2 resident) and are read with Triton gathers.
Layout of this probe (its own, natural order): planes [q, N, K/32] int32, bit i of word w = input 32w + i.

    python benchmark/lut_gemv_probe.py --out out/lut_probe.json          # H200: times + correctness
    TRITON_INTERPRET=1 python benchmark/lut_gemv_probe.py --check-only   # CPU: correctness at small shapes

It reports microseconds against torch's bf16 GEMV (cuBLAS) and the shipped ap_linear on the same shape and
bits, so the next GPU session can decide whether this route is worth a product kernel.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _tables_kernel(x_ptr, t_ptr, gs_ptr, K, G: tl.constexpr, BJ: tl.constexpr):
    """T[m, j, c] for BJ nibble groups of token m; gsum[m, g] for the groups these inputs complete."""
    m = tl.program_id(0)
    j0 = tl.program_id(1) * BJ
    jj = j0 + tl.arange(0, BJ)
    c = tl.arange(0, 16)
    acc = tl.zeros([BJ, 16], dtype=tl.float32)
    for i in tl.static_range(4):
        xi = tl.load(x_ptr + m * K + jj * 4 + i).to(tl.float32)
        sign = (((c >> i) & 1) * 2 - 1).to(tl.float32)
        acc += xi[:, None] * sign[None, :]
    tl.store(t_ptr + (m * (K // 4) + jj[:, None]) * 16 + c[None, :], acc.to(t_ptr.dtype.element_ty))
    # group sums: BJ * 4 inputs is a multiple of G (launcher checks), so each program owns whole groups
    xs = tl.load(x_ptr + m * K + j0 * 4 + tl.arange(0, BJ * 4)).to(tl.float32)
    gsum = tl.sum(tl.reshape(xs, [BJ * 4 // G, G]), axis=1)
    tl.store(gs_ptr + m * (K // G) + j0 * 4 // G + tl.arange(0, BJ * 4 // G), gsum)


@triton.jit
def _lut_gemv_kernel(planes_ptr, alpha_ptr, off_ptr, t_ptr, gs_ptr, y_ptr, M, N, K,
                     Q: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """y[m, n] += sum over this program's K slice; one bcq group (G inputs = G/32 words) per step."""
    WG: tl.constexpr = G // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    KW = K // 32
    ngroups = K // G
    per = tl.cdiv(ngroups, SPLIT)
    g_lo = pid_k * per
    g_hi = tl.minimum(g_lo + per, ngroups)
    ww = tl.arange(0, WG)
    for m in range(0, M):
        acc = tl.zeros([BN], dtype=tl.float32)
        for g in range(g_lo, g_hi):
            words_idx = g * WG + ww  # [WG]
            tsum = tl.load(gs_ptr + m * ngroups + g)
            acc += tl.load(off_ptr + rows * ngroups + g, mask=rmask, other=0.0).to(tl.float32) * tsum
            for p in tl.static_range(Q):
                wd = tl.load(planes_ptr + (p * N + rows[:, None]) * KW + words_idx[None, :], mask=rmask[:, None], other=0)
                part = tl.zeros([BN, WG], dtype=tl.float32)
                for t in tl.static_range(8):
                    nib = (wd >> (4 * t)) & 0xF
                    j = words_idx * 8 + t
                    part += tl.load(t_ptr + (m * (K // 4) + j[None, :]) * 16 + nib).to(tl.float32)
                a = tl.load(alpha_ptr + (p * N + rows) * ngroups + g, mask=rmask, other=0.0).to(tl.float32)
                acc += a * tl.sum(part, axis=1)
        if SPLIT == 1:
            tl.store(y_ptr + m * N + rows, acc, mask=rmask)
        else:
            tl.atomic_add(y_ptr + m * N + rows, acc, mask=rmask, sem="relaxed")


def make_weights(n: int, k: int, q: int, g: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    planes = torch.randint(-2**31, 2**31 - 1, (q, n, k // 32), dtype=torch.int64, generator=gen).to(torch.int32)
    alpha = (torch.rand(q, n, k // g, generator=gen) * 0.02 * 0.5 ** torch.arange(q)[:, None, None]).half()
    off = (torch.randn(n, k // g, generator=gen) * 1e-3).half()
    return planes.to(device), alpha.to(device), off.to(device)


def dequantize(planes, alpha, off, g: int) -> torch.Tensor:
    q, n, kw = planes.shape
    k = kw * 32
    bits = (planes.unsqueeze(-1).to(torch.int64) >> torch.arange(32, device=planes.device)) & 1  # [q, n, kw, 32]
    signs = (bits * 2 - 1).reshape(q, n, k).float()
    a = alpha.float().repeat_interleave(g, dim=2)
    return off.float().repeat_interleave(g, dim=1) + (a * signs).sum(0)


def lut_gemv(x, planes, alpha, off, g: int, bn: int = 64, split: int = 1, num_warps: int = 4,
             table_dtype: torch.dtype = torch.float32):
    """y = x @ W^T (float32). `table_dtype` float16 halves the tables' cache footprint (K/4 x 16 per token)."""
    m, k = x.shape
    q, n, _ = planes.shape
    bj = max(g // 4, 16)
    if k % (bj * 4) or (bj * 4) % g:
        raise ValueError(f"K={k} must be a multiple of {bj * 4} and of the group {g}")
    t = torch.empty(m, k // 4, 16, dtype=table_dtype, device=x.device)
    gs = torch.empty(m, k // g, dtype=torch.float32, device=x.device)
    _tables_kernel[(m, k // 4 // bj)](x, t, gs, k, G=g, BJ=bj)
    y = (torch.zeros if split > 1 else torch.empty)(m, n, dtype=torch.float32, device=x.device)
    _lut_gemv_kernel[(triton.cdiv(n, bn), split)](planes, alpha, off, t, gs, y, m, n, k, Q=q, G=g, BN=bn,
                                                  SPLIT=split, num_warps=num_warps)
    return y


def check(device, shapes=((1, 96, 256, 3, 128), (3, 64, 512, 4, 128), (2, 40, 256, 2, 64))) -> list[dict]:
    out = []
    for m, n, k, q, g in shapes:
        planes, alpha, off = make_weights(n, k, q, g, device, seed=n + k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device)
        ref = x.float() @ dequantize(planes, alpha, off, g).t()
        for split, tdt, tol in ((1, torch.float32, 1e-4), (2, torch.float32, 1e-4), (2, torch.float16, 2e-3)):
            y = lut_gemv(x, planes, alpha, off, g, bn=32, split=split, num_warps=2, table_dtype=tdt)
            err = ((y - ref).norm() / ref.norm()).item()
            out.append(dict(m=m, n=n, k=k, q=q, g=g, split=split, table=str(tdt).split(".")[1], rel_err=err,
                            ok=err < tol))
    return out


def time_us(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    from dequant_sweep import replay_median_us  # benchmark/ is on sys.path when this runs as a script

    return replay_median_us(g, reps)


def bench(device, rows: list[dict], budget_s: float) -> None:
    from pagedweight.kernels import ap_linear
    from pagedweight.kernels.testing import random_ap_projection

    t0 = time.time()
    shapes = {"qwen15moe_w13": (2 * 1408, 2048), "mixtral_w13": (2 * 14336, 4096), "mixtral_w2": (4096, 14336)}
    configs = list(itertools.product((32, 64, 128), (1, 2, 4, 8), (2, 4), (torch.float32, torch.float16)))
    for name, (n, k) in shapes.items():
        for m in (1, 4):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            w_bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            base = time_us(lambda: x @ w_bf16.t())
            ap = random_ap_projection(1, n, k, [4], table_kind="bcq", group_size=128, bits_min=2, device=device)
            shipped = time_us(lambda: ap_linear(x, ap.weights))
            planes, alpha, off = make_weights(n, k, 4, 128, device)
            for bn, split, warps, tdt in configs:
                if time.time() - t0 > budget_s:
                    print(f"time budget {budget_s}s spent: stopping at {name} M={m}", flush=True)
                    return
                cfg = dict(shape=name, m=m, n=n, k=k, bits=4, bn=bn, split=split, warps=warps, table=str(tdt).split(".")[1])
                try:
                    us = time_us(lambda: lut_gemv(x, planes, alpha, off, 128, bn=bn, split=split, num_warps=warps,
                                                  table_dtype=tdt))
                    row = dict(cfg, us=round(us, 1), torch_bf16_us=round(base, 1), ap_linear_us=round(shipped, 1),
                               weight_TBps=round(n * k * 0.5 / (us * 1e-6) / 1e12, 3))
                except Exception as e:  # keep going: the probe maps what compiles and what does not
                    row = dict(cfg, error=f"{type(e).__name__}: {e}"[:200])
                rows.append(row)
                print(row, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/lut_probe.json")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--budget-s", type=float, default=240, help="stop starting new configs after this")
    a = ap.parse_args()
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    device = torch.device("cpu" if interp or not torch.cuda.is_available() else "cuda")
    checks = check(device)
    print(json.dumps(checks, indent=1))
    if not all(c["ok"] for c in checks):
        raise SystemExit("LUT GEMV disagrees with the dequantized reference")
    if a.check_only:
        return
    rows: list[dict] = []
    bench(device, rows, a.budget_s)
    doc = dict(gpu=torch.cuda.get_device_name(0), checks=checks, rows=rows)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    from dequant_sweep import fastest  # benchmark/ is on sys.path when this runs as a script

    for key, r in fastest(rows, ("shape", "m")).items():
        print(f"{key}: best {r['us']} us (bn {r['bn']}, split {r['split']}, warps {r['warps']}, {r['table']} tables) vs torch bf16 "
              f"{r['torch_bf16_us']} us, ap_linear {r['ap_linear_us']} us")


if __name__ == "__main__":
    main()
