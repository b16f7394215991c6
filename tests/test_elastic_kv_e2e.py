"""End to end: the real SGLang server on CPU with --enable-paged-weight grows and shrinks its KV capacity
while serving, and SGLang's own memory checks (strict, every busy iteration and when idle) stay quiet.

The capacity moves with the weights (the PagedWeight controller offloads planes under a burst and the
freed bytes become token slots; a quiet period gives them back), and through the operator route
`POST /set_internal_state {"server_args": {"paged_weight_kv_capacity_tokens": N}}` within the budget; it is
read back from `/server_info` (SGLang's `memory_usage.token_capacity` and the cache's "paged_weight_kv" state).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.support.server import launch_server, wait_healthy

pytestmark = pytest.mark.e2e

START_TOKENS = 160  # SGLang's own capacity (--max-total-tokens)
EXTRA_TOKENS = 480  # room the elastic cache reserves on top
GROWN_TOKENS = 600
# Words the tiny test tokenizer knows (about 38 tokens per prompt); rotated so prompts differ.
WORDS = "the cat sat on the mat and the dog ran in the park while the sun was bright over the hills".split()


def _flags(cpu_server_flags: list[str]) -> list[str]:
    flags = list(cpu_server_flags)
    for name, value in (("--max-total-tokens", str(START_TOKENS)), ("--chunked-prefill-size", "128")):
        flags[flags.index(name) + 1] = value
    return flags


@pytest.fixture(scope="module")
def server(ap_qwen2_moe, server_env, cpu_server_flags, work_dir):
    env = dict(server_env)
    env["PAGEDWEIGHT_ELASTIC_KV_EXTRA_TOKENS"] = str(EXTRA_TOKENS)
    env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"  # assert SGLang's pool invariant every iteration
    env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"
    srv = launch_server(
        ap_qwen2_moe,
        ["--enable-paged-weight", "--paged-weight-bits", "4"] + _flags(cpu_server_flags),
        env,
        work_dir / "server-elastic-kv.log",
    )
    try:
        wait_healthy(srv)
        yield srv
    finally:
        srv.stop()


def _info(server) -> dict:
    r = requests.get(server.url + "/server_info", timeout=60)
    r.raise_for_status()
    return r.json()


def _kv(server) -> tuple[int, dict]:
    state = _info(server)["internal_states"][0]
    return state["memory_usage"]["token_capacity"], state["paged_weight_kv"]


def _snapshot(server) -> tuple[int, dict, dict]:
    """SGLang's token capacity, the elastic cache's state and the PagedWeight budget, from one answer."""
    state = _info(server)["internal_states"][0]
    return state["memory_usage"]["token_capacity"], state["paged_weight_kv"], state["paged_weight"]["budget"]


def _resize(server, tokens: int) -> bool:
    r = requests.post(
        server.url + "/set_internal_state",
        json={"server_args": {"paged_weight_kv_capacity_tokens": tokens}},
        timeout=60,
    )
    r.raise_for_status()
    return r.json() == [True]


def _generate(server, i: int) -> dict:
    prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(len(WORDS)))
    r = requests.post(
        server.url + "/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}},
        timeout=600,
    )
    r.raise_for_status()
    return r.json()


def _burst(server, n: int) -> list[dict]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: _generate(server, i), range(n)))


def test_starts_at_sglang_capacity_with_room_parked(server):
    info = _info(server)
    assert info["max_total_num_tokens"] == START_TOKENS
    capacity, kv = _kv(server)
    assert capacity == kv["capacity_tokens"] == START_TOKENS
    assert kv["max_tokens"] == START_TOKENS + EXTRA_TOKENS
    assert kv["parked_tokens"] == EXTRA_TOKENS and kv["bytes_per_token"] > 0
    assert "PagedWeight elastic KV: 160 tokens usable of 640" in server.log()


def test_grow_serve_shrink_serve(server):
    # One budget: the KV cache grows only with bytes the weights give up. A burst of 8 concurrent requests of
    # ~78 tokens needs ~4x the start capacity, so the controller offloads expert planes and the freed bytes
    # become token slots; once quiet, the cache shrinks back and the weights reload. SGLang's strict memory
    # checks run every busy and idle iteration meanwhile.
    for body in _burst(server, 8):
        assert body["meta_info"]["completion_tokens"] == 40 and body["text"]
    _, kv = _kv(server)
    assert kv["counters"]["grows"] >= 1, kv["counters"]

    # Back to the floor once nothing runs: finished requests' KV sits in the radix cache, on tail slots
    # among others; the shrink evicts what is in the way.
    assert _wait(lambda: _kv(server)[0] == START_TOKENS, 240), f"capacity back to {START_TOKENS}: {_kv(server)}"
    capacity, kv = _kv(server)
    assert capacity == kv["capacity_tokens"] == START_TOKENS
    assert kv["parked_tokens"] == EXTRA_TOKENS and kv["available_tokens"] <= START_TOKENS
    counters = kv["counters"]
    assert counters["grows"] >= 1 and counters["shrinks"] >= 1
    assert counters["tokens_shrunk"] - counters["tokens_grown"] == 0, counters  # back where it started
    print("elastic KV counters after burst/quiet:", counters)

    # Serving continues at the smaller capacity (requests queue or retract, and all complete).
    for body in _burst(server, 4):
        assert body["meta_info"]["completion_tokens"] == 40

    log = server.log()
    assert "elastic KV: grew 160 ->" in log
    assert "elastic KV: shrank" in log
    assert "Mem Leak" not in log and "memory leak" not in log and "Traceback" not in log


def _wait(ok, timeout_s: float = 60.0) -> bool:
    import time

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if ok():
            return True
        time.sleep(1.0)
    return False


def test_operator_resize_is_clamped_and_budgeted(server):
    """The operator route moves capacity within [SGLang's own capacity, the reserved room] and only with bytes
    the budget has: asking for more than the weights gave up is refused, never over-committed."""
    assert _wait(lambda: _resize(server, 1)), "clamped to SGLang's own capacity, the floor"
    assert f"capacity 1 requested, now {START_TOKENS} tokens" in server.log()
    # One snapshot holds SGLang's capacity and the budget together (the scheduler answers between
    # iterations). The runtime may grow the cache on its own meanwhile with bytes the shrink freed, so the
    # checks are the budget's invariants, not a fixed capacity.
    capacity, kv, budget = _snapshot(server)
    bpt = kv["bytes_per_token"]
    kv_bytes_at_zero = budget["used"]["kv"] - capacity * bpt  # the budget's KV bytes follow the capacity exactly
    refused = kv["counters"]["refused_grows"]
    assert not _resize(server, 10**6), "the budget backs far fewer than 10**6 tokens: the grow is refused"
    now = re.findall(r"capacity 1000000 requested, now (\d+) tokens", server.log())
    assert len(now) == 1 and START_TOKENS <= int(now[0]) < kv["max_tokens"], now
    capacity, kv, budget = _snapshot(server)
    assert kv["counters"]["refused_grows"] > refused
    assert budget["used"]["kv"] - capacity * bpt == kv_bytes_at_zero, "KV bytes in the budget left the capacity"
    assert 0 <= budget["free"] < (kv["max_tokens"] - capacity) * bpt, "refused a grow the budget could back"
    body = _generate(server, 3)
    assert body["meta_info"]["completion_tokens"] == 40
