"""PagedWeight with tensor parallelism (--tp 2): both ranks offload and reload in step, outputs match.

Three servers, one after another, with the same model, flags, `--tp` and `--mem-fraction-static`:

1. `stock`: stock SGLang (bf16 experts): decode throughput at each batch size.
2. `pagedweight`: `--enable-paged-weight` starting at `--paged-weight-bits`:
   decode throughput; greedy probes at the starting bits; then reloads are held
   (`set_internal_state paged_weight_hold_reloads=1`) while a burst of long requests fills the KV cache,
   so both ranks offload; once the pager is idle its plan is saved from `/get_server_info` and the probes
   run again on the held plan; the hold is released, both ranks reload, and the probes run a third time.
   The state endpoint reports every rank's digest (commits, transitions, bytes handed to the KV cache,
   KV capacity) at each iteration's exchange; the timeline keeps every rank's KV capacity.
3. `pagedweight_bits_map`: `--paged-weight-bits-map <the saved plan> --paged-weight-policy static`:
   decode throughput at the mixed plan, and the probes, which must equal the held plan's answers token
   for token.

Probes run one at a time (batch 1) after `/flush_cache`, so no answer reuses a prefix computed at other
bitwidths.

    python benchmark/tp2_bench.py --model-path /tmp/qwen15moe-dummy --load-format dummy --tp 2 \\
        --mem-fraction-static 0.33 --out out/tp2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import requests

from pagedweight.bench.burst import BurstSpec, run_burst
from pagedweight.bench.scenario import (SystemSpec, add_run_args, config_vocab_size, paged_state, run_system,
                                        server_info, start_results, write_results)


def _post(url: str, path: str, body: Optional[dict] = None, timeout: float = 120) -> Any:
    r = requests.post(url + path, json=body, timeout=timeout)
    r.raise_for_status()
    return r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") else r.text


def _flush_cache(url: str, timeout_s: float = 60.0) -> None:
    """POST /flush_cache until the server takes it: SGLang answers 400 while requests are still draining (its
    scheduler is not idle for a moment after the last answer went out, longer on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = requests.post(url + "/flush_cache", timeout=120)
        if r.ok:
            return
        if r.status_code != 400 or time.monotonic() > deadline:
            r.raise_for_status()
        time.sleep(0.5)


def probes(url: str, a: argparse.Namespace, vocab: int) -> list[dict[str, list]]:
    """Greedy answers to the probe prompts, one request at a time, from an empty prefix cache: each answer's
    token ids and their logprobs. A dummy-weight model's greedy tokens barely depend on the experts' bits,
    so the logprobs are what shows that a plan changed the numerics (and that a second server reproduces them)."""
    _flush_cache(url)
    prompts = BurstSpec(a.probes, a.probe_input_len, a.probe_output_len, vocab, seed=a.seed + 1000).prompts()
    out = []
    for ids in prompts:
        body = {"input_ids": ids, "return_logprob": True,
                "sampling_params": {"max_new_tokens": a.probe_output_len, "temperature": 0, "ignore_eos": True}}
        resp = _post(url, "/generate", body, timeout=600)
        out.append({"ids": list(resp["output_ids"]),
                    "logprobs": [float(t[0]) for t in resp["meta_info"]["output_token_logprobs"]]})
    return out


def _ids(answers: Optional[list[dict]]) -> Optional[list[list[int]]]:
    return [x["ids"] for x in answers] if answers else None


def _logprob_max_diff(a: Optional[list[dict]], b: Optional[list[dict]]) -> Optional[float]:
    """Largest |logprob difference| over the tokens two sets of answers share before their first difference."""
    if not a or not b or len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(a, b):
        for u, v, lu, lv in zip(x["ids"], y["ids"], x["logprobs"], y["logprobs"]):
            if u != v:
                break
            worst = max(worst, abs(lu - lv))
    return float(f"{worst:.3g}")


def decode_rates(url: str, a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rates: dict[str, Any] = {}
    for bs in a.batch_sizes:
        b = run_burst(url, BurstSpec(bs, a.decode_input_len, a.decode_output_len, vocab, seed=a.seed + bs))
        rates[str(bs)] = b.decode_tok_per_s if b.completed == bs else None
        print(f"  batch {bs}: decode {b.decode_tok_per_s} tok/s ({b.completed}/{bs} done)", flush=True)
    return rates


def wait_idle(url: str, timeout_s: float) -> dict[str, Any]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        pw = paged_state(server_info(url))
        if pw and not pw.get("queued_blocks") and not any((pw.get("ops") or {}).values()):
            return pw
        time.sleep(0.5)
    raise TimeoutError(f"pager not idle after {timeout_s}s")


def hold(url: str, on: bool) -> None:
    ok = _post(url, "/set_internal_state", {"server_args": {"paged_weight_hold_reloads": int(on)}})
    if ok != [True]:  # one answer per data-parallel rank
        raise RuntimeError(f"set_internal_state paged_weight_hold_reloads={int(on)} was refused: {ok}")


class Tp2Workload:
    def __init__(self, a: argparse.Namespace, vocab: int, plan_path: Path):
        self.a, self.vocab, self.plan_path = a, vocab, plan_path

    def __call__(self, url: str, i: int, info: dict[str, Any]) -> dict[str, Any]:
        a, system = self.a, info["system"]
        if system == "stock":
            return {"decode_tok_per_s": decode_rates(url, a, self.vocab)}
        if system == "pagedweight_bits_map":
            return {"decode_tok_per_s": decode_rates(url, a, self.vocab), "probes": probes(url, a, self.vocab)}
        if i == 1:  # after the quiet period that followed the released hold: every block is back
            return {"probes_reloaded": probes(url, a, self.vocab), "state": _slim(paged_state(server_info(url)))}
        r: dict[str, Any] = {"decode_tok_per_s": decode_rates(url, a, self.vocab),
                             "probes_start": probes(url, a, self.vocab),
                             # The same probes again on the same server and plan: the kernels' split-K
                             # atomics may reorder fp32 sums, so this is the baseline for "identical".
                             "probes_start_repeat": probes(url, a, self.vocab)}
        hold(url, True)
        try:
            cap = info.get("kv_max_tokens") or info["max_total_num_tokens"]
            n = a.num_requests or max(1, int(a.demand_of_max * cap // (a.input_len + a.output_len)))
            r["burst"] = run_burst(url, BurstSpec(n, a.input_len, a.output_len, self.vocab, seed=a.seed)).to_dict()
            b = r["burst"]
            print(f"[burst] {b['completed']}/{b['requests']} done, NaN logprobs {b['nan_logprobs']}", flush=True)
            held = wait_idle(url, a.quiet_timeout_s)
            snapshot = server_info(url)
            self.plan_path.write_text(json.dumps(snapshot))
            r["held_state"] = _slim(held)
            r["probes_held"] = probes(url, a, self.vocab)
        finally:
            hold(url, False)
        return r


def _slim(pw: Optional[dict]) -> Optional[dict]:
    return {k: v for k, v in (pw or {}).items() if k != "blocks"} or None


def headline(results: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["system"]: r for r in results}
    pw, mp, st = by.get("pagedweight", {}), by.get("pagedweight_bits_map", {}), by.get("stock", {})
    r0 = (pw.get("rounds") or [{}])[0]
    r1 = (pw.get("rounds") or [{}, {}])[1] if len(pw.get("rounds") or []) > 1 else {}
    held_hist = ((r0.get("held_state") or {}).get("committed_bits_histogram"))
    tp = pw.get("tp_end") or {}
    ranks = tp.get("ranks") or []
    caps = [s["tp_kv_capacity_tokens"] for s in pw.get("timeline") or [] if s.get("tp_kv_capacity_tokens")]

    def decode(r: dict) -> dict:
        return (r.get("rounds") or [{}])[0].get("decode_tok_per_s") or {}

    ratio = {bs: round(v / decode(st)[bs], 3) for bs, v in decode(pw).items() if v and decode(st).get(bs)}
    ratio_map = {bs: round(v / decode(st)[bs], 3) for bs, v in decode(mp).items() if v and decode(st).get(bs)}
    map_probes = (mp.get("rounds") or [{}])[0].get("probes")
    start, held = r0.get("probes_start"), r0.get("probes_held")
    return {
        "tp_size": tp.get("world_size"),
        "oom": sum(len(r.get("oom_lines") or []) for r in results),
        "servers_died": sum(bool(r.get("server_died")) for r in results),
        "digest_mismatches": tp.get("digest_mismatches"),
        # host time of the source rank's PagedWeight step per scheduler iteration and of its TP agreement
        # (issue #20: the per-step tax), every rank's agreement time, and the most bytes a rank sent in one exchange
        "step_overhead_us": _pct(pw.get("step_us_end")),
        "agreement_us": _pct(tp.get("agreement_us")),
        "rank_agreement_us": [_pct(h) for h in tp.get("rank_agreement_us") or []],
        "agreement_report_bytes_max": (tp.get("report_bytes") or {}).get("max"),
        "rank_transitions": [d["transitions"] for d in ranks],
        "rank_bytes_to_kv": [d["bytes_to_kv"] for d in ranks],
        "rank_kv_capacity_max_tokens": [max(c[k] for c in caps) for k in range(len(caps[0]))] if caps else None,
        "rank_kv_capacity_end_tokens": [d["kv_capacity_tokens"] for d in ranks],
        "held_plan_histogram": held_hist,
        "burst_completed": (r0.get("burst") or {}).get("completed"),
        "burst_requests": (r0.get("burst") or {}).get("requests"),
        "nan_logprobs": (r0.get("burst") or {}).get("nan_logprobs"),
        "reload_s": ((pw.get("quiets") or [{}])[0]).get("reload_s"),
        "outputs_identical_to_bits_map_server": (_ids(map_probes) == _ids(held)) if map_probes else None,
        "outputs_identical_after_reload": (_ids(r1.get("probes_reloaded")) == _ids(start)) if r1 else None,
        "outputs_repeatable_on_one_server": (_ids(r0.get("probes_start_repeat")) == _ids(start))
        if r0.get("probes_start_repeat") else None,
        "probe_prefix_agreement_bits_map": _prefix_agreement(_ids(map_probes), _ids(held)),
        "held_plan_changes_outputs": (_ids(held) != _ids(start)) if held else None,
        # Token ids alone are weak evidence on dummy weights: these say by how much the held plan moved the
        # answers' logprobs, and how far the server started at that plan (and one server repeating itself) is.
        "logprob_max_diff_held_vs_start": _logprob_max_diff(held, start),
        "logprob_max_diff_bits_map_vs_held": _logprob_max_diff(map_probes, held),
        "logprob_max_diff_reloaded_vs_start": _logprob_max_diff(r1.get("probes_reloaded"), start) if r1 else None,
        "logprob_max_diff_repeat": _logprob_max_diff(r0.get("probes_start_repeat"), start),
        "decode_tok_per_s": {name: decode(r) for name, r in by.items()},
        "decode_ratio_vs_stock": ratio,
        "decode_ratio_vs_stock_at_held_plan": ratio_map,
    }


def _pct(hist: Optional[dict]) -> Optional[dict]:
    return {k: hist.get(k) for k in ("p50_us", "p99_us", "mean_us", "count")} if hist else None


def _prefix_agreement(a: Optional[list], b: Optional[list]) -> Optional[float]:
    """Mean over probes of the fraction of output tokens before the first difference (1.0: identical)."""
    if not a or not b or len(a) != len(b):
        return None
    fr = []
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        fr.append(n / max(len(x), 1))
    return round(sum(fr) / len(fr), 4)


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# PagedWeight with tensor parallelism (--tp {doc['tp']})", "",
        f"Command: `{doc['command']}`", "",
        f"Machine: {doc['machine']}, {doc['date_utc']}. Model: {doc['model']}.", "",
        "## Headline", "",
    ]
    lines += [f"- {k} = **{v}**" for k, v in doc["headline"].items()]
    lines += ["", "## Servers", "", "| server | startup (s) | KV tokens at start | decode tok/s by batch | transitions | error |",
              "|---|---|---|---|---|---|"]
    for r in doc["systems"]:
        d = (r.get("rounds") or [{}])[0].get("decode_tok_per_s")
        lines.append(f"| {r['system']} | {r.get('startup_s')} | {r.get('kv_capacity_tokens_start', r.get('max_total_num_tokens'))} "
                     f"| {d} | {r.get('transitions')} | {r.get('error', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--bf16-model-path", default=None, help="what stock SGLang serves (default: --model-path)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--mem-fraction-static", type=float, required=True)
    p.add_argument("--systems", default="stock,pagedweight,pagedweight_bits_map")
    p.add_argument("--paged-weight-bits", type=int, default=8)
    p.add_argument("--paged-weight-min-bits", type=int, default=3)
    p.add_argument("--policy", default="hotness")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--decode-input-len", type=int, default=128)
    p.add_argument("--decode-output-len", type=int, default=256)
    p.add_argument("--probes", type=int, default=4)
    p.add_argument("--probe-input-len", type=int, default=64)
    p.add_argument("--probe-output-len", type=int, default=32)
    p.add_argument("--append", action="store_true",
                   help="keep the servers an earlier call wrote to --out and run only the missing ones (one device "
                        "call can run out of time for all three)")
    add_run_args(p, quiet_timeout_s=90.0)
    a = p.parse_args(argv)

    out, opts, cfg, doc = start_results(a, argv)
    plan = out.parent / "tp2_held_plan.json"  # the held plan's /get_server_info snapshot
    workload = Tp2Workload(a, config_vocab_size(cfg), plan)
    common = ["--load-format", a.load_format, "--tp", str(a.tp), "--mem-fraction-static", str(a.mem_fraction_static),
              "--enable-metrics"] + a.extra_server_args.split()
    pw = ("--enable-paged-weight", "--paged-weight-bits", str(a.paged_weight_bits), "--paged-weight-min-bits",
          str(a.paged_weight_min_bits), "--paged-weight-policy", a.policy)
    table = {
        "stock": SystemSpec("stock", a.bf16_model_path or a.model_path, (), 1),
        "pagedweight": SystemSpec("pagedweight", a.model_path, pw, 2),
        "pagedweight_bits_map": SystemSpec(
            "pagedweight_bits_map", a.model_path,
            ("--enable-paged-weight", "--paged-weight-bits-map", str(plan), "--paged-weight-min-bits",
             str(a.paged_weight_min_bits), "--paged-weight-policy", "static"), 1),
    }
    doc["tp"] = a.tp
    doc["workload"] = (f"decode: batches {a.batch_sizes} of {a.decode_input_len}+{a.decode_output_len} tokens; burst: "
                       f"{a.input_len}+{a.output_len}-token requests, {a.demand_of_max} x the reachable KV capacity; "
                       f"probes: {a.probes} x {a.probe_input_len}+{a.probe_output_len} greedy")
    if a.append and out.exists():
        doc["systems"] = [r for r in json.loads(out.read_text())["systems"] if not r.get("error")]
        doc["command"] += "  (appended to an earlier call's servers)"
    done = {r["system"] for r in doc["systems"]}
    for name in a.systems.split(","):
        if name in done:
            continue
        if name not in table:
            raise SystemExit(f"unknown system {name!r}; choose from {', '.join(table)}")
        if name == "pagedweight_bits_map" and not plan.exists():
            doc["systems"].append({"system": name, "error": "no held plan was saved (the pagedweight run failed)"})
            continue
        spec = table[name]
        result = run_system(spec, common, lambda url, i, info, _n=name: workload(url, i, {**info, "system": _n}), opts)
        doc["systems"].append(result)
        doc["headline"] = headline(doc["systems"])
        out.write_text(json.dumps(doc, indent=1))  # after every server: a later failure keeps what ran
    doc["headline"] = headline(doc["systems"])
    write_results(out, doc, markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
