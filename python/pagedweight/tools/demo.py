"""The main job on an embedded default: experts give memory to the KV cache under a burst and take it back.

    python scripts/demo.py [--arch qwen2_moe|mixtral|qwen3_moe] [--ap-dir DIR] [--work out/demo]

1. builds a tiny random MoE checkpoint with its own tokenizer (no model hub) and converts it to AP, or serves
   an AP checkpoint you give with --ap-dir (e.g. a converted MoEfied SmolLM2, which speaks real text);
2. starts `python -m sglang.launch_server --enable-paged-weight` at the parent bitwidth with a small KV cache
   (on the GPU if there is one; otherwise on SGLang's CPU engine);
3. sends a burst of long requests and prints, as they happen, the committed-bits histogram and the KV
   capacity (the experts lowering their bitwidths to make room) and each answer as it arrives;
4. waits for the quiet period's reload back to the parent bitwidth, asks once more through the
   OpenAI-compatible API, writes a timeline PNG (bits per layer x expert, weight and KV bytes over time) and
   the samples behind it (timeline.json) and prints their paths; then stops the server. Exit status 1 when no
   offload or no reload was seen.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import requests

from pagedweight.bench.burst import BurstSpec, RequestOutcome, one_request
from pagedweight.bench.scenario import paged_state, server_info, start_info, wait_reloaded
from pagedweight.bench.state_sampler import StateSample, StateSampler

# KV pressure a 6-request burst crosses on the tiny model: 700 KV tokens, offload below half free, reload above
# 80% free (the same watermarks as the end-to-end paging tests)
DEMO_KV_TOKENS = 700
PRESSURE_FLAGS = ["--paged-weight-kv-low-watermark", "0.5", "--paged-weight-kv-high-watermark", "0.8"]


@dataclass
class ChangePrinter:
    """Prints one line whenever the committed-bits histogram or the KV capacity changes between samples."""

    emit: Callable[[str], None] = print
    last: Optional[tuple] = None
    last_mean_bits: Optional[float] = None
    offloads_seen: int = 0  # lines where the mean bitwidth went down
    reloads_seen: int = 0  # ... and up

    def __call__(self, s: StateSample) -> None:
        key = (tuple(sorted((s.histogram or {}).items())), s.token_capacity)
        if key == self.last:
            return
        if self.last_mean_bits is not None and s.mean_bits is not None:
            self.offloads_seen += s.mean_bits < self.last_mean_bits
            self.reloads_seen += s.mean_bits > self.last_mean_bits
        self.last, self.last_mean_bits = key, s.mean_bits
        self.emit(f"[demo] t={s.t_s:6.1f}s  bits {describe_histogram(s.histogram)}  |  KV {s.token_capacity} tokens"
                  f"  |  experts {_mib(s.weight_bytes)}  KV {_mib(s.kv_bytes)}")


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def describe_histogram(hist: Optional[dict[str, int]]) -> str:
    """'8b x 40, 4b x 8': blocks per committed bitwidth, widest first."""
    if not hist:
        return "-"
    return ", ".join(f"{b}b x {n}" for b, n in sorted(hist.items(), key=lambda kv: -int(kv[0])))


def burst(url: str, spec: BurstSpec, emit: Callable[[str], None] = print, timeout_s: float = 1800.0) -> list[RequestOutcome]:
    """The burst, all requests at once; one line per answer as it arrives."""
    t0 = time.monotonic()
    outs: list[RequestOutcome] = []
    with ThreadPoolExecutor(spec.num_requests) as pool:
        futures = [pool.submit(one_request, url, p, spec.output_len, t0, timeout_s) for p in spec.prompts()]
        for fut in as_completed(futures):
            o = fut.result()
            outs.append(o)
            state = (f"{o.completion_tokens} tokens, first after {o.ttft_s:.1f}s, done at {o.started_s + o.latency_s:.1f}s"
                     if o.ok else f"FAILED: {o.error}")
            emit(f"[demo] answer {len(outs)}/{spec.num_requests}: {state}")
    return outs


def server_flags(on_gpu: bool) -> list[str]:
    from pagedweight.bench.cpu_engine import CPU_SERVER_FLAGS, pressure_server_flags

    if on_gpu:
        return ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.3",
                "--max-total-tokens", str(DEMO_KV_TOKENS), "--max-running-requests", "8", *PRESSURE_FLAGS]
    return pressure_server_flags(CPU_SERVER_FLAGS, DEMO_KV_TOKENS)


def prepare_checkpoint(args: argparse.Namespace) -> Path:
    if args.ap_dir is not None:
        if not (args.ap_dir / "pagedweight" / "manifest.json").exists():
            raise SystemExit(f"demo: {args.ap_dir} holds no pagedweight/manifest.json: pass a converted AP "
                             "checkpoint (pagedweight convert --model M --out DIR)")
        return args.ap_dir
    from pagedweight.tools.convert import convert_checkpoint
    from pagedweight.tools.tiny_model import make_tiny_moe

    hf_dir = args.work / f"tiny-{args.arch}"
    ap_dir = args.work / f"tiny-{args.arch}-ap"
    if not (hf_dir / "config.json").exists():
        make_tiny_moe(hf_dir, arch=args.arch, seed=0)
    if not (ap_dir / "pagedweight" / "manifest.json").exists():
        convert_checkpoint(hf_dir, ap_dir, bits_min=2, bits_max=8, seed=0, force=True)
    return ap_dir


def vocab_size(model_dir: Path) -> int:
    from pagedweight.bench.scenario import config_vocab_size

    return config_vocab_size(json.loads((model_dir / "config.json").read_text()))


def run(args: argparse.Namespace, emit: Callable[[str], None] = print) -> dict:
    """The whole demo; returns what it saw (the tests read it)."""
    import torch

    from pagedweight.bench.server_process import launch_server, wait_healthy
    from pagedweight.bench.timeline_plot import plot, require_matplotlib

    require_matplotlib()  # before anything starts: the demo ends with the PNG
    args.work.mkdir(parents=True, exist_ok=True)
    ap_dir = prepare_checkpoint(args)
    emit(f"[demo] AP checkpoint: {ap_dir}")
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        env = dict(os.environ)
    else:
        from pagedweight.bench.cpu_engine import build_fake_libcuda, cpu_server_env

        env = cpu_server_env(build_fake_libcuda(args.work / "libcuda"))
    flags = ["--enable-paged-weight", *server_flags(on_gpu)]
    log = args.work / "server.log"
    emit(f"[demo] starting SGLang with PagedWeight on the {'GPU' if on_gpu else 'CPU engine'} (log: {log}) ...")
    server = launch_server(ap_dir, flags, env, log)
    seen: dict = {"ap_dir": str(ap_dir)}
    try:
        wait_healthy(server, timeout_s=args.start_timeout_s)
        for line in server.log().splitlines():
            if "PagedWeight:" in line:
                emit("[demo] server: " + line.split("PagedWeight:", 1)[1].strip())
        info = start_info(server_info(server.url))
        initial = info["committed_bits_start"]
        seen["initial_histogram"] = initial
        printer = ChangePrinter(emit)
        watch = StateSampler(server.url, 0.5, on_sample=printer).start()
        spec = BurstSpec(num_requests=args.requests, input_len=args.input_len, output_len=args.output_len,
                         vocab_size=vocab_size(ap_dir), seed=0)
        emit(f"[demo] burst: {spec.num_requests} requests of {spec.input_len} prompt tokens + {spec.output_len} "
             f"output tokens, all at once, into a {DEMO_KV_TOKENS}-token KV cache")
        outs = burst(server.url, spec, emit)
        seen["answers"] = [o.completion_tokens for o in outs if o.ok]
        emit(f"[demo] burst done: {len(seen['answers'])}/{spec.num_requests} answered; quiet now, waiting for the "
             f"reload to {describe_histogram(initial)} ...")
        reload_s = wait_reloaded(server.url, initial, args.reload_timeout_s)
        timeline = watch.stop()
        final = paged_state(server_info(server.url))
        counters = final["counters"]
        seen.update(reloaded=reload_s is not None, offloads=counters["offloads_committed"],
                    reloads=counters["reloads_committed"], transitions=counters["transitions"],
                    offload_lines=printer.offloads_seen, reload_lines=printer.reloads_seen)
        emit(f"[demo] {f'reloaded after {reload_s}s' if reload_s is not None else 'NOT reloaded within the timeout'}: "
             f"{counters['offloads_committed']} block offloads and {counters['reloads_committed']} reloads committed "
             f"(the initial load counts as reloads), {counters['transitions']} transitions")
        r = requests.post(server.url + "/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}, timeout=300)
        r.raise_for_status()
        seen["chat"] = r.json()["choices"][0]["message"]["content"]
        emit(f"[demo] /v1/chat/completions -> {seen['chat']!r}")
        if args.ap_dir is None:
            emit("[demo] (a tiny random model speaks gibberish; the point is the path and the moving bitwidths)")
        doc = {"systems": [{"system": "PagedWeight", "timeline": timeline, "block_keys": info.get("block_keys")}]}
        (args.work / "timeline.json").write_text(json.dumps(doc))
        png = args.work / "timeline.png"
        plot(doc, png)
        seen["png"] = str(png)
        emit(f"[demo] timeline: {png} (samples: {args.work / 'timeline.json'}; "
             f"python benchmark/plot_timeline.py redraws it)")
    finally:
        server.stop()
    return seen


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2_moe", choices=["qwen2_moe", "mixtral", "qwen3_moe"],
                    help="architecture of the embedded tiny model")
    ap.add_argument("--ap-dir", type=Path, default=None, help="serve this AP checkpoint instead of the tiny model")
    ap.add_argument("--work", type=Path, default=Path("out") / "demo")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--input-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=40)
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--reload-timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    seen = run(args)
    return 0 if seen.get("reloaded") and seen.get("offloads") else 1
