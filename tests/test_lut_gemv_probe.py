"""benchmark/lut_gemv_probe.py (the activation-LUT GEMV probe the next GPU session times) still agrees with the
dequantized reference, under the Triton interpreter on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_lut_gemv_probe_matches_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(REPO / "benchmark" / "lut_gemv_probe.py"), "--check-only"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count('"ok": true') == 9  # 3 shapes x (fp32 tables, split 1 and 2; fp16 tables)
