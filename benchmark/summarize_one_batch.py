#!/usr/bin/env python3
"""Side-by-side table of bench_one_batch result files (same run, same machine): a bf16 base and AP systems.

    python benchmark/summarize_one_batch.py --base obb_bf16.jsonl --ap obb_ap4.jsonl --out docs/results/e2e_decode.json
    python benchmark/summarize_one_batch.py --base obb_bf16.jsonl --ap experts=obb_ap4.jsonl \
        --ap all=obb_ap4_all.jsonl --log bf16=obb_bf16.log --log experts=obb_ap4.log --log all=obb_ap4_all.log \
        --out docs/results/e2e_scope_all.json
--ap LABEL=PATH may repeat (a bare PATH is labelled "ap", the single-system layout of e2e_decode.json);
--log LABEL=PATH adds each run's KV-cache size (SGLang's max_total_num_tokens) to the output.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def load(path: Path) -> dict[int, dict]:
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    return {r["batch_size"]: r for r in rows}


def labelled(spec: str, default: str) -> tuple[str, Path]:
    label, sep, path = spec.partition("=")
    return (label, Path(path)) if sep else (default, Path(spec))


def kv_tokens(log: Path) -> int:
    found = re.findall(r"max_total_num_tokens=(\d+)", log.read_text(errors="replace"))
    if not found:
        raise SystemExit(f"{log}: no max_total_num_tokens line (not a bench_one_batch log?)")
    return int(found[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--ap", action="append", required=True, help="[LABEL=]PATH of an AP run; may repeat")
    ap.add_argument("--log", action="append", default=[], help="LABEL=PATH of a run's log, for its KV-cache size")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--meta", type=str, default="{}", help="JSON object merged into the output's meta")
    args = ap.parse_args()
    base = load(args.base)
    systems = dict(labelled(s, "ap") for s in args.ap)
    runs = {label: load(path) for label, path in systems.items()}
    single = list(runs) == ["ap"]
    cases = []
    for bs in sorted(set(base).intersection(*runs.values())):
        b = base[bs]
        case = {"batch_size": bs, "input_len": b["input_len"], "output_len": b["output_len"],
                "decode_tok_s_bf16": round(b["median_decode_throughput"], 1),
                "prefill_ms_bf16": round(b["prefill_latency"] * 1e3, 1)}
        for label, run in runs.items():
            a, suffix = run[bs], "ap" if single else f"ap_{label}"
            case[f"decode_tok_s_{suffix}"] = round(a["median_decode_throughput"], 1)
            case[f"decode_ratio_{suffix}_vs_bf16"] = round(a["median_decode_throughput"] / b["median_decode_throughput"], 3)
            case[f"prefill_ms_{suffix}"] = round(a["prefill_latency"] * 1e3, 1)
        cases.append(case)
    out = {"meta": json.loads(args.meta), "cases": cases}
    if args.log:
        out["kv_cache_tokens"] = {label: kv_tokens(path) for label, path in (labelled(s, "?") for s in args.log)}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    suffixes = ["ap"] if single else [f"ap_{label}" for label in runs]
    head = "| batch | decode tok/s bf16 | " + " | ".join(f"decode tok/s {s} | {s} / bf16" for s in suffixes) + \
        " | prefill ms bf16 | " + " | ".join(f"prefill ms {s}" for s in suffixes) + " |"
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for c in cases:
        cells = [str(c["batch_size"]), str(c["decode_tok_s_bf16"])]
        cells += [f"{c[f'decode_tok_s_{s}']} | {c[f'decode_ratio_{s}_vs_bf16']}" for s in suffixes]
        cells += [str(c["prefill_ms_bf16"])] + [str(c[f"prefill_ms_{s}"]) for s in suffixes]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if "kv_cache_tokens" in out:
        print("KV cache tokens:", out["kv_cache_tokens"])


if __name__ == "__main__":
    main()
