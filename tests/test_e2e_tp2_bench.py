"""benchmark/tp2_bench.py end to end on the CPU server (--tp 1: SGLang's CPU engine cannot start two ranks
here, see docs/runtime.md): the script the two-GPU evidence comes from, with its hold, plan snapshot,
restart from the bits map and the three probe sets.

The held plan must be mixed, the restarted server must answer the probes token for token as the held one
did, the reloaded server as it did at the start, and the headline must carry the keys docs/results/tp2.json
is read by.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cpu_engine import pressure_server_flags

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_tp2_bench_script_cpu(ap_qwen2_moe, tiny_qwen2_moe, server_env, cpu_server_flags, tmp_path):
    flags = pressure_server_flags(cpu_server_flags)
    out = tmp_path / "tp2.json"
    cmd = [sys.executable, str(REPO / "benchmark" / "tp2_bench.py"), "--model-path", str(ap_qwen2_moe),
           "--bf16-model-path", str(tiny_qwen2_moe), "--tp", "1", "--mem-fraction-static", "0.5",
           "--policy", "scripted", "--batch-sizes", "1", "2", "--decode-input-len", "16", "--decode-output-len", "8",
           "--probes", "2", "--probe-input-len", "16", "--probe-output-len", "8", "--num-requests", "6",
           "--input-len", "90", "--output-len", "40", "--quiet-timeout-s", "300",
           "--extra-server-args", " ".join(flags), "--out", str(out)]
    proc = subprocess.run(cmd, env=server_env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    h = doc["headline"]
    assert [r["system"] for r in doc["systems"]] == ["stock", "pagedweight", "pagedweight_bits_map"]
    assert not any(r.get("error") for r in doc["systems"]), [r.get("error") for r in doc["systems"]]
    assert h["oom"] == 0 and h["servers_died"] == 0
    assert h["burst_completed"] == h["burst_requests"] == 6 and h["nan_logprobs"] == 0
    assert any(int(b) < 8 for b in h["held_plan_histogram"]), h["held_plan_histogram"]
    assert h["outputs_identical_to_bits_map_server"] is True
    assert h["outputs_identical_after_reload"] is True
    assert h["outputs_repeatable_on_one_server"] is True and h["probe_prefix_agreement_bits_map"] == 1.0
    assert h["reload_s"] is not None
    assert set(h["decode_tok_per_s"]) == {"stock", "pagedweight", "pagedweight_bits_map"}
    assert set(h["decode_ratio_vs_stock"]) == {"1", "2"} and all(v > 0 for v in h["decode_ratio_vs_stock"].values())
    held = json.loads((tmp_path / "tp2_held_plan.json").read_text())
    restarted = doc["systems"][2]
    assert restarted["committed_bits_start"] == held["internal_states"][0]["paged_weight"]["committed_bits_histogram"]
    assert h["tp_size"] is None and h["digest_mismatches"] is None  # one rank: no exchange

    # --append keeps what ran and runs only what is missing (here: nothing).
    proc = subprocess.run(cmd + ["--append"], env=server_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["headline"] == h
