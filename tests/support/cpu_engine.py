"""The CPU-engine bootstrap for end-to-end tests: see pagedweight.bench.cpu_engine (the demo uses it too)."""

from pagedweight.bench.cpu_engine import (
    CPU_SERVER_FLAGS,
    build_fake_libcuda,
    cpu_server_env,
    cpu_tp_env,
    pressure_server_flags,
)

__all__ = ["CPU_SERVER_FLAGS", "build_fake_libcuda", "cpu_server_env", "cpu_tp_env", "pressure_server_flags"]
