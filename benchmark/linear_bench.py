#!/usr/bin/env python3
"""Dense AP linear (--paged-weight-scope all) on the H200: tile rebuild vs dequantize-then-GEMM vs torch bf16.

    python3 benchmark/linear_bench.py --out out/linear_bench.json       # needs a GPU; torch + triton only

Shapes of the dense linears scope "all" serves: Qwen1.5-MoE-A2.7B attention (qkv 6144x2048, o 2048x2048)
and shared expert (gate_up 11264x2048, down 2048x5632), Mixtral attention (qkv 6144x4096, o 4096x4096).
AP at 4 bits, bcq group 128. Each row: median microseconds of ap_linear with the tile kernel, with the CUDA
LUT kernel (the default up to LINEAR_LUT_MAX_M rows), with the dequantize-then-GEMM path (the default from
LINEAR_DEQUANT_MIN_M rows), the default choice, and torch's bf16 GEMM (cuBLAS) on the same shape, all in this run. Times are device times: each call
is captured 10 times into a CUDA graph, each after a write of 256 MB that evicts the weights from L2, and the
replays are timed minus the writes alone (a decode server runs these linears under CUDA graphs; timed eagerly,
one call measures Python dispatch and launch, ~40-200 us, not the kernels).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from pagedweight.bench.cuda_timing import FLUSH_BYTES, replay_median_us
from pagedweight.kernels import ap_linear
from pagedweight.kernels.config import LINEAR_DEQUANT_MIN_M, LINEAR_LUT_MAX_M, default_linear_config
from pagedweight.kernels.testing import random_ap_projection

SHAPES = {
    "qwen15moe_qkv": (6144, 2048), "qwen15moe_o": (2048, 2048),
    "qwen15moe_shared_gate_up": (11264, 2048), "qwen15moe_shared_down": (2048, 5632),
    "mixtral_qkv": (6144, 4096), "mixtral_o": (4096, 4096),
    # one Mixtral expert's projections as plain GEMVs (the MoE kernels' per-expert work at decode)
    "mixtral_expert_w13": (28672, 4096), "mixtral_expert_w2": (4096, 14336),
}
INNER = 10  # calls per graph replay


def _replay_us(body, reps: int) -> float:
    """Median device time of one replay of a CUDA graph that runs body() INNER times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (Triton compiles, allocator) outside the capture
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(INNER):
            body()
    graph.replay()
    torch.cuda.synchronize()
    return replay_median_us(graph, reps)


def graph_time_us(fn, flush: torch.Tensor, flush_us: float, reps: int = 20) -> float:
    """Device time of one fn() call with a cold L2: graph replays of (L2 flush, fn) minus those of the flushes
    alone (flush_us, one replay of INNER flushes)."""
    return max(_replay_us(lambda: (flush.zero_(), fn()), reps) - flush_us, 0.0) / INNER


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,16,64,128,256,2048")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--lut-max-m", type=int, default=16, help="also time the CUDA LUT kernel up to this M")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    flush_us = _replay_us(flush.zero_, 20)
    rows = []
    for name, (n, k) in SHAPES.items():
        proj = random_ap_projection(1, n, k, [args.bits], group_size=128, seed=0, device="cuda")
        w_bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            default = default_linear_config(m, n, k, 128, num_sms=sms)
            tiles = default_linear_config(m, n, k, 128, num_sms=sms, dequant_min_m=1 << 30)
            dequant = default_linear_config(m, n, k, 128, num_sms=sms, dequant_min_m=1)
            row = {"shape": name, "N": n, "K": k, "M": m, "bits": args.bits}
            for label, cfg in (("tiles", tiles), ("dequant_gemm", dequant)):
                row[f"us_{label}"] = round(graph_time_us(lambda: ap_linear(x, proj.weights, config=cfg), flush, flush_us), 1)
            if m <= args.lut_max_m:
                row["us_lut"] = round(graph_time_us(lambda: ap_linear(x, proj.weights, kernel="lut"), flush, flush_us), 1)
            row["default_path"] = ("lut" if m <= LINEAR_LUT_MAX_M else "dequant_gemm" if default.dequant_chunk else "tiles")
            row["us_default"] = row[f"us_{row['default_path']}"]
            row["us_torch_bf16"] = round(graph_time_us(lambda: torch.nn.functional.linear(x, w_bf16), flush, flush_us), 1)
            row["default_vs_bf16_time"] = round(row["us_default"] / row["us_torch_bf16"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"command": "python3 benchmark/linear_bench.py --out OUT", "machine": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "linear_dequant_min_m": LINEAR_DEQUANT_MIN_M, "timing": f"CUDA graph of {INNER} x (256 MB L2 flush, call) minus {INNER} flushes, median of 20 replays / {INNER}",
           "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
