#!/usr/bin/env python3
"""The fold MoE call timed with several kernel sources, alternately in one process, so that a kernel change is
measured against this tree's kernel on the same machine and in the same call.

    python3 benchmark/fold_source_ab.py --rev 4ecc2b7 --models mixtral --cases u4,u8,mix4 --ms 4,16 --out OUT.json
    python3 benchmark/fold_source_ab.py --source pipe=path/to/cuda_fold_gemv.cu --probe nomath,noload --out OUT.json

Sources: this tree's (`tree`), a git revision's (`--rev`), kernel files (`--source NAME=PATH`, the headers it
includes beside it), and timing probes of this tree's source (`--probe`; their results are wrong by design):
`nomath` keeps the plane copies, ldmatrix and activation loads but drops the bit transposition, the mma and the
group-end epilogue; `noload` reads every warp's planes from the first rows of each plane (L2-resident), so HBM
serves only the tables and activations (every warp on the same rows: the reads crowd a few L2 slices);
`l2rows` wraps each warp's rows into the first 128 rows of each plane (an L2-resident working set spread over the
L2, so HBM serves only the tables and activations without that crowding); `nomath_noload` both; `noshfl` drops the four coefficient shuffles of
each group end; `noact` loads every chunk's activations from the unit's first chunk (L1-resident; with
`shared_act` the activation ring is never filled), so L2 serves only the planes and tables. Every source must take the same launch arguments (cuda_fold.py of this tree launches them);
the launch configs are this tree's defaults for each shape. Writes every timing and, per (model, case, M) and
source, the median of its times over the median of this tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import pagedweight.kernels.cuda_fold as cuda_fold
from pagedweight.kernels.testing import random_ap_projection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import MODELS, case_bits, cuda_setup, graph_time, make_routing  # noqa: E402

SOURCE_IN_REPO = "sgl-kernel-ext/cuda_fold_gemv.cu"
_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.M)

# probe patches of warp_rows: (marker that must occur once, replacement)
_MATH_START = "                    u32 ca4[4], cb4[4], la4[4], lb4[4];\n"
_LOOP_END = "                }\n            }\n        }\n        if (!SA) __syncwarp();\n    }\n    cp_async_wait<0>();"
_NOMATH_BODY = """                    u32 xr = 0;
#pragma unroll
                    for (int p = 0; p < Q; ++p) xr ^= wa[p] ^ wb[p];
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int v = 0; v < 4; ++v) xr ^= b[nt][v].x ^ b[nt][v].w;
                    if (group_end) y[r][0][1] += S[0].x + ca[i >> 2][r].a + cb[i >> 2][r].b;
                    y[r][0][0] += __uint_as_float(xr & 0x3fffffffu);
"""
_ROW_OFFSET = "+ (long long)ra[0] * row_bytes + (long long)(c_begin + t) * 16;"
_DROW = "da[r] = (long long)(ra[r] - ra[0]) * row_bytes;\n        db[r] = (long long)(rb[r] - ra[0]) * row_bytes;"
_ACT_CHUNK = "const u16* pc = xl + (long long)c * UNIT_CHUNK_ELEMS;"
_SA_ACT_COPY = "        if (SA && si < nstages) {\n            const u32 base = act_ring"


def _once(text: str, marker: str) -> int:
    if text.count(marker) != 1:
        raise SystemExit(f"probe patch: the kernel source holds {text.count(marker)} copies of {marker!r}, not 1; "
                         "update fold_source_ab.py's probe markers to the kernel")
    return text.index(marker)


def probe_text(text: str, probe: str) -> str:
    """This tree's kernel source with the math and / or the HBM plane reads removed (timing only)."""
    parts = probe.split("_")
    if not set(parts) <= {"nomath", "noload", "l2rows", "noshfl", "noact"}:
        raise SystemExit(f"--probe: unknown probe {probe!r} (nomath, noload, l2rows, noshfl, noact, joined by _)")
    if "nomath" in parts:
        start, end = _once(text, _MATH_START), _once(text, _LOOP_END)
        text = text[:start] + _NOMATH_BODY + text[end:]
    if "noload" in parts:
        _once(text, _ROW_OFFSET), _once(text, _DROW)
        text = text.replace(_ROW_OFFSET, "+ (long long)t * 16;").replace(_DROW, "da[r] = db[r] = 0;")
    if "l2rows" in parts:
        _once(text, _ROW_OFFSET), _once(text, _DROW)
        text = text.replace(_ROW_OFFSET, "+ (long long)(ra[0] & 127) * row_bytes + (long long)(c_begin + t) * 16;")
        text = text.replace(_DROW, "da[r] = (long long)((ra[r] & 127) - (ra[0] & 127)) * row_bytes;\n"
                                   "        db[r] = (long long)((rb[r] & 127) - (ra[0] & 127)) * row_bytes;")
    if "noact" in parts:
        _once(text, _ACT_CHUNK), _once(text, _SA_ACT_COPY)
        text = text.replace(_ACT_CHUNK, "const u16* pc = xl; (void)c;")
        text = text.replace(_SA_ACT_COPY, _SA_ACT_COPY.replace("SA && si < nstages", "false && si < nstages"))
    if "noshfl" in parts:
        text, n = re.subn(r"__shfl_sync\(0xffffffffu, (x[ab]\.[ab]), src_lane\)", r"\1", text)
        if n != 4:
            raise SystemExit(f"probe noshfl: found {n} coefficient shuffles, not 4")
    return text


def git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout


def revision_source(rev: str, workdir: Path) -> Path:
    """The revision's kernel source in `workdir`, with the headers it includes from that revision beside it."""
    text = git_show(rev, SOURCE_IN_REPO)
    folder = os.path.dirname(SOURCE_IN_REPO)
    for header in _INCLUDE.findall(text):
        (workdir / header).write_text(git_show(rev, f"{folder}/{header}"))
    path = workdir / os.path.basename(SOURCE_IN_REPO)
    path.write_text(text)
    return path


def written_source(name: str, text: str, workdir: Path, header_dir: Path) -> Path:
    """`text` as a kernel file in its own folder under `workdir`, with the headers it includes from `header_dir`."""
    folder = workdir / name
    folder.mkdir()
    for header in _INCLUDE.findall(text):
        shutil.copy(header_dir / header, folder / header)
    path = folder / "cuda_fold_gemv.cu"
    path.write_text(text)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="", help="git revision whose cuda_fold_gemv.cu is timed against this tree's")
    ap.add_argument("--source", action="append", default=[], help="NAME=PATH of a kernel source to time")
    ap.add_argument("--probe", default="", help="comma list of timing probes of this tree's source")
    ap.add_argument("--models", default="mixtral")
    ap.add_argument("--cases", default="u4,u8,mix4")
    ap.add_argument("--ms", default="4,16")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the sources")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, sms, flush = cuda_setup()
    here = cuda_fold._SOURCE
    rows, summary = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"tree": here}
        if args.rev:
            sources[args.rev] = revision_source(args.rev, Path(tmp))
        for spec in args.source:
            name, _, path = spec.partition("=")
            if not path or not Path(path).is_file():
                raise SystemExit(f"--source {spec!r}: give NAME=PATH of an existing kernel file")
            sources[name] = Path(path).resolve()
        for probe in [p for p in args.probe.split(",") if p]:
            sources[probe] = written_source(probe, probe_text(here.read_text(), probe), Path(tmp), here.parent)
        for model in args.models.split(","):
            md = MODELS[model]
            E, topk, H, I = md["E"], md["topk"], md["H"], md["I"]
            for case in args.cases.split(","):
                w13 = random_ap_projection(E, 2 * I, H, case_bits(case, E, "w13"), table_kind="ubcq", bits_min=2,
                                           seed=1, device=dev).weights
                w2 = random_ap_projection(E, H, I, case_bits(case, E, "w2"), table_kind="ubcq", bits_min=2, seed=2,
                                          device=dev).weights
                for m in [int(v) for v in args.ms.split(",")]:
                    x = torch.randn((m, H), device=dev, dtype=torch.bfloat16)
                    tw, ids = make_routing(m, E, topk, md["renormalize"], m, dev)
                    configs = cuda_fold.default_fold_configs(m, topk, w13, w2, sms, pdl=cuda_fold.device_launch_facts(dev)[1])
                    times = {name: [] for name in sources}
                    for _ in range(args.rounds):
                        for name, src in sources.items():
                            cuda_fold._SOURCE = src  # compiled once per source (cached by source)
                            call = lambda: cuda_fold.ap_fused_moe_fold(x, tw, ids, w13, w2, configs=configs)  # noqa: E731
                            call()
                            us = graph_time(call, args.reps, flush)["median"]
                            times[name].append(us)
                            rows.append(dict(model=model, case=case, M=m, source=name, us=us))
                    base = statistics.median(times["tree"])
                    line = f"{model:<10} {case:<5} M={m:<3} tree {base:8.1f} us"
                    for name in sources:
                        if name != "tree":
                            med = statistics.median(times[name])
                            summary[f"{model}/{case}/M={m}/{name}"] = round(med / base, 3)
                            line += f" | {name} {med:8.1f} ({med / base:.3f})"
                    print(line, flush=True)
                    with open(args.out, "w") as f:
                        json.dump(dict(rev=args.rev, sources=list(sources), rows=rows, over_tree=summary), f, indent=1)
                del w13, w2
                torch.cuda.empty_cache()
    cuda_fold._SOURCE = here


if __name__ == "__main__":
    main()
