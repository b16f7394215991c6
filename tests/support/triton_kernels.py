"""Shared set-up of the Triton kernel tests: where the Triton kernels run in this process.

Triton decides interpreted vs compiled when a kernel is decorated, so a process runs the kernels either
compiled on CUDA or interpreted on CPU (TRITON_INTERPRET=1 set before import). Without both, the kernel
test modules re-run themselves once in a subprocess under the interpreter (see run_under_interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_CUDA = torch.cuda.is_available()
# where the Triton kernels can run in this process (None: nowhere)
KERNEL_DEVICE = "cuda" if HAS_CUDA and not INTERPRET else ("cpu" if INTERPRET else None)

needs_kernel_device = pytest.mark.skipif(
    KERNEL_DEVICE is None, reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (run via the interpreter test)"
)


def run_under_interpreter(test_file: str, timeout_s: int = 600) -> None:
    """Run `test_file` in a fresh pytest process with TRITON_INTERPRET=1 on CPU; fail with its output."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file],
        env=env, capture_output=True, text=True, timeout=timeout_s,
    )
    if proc.returncode != 0:
        pytest.fail(f"interpreted kernel tests failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().cpu(), ref.float().cpu()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    # fp16 builds weights in fp16 (11-bit mantissa); bf16/fp32 in bf16 (8-bit), plus the interpreter's
    # truncating fp32->bf16 casts on CPU
    return 5e-3 if dtype == torch.float16 else 3e-2
