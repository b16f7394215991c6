"""Start and stop a real SGLang server (CPU engine) for end-to-end tests: see pagedweight.bench.server_process."""

from pagedweight.bench.server_process import ServerProcess, free_port, launch_server, run_to_exit, wait_healthy

__all__ = ["ServerProcess", "free_port", "launch_server", "run_to_exit", "wait_healthy"]
