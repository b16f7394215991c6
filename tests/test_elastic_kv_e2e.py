"""End to end: the real SGLang server on CPU with --enable-paged-weight grows and shrinks its KV capacity
while serving, and SGLang's own memory checks (strict, every busy iteration and when idle) stay quiet.

The capacity is moved from outside through the elastic KV cache's operator route,
`POST /set_internal_state {"server_args": {"paged_weight_kv_capacity_tokens": N}}`, and read back from
`/server_info` (SGLang's `memory_usage.token_capacity` and the cache's own "paged_weight_kv" state).
"""

from __future__ import annotations

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
    # PagedWeight's own controller runs every scheduler iteration too: under pressure it offloads weights
    # and grows the cache, when quiet it shrinks it back toward its floor. So this test checks what holds
    # whatever the controller does meanwhile: our moves land, requests complete, the books balance.
    assert _resize(server, GROWN_TOKENS), "grow to 600 tokens"
    # 8 concurrent requests of ~78 tokens each need ~4x the start capacity.
    for body in _burst(server, 8):
        assert body["meta_info"]["completion_tokens"] == 40 and body["text"]

    # Back to the floor once nothing runs: finished requests' KV sits in the radix cache, on tail slots
    # among others; the shrink evicts what is in the way.
    assert _wait(lambda: _resize(server, START_TOKENS)), "shrink back to 160 tokens once nothing runs"
    capacity, kv = _kv(server)
    assert capacity == kv["capacity_tokens"] == START_TOKENS
    assert kv["parked_tokens"] == EXTRA_TOKENS and kv["available_tokens"] <= START_TOKENS
    counters = kv["counters"]
    assert counters["grows"] >= 1 and counters["shrinks"] >= 1
    assert counters["tokens_shrunk"] - counters["tokens_grown"] == 0, counters  # back where it started
    print("elastic KV counters after grow/burst/shrink:", counters)

    # Serving continues at the smaller capacity (requests queue or retract, and all complete).
    for body in _burst(server, 4):
        assert body["meta_info"]["completion_tokens"] == 40

    log = server.log()
    assert "elastic KV: grew 160 -> 600 tokens" in log
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


def test_resize_outside_the_range_is_clamped(server):
    assert _resize(server, 10**6), "clamped to max_tokens, which is reached: updated"
    assert f"capacity 1000000 requested, now {START_TOKENS + EXTRA_TOKENS} tokens" in server.log()
    assert _wait(lambda: _resize(server, 1)), "clamped to SGLang's own capacity, the floor"
    assert f"capacity 1 requested, now {START_TOKENS} tokens" in server.log()
    body = _generate(server, 3)
    assert body["meta_info"]["completion_tokens"] == 40
