"""End to end: the real SGLang server on CPU serves a converted tiny Qwen2-MoE with --enable-paged-weight."""

from __future__ import annotations

import re

import pytest
import requests

from tests.support.server import launch_server, wait_healthy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(ap_qwen2_moe, server_env, cpu_server_flags, work_dir):
    srv = launch_server(
        ap_qwen2_moe,
        ["--enable-paged-weight", "--paged-weight-bits", "4"] + cpu_server_flags,
        server_env,
        work_dir / "server-e2e.log",
    )
    try:
        wait_healthy(srv)
        yield srv
    finally:
        srv.stop()


def test_generate(server):
    r = requests.post(
        server.url + "/generate",
        json={
            "text": "The quick brown fox",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        },
        timeout=120,
    )
    r.raise_for_status()
    body = r.json()
    assert isinstance(body["text"], str) and body["text"]
    assert body["meta_info"]["completion_tokens"] == 12


def _greedy(server, text: str, n: int) -> str:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = requests.post(server.url + "/generate", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["text"]


def test_openai_completions(server):
    """The OpenAI route serves the same model and sampling as /generate: the same greedy continuation."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    resp = client.completions.create(model="default", prompt="Hello there", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 8
    assert resp.choices[0].text == _greedy(server, "Hello there", 8)


def test_openai_chat_completions(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    resp = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say something."}], max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage.completion_tokens == 8 and resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content


def test_frontend_program(server):
    import sglang as sgl

    @sgl.function
    def two_steps(s, topic):
        s += "Topic: " + topic + "\n"
        s += "First: " + sgl.gen("first", max_tokens=6, temperature=0) + "\n"
        s += "Second: " + sgl.gen("second", max_tokens=6, temperature=0)

    backend = sgl.RuntimeEndpoint(server.url)
    state = two_steps.run(topic="rivers", backend=backend)
    assert state.text().startswith("Topic: rivers\nFirst: ")
    # each gen continues the program's text so far exactly as /generate continues that text
    first_prompt = "Topic: rivers\nFirst: "
    assert state["first"] == _greedy_stop(server, first_prompt, 6)
    second_prompt = first_prompt + state["first"] + "\nSecond: "
    assert state["second"] == _greedy_stop(server, second_prompt, 6)


def _greedy_stop(server, text: str, n: int) -> str:  # as sgl.gen asks: eos may end it early
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    r = requests.post(server.url + "/generate", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["text"]


def test_startup_log_reports_expert_memory(server):
    line = next((l for l in server.log().splitlines() if "PagedWeight:" in l and "expert blocks" in l), None)
    assert line is not None, "no PagedWeight memory line in the server log"
    # tiny Qwen2-MoE: every expert block committed at 4 bits, far below bf16
    assert "at 4 bits" in line
    frac = float(re.search(r", ([0-9.]+)%\)", line).group(1))
    assert 0 < frac < 40.0


def test_startup_log_names_the_policy_and_floor(server):
    """No calibration.json: 'auto' serves the uncalibrated policy, and one line says so, with its floor and why."""
    line = next((l for l in server.log().splitlines() if "PagedWeight: policy" in l), None)
    assert line is not None, "no PagedWeight policy line in the server log"
    assert "policy uncalibrated (auto: no calibration.json in" in line
    assert re.search(r"floor [0-9] bits \(lowest bitwidth whose relative weight error", line), line
    assert "weight_errors.json" in line


@pytest.mark.parametrize("kind", ["kmeans", "ubcq"])
def test_mixtral_with_other_table_kinds_serves(kind, tiny_mixtral, server_env, cpu_server_flags, work_dir):
    """The second architecture and the other table kinds through the same server path."""
    from pagedweight.tools.convert import convert_checkpoint

    ap = convert_checkpoint(tiny_mixtral, work_dir / f"ap-mixtral-{kind}", table_kind=kind, bits_min=2,
                            bits_max=8, seed=0)
    srv = launch_server(ap, ["--enable-paged-weight", "--paged-weight-bits", "3"] + cpu_server_flags, server_env,
                        work_dir / f"server-mixtral-{kind}.log")
    try:
        wait_healthy(srv)
        r = requests.post(srv.url + "/generate", json={"text": "a b c", "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}, timeout=120)
        r.raise_for_status()
        assert r.json()["meta_info"]["completion_tokens"] == 6
        assert any("PagedWeight:" in l and "at 3 bits" in l for l in srv.log().splitlines())
    finally:
        srv.stop()


def test_hf_checkpoint_plus_separate_ap_dir(server, tiny_qwen2_moe, server_env, cpu_server_flags, work_dir):
    """--model-path <HF bf16 checkpoint> --paged-weight-path <AP dir>: SGLang streams the bf16 experts from
    disk and the plugin drops them; the answers equal the converted model's (same planes, same bitwidth)."""
    from pagedweight.tools.convert import convert_checkpoint

    ap_only = convert_checkpoint(tiny_qwen2_moe, work_dir / "ap-standalone", bits_min=2, bits_max=8, seed=0,
                                 standalone_ap_dir=True)
    payload = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    expected = requests.post(server.url + "/generate", json=payload, timeout=120).json()["text"]
    srv = launch_server(
        tiny_qwen2_moe,
        ["--enable-paged-weight", "--paged-weight-path", str(ap_only), "--paged-weight-bits", "4"] + cpu_server_flags,
        server_env,
        work_dir / "server-hf-plus-ap.log",
    )
    try:
        wait_healthy(srv)
        got = requests.post(srv.url + "/generate", json=payload, timeout=120).json()["text"]
        assert got == expected
        assert any("PagedWeight:" in l and "at 4 bits" in l for l in srv.log().splitlines())
    finally:
        srv.stop()


def test_longbench_harness_against_the_live_server(server, tmp_path):
    """The LongBench harness (official templates, truncation, scoring) against the real PagedWeight server."""
    import json
    import subprocess
    import sys

    data = tmp_path / "lb-data"
    subprocess.run([sys.executable, "-m", "pagedweight.longbench", "make-fixtures", "--out", str(data)], check=True,
                   capture_output=True, timeout=120)
    out = tmp_path / "lb-run"
    r = subprocess.run(
        [sys.executable, "-m", "pagedweight.longbench", "run", "--data-dir", str(data), "--out", str(out),
         "--base-url", server.url, "--datasets", "passage_retrieval_en,qmsum", "--limit", "2",
         "--max-prompt-tokens", "900", "--concurrency", "2", "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    text = json.dumps(results)
    for name in ("passage_retrieval_en", "qmsum"):
        assert name in text
        lines = (out / "predictions" / f"{name}.jsonl").read_text().splitlines()
        assert len(lines) == 2
