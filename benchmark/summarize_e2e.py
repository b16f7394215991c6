#!/usr/bin/env python3
"""Issues #18 / #19 end to end: bench_one_batch runs of one device call -> docs/results/e2e_decode.json's headline.

    python benchmark/summarize_e2e.py --dir out/gpu --merge docs/results/e2e_decode.json --out out/gpu/e2e_decode.json \
        --meta '{"commit": "...", "session": 27}'

`--dir` holds `e2e_<model>_<system>.jsonl` (gpu_session.sh's `e2e` stage; systems bf16 and fp8 are stock SGLang,
`--quantization fp8` for the latter, ap4 / ap4_all PagedWeight at 4 bits with --paged-weight-scope experts / all).
Per model and batch size the headline holds, each `{model: {batch: x}}`:
- `decode_ratio_vs_stock_fp8`: PagedWeight experts-scope decode throughput over stock fp8's (the issue's target key),
  `decode_ratio_vs_stock_fp8_scope_all` the same for scope all;
- `decode_ratio_vs_stock_bf16` (and `_scope_all`);
- `prefill_ratio_vs_stock_bf16`: stock bf16's prefill time over PagedWeight's (> 1: PagedWeight faster), and
  `prefill_ratio_vs_stock_fp8`.
A model whose run misses a system has no entry in the keys that need it. The headline names a model run with fewer
layers (`mixtral_16l`) by its family (`mixtral`) and records the layer count in `headline_layers`. `--merge` keeps
every key of an existing file (the older sessions' cases) and the runs of the models this call did not run (one
model per device call: the headline covers all of them), replacing this call's models; `e2e_meta` keeps each
model's meta (commit, machine, call).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

SYSTEMS = ("bf16", "fp8", "ap4", "ap4_all")
NAME = re.compile(r"^e2e_(?P<model>.+)_(?P<system>bf16|fp8|ap4_all|ap4)\.jsonl$")
LAYERS = re.compile(r"^(?P<family>.+)_(?P<layers>\d+)l$")  # gpu_session.sh's tag of a run with --num-layers


def load_runs(directory: Path) -> dict[str, dict[str, dict[int, dict]]]:
    """{model: {system: {batch: bench_one_batch row}}} of every e2e result file in `directory`."""
    runs: dict[str, dict[str, dict[int, dict]]] = {}
    for path in sorted(directory.glob("e2e_*.jsonl")):
        m = NAME.match(path.name)
        if m is None:
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows:
            runs.setdefault(m["model"], {})[m["system"]] = {int(r["batch_size"]): r for r in rows}
    return runs


def _ratio(runs: dict, num: str, den: str, field: str, invert: bool = False) -> dict[str, float]:
    """{batch: num / den} over the batches both systems ran (den / num with `invert`: times, not throughputs)."""
    a, b = runs.get(num), runs.get(den)
    if not a or not b:
        return {}
    out = {}
    for bs in sorted(set(a) & set(b)):
        x, y = float(a[bs][field]), float(b[bs][field])
        out[str(bs)] = round(y / x if invert else x / y, 3)
    return out


# headline key -> (numerator system, denominator system, field, invert: a time, so denominator over numerator)
RATIOS = {
    "decode_ratio_vs_stock_fp8": ("ap4", "fp8", "median_decode_throughput", False),
    "decode_ratio_vs_stock_fp8_scope_all": ("ap4_all", "fp8", "median_decode_throughput", False),
    "decode_ratio_vs_stock_bf16": ("ap4", "bf16", "median_decode_throughput", False),
    "decode_ratio_vs_stock_bf16_scope_all": ("ap4_all", "bf16", "median_decode_throughput", False),
    "prefill_ratio_vs_stock_bf16": ("ap4", "bf16", "prefill_latency", True),
    "prefill_ratio_vs_stock_fp8": ("ap4", "fp8", "prefill_latency", True),
}


def family(tag: str) -> str:
    m = LAYERS.match(tag)
    return m["family"] if m else tag


def headline(runs: dict) -> dict:
    return {key: {family(model): r for model, sys_runs in runs.items() if (r := _ratio(sys_runs, *spec))}
            for key, spec in RATIOS.items()}


def runs_of(e2e_runs: dict) -> dict:
    """e2e_decode.json's `e2e_runs` ({model: {system: [rows]}}) back into load_runs' form."""
    return {model: {system: {int(r["batch_size"]): r for r in rows} for system, rows in sys_runs.items()}
            for model, sys_runs in e2e_runs.items()}


def table(runs: dict) -> str:
    lines = ["| model | batch | decode tok/s bf16 / fp8 / ap4 / ap4_all | ap4 vs fp8 | ap4_all vs fp8 | "
             "prefill ms bf16 / fp8 / ap4 | prefill bf16 / ap4 |", "|---|---|---|---|---|---|---|"]
    for model, sys_runs in runs.items():
        batches = sorted(set().union(*[set(r) for r in sys_runs.values()]))
        for bs in batches:
            def cell(system, field, scale=1.0, nd=1):
                row = sys_runs.get(system, {}).get(bs)
                return f"{float(row[field]) * scale:.{nd}f}" if row else "-"

            dec = " / ".join(cell(s, "median_decode_throughput") for s in SYSTEMS)
            pre = " / ".join(cell(s, "prefill_latency", 1e3) for s in ("bf16", "fp8", "ap4"))
            r = {k: _ratio(sys_runs, *RATIOS[k]).get(str(bs), "-") for k in (
                "decode_ratio_vs_stock_fp8", "decode_ratio_vs_stock_fp8_scope_all", "prefill_ratio_vs_stock_bf16")}
            lines.append(f"| {model} | {bs} | {dec} | {r['decode_ratio_vs_stock_fp8']} | "
                         f"{r['decode_ratio_vs_stock_fp8_scope_all']} | {pre} | {r['prefill_ratio_vs_stock_bf16']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="where the e2e_<model>_<system>.jsonl files are")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--merge", type=Path, default=None, help="an existing e2e_decode.json whose keys are kept")
    ap.add_argument("--meta", type=str, default="{}", help="JSON object: this run's commit, machine, command, call")
    args = ap.parse_args()
    runs = load_runs(args.dir)
    if not runs:
        raise SystemExit(f"{args.dir}: no e2e_<model>_<system>.jsonl files (run gpu_session.sh e2e first)")
    doc = json.loads(args.merge.read_text()) if args.merge is not None and args.merge.exists() else {}
    meta = json.loads(args.meta)
    merged = {**runs_of(doc.get("e2e_runs", {})), **runs}  # this call's models replace theirs
    doc["headline"] = headline(merged)
    doc["headline_layers"] = {family(m): int(LAYERS.match(m)["layers"]) for m in merged if LAYERS.match(m)}
    doc["headline_meta"] = meta
    doc["e2e_meta"] = {**doc.get("e2e_meta", {}), **{model: meta for model in runs}}
    doc["e2e_runs"] = {model: {system: [rows[bs] for bs in sorted(rows)] for system, rows in sys_runs.items()}
                       for model, sys_runs in merged.items()}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(runs))


if __name__ == "__main__":
    main()
