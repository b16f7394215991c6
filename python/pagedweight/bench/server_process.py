"""Start and stop a real SGLang server in its own process group (benchmarks and end-to-end tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def launch_server(
    model_path: Path, extra_args: list[str], env: dict[str, str], log_path: Path, port: Optional[int] = None
) -> ServerProcess:
    port = port or free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), "--port", str(port)]
    cmd += ["--host", "127.0.0.1"] + extra_args
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return ServerProcess(proc, port, log_path)


def wait_healthy(server: ServerProcess, timeout_s: float = 300.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with code {server.proc.returncode}:\n{server.log()[-6000:]}")
        try:
            if requests.get(server.url + "/health_generate", timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    server.stop()
    raise TimeoutError(f"server not healthy after {timeout_s}s:\n{server.log()[-6000:]}")


def run_to_exit(model_path: Path, extra_args: list[str], env: dict[str, str], log_path: Path, timeout_s: float = 240.0):
    """Launch a server that is expected to refuse to start; return (exit code, log, seconds taken)."""
    t0 = time.time()
    server = launch_server(model_path, extra_args, env, log_path)
    try:
        server.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.stop()
        raise AssertionError(f"server did not refuse to start within {timeout_s}s:\n{server.log()[-4000:]}")
    return server.proc.returncode, server.log(), time.time() - t0
