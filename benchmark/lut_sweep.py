#!/usr/bin/env python3
"""Launch-config sweep of the CUDA LUT kernel (cuda_lut.py) on dense GEMV shapes, H200.

    python3 benchmark/lut_sweep.py --out OUT.json [--profile-one]   # needs a GPU; torch only

For each shape and M: the default LUTConfig and every (n_per_block, k_per_split) candidate, device time per
call with a cold L2 (linear_bench.graph_time_us), next to cuBLAS bf16. --profile-one runs a few eager calls of
the first shape's default config and nothing else (for `ncu --kernel-name ap_lut_gemv`).
"""

from __future__ import annotations

import argparse
import json

import torch

from pagedweight.kernels.cuda_lut import LUTConfig, ap_linear_lut, block_m_for_rows, default_lut_config
from pagedweight.kernels.testing import random_ap_projection

from linear_bench import FLUSH_BYTES, _replay_us, graph_time_us  # benchmark/ is on sys.path as a script

SHAPES = {"mixtral_expert_w13": (28672, 4096), "mixtral_expert_w2": (4096, 14336), "qwen15moe_expert_w13": (2816, 2048),
          "qwen15moe_qkv": (6144, 2048)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--profile-one", action="store_true")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.profile_one:
        n, k = SHAPES["mixtral_expert_w13"]
        proj = random_ap_projection(1, n, k, [args.bits], group_size=128, device="cuda")
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            ap_linear_lut(x, proj.weights, 0, None)
        torch.cuda.synchronize()
        return
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    flush_us = _replay_us(flush.zero_, 20)
    rows = []
    for name, (n, k) in SHAPES.items():
        proj = random_ap_projection(1, n, k, [args.bits], group_size=128, device="cuda")
        w_bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bm = block_m_for_rows(m)
            default = default_lut_config(-(-m // bm), bm, n, k, sms)
            row = {"shape": name, "N": n, "K": k, "M": m, "default": vars(default),
                   "us_torch_bf16": round(graph_time_us(lambda: torch.nn.functional.linear(x, w_bf16), flush, flush_us), 1)}
            cands = {}
            for nb in (256, 512, 1024):
                for kc in (512, 1024, 2048, 4096):
                    if kc > -(-k // 128) * 128:
                        continue
                    cfg = LUTConfig(bm, nb, kc)
                    if cfg.shared_bytes() > 96 * 1024:
                        continue
                    cands[f"nb{nb}_kc{kc}"] = round(graph_time_us(lambda: ap_linear_lut(x, proj.weights, 0, None, cfg),
                                                                  flush, flush_us), 1)
            row["us_default"] = round(graph_time_us(lambda: ap_linear_lut(x, proj.weights, 0, None, default), flush, flush_us), 1)
            row["candidates_us"] = cands
            best = min(cands, key=cands.get)
            row["best"], row["us_best"] = best, cands[best]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "candidates_us"}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(0), "bits": args.bits, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
