#!/usr/bin/env python3
"""GPU kernel time of one forward by category and by kernel, from torch profiler chrome traces, side by side.

    python3 benchmark/trace_kernels.py --trace bf16=A.trace.json.gz --trace ap4=B.trace.json.gz \
        --out OUT.json [--layers 48] [--top 15]

Each trace is what `bench_one_batch --profile --profile-stage prefill` writes (SGLANG_TORCH_PROFILER_DIR): the
events of category "kernel" (kernels inside CUDA graph replays included, as CUPTI reports them) are summed by name
and sorted into categories by the first pattern of `CATEGORIES` that matches the name. The first trace is the
baseline: every category's time is also given as a difference from it, per forward and (with `--layers`) per
layer, so "where does the end-to-end prefill gap go" reads off one table: the MoE kernels against stock's fused
MoE, and anything that changed besides them.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from dataclasses import dataclass, field

# (category, pattern): first match wins. The AP MoE path's own kernels (CUDA, NVRTC: ap_*; Triton: _ap_*,
# _dequant_kernel, _dense_moe_kernel, _moe_align_kernel) and stock SGLang's fused MoE (Triton fused_moe_kernel,
# sgl-kernel's alignment and sums) are kept apart from the rest of the model.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("moe_ap", r"^(ap_|_ap_|_dequant_kernel|_dense_moe_kernel|_moe_align_kernel|_gate_mul_kernel)"),
    ("moe_stock", r"fused_moe|moe_align|moe_sum|count_and_sort|compute_identity|moe_fused_gate"),
    ("router_topk", r"topk|top_k|softmax|grouped_topk|biased_grouped"),
    ("attention", r"attn|attention|flash|fmha|_fwd_kernel|extend|decode_kernel|mla"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|sm90_|sm80_|Kernel2|cublas|matmul|splitK|wgmma"),
    ("norm", r"rms|norm"),
    ("copy_cast", r"copy|cast|convert|Memcpy|Memset|fill|cat_|CatArray|index"),
)
OTHER = "other"


@dataclass
class TraceSummary:
    label: str
    path: str
    kernels: int = 0
    total_us: float = 0.0
    by_category: dict[str, float] = field(default_factory=dict)
    by_kernel: dict[str, tuple[float, int]] = field(default_factory=dict)  # name -> (us, launches)


def category_of(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return cat
    return OTHER


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise SystemExit(f"trace_kernels: {path} holds no traceEvents list: pass a torch profiler chrome trace")
    return events


def summarize(label: str, path: str) -> TraceSummary:
    s = TraceSummary(label, path)
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for ev in load_events(path):
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            per_kernel[ev["name"]].append(float(ev.get("dur", 0.0)))
    if not per_kernel:
        raise SystemExit(f"trace_kernels: {path} has no GPU kernel events: profile with GPU activities "
                         f"(bench_one_batch --profile --profile-activities CPU GPU)")
    cats: dict[str, float] = collections.defaultdict(float)
    for name, durs in per_kernel.items():
        t = sum(durs)
        s.by_kernel[name] = (round(t, 1), len(durs))
        cats[category_of(name)] += t
        s.kernels += len(durs)
        s.total_us += t
    s.total_us = round(s.total_us, 1)
    s.by_category = {c: round(cats.get(c, 0.0), 1) for c in [c for c, _ in CATEGORIES] + [OTHER]}
    return s


def report(summaries: list[TraceSummary], layers: int | None, top: int) -> dict:
    base = summaries[0]
    out: dict = {"baseline": base.label, "layers": layers, "traces": {}}
    for s in summaries:
        diff = {c: round(v - base.by_category[c], 1) for c, v in s.by_category.items()}
        entry = {
            "path": s.path, "kernels": s.kernels, "total_us": s.total_us, "by_category_us": s.by_category,
            "diff_vs_baseline_us": diff, "total_diff_vs_baseline_us": round(s.total_us - base.total_us, 1),
            "top_kernels": [{"name": n[:160], "us": t, "launches": k, "category": category_of(n)}
                            for n, (t, k) in sorted(s.by_kernel.items(), key=lambda kv: -kv[1][0])[:top]],
        }
        if layers:
            entry["diff_vs_baseline_us_per_layer"] = {c: round(v / layers, 1) for c, v in diff.items()}
        out["traces"][s.label] = entry
    return out


def table(rep: dict) -> str:
    labels = list(rep["traces"])
    cats = list(rep["traces"][labels[0]]["by_category_us"])
    head = "| category | " + " | ".join(f"{l} us" for l in labels) + " | " + \
        " | ".join(f"{l} - {rep['baseline']}" for l in labels[1:]) + " |"
    rows = [head, "|" + "---|" * (1 + 2 * len(labels) - 1)]
    for c in cats + ["total"]:
        vals = [rep["traces"][l]["total_us" if c == "total" else "by_category_us"] for l in labels]
        vals = [v if c == "total" else v[c] for v in vals]
        diffs = [rep["traces"][l]["total_diff_vs_baseline_us" if c == "total" else "diff_vs_baseline_us"]
                 for l in labels[1:]]
        diffs = [d if c == "total" else d[c] for d in diffs]
        rows.append(f"| {c} | " + " | ".join(f"{v:.1f}" for v in vals) + " | " +
                    " | ".join(f"{d:+.1f}" for d in diffs) + " |")
    return "\n".join(rows)


def parse_trace_arg(text: str) -> tuple[str, str]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"--trace takes LABEL=PATH, got {text!r}")
    return label, path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append", type=parse_trace_arg, required=True,
                    help="LABEL=PATH of a chrome trace (.json or .json.gz); the first is the baseline")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="the model's layers: differences also per layer")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per trace, by time")
    args = ap.parse_args(argv)
    labels = [label for label, _ in args.trace]
    if len(set(labels)) != len(labels):
        ap.error(f"--trace labels must differ, got {labels}")
    rep = report([summarize(label, path) for label, path in args.trace], args.layers, args.top)
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    print(table(rep))
    for label, entry in rep["traces"].items():
        print(f"\n{label}: top kernels")
        for k in entry["top_kernels"]:
            print(f"  {k['us']:10.1f} us  x{k['launches']:<5} {k['category']:<11} {k['name'][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
