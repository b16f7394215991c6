"""Start and stop a real SGLang server in its own process group (benchmarks and end-to-end tests)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import requests


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default lower bound


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(rng: Optional[random.Random] = None) -> int:
    """A free TCP port below the kernel's ephemeral range.

    The server binds its HTTP port only after loading the model. A port the kernel hands out as ephemeral
    (bind to port 0) can meanwhile become the source port of any outgoing socket on the machine: the
    server's own gloo sockets between TP ranks, or wait_healthy's own polling of that very port (a connect to
    a local port nobody listens on can pick the same port as its source and connect to itself). uvicorn
    then exits with code 3 ("address already in use"). Ports below the ephemeral range are only ever taken
    by an explicit bind.
    """
    rng = rng or random.Random()
    hi = max(_ephemeral_low() - 1, 12000)
    for _ in range(200):
        port = rng.randrange(10000, hi)
        if _bindable(port):
            return port
    raise RuntimeError(f"no free TCP port in 10000..{hi} after 200 tries")


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
    if "--nccl-port" not in extra_args:  # SGLang's default is an ephemeral port: the same race as above
        nccl_port = free_port()
        while nccl_port == port:
            nccl_port = free_port()
        cmd += ["--nccl-port", str(nccl_port)]
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
