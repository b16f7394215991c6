"""The long-context pressure scenario: LongBench-format work at one fixed GPU budget, three systems.

Systems (same model, same flags, same `--mem-fraction-static`, hence the same GPU budget for weights + KV):
  static_bf16     stock SGLang serving the bf16 checkpoint
  uniform_apQ     PagedWeight with every expert block fixed at Q bits (`--paged-weight-policy static`)
  pagedweight     PagedWeight starting at the parent bits, lowering bitwidths under KV pressure (quality policy)

Each system answers the same LongBench-format files through `pagedweight-longbench run` (OpenAI API, greedy,
streamed for time to first token, `--concurrency` in flight) while a sampler records the bitwidth of every
block, the KV capacity, KV and weight bytes over time. Written: per system the scores, requests completed,
retractions, TTFT mean/P99, output throughput, GPU budget, and the timeline (see --plot for the figure).

The budget: `--bf16-kv-tokens T` sets f so that stock bf16 gets about T KV tokens:
f = (bf16 checkpoint bytes + T x KV bytes per token) / free GPU memory before start. Or give
`--mem-fraction-static` directly.

    python benchmark/longbench_pressure.py --ap-model AP_DIR --bf16-model HF_DIR --data-dir LB_DIR \\
        --bf16-kv-tokens 16000 --uniform-bits 3 --out out/longbench.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from pagedweight.bench.scenario import RunOptions, SystemSpec, machine_description, run_system


def kv_bytes_per_token(cfg: dict[str, Any], dtype_bytes: int = 2) -> int:
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return int(cfg["num_hidden_layers"]) * 2 * kv_heads * head_dim * dtype_bytes


def checkpoint_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def fraction_for_kv_tokens(bf16_dir: Path, tokens: int) -> tuple[float, dict[str, Any]]:
    import torch

    free, total = torch.cuda.mem_get_info()
    cfg = json.loads((bf16_dir / "config.json").read_text())
    need = checkpoint_bytes(bf16_dir) + tokens * kv_bytes_per_token(cfg)
    # SGLang measures "free before load" inside the server, after its own CUDA context (~0.5 GiB) exists.
    pre = free - (512 << 20)
    f = round(need / pre, 5)
    return f, {"gpu_free_bytes": free, "gpu_total_bytes": total, "budget_bytes": need, "bf16_kv_tokens_target": tokens}


class LongBenchWorkload:
    def __init__(self, a: argparse.Namespace, runs_dir: Path):
        self.a, self.runs_dir = a, runs_dir
        self.current = ""

    def __call__(self, url: str, i: int, info: dict[str, Any]) -> dict[str, Any]:
        a = self.a
        out = self.runs_dir / f"{self.current}-{i}"
        cmd = [sys.executable, "-m", "pagedweight.longbench", "run", "--data-dir", str(a.data_dir), "--out", str(out),
               "--base-url", url, "--stream", "--concurrency", str(a.concurrency), "--max-prompt-tokens",
               str(a.max_prompt_tokens), "--no-progress"]
        if a.limit:
            cmd += ["--limit", str(a.limit)]
        if a.datasets:
            cmd += ["--datasets", a.datasets]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"pagedweight-longbench failed ({proc.returncode}): {proc.stderr[-2000:]}")
        rep = json.loads((out / "results.json").read_text())
        t = rep.get("this_run") or {}
        scores = {d: s["score"] for d, s in rep["scores"].items()}
        r = {
            "scores": scores,
            "average": rep.get("average"),
            "completed": sum(s["n_scored"] for s in rep["scores"].values()),
            "samples": sum(s["n_samples"] for s in rep["scores"].values()),
            "ttft_mean_s": t.get("ttft_mean_s"),
            "ttft_p99_s": t.get("ttft_p99_s"),
            "output_tok_per_s": t.get("output_throughput_tok_s"),
            "latency_mean_s": t.get("latency_mean_s"),
            "wall_s": round(wall, 1),
            "truncated_prompts": t.get("truncated_prompts"),
        }
        print(f"[{self.current}] average {r['average']}, {r['completed']}/{r['samples']} answered, "
              f"{r['output_tok_per_s']} tok/s, TTFT mean {r['ttft_mean_s']} s", flush=True)
        return r


def agreement_with_reference(runs: Path, system: str, reference: str, datasets: list[str]) -> Optional[dict[str, Any]]:
    """How close a system's answers are to the reference system's (stock bf16) on the same samples: the
    share of identical answers and the mean ROUGE-L F1 between them. With a small model the task scores sit
    near their floor, so fidelity to bf16 is the sharper signal of what lower bitwidths cost."""
    from pagedweight.longbench.metrics import rouge_score
    from pagedweight.longbench.predictions import predictions_path, read_predictions

    same, rouge, n = 0, 0.0, 0
    for d in datasets:
        ref = read_predictions(predictions_path(runs / f"{reference}-0", d))
        mine = read_predictions(predictions_path(runs / f"{system}-0", d))
        for sid, rec in mine.items():
            if sid in ref:
                n += 1
                a, b = rec.pred.strip(), ref[sid].pred.strip()
                same += a == b
                rouge += 1.0 if a == b else (rouge_score(a, b) if a and b else 0.0)
    if n == 0:
        return None
    return {"samples": n, "identical": round(same / n, 4), "rouge_l_vs_reference": round(rouge / n, 4)}


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Long-context pressure: LongBench-format work at one GPU budget", "",
        f"Command: `{doc['command']}`", "",
        f"Machine: {doc['machine']}, {doc['date_utc']}. Budget: {doc['budget']}.", "",
        "| system | KV tokens start / max | retractions | answered | average score | "
        + " | ".join(doc.get("datasets", [])) + " | identical to bf16 / ROUGE-L vs bf16 | TTFT mean / P99 (s) | output tok/s | mean bits at end |",
        "|---|---|---|---|---|" + "---|" * len(doc.get("datasets", [])) + "---|---|---|---|",
    ]
    for r in doc["systems"]:
        rd = (r.get("rounds") or [{}])[0]
        sc = rd.get("scores") or {}
        tl = r.get("timeline") or []
        end_bits = next((s["mean_bits"] for s in reversed(tl) if s.get("mean_bits") is not None), None)
        start = r.get("kv_capacity_tokens_start", r.get("max_total_num_tokens"))
        lines.append(
            f"| {r['system']} | {start} / {r.get('kv_max_tokens', start)} | {r.get('retractions')} | "
            f"{rd.get('completed')}/{rd.get('samples')} | {rd.get('average')} | "
            + " | ".join(str(sc.get(d)) for d in doc.get("datasets", []))
            + f" | {(r.get('agreement') or {}).get('identical')} / {(r.get('agreement') or {}).get('rouge_l_vs_reference')}"
            + f" | {rd.get('ttft_mean_s')} / {rd.get('ttft_p99_s')} | {rd.get('output_tok_per_s')} | {end_bits} |"
            + (f" error: {r['error']}" if r.get("error") else ""))
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ap-model", type=Path, required=True)
    p.add_argument("--bf16-model", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--datasets", default=None, help="comma-separated subset of the data dir's files")
    p.add_argument("--limit", type=int, default=None, help="samples per dataset")
    p.add_argument("--systems", default="pagedweight,static_bf16,uniform_ap")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--bf16-kv-tokens", type=int, help="size the budget so stock bf16 gets about this many KV tokens")
    g.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--uniform-bits", type=int, default=3)
    p.add_argument("--pw-bits", type=int, default=8)
    p.add_argument("--pw-min-bits", type=int, default=3)
    p.add_argument("--policy", default="quality")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=7500)
    p.add_argument("--sample-interval-s", type=float, default=1.0)
    p.add_argument("--start-timeout-s", type=float, default=480.0,
                   help="a fresh GPU machine JIT-compiles and captures prefill graphs at the first start (seen: 303 s)")
    p.add_argument("--extra-server-args", default="")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)

    a.out.parent.mkdir(parents=True, exist_ok=True)
    runs = a.out.parent / "longbench_runs"
    opts = RunOptions(a.out.parent / "logs", a.sample_interval_s, a.start_timeout_s)
    opts.log_dir.mkdir(exist_ok=True)
    budget: dict[str, Any]
    if a.bf16_kv_tokens is not None:
        f, budget = fraction_for_kv_tokens(a.bf16_model, a.bf16_kv_tokens)
    else:
        f, budget = a.mem_fraction_static, {}
    budget["mem_fraction_static"] = f
    common = ["--mem-fraction-static", str(f), "--enable-metrics"] + a.extra_server_args.split()
    pw = ("--enable-paged-weight", "--paged-weight-bits", str(a.pw_bits), "--paged-weight-min-bits", str(a.pw_min_bits),
          "--paged-weight-policy", a.policy)
    table = {
        "pagedweight": SystemSpec("pagedweight", str(a.ap_model), pw),
        "static_bf16": SystemSpec("static_bf16", str(a.bf16_model), ()),
        "uniform_ap": SystemSpec(f"uniform_ap{a.uniform_bits}", str(a.ap_model),
                                 ("--enable-paged-weight", "--paged-weight-bits", str(a.uniform_bits),
                                  "--paged-weight-policy", "static")),
    }
    workload = LongBenchWorkload(a, runs)
    datasets = sorted(x.stem for x in a.data_dir.glob("*.jsonl"))
    if a.datasets:
        datasets = [d for d in datasets if d in a.datasets.split(",")]
    doc: dict[str, Any] = {
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "machine": machine_description(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "budget": budget,
        "datasets": datasets,
        "systems": [],
    }
    for name in a.systems.split(","):
        spec = table[name]
        workload.current = spec.name
        r = run_system(spec, common, workload, opts)
        r["gpu_budget"] = budget
        doc["systems"].append(r)
        a.out.write_text(json.dumps(doc, indent=1))
    if any(r["system"] == "static_bf16" and r.get("rounds") for r in doc["systems"]):
        for r in doc["systems"]:
            if r.get("rounds"):
                r["agreement"] = agreement_with_reference(runs, r["system"], "static_bf16", datasets)
        a.out.write_text(json.dumps(doc, indent=1))
    a.out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
