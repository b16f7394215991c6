"""Assemble docs/results/pressure.json from two pressure_bench runs: the headline run and the poison run.

The headline run is the workload where stock SGLang retracts (long outputs: it admits on an estimate of
0.7 x max_new_tokens and retracts once decode outgrows the cache); the poison run (`--paged-weight-debug-
poison`, freed planes filled with NaN) is where "poison_nan" comes from. Each run keeps its own command.

Retractions are recounted from the servers' logs ("KV cache pool is full. Retract requests. #retracted_reqs:
N") when the logs are given: results written before the /metrics reader was fixed (it looked for
`sglang:num_retracted_reqs_total`; SGLang 0.5.17 exports `sglang:num_retracted_requests_total`) read 0.

    python benchmark/pressure_report.py --run out/pressure.json --run-logs out/pressure_logs.tgz \\
        --poison-run docs/results/pressure.json --out docs/results/pressure.json
"""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path
from typing import Any, Optional

from pagedweight.bench.prometheus import retractions_in_log


def logged_retractions(tgz: Path) -> dict[str, int]:
    """System name -> retractions in its server log (logs/server_<system>.log inside the archive)."""
    out = {}
    with tarfile.open(tgz) as tar:
        for m in tar.getmembers():
            name = Path(m.name).name
            if m.isfile() and name.startswith("server_") and name.endswith(".log"):
                text = tar.extractfile(m).read().decode("utf-8", "replace")
                out[name[len("server_"):-len(".log")]] = retractions_in_log(text.splitlines())
    return out


def _by(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["system"]: s for s in doc["systems"]}


def report(run: dict[str, Any], poison: Optional[dict[str, Any]], logged: dict[str, int]) -> dict[str, Any]:
    for s in run["systems"]:
        if s["system"] in logged:
            s["retractions_metric_at_run_time"] = s.get("retractions")
            s["retractions"] = s["retractions_logged"] = logged[s["system"]]
    by = _by(run)
    pw, bf = by["pagedweight"], by["static_bf16"]
    tps = lambda r: r["rounds"][0]["output_tok_per_s"]  # noqa: E731
    poison_sys = [s for s in (poison or {}).get("systems", []) if s["system"] == "pagedweight_poison"]
    headline = {
        "oom": sum(len(s.get("oom_lines") or []) for s in run["systems"] + list((poison or {}).get("systems", []))),
        "poison_nan": sum(r["nan_logprobs"] for s in poison_sys for r in s["rounds"]) if poison_sys else None,
        "transitions": pw.get("transitions"),
        "retractions_pagedweight": pw["retractions"],
        "retractions_static_bf16": bf["retractions"],
        "throughput_ratio_vs_static_bf16": round(tps(pw) / tps(bf), 3),
    }
    return {
        "headline": headline,
        "headline_sources": {
            "poison_nan": "poison_run (pagedweight_poison, every burst)",
            "oom": "both runs, every server",
            "others": "this run (the workload where stock SGLang retracts)",
        },
        **{k: v for k, v in run.items() if k != "headline"},
        "retractions_note": "recounted from the server logs (pagedweight.bench.prometheus.retractions_in_log); the "
        "/metrics reader at run time looked for a wrong counter name and read 0 (fixed since)" if logged else None,
        "poison_run": poison,
        "poison_run_note": "the poison run's own retraction counts were read with the wrong counter name and its "
        "server logs were not kept, so they cannot be recounted: use its NaN/OOM/transition counts, not its "
        "retractions" if poison and not any("retractions_logged" in s for s in poison.get("systems", [])) else None,
    }


def markdown(doc: dict[str, Any]) -> str:
    h = doc["headline"]
    lines = ["# KV pressure: PagedWeight vs stock SGLang at the same GPU budget", "",
             f"Machine: {doc['machine']}, {doc['date_utc']}. Model: {doc['model']}.", "",
             "## Headline", ""]
    lines += [f"- {k} = **{v}**" for k, v in h.items()]
    lines += ["", f"Sources: {doc['headline_sources']}.", "", "## Retraction run", "",
              f"Command: `{doc['command']}`", "", f"Workload: {doc['workload']}.", "",
              "| system | KV tokens start / max reached | retractions | completed | output tok/s | TTFT mean / P99 (s) | "
              "median latency (s) | transitions | min mean bits |", "|---|---|---|---|---|---|---|---|---|"]
    for s in doc["systems"]:
        b = s["rounds"][0]
        tl = s.get("timeline") or []
        caps = [t["token_capacity"] for t in tl if t.get("token_capacity")]
        bits = [t["mean_bits"] for t in tl if t.get("mean_bits") is not None]
        start = s.get("kv_capacity_tokens_start", s.get("max_total_num_tokens"))
        lines.append(f"| {s['system']} | {start} / {max(caps) if caps else start} | {s['retractions']} | "
                     f"{b['completed']}/{b['requests']} | {b['output_tok_per_s']} | {b['ttft_mean_s']} / {b['ttft_p99_s']} | "
                     f"{b['latency_median_s']} | {s.get('transitions')} | {min(bits) if bits else ''} |")
    p = doc.get("poison_run")
    if p:
        lines += ["", "## Poison run", "", f"Commands: {p.get('commands') or p.get('command')}", "",
                  f"Workload: {p.get('workload')}. Its own headline: {p.get('headline')}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="pressure_bench results with static_bf16 and pagedweight")
    ap.add_argument("--run-logs", type=Path, default=None, help="its pressure_logs.tgz (recount retractions)")
    ap.add_argument("--poison-run", type=Path, default=None, help="results holding pagedweight_poison")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    run = json.loads(a.run.read_text())
    poison = json.loads(a.poison_run.read_text()) if a.poison_run else None
    if poison and "poison_run" in poison:  # an earlier report: take its poison run, not the report
        poison = poison["poison_run"] or poison
    logged = logged_retractions(a.run_logs) if a.run_logs else {}
    doc = report(run, poison, logged)
    a.out.write_text(json.dumps(doc, indent=1))
    a.out.with_suffix(".md").write_text(markdown(doc))
    print(json.dumps(doc["headline"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
