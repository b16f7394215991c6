#!/usr/bin/env python3
"""The main job on an embedded default: a tiny MoE model, converted to AP, served by SGLang with PagedWeight.

    python scripts/demo.py [--bits 4] [--arch qwen2_moe|mixtral|qwen3_moe] [--work out/demo]

1. generates a tiny random MoE checkpoint with its own tokenizer (no model hub needed),
2. converts it to an Any-Precision checkpoint (`pagedweight convert`),
3. starts `python -m sglang.launch_server --enable-paged-weight --paged-weight-bits B` (on the GPU if there
   is one; otherwise on SGLang's CPU engine, with the libcuda stand-in the tests use),
4. asks it through /generate and the OpenAI-compatible API, prints the answers and PagedWeight's startup
   memory line, and stops the server.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2_moe", choices=["qwen2_moe", "mixtral", "qwen3_moe"])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--work", type=Path, default=REPO / "out" / "demo")
    args = ap.parse_args()

    import requests
    import torch

    from pagedweight.convert import convert_checkpoint
    from pagedweight.tiny_model import make_tiny_moe
    from tests.support.cpu_engine import CPU_SERVER_FLAGS, build_fake_libcuda, cpu_server_env
    from tests.support.server import launch_server, wait_healthy

    args.work.mkdir(parents=True, exist_ok=True)
    hf_dir = args.work / f"tiny-{args.arch}"
    ap_dir = args.work / f"tiny-{args.arch}-ap"
    if not (hf_dir / "config.json").exists():
        make_tiny_moe(hf_dir, arch=args.arch, seed=0)
    if not (ap_dir / "pagedweight" / "manifest.json").exists():
        convert_checkpoint(hf_dir, ap_dir, bits_min=2, bits_max=8, seed=0, force=True)
    print(f"[demo] AP checkpoint: {ap_dir}")

    flags = ["--enable-paged-weight", "--paged-weight-bits", str(args.bits)]
    if torch.cuda.is_available():
        import os

        env = dict(os.environ)
        flags += ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.3"]
    else:
        env = cpu_server_env(build_fake_libcuda(args.work / "libcuda"))
        flags += CPU_SERVER_FLAGS
    log = args.work / "server.log"
    print(f"[demo] starting SGLang (log: {log}) ...")
    server = launch_server(ap_dir, flags, env, log)
    try:
        wait_healthy(server)
        for line in server.log().splitlines():
            if "PagedWeight:" in line:
                print("[demo] server:", line.split("PagedWeight:", 1)[1].strip())
        r = requests.post(
            server.url + "/generate",
            json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
            timeout=300,
        ).json()
        print(f"[demo] /generate -> {r['text']!r}")
        r = requests.post(
            server.url + "/v1/chat/completions",
            json={"model": "default", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16},
            timeout=300,
        ).json()
        print(f"[demo] /v1/chat/completions -> {r['choices'][0]['message']['content']!r}")
        print("[demo] (a tiny random model speaks gibberish; the point is the path: AP planes served by SGLang)")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
