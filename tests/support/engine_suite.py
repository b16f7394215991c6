"""Re-run a test module in the CPU-engine environment: importing SGLang's mem_cache needs the fake libcuda on
LD_LIBRARY_PATH at process start, so such a module holds one outer test that runs the module again in a subprocess
with that environment (SGLANG_USE_CPU_ENGINE=1 selects the inner suite)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_suite_in_cpu_engine(module_file: str, server_env: dict[str, str], *, allow_skips: bool = False) -> None:
    """Run `module_file` under pytest in `server_env`; fail with the inner output unless every test passed."""
    env = dict(server_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(module_file))],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, f"inner suite failed:\n{r.stdout[-12000:]}\n{r.stderr[-4000:]}"
    assert " passed" in r.stdout, r.stdout[-2000:]
    assert allow_skips or " skipped" not in r.stdout, r.stdout[-2000:]
