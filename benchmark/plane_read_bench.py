#!/usr/bin/env python3
"""How fast can a decode kernel stream AP bit-planes, by access pattern (plane_read.cu: loads only, no compute).

    python3 benchmark/plane_read_bench.py --out OUT.json

Each variant reads the same planes (by default Mixtral's w13 at 4 bits: 8 experts x 28672 rows x 512 bytes x 4
planes, and the two experts of one token) with warps of 16 rows walking K in stages, as the fold kernel does,
and reports the read rate. The question it answers: does the row-major plane layout (a stage = 16 pieces of
64 bytes, a row apart) cap the rate below what contiguous tile-major stages or TMA bulk copies reach, at the
fold kernel's occupancy (4 blocks of 4 warps per SM)?
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedweight.kernels.nvrtc import load_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import cuda_setup, time_cuda  # noqa: E402

SOURCE = Path(__file__).with_name("plane_read.cu")
SMEM_PER_SM = 227 * 1024


@dataclass(frozen=True)
class Variant:
    name: str
    piece: int  # bytes per row, plane and stage
    stages: int  # ring depth D
    layout: int  # 0 row-major planes, 1 tile-major
    bulk: int  # 0 cp.async 16 B, 1 cp.async.bulk + mbarrier
    blocks_per_sm: int  # occupancy target (4 warps a block), set through the shared-memory request
    l2_prefetch: int = 0  # cp.async's L2 prefetch size hint (bytes; 0 none)

    def ring_bytes(self, q: int) -> int:
        return 4 * self.stages * q * 16 * self.piece + (4 * self.stages * 8 if self.bulk else 0)


VARIANTS = [
    Variant("fold_rowmajor_p64_d2", 64, 2, 0, 0, 4),
    Variant("rowmajor_p64_d2_pf128", 64, 2, 0, 0, 4, 128),
    Variant("rowmajor_p64_d2_pf256", 64, 2, 0, 0, 4, 256),
    Variant("rowmajor_p64_d4_pf256", 64, 4, 0, 0, 3, 256),
    Variant("rowmajor_p64_d4", 64, 4, 0, 0, 3),
    Variant("rowmajor_p128_d2", 128, 2, 0, 0, 3),
    Variant("rowmajor_p256_d2", 256, 2, 0, 0, 1),
    Variant("tile_p64_d2", 64, 2, 1, 0, 4),
    Variant("tile_p64_d4", 64, 4, 1, 0, 3),
    Variant("tile_p64_d1_8blocks", 64, 1, 1, 0, 8),
    Variant("bulk_rowmajor_p64_d4", 64, 4, 0, 1, 3),
    Variant("bulk_tile_p64_d4", 64, 4, 1, 1, 3),
    Variant("bulk_tile_p128_d4", 128, 4, 1, 1, 1),
    Variant("bulk_tile_p64_d2", 64, 2, 1, 1, 4),
]

SHAPES = {  # name: (tiles of 16 rows, row bytes = K / 8)
    "mixtral_w13_all": (8 * 2 * 14336 // 16, 4096 // 8),
    "mixtral_w13_top2": (2 * 2 * 14336 // 16, 4096 // 8),
    "mixtral_w2_all": (8 * 4096 // 16, 14336 // 8),
    "qwen3_w13_all": (128 * 2 * 768 // 16, 2048 // 8),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, sms, flush = cuda_setup()
    q = args.bits
    rows_out = []
    for shape in args.shapes.split(","):
        tiles, row_bytes = SHAPES[shape]
        plane_bytes = tiles * 16 * row_bytes
        planes = torch.randint(0, 256, (q * plane_bytes,), dtype=torch.uint8, device=dev)
        sink = torch.zeros(tiles, dtype=torch.int32, device=dev)
        total = q * plane_bytes
        for v in VARIANTS:
            if row_bytes % v.piece:
                continue
            need = v.ring_bytes(q)
            smem = max(need, SMEM_PER_SM // v.blocks_per_sm - 1024)
            if smem > SMEM_PER_SM or need * v.blocks_per_sm > SMEM_PER_SM:
                print(f"skip {v.name}: {need} B of shared memory per block", flush=True)
                continue
            kernel = load_kernel(SOURCE, "plane_read", [f"-DPIECE={v.piece}", f"-DD={v.stages}", f"-DQ={q}",
                                                        f"-DLAYOUT={v.layout}", f"-DBULK={v.bulk}",
                                                        f"-DL2PF={v.l2_prefetch}"], dev.index or 0)
            kernel.set_shared_memory_config(smem)
            grid = (-(-tiles // 4), 1, 1)

            def call(kernel=kernel, smem=smem, grid=grid):
                kernel(grid=grid, block=(128, 1, 1), shared_mem=smem,
                       args=[planes, plane_bytes, tiles, row_bytes, sink])

            call()
            torch.cuda.synchronize()
            t = time_cuda(call, args.reps, flush)
            tbps = total / (t["median"] * 1e-6) / 1e12
            rows_out.append(dict(shape=shape, **asdict(v), smem=smem, bytes=total, us=t["median"], tbps=tbps,
                                 waves=tiles / 4 / (v.blocks_per_sm * sms)))
            print(f"{shape:<18} {v.name:<24} {t['median']:8.1f} us  {tbps:5.2f} TB/s", flush=True)
        del planes
        torch.cuda.empty_cache()
    summary = {}
    for r in rows_out:
        summary.setdefault(r["shape"], {})[r["name"]] = round(r["tbps"], 3)
    Path(args.out).write_text(json.dumps(dict(bits=q, sms=sms, rows=rows_out, tbps=summary,
                                              median_of_shapes={n: statistics.median(s[n] for s in summary.values()
                                                                                       if n in s)
                                                                for n in {r["name"] for r in rows_out}}), indent=1))


if __name__ == "__main__":
    main()
