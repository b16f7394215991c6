"""What the real SGLang server needs to run on a machine without a GPU (SGLang's CPU engine with a libcuda.so.1
stand-in compiled from fake_libcuda.c, shipped with the package): the demo and the end-to-end tests use it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build_fake_libcuda(out_dir: Path) -> Path:
    """Compile the libcuda.so.1 stand-in into out_dir and return the folder to put on LD_LIBRARY_PATH."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libcuda.so.1"
    if not lib.exists():
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(HERE / "fake_libcuda.c")], check=True)
        (out_dir / "libcuda.so").unlink(missing_ok=True)
        (out_dir / "libcuda.so").symlink_to(lib.name)
    return out_dir


def cpu_server_env(libcuda_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["TRITON_INTERPRET"] = "1"
    env["LD_LIBRARY_PATH"] = f"{libcuda_dir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    env.setdefault("OMP_NUM_THREADS", "2")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def cpu_tp_env(env: dict[str, str], tp: int) -> dict[str, str]:
    """`cpu_server_env` for `--tp N` on the CPU engine (N scheduler ranks, gloo between them):
    - SGLANG_CPU_OMP_THREADS_BIND gives each rank its cores (SGLang refuses more ranks than NUMA nodes
      without it); ranks share cores on a machine with fewer than N;
    - SGLANG_NCCL_SO_PATH names a library that does not exist, so SGLang's TP group skips its NCCL
      communicator (the PyPI torch wheel ships libnccl, and opening a communicator needs a CUDA device)."""
    cores = os.cpu_count() or 1
    out = dict(env)
    out["OMP_NUM_THREADS"] = str(max(1, cores // tp))
    out["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp))
    out["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so.2"
    return out


CPU_SERVER_FLAGS = [
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-cuda-graph",
    "--page-size", "1",
    "--max-total-tokens", "4096",
    "--mem-fraction-static", "0.5",
    "--max-running-requests", "8",
    "--chunked-prefill-size", "512",
    "--skip-server-warmup",
]


def pressure_server_flags(flags: list[str], max_total_tokens: int = 700) -> list[str]:
    """CPU server flags for a benchmark script that sets --mem-fraction-static itself: a small KV cache and
    watermarks (offload below half free, reload above 80% free) that a 6-request burst crosses."""
    out = list(flags)
    i = out.index("--mem-fraction-static")
    del out[i:i + 2]
    out[out.index("--max-total-tokens") + 1] = str(max_total_tokens)
    return out + ["--paged-weight-kv-low-watermark", "0.5", "--paged-weight-kv-high-watermark", "0.8"]
