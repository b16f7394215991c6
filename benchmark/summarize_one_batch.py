#!/usr/bin/env python3
"""Side-by-side table of two bench_one_batch result files (same run, same machine).

    python benchmark/summarize_one_batch.py --base obb_bf16.jsonl --ap obb_ap4.jsonl --out docs/results/e2e_decode.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> dict[int, dict]:
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    return {r["batch_size"]: r for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--ap", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--meta", type=str, default="{}", help="JSON object merged into the output's meta")
    args = ap.parse_args()
    base, apr = load(args.base), load(args.ap)
    cases = []
    for bs in sorted(set(base) & set(apr)):
        b, a = base[bs], apr[bs]
        cases.append({
            "batch_size": bs,
            "input_len": b["input_len"],
            "output_len": b["output_len"],
            "decode_tok_s_bf16": round(b["median_decode_throughput"], 1),
            "decode_tok_s_ap": round(a["median_decode_throughput"], 1),
            "decode_ratio_ap_vs_bf16": round(a["median_decode_throughput"] / b["median_decode_throughput"], 3),
            "prefill_ms_bf16": round(b["prefill_latency"] * 1e3, 1),
            "prefill_ms_ap": round(a["prefill_latency"] * 1e3, 1),
        })
    out = {"meta": json.loads(args.meta), "cases": cases}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    lines = ["| batch | decode tok/s bf16 | decode tok/s AP | AP / bf16 | prefill ms bf16 | prefill ms AP |",
             "|---|---|---|---|---|---|"]
    for c in cases:
        lines.append(f"| {c['batch_size']} | {c['decode_tok_s_bf16']} | {c['decode_tok_s_ap']} | "
                     f"{c['decode_ratio_ap_vs_bf16']} | {c['prefill_ms_bf16']} | {c['prefill_ms_ap']} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
