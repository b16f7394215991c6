#!/usr/bin/env python3
"""PagedWeight's per-iteration cost under tensor parallelism, two TP processes on one machine (issue #20).

    python benchmark/tp_overhead_bench.py --model qwen15moe --out docs/results/tp_overhead.json

SGLang's launcher cannot put two TP ranks on one GPU (NCCL refuses duplicate GPUs, SGLang asserts
gpu_id_step >= 1), so this harness starts the ranks itself: `--tp` processes (torch.multiprocessing, spawn) in one
gloo process group, as SGLang's TP CPU group is, each on cuda:0 when CUDA exists (CPU otherwise). Each rank builds
the real PagedWeight runtime for its shard of the model's expert blocks (random AP planes at the real shard shapes,
as `--load-format dummy` serves), a real SGLang KV pool + allocator made elastic, and the serving side through the
scheduler hooks a server runs (python/pagedweight/bench/tp_overhead.py says exactly what is built and by whom).

Measured per rank, in the same run:

- the whole PagedWeight per-iteration step (the two `get_next_batch_to_run` BEFORE hooks: the elastic KV poll and
  PagedWeightScheduler.step with its TpStepSync agreement, controller and pager boundary), host time, p50/p99,
  and the agreement alone (TpStepSync's own histogram), and the bytes each agreement sent;
  - regime `steady`: free KV, no pressure (a decode batch that fits): nothing pending, the policy idle;
  - regime `offload_reload`: alternating phases that hold the free KV below the offload watermark (every token the
    offloads hand the cache is taken at once) and that free it all (reloads), so fences are pending on most
    iterations (`iterations_with_fences_pending` says on how many);
- the decode step's MoE work of the same shard (`ap_fused_moe` over every layer at M = batch, the call the
  PagedWeight MoE method makes, at the starting bitwidths), CUDA-graph timed by the project's one CUDA timer
  (pagedweight.bench.cuda_timing), one rank at a time so the two processes never share the GPU while it is timed.

Baseline, and why: `headline.step_overhead_share` = PagedWeight step p50 (steady regime; the worse rank) / the
shard's MoE decode work p50. The MoE work is a strict lower bound of a rank's decode step (attention, the dense
layers, the TP all-reduces, sampling and SGLang's own scheduling are left out) and AP experts at the starting 8 bits
read half the bytes of stock bf16 experts, so the true share of a `--tp 2` decode step is smaller than the one
reported: a headline <= 0.01 here holds for the real step too. The stock decode step of bench_one_batch would not be
the same thing: it runs the whole model unsharded on one GPU. `step_overhead_share_offload_reload` is the same ratio
for the pressure regime. With the agreement's quiet windows (runtime/tp_sync.py) most steady iterations skip the
exchange and the step, so their p50 is a skip's cost: `step_overhead_share_mean` (mean step / MoE p50) carries the
exchanges' share too, and `skipped_iterations` counts the skips per regime. Whether windows open depends on the free
KV against what one iteration may allocate (`--chunked-prefill-size`, `--max-running-requests`: the server's; the
defaults are a decode server's 8192 and 256) times the window; `--kv-tokens` is the capacity SGLang would have sized.

What is not measured: the CUDA VMM KV backing (the host backing is used: the VMM one needs SGLang's VMM pool owner,
which only a server's KV allocation creates), a forward running while the step runs (each iteration synchronizes the
forward stream after the step instead), and NCCL (PagedWeight exchanges nothing over it).

Nothing of this script has run on a GPU yet: its first CUDA run is `bash benchmark/gpu_session.sh tp_overhead`.
On CPU the MoE baseline is the reference path (orders of magnitude slower than a GPU's), so a CPU share says nothing
about the H200 goal; the CPU results are written with machine = CPU (docs/results/tp_overhead_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch.multiprocessing as mp

from pagedweight.bench.scenario import machine_description, write_results
from pagedweight.bench.tp_overhead import RunSpec, ShardShape, run_rank

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dummy_model import CONFIGS  # noqa: E402  (the published configs the dummy-weight runs use)

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """$PW_COMMIT when set (the device machine's copy of the work tree may carry stale git metadata), else HEAD's
    short hash, '+dirty' when tracked files differ from it, else 'unknown'."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    if os.environ.get("PW_COMMIT"):
        return os.environ["PW_COMMIT"]
    head = git("rev-parse", "--short=12", "HEAD")
    if not head:
        return os.environ.get("PW_COMMIT", "unknown")
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _worst(ranks: list[dict], regime: str, key: str, q: str) -> Optional[float]:
    vals = [next(r for r in rk["regimes"] if r["regime"] == regime)[key][q] for rk in ranks]
    return None if any(v is None for v in vals) else max(vals)


def headline(ranks: list[dict], batches: list[int]) -> dict[str, Any]:
    regimes = [r["regime"] for r in ranks[0]["regimes"]]

    def share(regime: str) -> dict[str, float]:
        out = {}
        for m in batches:
            # per rank: its step p50 over its own MoE step p50; the worse rank is the headline
            out[str(m)] = round(max(next(r for r in rk["regimes"] if r["regime"] == regime)["step_us"]["p50_us"]
                                    / rk["moe_step_us"][str(m)]["median"] for rk in ranks), 5)
        return out

    identical = all(rk["commits_crc"] == ranks[0]["commits_crc"] and rk["transitions"] == ranks[0]["transitions"]
                    and rk["committed_bits"] == ranks[0]["committed_bits"] for rk in ranks[1:])
    return {
        "step_overhead_share": share("steady"),
        "step_overhead_share_offload_reload": share("offload_reload"),
        # the mean too: with quiet windows most steps are skips, so the p50 is a skip's cost and the mean carries the
        # exchanges' share
        "step_overhead_share_mean": {str(m): round(max(
            next(r for r in rk["regimes"] if r["regime"] == "steady")["step_us"]["mean_us"]
            / rk["moe_step_us"][str(m)]["median"] for rk in ranks), 5) for m in batches},
        "step_overhead_us": {g: {q: _worst(ranks, g, "step_us", q) for q in ("p50_us", "mean_us", "p99_us")}
                             for g in regimes},
        "agreement_us": {g: {q: _worst(ranks, g, "agreement_us", q) for q in ("p50_us", "p99_us")} for g in regimes},
        "agreement_bytes": {g: {"row": ranks[0]["regimes"][i]["report_bytes"]["row"],
                                "max": max(rk["regimes"][i]["report_bytes"]["max"] for rk in ranks),
                                "mean": round(max(rk["regimes"][i]["report_bytes"]["mean"] for rk in ranks), 1)}
                            for i, g in enumerate(regimes)},
        "moe_decode_step_us_p50": {str(m): round(max(rk["moe_step_us"][str(m)]["median"] for rk in ranks), 1)
                                   for m in batches},
        "digest_mismatches": sum(rk["tp"]["digest_mismatches"] for rk in ranks),
        "ranks_identical": identical,
        "transitions_offload_reload": ranks[0]["regimes"][-1]["transitions"],
        "iterations_with_fences_pending": {g: ranks[0]["regimes"][i]["iterations_with_fences_pending"]
                                           for i, g in enumerate(regimes)},
        # timed iterations a quiet window skipped (the same on every rank, or a rank would wait alone in the collective)
        "skipped_iterations": {g: ranks[0]["regimes"][i]["skipped"] for i, g in enumerate(regimes)},
    }


def markdown(doc: dict[str, Any]) -> str:
    h = doc["headline"]
    lines = [
        "# PagedWeight's per-iteration step under TP: two processes, one machine (issue #20)", "",
        f"Command: `{doc['command']}`", "",
        f"Commit {doc['commit']}; machine: **{doc['machine']}**; {doc['date_utc']}; {doc['ranks_n']} TP ranks "
        f"(gloo CPU group), model {doc['shape']['name']} shard: {doc['shape']['layers']} layers x "
        f"{doc['shape']['experts']} experts, H {doc['shape']['hidden']}, I/rank {doc['shape']['intermediate']}; "
        f"policy {doc['policy']}, {doc['spec']['bits']} -> floor {doc['spec']['floor_bits']} bits.", "",
        "Baseline measured in the same run: the shard's MoE work of one decode step (ap_fused_moe over every layer, "
        "starting bits), a lower bound of a rank's decode step; see the script's docstring.", "",
        "| batch | MoE decode step p50 (us) | PagedWeight step p50 steady (us) | share steady (p50) | "
        "share steady (mean) | share offload/reload |", "|---|---|---|---|---|---|",
    ]
    for m, us in h["moe_decode_step_us_p50"].items():
        lines.append(f"| {m} | {us:.1f} | {h['step_overhead_us']['steady']['p50_us']} | "
                     f"{h['step_overhead_share'][m]} | {h['step_overhead_share_mean'][m]} | "
                     f"{h['step_overhead_share_offload_reload'][m]} |")
    lines += ["", "| regime | step p50 / mean / p99 (us) | agreement p50 / p99 (us) | bytes sent per agreement "
              "(row / max / mean) | iterations with fences pending | iterations skipped (quiet windows) |",
              "|---|---|---|---|---|---|"]
    for g, st in h["step_overhead_us"].items():
        ag, b = h["agreement_us"][g], h["agreement_bytes"][g]
        lines.append(f"| {g} | {st['p50_us']} / {st['mean_us']} / {st['p99_us']} | {ag['p50_us']} / {ag['p99_us']} | "
                     f"{b['row']} / {b['max']} / {b['mean']} | {h['iterations_with_fences_pending'][g]} of "
                     f"{doc['spec']['iters']} | {h['skipped_iterations'][g]} |")
    lines += ["", f"Digest mismatches: {h['digest_mismatches']}; ranks committed identical plans: "
              f"{h['ranks_identical']}; transitions in the offload/reload regime: {h['transitions_offload_reload']}."]
    if doc.get("note"):
        lines += ["", doc["note"]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen15moe", choices=sorted(CONFIGS))
    p.add_argument("--config-json", default=None, help="a model's config.json instead of --model")
    p.add_argument("--layers", type=int, default=None, help="fewer MoE layers than the model has (small machines)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--bits", type=int, default=8)
    p.add_argument("--min-bits", type=int, default=3)
    p.add_argument("--policy", default="hotness")
    p.add_argument("--kv-tokens", type=int, default=262144, help="the KV capacity SGLang would have sized (tokens)")
    p.add_argument("--iters", type=int, default=2000, help="timed iterations per regime")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--phase-iters", type=int, default=100, help="offload/reload regime: pressure on, then off, each")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--chunked-prefill-size", type=int, default=8192,
                   help="the server's; with --max-running-requests it bounds one iteration's KV allocation")
    p.add_argument("--max-running-requests", type=int, default=256, help="the server's running-request cap")
    p.add_argument("--moe-reps", type=int, default=50)
    p.add_argument("--note", default="", help="a line for the markdown")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    if a.config_json:
        cfg, name = json.loads(Path(a.config_json).read_text()), Path(a.config_json).parent.name
    else:
        cfg, name = CONFIGS[a.model], a.model
    shape = ShardShape.from_hf_config(name, cfg, a.tp, a.layers)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tp_overhead-") as tmp:
        spec = RunSpec(shape=shape, tp=a.tp, bits=a.bits, floor_bits=a.min_bits, policy=a.policy,
                       kv_tokens=a.kv_tokens, iters=a.iters, warmup=a.warmup, phase_iters=a.phase_iters,
                       batches=tuple(a.batches), moe_reps=a.moe_reps, out_dir=tmp,
                       chunked_prefill_size=a.chunked_prefill_size, max_running_requests=a.max_running_requests)
        mp.start_processes(run_rank, args=(spec, str(Path(tmp) / "init")), nprocs=a.tp, start_method="spawn", join=True)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(a.tp)]
    doc = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], REPO) if argv is None else
                                         "benchmark/tp_overhead_bench.py"] + (argv if argv is not None else sys.argv[1:])),
        "commit": git_commit(),
        "machine": machine_description(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_s": round(time.monotonic() - t0, 1),
        "ranks_n": a.tp,
        "shape": shape.__dict__,
        "policy": ranks[0]["policy"],
        "spec": {k: getattr(spec, k) for k in ("bits", "floor_bits", "kv_tokens", "iters", "warmup", "phase_iters",
                                               "batches", "moe_reps", "chunked_prefill_size", "max_running_requests")},
        "baseline": "the shard's MoE work of one decode step (ap_fused_moe over every layer at the starting bits), "
                    "a lower bound of the rank's decode step",
        "note": a.note,
        "headline": headline(ranks, a.batches),
        "ranks": ranks,
    }
    write_results(out, doc, markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
