"""benchmark/longbench_pressure.py end to end on the CPU server (the script the issue-6 evidence comes from).

Two systems at one budget on the tiny model with project-made LongBench-format files: every sample is answered,
scores, timing and the bitwidth timeline are recorded, and each system's answers are compared with stock bf16's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_longbench_pressure_cpu(ap_qwen2_moe, tiny_qwen2_moe, server_env, cpu_server_flags, tmp_path):
    data = tmp_path / "lb"
    subprocess.run([sys.executable, "-m", "pagedweight.longbench", "make-fixtures", "--out", str(data), "--samples", "2",
                    "--paragraphs", "4", "--passkey-filler", "3"], check=True, capture_output=True, timeout=300)
    flags = list(cpu_server_flags)
    i = flags.index("--mem-fraction-static")
    del flags[i:i + 2]
    out = tmp_path / "longbench.json"
    cmd = [sys.executable, str(REPO / "benchmark" / "longbench_pressure.py"), "--ap-model", str(ap_qwen2_moe),
           "--bf16-model", str(tiny_qwen2_moe), "--data-dir", str(data), "--datasets", "passage_retrieval_en,passkey",
           "--systems", "pagedweight,static_bf16", "--mem-fraction-static", "0.5", "--policy", "scripted",
           "--concurrency", "4", "--max-prompt-tokens", "300", "--extra-server-args", " ".join(flags), "--out", str(out)]
    proc = subprocess.run(cmd, env=server_env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["budget"]["mem_fraction_static"] == 0.5 and doc["datasets"] == ["passage_retrieval_en", "passkey"]
    pw, bf16 = doc["systems"]
    for r in (pw, bf16):
        assert not r.get("error"), r.get("error")
        rd = r["rounds"][0]
        assert rd["completed"] == rd["samples"] == 4
        assert set(rd["scores"]) == {"passage_retrieval_en", "passkey"} and rd["ttft_mean_s"] is not None
        assert isinstance(r["retractions"], int)
    assert bf16["agreement"] == {"samples": 4, "identical": 1.0, "rouge_l_vs_reference": 1.0}
    assert pw["agreement"]["samples"] == 4
    assert pw["timeline"] and pw["timeline"][0]["mean_bits"] == 8.0 and pw["block_keys"]
    assert "| pagedweight |" in out.with_suffix(".md").read_text()
