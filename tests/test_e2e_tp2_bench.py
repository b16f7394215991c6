"""benchmark/tp2_bench.py end to end with `--tp 2` on the CPU engine: two real SGLang scheduler ranks.

The script the two-GPU evidence comes from (docs/results/tp2.md), here with two CPU ranks (gloo between them,
tests/support/cpu_engine.cpu_tp_env): stock SGLang --tp 2; PagedWeight --tp 2 where a burst under held
reloads makes both ranks offload, the held plan is saved and probed, and releasing the hold makes both ranks
reload; then a --tp 2 server started at the saved plan (--paged-weight-bits-map). Both ranks must report the
same digest at every iteration (commits, transitions, bytes handed to the KV cache, KV capacity), grow and
shrink their KV caches alike, and the restarted server must answer the probes token for token as the held
one did.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cpu_engine import cpu_tp_env, pressure_server_flags

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_tp2_bench_two_cpu_ranks(ap_qwen2_moe_g32, tiny_qwen2_moe, server_env, cpu_server_flags, tmp_path):
    flags = pressure_server_flags(cpu_server_flags)
    out = tmp_path / "tp2.json"
    cmd = [sys.executable, str(REPO / "benchmark" / "tp2_bench.py"), "--model-path", str(ap_qwen2_moe_g32),
           "--bf16-model-path", str(tiny_qwen2_moe), "--tp", "2", "--mem-fraction-static", "0.5",
           "--policy", "scripted", "--batch-sizes", "1", "2", "--decode-input-len", "16", "--decode-output-len", "8",
           "--probes", "2", "--probe-input-len", "16", "--probe-output-len", "8", "--num-requests", "6",
           "--input-len", "90", "--output-len", "40", "--quiet-timeout-s", "300",
           "--extra-server-args", " ".join(flags), "--out", str(out)]
    env = cpu_tp_env(server_env, 2)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    h = doc["headline"]
    assert [r["system"] for r in doc["systems"]] == ["stock", "pagedweight", "pagedweight_bits_map"]
    errors = [f"{r['system']}: {r['error']}" for r in doc["systems"] if r.get("error")]
    assert not errors, "\n\n".join(errors)  # whole, not pytest's shortened repr: the server log is in there
    assert h["tp_size"] == 2 and h["oom"] == 0 and h["servers_died"] == 0
    # Both ranks did the same, at the same iterations.
    assert h["digest_mismatches"] == 0
    # issue #20's measurement: the per-iteration step and its agreement are timed on the running servers
    assert h["step_overhead_us"]["count"] > 0 and h["agreement_us"]["count"] > 0
    assert 0 < h["agreement_us"]["p50_us"] <= h["step_overhead_us"]["p99_us"] * 10
    assert len(h["rank_agreement_us"]) == 2 and h["agreement_report_bytes_max"] > 0
    r0, r1 = h["rank_transitions"]
    assert r0 == r1 > 32  # more than the initial load of the 32 blocks
    assert h["rank_bytes_to_kv"][0] == h["rank_bytes_to_kv"][1] > 0
    start = doc["systems"][1]["kv_capacity_tokens_start"]
    assert h["rank_kv_capacity_max_tokens"][0] == h["rank_kv_capacity_max_tokens"][1] > start  # grew on both
    assert h["rank_kv_capacity_end_tokens"] == [start, start]  # and gave the room back on both
    # The burst completed, the held plan was mixed, the ranks reloaded, and outputs matched.
    assert h["burst_completed"] == h["burst_requests"] == 6 and h["nan_logprobs"] == 0
    assert any(int(b) < 8 for b in h["held_plan_histogram"]), h["held_plan_histogram"]
    assert h["reload_s"] is not None
    assert h["outputs_repeatable_on_one_server"] is True
    assert h["outputs_identical_to_bits_map_server"] is True and h["probe_prefix_agreement_bits_map"] == 1.0
    assert h["outputs_identical_after_reload"] is True
    # Token ids barely move on these weights; the logprobs show the held plan changed the numerics, the server
    # started at that plan reproduced them, and the reloaded server is back where it started.
    assert h["logprob_max_diff_held_vs_start"] > 1e-3, h
    assert h["logprob_max_diff_bits_map_vs_held"] <= 1e-4, h
    assert h["logprob_max_diff_reloaded_vs_start"] <= 1e-4, h
    held = json.loads((tmp_path / "tp2_held_plan.json").read_text())
    restarted = doc["systems"][2]
    assert restarted["committed_bits_start"] == held["internal_states"][0]["paged_weight"]["committed_bits_histogram"]
    assert set(h["decode_ratio_vs_stock"]) == {"1", "2"} and all(v > 0 for v in h["decode_ratio_vs_stock"].values())

    # --append keeps what ran and runs only what is missing (here: nothing).
    proc = subprocess.run(cmd + ["--append"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["headline"] == h
