"""End to end on the CPU server: KV pressure makes the experts give bytes back, a quiet period reloads them.

A small KV cache (--max-total-tokens) and a high low-watermark make a burst of long requests push free KV
blocks under the threshold; the scripted policy lowers bitwidths; once the burst is over, free blocks stay
above the high watermark and every block is reloaded to its initial bitwidth. All requests complete, and a
greedy answer after the round trip equals the one before it (same committed bitwidths, same output).
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest
import requests

from pagedweight.serving.metrics import GAUGES
from tests.support.server import launch_server, wait_healthy

pytestmark = pytest.mark.e2e

PROBE = {"text": "the river runs to the sea", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}


def _state(url: str) -> dict:
    info = requests.get(url + "/get_server_info", timeout=60).json()
    return info["internal_states"][0]["paged_weight"]


def _wait_for(url: str, pred, timeout_s: float, what: str) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        st = _state(url)
        if pred(st):
            return st
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last state: { {k: v for k, v in st.items() if k != 'blocks'} }")


@pytest.fixture(scope="module")
def paging_server(ap_qwen2_moe, server_env, cpu_server_flags, work_dir):
    flags = [f for f in cpu_server_flags]
    i = flags.index("--max-total-tokens")
    flags[i + 1] = "700"
    srv = launch_server(
        ap_qwen2_moe,
        ["--enable-paged-weight", "--paged-weight-bits", "8", "--paged-weight-policy", "scripted",
         "--paged-weight-kv-low-watermark", "0.5", "--paged-weight-kv-high-watermark", "0.8",
         "--enable-metrics"] + flags,
        server_env,
        work_dir / "server-paging.log",
    )
    try:
        wait_healthy(srv)
        yield srv
    finally:
        srv.stop()


def test_burst_offloads_and_quiet_reloads(paging_server):
    url = paging_server.url
    before = requests.post(url + "/generate", json=PROBE, timeout=120).json()["text"]
    start = _state(url)
    assert start["committed_bits_histogram"] == {"8": len(start["blocks"])}
    kv0 = start["elastic_kv"]["capacity_tokens"]

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(90)) for i in range(6)]

    def one(p):
        r = requests.post(url + "/generate", json={"text": p, "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}, timeout=600)
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        burst = pool.map(one, prompts)
        # While the burst runs, the KV cache fills and the weights must give memory back.
        low = _wait_for(url, lambda st: st["counters"]["offloads_committed"] > 0, 300, "an offload")
        # The freed weight bytes become KV token slots.
        grown = _wait_for(url, lambda st: st["elastic_kv"]["capacity_tokens"] > kv0, 120, "the KV cache to grow")
        done = list(burst)
    assert done == [40] * len(prompts), "every request of the burst completes"
    assert any(int(b) < 8 for b in low["committed_bits_histogram"]), low["committed_bits_histogram"]

    total = len(start["blocks"])
    # committed at 8 bits everywhere AND idle: right after a reload commits, the replaced table is still
    # resident until the fence of the next forward retires it (it counts in weights_resident_bytes until then)
    back = _wait_for(url, lambda st: st["committed_bits_histogram"] == {"8": total} and not st["queued_blocks"]
                     and not any(st["ops"].values()), 300, "reload to 8 bits and the pager idle")
    assert back["counters"]["reloads_committed"] > total  # the initial load plus the reloads
    assert back["weights_resident_bytes"] == start["weights_resident_bytes"]
    # The KV cache gave the slots back for the reload.
    assert back["elastic_kv"]["capacity_tokens"] < grown["elastic_kv"]["capacity_tokens"]
    assert back["counters"]["bytes_to_kv"] > 0
    after = requests.post(url + "/generate", json=PROBE, timeout=120).json()["text"]
    assert after == before


def _burst(url: str, n: int = 6) -> list[int]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(90)) for i in range(n)]

    def one(p):
        r = requests.post(url + "/generate", json={"text": p, "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}, timeout=600)
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, prompts))


def _set(url: str, key: str, value: int) -> bool:
    r = requests.post(url + "/set_internal_state", json={"server_args": {key: value}}, timeout=60)
    r.raise_for_status()
    return r.json() == [True]  # one answer per data-parallel rank


def test_held_plan_restarts_identically_from_a_bits_map(paging_server, ap_qwen2_moe, server_env, cpu_server_flags,
                                                        work_dir):
    """Hold reloads, let a burst lower bitwidths, save the plan from /get_server_info, and serve it again from
    --paged-weight-bits-map: the restarted server commits the same bits and answers the same tokens."""
    url = paging_server.url
    total = len(_state(url)["blocks"])
    _wait_for(url, lambda st: st["committed_bits_histogram"] == {"8": total}, 300, "the starting bitwidths")
    assert _set(url, "paged_weight_hold_reloads", 1)
    try:
        assert _burst(url) == [40] * 6
        idle = lambda st: not st["queued_blocks"] and not any(st["ops"].values())  # noqa: E731
        held = _wait_for(url, idle, 120, "the pager to go idle")
        assert held["reloads_held"] and any(int(b) < 8 for b in held["committed_bits_histogram"])
        time.sleep(3)  # quiet and far above the high watermark: only the hold keeps the plan
        again = _state(url)
        assert again["committed_bits_histogram"] == held["committed_bits_histogram"]
        assert again["counters"]["transitions"] == held["counters"]["transitions"]
        snapshot = work_dir / "held_plan.json"
        snapshot.write_text(requests.get(url + "/get_server_info", timeout=60).text)
        requests.post(url + "/flush_cache", timeout=60).raise_for_status()  # no prefix computed at other bits
        text_held = requests.post(url + "/generate", json=PROBE, timeout=120).json()["text"]
    finally:
        assert _set(url, "paged_weight_hold_reloads", 0)
    _wait_for(url, lambda st: st["committed_bits_histogram"] == {"8": total}, 300, "reload once the hold is released")

    srv = launch_server(
        ap_qwen2_moe,
        ["--enable-paged-weight", "--paged-weight-bits-map", str(snapshot), "--paged-weight-policy", "static"]
        + cpu_server_flags,
        server_env,
        work_dir / "server-bits-map.log",
    )
    try:
        wait_healthy(srv)
        restarted = _state(srv.url)
        assert sorted(b[:4] for b in restarted["blocks"]) == sorted(b[:4] for b in held["blocks"])
        assert requests.post(srv.url + "/generate", json=PROBE, timeout=120).json()["text"] == text_held
    finally:
        srv.stop()


def test_prometheus_gauges(paging_server):
    """Every PagedWeight gauge, and every metric the Grafana dashboard (docs/grafana/) queries, is on /metrics."""
    from tests.test_grafana_dashboard import DASHBOARD, dashboard_metrics

    text = requests.get(paging_server.url + "/metrics", timeout=60).text
    exported = {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in ["sglang:pagedweight_" + k for k in GAUGES] + sorted(dashboard_metrics(json.loads(DASHBOARD.read_text()))):
        assert name in exported, f"{name} missing from /metrics"
    mean_bits = [float(l.split()[-1]) for l in text.splitlines() if l.startswith("sglang:pagedweight_mean_committed_bits")]
    assert mean_bits and 2.0 <= mean_bits[0] <= 8.0


def test_top_renders_the_servers_state(paging_server, capsys):
    """`pagedweight top --once` against the CPU server: its heat map is the state's blocks (lowest bitwidth over
    the projections of each expert, per layer), its byte lines the state's."""
    from pagedweight.cli import main
    from pagedweight.tools.top import heat_map

    before = _state(paging_server.url)
    assert main(["top", "--url", paging_server.url, "--once"]) == 0
    frame = capsys.readouterr().out.rstrip()
    after = _state(paging_server.url)  # the frame's state lies between the two reads
    assert any(frame.endswith("\n".join(heat_map(st["blocks"]))) for st in (before, after)), frame
    assert f"policy {before['policy']}" in frame and "KV cache capacity" in frame
    assert len(heat_map(before["blocks"])) == len({b[0] for b in before["blocks"]})  # one row per layer


def test_quality_policy_with_calibration_serves_a_burst(ap_qwen2_moe, tiny_qwen2_moe, server_env, cpu_server_flags,
                                                         work_dir, tmp_path):
    """`--paged-weight-policy auto` picks the quality policy when the AP checkpoint has a calibration file; its
    plans (fed by the MoE layers' routing observer) lower bitwidths under the burst, and every request completes."""
    import shutil
    import subprocess
    import sys

    from pagedweight.tools.tiny_model import TINY_CORPUS

    ap = tmp_path / "ap-calibrated"
    shutil.copytree(ap_qwen2_moe, ap)
    text = tmp_path / "calib.txt"
    text.write_text(TINY_CORPUS * 3)
    subprocess.run([sys.executable, "-m", "pagedweight", "calibrate", "--model", str(tiny_qwen2_moe), "--ap", str(ap),
                    "--text", str(text)], check=True, capture_output=True, timeout=600)
    flags = list(cpu_server_flags)
    flags[flags.index("--max-total-tokens") + 1] = "700"
    srv = launch_server(ap, ["--enable-paged-weight", "--paged-weight-bits", "8", "--paged-weight-kv-low-watermark",
                             "0.5", "--paged-weight-kv-high-watermark", "0.8"] + flags, server_env,
                        work_dir / "server-quality.log")
    try:
        wait_healthy(srv)
        assert _state(srv.url)["policy"] == "QualityPolicy"
        prompts = [" ".join(["alpha beta gamma delta epsilon"] * 18) + f" {i}" for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            bodies = list(pool.map(lambda p: requests.post(srv.url + "/generate", json={"text": p, "sampling_params": {
                "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}, timeout=600).json(), prompts))
        assert [b["meta_info"]["completion_tokens"] for b in bodies] == [40] * len(prompts)
        st = _state(srv.url)
        assert st["counters"]["offloads_committed"] > 0
        assert "quality offload" in srv.log() and "routing observer" in srv.log()
    finally:
        srv.stop()


def _two_long_prompts(url: str) -> list[int]:
    """Two requests whose prompts do not fit in the KV cache together (700 slots, 520 tokens each)."""
    prompts = [[10 + (7 * i + 3 * j) % 480 for j in range(500)] for i in range(2)]

    def one(ids):
        r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 20, "temperature": 0, "ignore_eos": True}}, timeout=600)
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, prompts))


@pytest.mark.parametrize("queue_aware", [True, False])
def test_a_waiting_long_prompt_is_pressure(queue_aware, ap_qwen2_moe, server_env, cpu_server_flags, work_dir):
    """Free KV stays above the low watermark while a long prompt waits for room (SGLang admits it only when it
    fits): with queue awareness its unmet demand makes the experts give memory back and the KV cache grows;
    without it nothing moves (the control)."""
    flags = list(cpu_server_flags)
    flags[flags.index("--max-total-tokens") + 1] = "700"
    flag = "--paged-weight-queue-aware" if queue_aware else "--no-paged-weight-queue-aware"
    srv = launch_server(ap_qwen2_moe, ["--enable-paged-weight", "--paged-weight-bits", "8", "--paged-weight-policy",
                                       "scripted", flag] + flags, server_env,
                        work_dir / f"server-queue-{queue_aware}.log")
    try:
        wait_healthy(srv)
        start = _state(srv.url)
        assert start["kv"]["queue_aware"] is queue_aware
        assert _two_long_prompts(srv.url) == [20, 20]
        st = _state(srv.url)
        if queue_aware:
            assert st["counters"]["offloads_committed"] > 0
            assert st["elastic_kv"]["counters"]["grows"] > 0, st["elastic_kv"]
        else:
            assert st["counters"]["offloads_committed"] == 0
            assert st["elastic_kv"]["capacity_tokens"] == start["elastic_kv"]["capacity_tokens"]
    finally:
        srv.stop()
