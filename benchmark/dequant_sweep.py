"""Time the prefill path's dequantization kernels (planes -> dense bf16 scratch) over launch shapes.

The prefill path costs "dequantize every expert once + the bf16 GEMM"; this isolates the first part and
compares it with the copy rate it could reach (bytes = planes and tables read + 2 bytes per weight
written), for the CUDA kernel (bcq) and the Triton one (both kinds, block shapes).
Needs only torch + Triton on a CUDA GPU (no SGLang):

    python benchmark/dequant_sweep.py --out out/dequant_sweep.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from pagedweight.bench.cuda_timing import replay_median_us, time_cuda
from pagedweight.kernels.cuda_dequant import dequantize_chunk_cuda
from pagedweight.kernels.testing import random_ap_projection
from pagedweight.kernels.triton_dequant_moe import dequantize_chunk

SHAPES = {"mixtral": (8, 2 * 14336, 4096), "qwen15moe": (60, 2 * 1408, 2048)}  # (experts, N of w13, K)


def eager_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    return time_cuda(fn, reps)["median"]


def time_us(fn, reps: int = 20) -> float:
    """Median GPU microseconds of one call, replayed from a CUDA graph (an eager launch through torch's NVRTC
    launcher costs tens of microseconds of Python, which would otherwise be timed as idle GPU)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return replay_median_us(graph, reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/dequant_sweep.json")
    ap.add_argument("--chunk", type=int, default=2, help="experts per launch")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--kinds", default="bcq,kmeans", help="table kinds (bcq, ubcq, kmeans)")
    a = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    copy_src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    # eager: a copy captured in a CUDA graph becomes a copy-engine memcpy node (~2.8 TB/s, not the SM copy rate)
    copy_tbps = 2 * copy_src.numel() / (eager_us(lambda: copy_dst.copy_(copy_src)) * 1e-6) / 1e12
    # the rebuild's traffic is ~80% writes: the write-only rate (a fill) is its closer roofline
    fill_tbps = copy_dst.numel() / (eager_us(lambda: copy_dst.fill_(1)) * 1e-6) / 1e12
    rows = []
    for model, (E, N, K) in SHAPES.items():
        for kind in a.kinds.split(","):
            p = random_ap_projection(E, N, K, [4] * E, table_kind=kind, group_size=128, bits_min=2, seed=1, device=dev)
            w = p.weights
            chunk = min(a.chunk, E)
            scratch = torch.empty(chunk, N, K, dtype=torch.bfloat16, device=dev)
            plane_bytes = chunk * N * K * 4 / 8
            moved = plane_bytes + scratch.numel() * 2
            if kind != "kmeans":  # the CUDA kernel (cuda_dequant.py), what the prefill path runs for bcq/ubcq on CUDA
                us = time_us(lambda: dequantize_chunk_cuda(w, scratch, 0))
                r = dict(model=model, kind=kind, kernel="cuda", us=round(us, 1),
                         TBps=round(moved / (us * 1e-6) / 1e12, 3), us_all_experts=round(us * E / chunk, 1))
                rows.append(r)
                print(r, flush=True)
            for bn in (32, 64, 128):
                for bk in (64, 128):
                    for warps in (2, 4, 8):
                        if time.time() - t0 > a.budget_s:
                            break

                        def run():
                            dequantize_chunk(w, scratch, 0, triton.language.bfloat16, bn, bk, True, num_warps=warps,
                                             kernel="triton")
                        try:
                            us = time_us(run)
                            r = dict(model=model, kind=kind, kernel="triton", bn=bn, bk=bk, warps=warps, us=round(us, 1),
                                     TBps=round(moved / (us * 1e-6) / 1e12, 3),
                                     us_all_experts=round(us * E / chunk, 1))
                        except Exception as e:  # a shape the compiler refuses: keep going, say so
                            r = dict(model=model, kind=kind, kernel="triton", bn=bn, bk=bk, warps=warps, error=f"{type(e).__name__}: {e}"[:200])
                        rows.append(r)
                        print(r, flush=True)
    # what the prefill path launches: BN 64, 4 warps, BK = the widest dividing K and the group (128 here)
    doc = dict(gpu=torch.cuda.get_device_name(0), copy_TBps=round(copy_tbps, 3), fill_TBps=round(fill_tbps, 3), chunk=a.chunk, bits=4,
               current_default=dict(bcq="cuda", kmeans=dict(bn=64, bk=128, warps=4)), rows=rows)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    best = fastest(rows, ("model", "kind", "kernel"))
    print("copy TB/s", doc["copy_TBps"], "fill TB/s", doc["fill_TBps"], "best:", json.dumps({"/".join(k): v for k, v in best.items()}))


def fastest(rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, dict]:
    """The fastest timed row per combination of `keys` (rows with an error are skipped)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        k = tuple(str(r[name]) for name in keys)
        if "us" in r and (k not in best or r["us"] < best[k]["us"]):
            best[k] = r
    return best


if __name__ == "__main__":
    main()
