"""One system of a side-by-side serving benchmark: start a server, run workload rounds, record what happened.

A round is whatever the caller's workload does against the server's URL (a burst of requests, a LongBench
run); between rounds a PagedWeight server gets a quiet period, and the runner waits until every block is
back at its starting bitwidth. Throughout, a `StateSampler` records the KV capacity, weight bytes, committed
bitwidths and free GPU memory. At the end: SGLang's retraction counter (`/metrics`), PagedWeight's pager
counters, OOM lines from the server log and whether the server died. A failure is recorded in the result
(`error`) rather than raised, so the other systems of a comparison still run.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import requests

from pagedweight.bench.prometheus import retracted_requests, retractions_in_log, scrape
from pagedweight.bench.server_process import launch_server, wait_healthy
from pagedweight.bench.state_sampler import StateSampler

OOM_PATTERNS = re.compile(r"out of memory|OutOfMemoryError|CUDA error|cudaErrorMemoryAllocation", re.I)

# (server URL, round index, what the server reported at start) -> that round's result (JSON-ready)
Workload = Callable[[str, int, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class SystemSpec:
    name: str
    model_path: str
    args: tuple[str, ...]  # server flags on top of the common ones
    rounds: int = 1


@dataclass(frozen=True)
class RunOptions:
    log_dir: Path
    sample_interval_s: float = 1.0
    start_timeout_s: float = 300.0
    quiet_timeout_s: float = 60.0
    port: Optional[int] = None
    env: Optional[dict[str, str]] = None


def server_info(url: str) -> dict[str, Any]:
    return requests.get(url + "/get_server_info", timeout=60).json()


def paged_state(info: dict[str, Any]) -> Optional[dict[str, Any]]:
    return ((info.get("internal_states") or [{}])[0]).get("paged_weight")


def start_info(info: dict[str, Any]) -> dict[str, Any]:
    """What a result records about the server right after start."""
    out: dict[str, Any] = {"max_total_num_tokens": info.get("max_total_num_tokens")}
    pw = paged_state(info)
    if pw:
        kv = pw.get("elastic_kv") or {}
        out.update(
            kv_capacity_tokens_start=kv.get("capacity_tokens"),
            kv_max_tokens=kv.get("max_tokens"),
            kv_bytes_per_token=kv.get("bytes_per_token"),
            weights_bytes_start=pw.get("weights_resident_bytes"),
            committed_bits_start=pw.get("committed_bits_histogram"),
            policy=pw.get("policy"),
            gpu_memory_start=pw.get("gpu_memory"),
            # Row order of every timeline sample's block_bits string.
            block_keys=[b[:3] for b in pw.get("blocks") or []],
        )
    return out


def wait_reloaded(url: str, initial_hist: dict, timeout_s: float) -> Optional[float]:
    """Seconds until the committed-bits histogram is back to `initial_hist` with nothing queued; None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        pw = paged_state(server_info(url))
        if pw and pw.get("committed_bits_histogram") == initial_hist and not pw.get("queued_blocks"):
            return round(time.monotonic() - t0, 1)
        time.sleep(0.5)
    return None


def run_system(spec: SystemSpec, common: list[str], workload: Workload, opts: RunOptions) -> dict[str, Any]:
    log = opts.log_dir / f"server_{spec.name}.log"
    t_start = time.monotonic()
    srv = launch_server(Path(spec.model_path), common + list(spec.args), opts.env or dict(os.environ), log, port=opts.port)
    result: dict[str, Any] = {"system": spec.name, "model_path": spec.model_path, "server_args": common + list(spec.args)}
    sampler: Optional[StateSampler] = None
    try:
        wait_healthy(srv, timeout_s=opts.start_timeout_s)
        result["startup_s"] = round(time.monotonic() - t_start, 1)
        result.update(start_info(server_info(srv.url)))
        sampler = StateSampler(srv.url, opts.sample_interval_s).start()
        rounds, quiets = [], []
        for i in range(spec.rounds):
            r = workload(srv.url, i, result)
            r["t_end_s"] = sampler.samples[-1].t_s if sampler.samples else None
            rounds.append(r)
            if result.get("committed_bits_start"):
                q = wait_reloaded(srv.url, result["committed_bits_start"], opts.quiet_timeout_s)
                quiets.append({"reload_s": q})
                print(f"[{spec.name}] quiet {i}: back to the starting bitwidths after {q}s", flush=True)
        result["rounds"] = rounds
        result["quiets"] = quiets
        result["timeline"] = sampler.stop()
        result["retractions"] = retracted_requests(scrape(srv.url))
        pw = paged_state(server_info(srv.url))
        if pw:
            result["transitions"] = (pw.get("counters") or {}).get("transitions")
            result["pager_counters"] = pw.get("counters")
            result["elastic_kv_end"] = pw.get("elastic_kv")
            result["gpu_memory_end"] = pw.get("gpu_memory")
            result["tp_end"] = pw.get("tp")
            result["step_us_end"] = pw.get("step_us")  # host time of PagedWeight's per-iteration step
    except Exception as e:  # noqa: BLE001 - a failed system is a result; the others still run
        result["error"] = f"{type(e).__name__}: {e}"
        print(f"[{spec.name}] FAILED: {result['error']}", flush=True)
    finally:
        if sampler is not None and "timeline" not in result:
            result["timeline"] = sampler.stop(final_sample=srv.proc.poll() is None)
        alive = srv.proc.poll() is None
        srv.stop()
        lines = srv.log().splitlines()
        result["server_died"] = not alive
        result["oom_lines"] = [l for l in lines if OOM_PATTERNS.search(l)][:5]
        result["retractions_logged"] = retractions_in_log(lines)
        result["plans_logged"] = sum(1 for l in lines if "pagedweight plan:" in l)
        result["server_log"] = str(log)
    return result


def write_results(out: Path, doc: dict[str, Any], markdown: str) -> None:
    """A benchmark's results document at `out`, its markdown beside it (.md), and its headline on stdout."""
    import json

    out.write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(markdown)
    print(json.dumps(doc["headline"], indent=1))


def machine_description() -> str:
    import platform

    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {os.cpu_count()} CPU cores"
    except Exception:  # noqa: BLE001
        pass
    return f"{platform.processor() or platform.machine()}, CPU only, {os.cpu_count()} cores"


def add_run_args(p: Any, quiet_timeout_s: float) -> None:
    """The server-run flags every benchmark script shares (what `start_results` and `RunOptions` read)."""
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=384)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--demand-of-max", type=float, default=0.9)
    p.add_argument("--quiet-timeout-s", type=float, default=quiet_timeout_s)
    p.add_argument("--sample-interval-s", type=float, default=1.0)
    p.add_argument("--start-timeout-s", type=float, default=480.0,
                   help="a fresh GPU machine JIT-compiles and captures prefill graphs at the first start (seen: 303 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--extra-server-args", default="", help="more flags for every server, one string")
    p.add_argument("--out", required=True)


def config_vocab_size(cfg: dict[str, Any]) -> int:
    """The vocabulary size of a model's config.json: top level, or under `text_config` for a multimodal
    checkpoint (Gemma-4's Gemma4Config); a burst's random token ids must stay below it."""
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not size:
        raise ValueError("config.json names no vocab_size (top level or text_config)")
    return int(size)


def start_results(a: Any, argv: Optional[list[str]]) -> tuple[Path, RunOptions, dict[str, Any], dict[str, Any]]:
    """For a benchmark script's parsed args `a` (out, model_path, sample_interval_s, start_timeout_s,
    quiet_timeout_s, port): the results path, run options (server logs next to the results), the model's
    config.json and the results document's common fields (command, machine, date, model, no systems yet)."""
    import json
    import sys

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    opts = RunOptions(out.parent / "logs", a.sample_interval_s, a.start_timeout_s, a.quiet_timeout_s, a.port)
    opts.log_dir.mkdir(exist_ok=True)
    cfg = json.loads((Path(a.model_path) / "config.json").read_text())
    doc: dict[str, Any] = {
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "machine": machine_description(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": f"{a.model_path} ({cfg.get('architectures', ['?'])[0]}, {cfg.get('num_hidden_layers')} layers)",
        "systems": [],
    }
    return out, opts, cfg, doc
