"""KV pressure, side by side: stock SGLang (bf16 experts) vs PagedWeight at the same GPU budget.

Every system is one `python -m sglang.launch_server` with the same model, flags and `--mem-fraction-static`.
SGLang sizes its KV cache as (free memory after loading the weights) - (free memory before) * (1 - f), so an
equal f is an equal GPU budget for weights + KV: smaller AP experts leave more room for the KV cache, and
PagedWeight's elastic KV cache grows further only into bytes its experts give back.

Per system: bursts of concurrent long requests (streamed, greedy, ignore_eos, output log-probabilities checked
for NaN), each followed on PagedWeight by a quiet period until every block is back at its starting bitwidth;
the KV/weights/bitwidth timeline, SGLang's retraction counter and OOMs are recorded (pagedweight.bench.scenario).

The number of requests per burst: `--num-requests`, or `--demand-of-max` x the largest KV capacity the first
system can reach (PagedWeight's elastic maximum), in whole requests; every system gets the same requests.

    python benchmark/pressure_bench.py --model-path /tmp/qwen15moe-dummy --load-format dummy \\
        --mem-fraction-static 0.33 --out out/pressure.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from pagedweight.bench.burst import BurstSpec, run_burst
from pagedweight.bench.scenario import SystemSpec, add_run_args, config_vocab_size, run_system, start_results


def systems_from_args(a: argparse.Namespace) -> list[SystemSpec]:
    pw = ("--enable-paged-weight", "--paged-weight-bits", str(a.paged_weight_bits), "--paged-weight-min-bits",
          str(a.paged_weight_min_bits), "--paged-weight-policy", a.policy)
    ap, bf16 = a.model_path, a.bf16_model_path or a.model_path
    table = {
        "pagedweight": SystemSpec("pagedweight", ap, pw, a.bursts),
        "pagedweight_poison": SystemSpec("pagedweight_poison", ap, pw + ("--paged-weight-debug-poison",), a.poison_bursts),
        "static_bf16": SystemSpec("static_bf16", bf16, (), 1),
        "static_ap": SystemSpec("static_ap", ap, pw[:3] + ("--paged-weight-policy", "static"), 1),
    }
    unknown = [n for n in a.systems.split(",") if n not in table]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {', '.join(table)}")
    return [table[n] for n in a.systems.split(",")]


class BurstWorkload:
    """The same bursts for every system; the request count is fixed by the first system that runs."""

    def __init__(self, a: argparse.Namespace, vocab: int):
        self.a, self.vocab = a, vocab
        self.num_requests: Optional[int] = a.num_requests

    def __call__(self, url: str, i: int, info: dict[str, Any]) -> dict[str, Any]:
        a = self.a
        if self.num_requests is None:
            cap = info.get("kv_max_tokens") or info["max_total_num_tokens"]
            self.num_requests = max(1, int(a.demand_of_max * cap // (a.input_len + a.output_len)))
        info["num_requests"] = self.num_requests
        spec = BurstSpec(self.num_requests, a.input_len, a.output_len, self.vocab, seed=a.seed + i)
        b = run_burst(url, spec).to_dict()
        print(f"[burst {i}] {b['completed']}/{b['requests']} done, {b['output_tok_per_s']} tok/s, TTFT mean "
              f"{b['ttft_mean_s']}s, NaN logprobs {b['nan_logprobs']}", flush=True)
        return b


def headline(results: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["system"]: r for r in results}
    bf = by.get("static_bf16", {})
    poison = by.get("pagedweight_poison", {})
    # Throughput from the run without poison fills when it ran; else from the poison run (a lower bound).
    pw = by.get("pagedweight") or poison
    paged = [r for r in results if r["system"].startswith("pagedweight")]

    def first_tps(r: dict) -> Optional[float]:
        return r["rounds"][0]["output_tok_per_s"] if r.get("rounds") else None

    ratio = round(first_tps(pw) / first_tps(bf), 3) if first_tps(pw) and first_tps(bf) else None
    return {
        "oom": sum(len(r.get("oom_lines", [])) + int(bool(r.get("server_died"))) for r in paged),
        "poison_nan": sum(b["nan_logprobs"] for b in poison["rounds"]) if poison.get("rounds") else None,
        "transitions": sum(r.get("transitions") or 0 for r in paged),
        "retractions_pagedweight": pw.get("retractions"),
        "retractions_static_bf16": bf.get("retractions"),
        "throughput_ratio_vs_static_bf16": ratio,
    }


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# KV pressure: PagedWeight vs stock SGLang at the same GPU budget", "",
        f"Command: `{doc['command']}`", "",
        f"Machine: {doc['machine']}, {doc['date_utc']}. Model: {doc['model']}. Workload: {doc['workload']}.", "",
        "## Headline", "",
    ]
    lines += [f"- {k} = **{v}**" for k, v in doc["headline"].items()]
    lines += ["", "## Per system (first burst; poison run: every burst)", "",
              "| system | KV tokens at start | KV max | requests | retractions | completed | output tok/s | TTFT mean / P99 (s) | NaN logprobs | transitions | reload after burst (s) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["systems"]:
        b = (r.get("rounds") or [{}])[0]
        q = (r.get("quiets") or [{}])[0]
        start = r.get("kv_capacity_tokens_start", r.get("max_total_num_tokens"))
        lines.append(
            f"| {r['system']} | {start} | {r.get('kv_max_tokens', start)} | {r.get('num_requests')} | "
            f"{r.get('retractions')} | {b.get('completed')}/{b.get('requests')} | {b.get('output_tok_per_s')} | "
            f"{b.get('ttft_mean_s')} / {b.get('ttft_p99_s')} | {sum(x['nan_logprobs'] for x in r.get('rounds', []))} | "
            f"{r.get('transitions')} | {q.get('reload_s')} |" + (f" error: {r['error']}" if r.get("error") else ""))
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="what PagedWeight serves (AP checkpoint, or a config-only dir with dummy)")
    p.add_argument("--bf16-model-path", default=None,
                   help="HF checkpoint stock SGLang serves for static_bf16 (default: --model-path)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--mem-fraction-static", type=float, required=True)
    p.add_argument("--systems", default="pagedweight_poison,static_bf16,pagedweight")
    p.add_argument("--paged-weight-bits", type=int, default=8)
    p.add_argument("--paged-weight-min-bits", type=int, default=3)
    p.add_argument("--policy", default="hotness")
    p.add_argument("--bursts", type=int, default=1, help="bursts for the 'pagedweight' system")
    p.add_argument("--poison-bursts", type=int, default=2)
    add_run_args(p, quiet_timeout_s=60.0)
    a = p.parse_args(argv)

    out, opts, cfg, doc = start_results(a, argv)
    workload = BurstWorkload(a, config_vocab_size(cfg))
    common = ["--load-format", a.load_format, "--mem-fraction-static", str(a.mem_fraction_static), "--enable-metrics"]
    common += a.extra_server_args.split()
    doc["workload"] = (f"bursts of N concurrent requests of {a.input_len} random prompt tokens + {a.output_len} output "
                       "tokens (greedy, ignore_eos); N fixed by the first system")
    for spec in systems_from_args(a):
        doc["systems"].append(run_system(spec, common, workload, opts))
        doc["headline"] = headline(doc["systems"])
        out.write_text(json.dumps(doc, indent=1))  # after every system: a later failure keeps what ran
    out.with_suffix(".md").write_text(markdown(doc))
    print(json.dumps(doc["headline"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
