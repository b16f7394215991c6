"""The benchmark support code (pagedweight.bench): what it parses and summarizes, on hand-made inputs."""

from __future__ import annotations

import json
import math

import pytest

from pagedweight.bench.burst import BurstSpec, _count_bad_logprobs, percentile
from pagedweight.bench.cuda_timing import summarize_us
from pagedweight.bench.prometheus import parse_prometheus, retracted_requests, retractions_in_log
from pagedweight.bench.state_sampler import summarize_state

# As SGLang 0.5.17 exports it (the attribute is num_retracted_reqs_total, the name differs).
PROM = """# HELP sglang:num_retracted_requests_total retracted
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="m",tp_rank="0"} 3.0
sglang:num_retracted_requests_total{model_name="m",tp_rank="1"} 2.0
sglang:num_retracted_requests_created{model_name="m"} 1.7e9
sglang:num_retracted_reqs{model_name="m"} 1.0
sglang:gen_throughput{model_name="m"} NaN
sglang:token_usage{model_name="m"} 0.25
"""


def test_parse_prometheus_sums_label_sets_and_skips_nan():
    m = parse_prometheus(PROM)
    assert m["sglang:num_retracted_requests_total"] == 5.0
    assert m["sglang:token_usage"] == 0.25
    assert "sglang:gen_throughput" not in m
    assert retracted_requests(m) == 5


def test_retractions_in_the_scheduler_log():
    lines = [
        "[2026-11-29 14:07:59] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 1685",
        "[2026-11-29 14:08:00] KV cache pool is full. Retract requests. #retracted_reqs: 3, #new_tokens_gained: 1200",
        "server_args=ServerArgs(retraction_policy='length')",
    ]
    assert retractions_in_log(lines) == 4


def test_retractions_absent_counter_is_zero_only_with_sglang_metrics():
    assert retracted_requests({"sglang:token_usage": 0.1}) == 0
    with pytest.raises(KeyError, match="enable-metrics"):
        retracted_requests({"python_gc_objects_collected_total": 1.0})


def _info(blocks, hist, kv_cap=1000, used_kv=4096):
    return {
        "max_total_num_tokens": 900,
        "internal_states": [{
            "memory_usage": {"token_capacity": 900},
            "paged_weight": {
                "elastic_kv": {"capacity_tokens": kv_cap},
                "budget": {"used": {"kv": used_kv, "weights": 100}, "free": 7},
                "weights_resident_bytes": 123,
                "committed_bits_histogram": hist,
                "counters": {"transitions": 11},
                "queued_blocks": 2,
                "gpu_memory": {"free_bytes": 5, "total_bytes": 10},
                "blocks": blocks,
            },
        }],
    }


def test_summarize_state_paged_weight():
    blocks = [[0, 0, "w13", 8, 8], [0, 0, "w2", 3, 3], [1, 0, "w13", 4, 3]]
    s = summarize_state(_info(blocks, {"8": 1, "3": 1, "4": 1}), 1.23456)
    assert s.t_s == 1.235
    assert s.token_capacity == 1000  # the elastic capacity, not SGLang's start value
    assert (s.kv_bytes, s.weight_bytes, s.free_budget_bytes) == (4096, 123, 7)
    assert s.mean_bits == 5.0
    assert s.block_bits == "834"
    assert (s.transitions, s.queued_blocks, s.gpu_free_bytes) == (11, 2, 5)


def test_summarize_state_stock_sglang():
    s = summarize_state({"max_total_num_tokens": 900, "internal_states": [{"memory_usage": {"token_capacity": 900}}]}, 0)
    assert s.token_capacity == 900 and s.kv_bytes is None and s.block_bits is None


def test_burst_prompts_are_deterministic_and_in_range():
    a = BurstSpec(3, 50, 4, vocab_size=5000, seed=7).prompts()
    b = BurstSpec(3, 50, 4, vocab_size=5000, seed=7).prompts()
    c = BurstSpec(3, 50, 4, vocab_size=5000, seed=8).prompts()
    assert a == b and a != c
    assert all(len(p) == 50 and all(1000 <= t < 5000 for t in p) for p in a)


def test_nan_and_null_logprobs_count_as_bad():
    meta = {"output_token_logprobs": [[-0.5, 1, None], [None, 2, None], [math.nan, 3, None], [-1.0, 4, None]]}
    assert _count_bad_logprobs(meta) == 2


def test_percentile_nearest_rank():
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 99) == 99.0 and percentile(xs, 50) == 50.0 and percentile([], 99) is None
    assert percentile([4.0], 99) == 4.0


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    # An ephemeral port can be taken by the server's own gloo sockets before uvicorn binds it (exit code 3).
    import random
    import socket

    from pagedweight.bench.server_process import _ephemeral_low, free_port

    rng = random.Random(0)
    for _ in range(20):
        port = free_port(rng)
        assert 10000 <= port < _ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_launch_server_pins_the_nccl_port_unless_given(tmp_path, monkeypatch):
    import subprocess

    from pagedweight.bench import server_process

    seen = []

    class FakePopen:
        pid = 0

        def __init__(self, cmd, **kw):
            seen.append(cmd)

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    server_process.launch_server(tmp_path, ["--tp", "2"], {}, tmp_path / "a.log")
    server_process.launch_server(tmp_path, ["--nccl-port", "12345"], {}, tmp_path / "b.log")
    a, b = seen
    assert a.count("--nccl-port") == 1 and int(a[a.index("--nccl-port") + 1]) != int(a[a.index("--port") + 1])
    assert b.count("--nccl-port") == 1 and b[b.index("--nccl-port") + 1] == "12345"


def test_summarize_us_orders_the_times():
    got = summarize_us([9.0, 1.0, 5.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 10.0, 11.0])
    assert got == dict(median=6.0, min=1.0, p10=2.0, p90=10.0, reps=11)
    assert summarize_us([4.0, 2.0])["median"] == 3.0
    with pytest.raises(ValueError, match="no times"):
        summarize_us([])


def _load_script(name: str):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmark" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve a script's string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name,model_type,experts_key", [
    ("deepseek_v2_lite", "deepseek_v2", "n_routed_experts"), ("glm45_air", "glm4_moe", "n_routed_experts"),
    ("qwen15moe", "qwen2_moe", "num_experts"), ("mixtral", "mixtral", "num_local_experts"),
    ("qwen3moe", "qwen3_moe", "num_experts")])
def test_dummy_models_load_as_their_transformers_config(name, model_type, experts_key, tmp_path):
    """Each config-only model dir is what transformers (and so SGLang's dummy loader) reads: the family, the
    expert count, and the layer override for runs that cut the model down."""
    import transformers

    out = _load_script("dummy_model").make_dummy_model(name, tmp_path / name, num_layers=3)
    cfg = transformers.AutoConfig.from_pretrained(out)
    assert cfg.model_type == model_type and cfg.num_hidden_layers == 3
    assert getattr(cfg, experts_key) == _load_script("dummy_model").CONFIGS[name][experts_key]
    assert (out / "tokenizer.json").exists()


def test_gemma4_dummy_model_is_the_26b_a4b_decoder(tmp_path):
    """The Gemma-4 config-only dir: the multimodal config SGLang serves, its decoder at 26B-A4B's shapes (128 GELU
    experts top-8 of 704, hidden 2816), cut to 12 layers with the published 5:1 sliding/full pattern."""
    import transformers

    out = _load_script("dummy_model").make_dummy_model("gemma4_26b_a4b", tmp_path / "g4", num_layers=12)
    cfg = transformers.AutoConfig.from_pretrained(out)
    text = cfg.text_config
    assert cfg.model_type == "gemma4" and cfg.architectures == ["Gemma4ForConditionalGeneration"]
    assert (text.num_hidden_layers, text.num_experts, text.top_k_experts) == (12, 128, 8)
    assert (text.hidden_size, text.moe_intermediate_size, text.intermediate_size) == (2816, 704, 2112)
    assert text.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert text.enable_moe_block and text.attention_k_eq_v and text.sliding_window == 1024
    # the processor launch_server loads for this architecture, its media tokens inside the vocabulary
    processor = transformers.AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == "Gemma4Processor"
    assert 0 <= processor.image_token_id < len(processor.tokenizer) <= text.vocab_size
    from pagedweight.bench.scenario import config_vocab_size

    assert config_vocab_size(json.loads((out / "config.json").read_text())) == text.vocab_size == 262144


def test_config_vocab_size_top_level_or_text_config():
    from pagedweight.bench.scenario import config_vocab_size

    assert config_vocab_size({"vocab_size": 151936}) == 151936
    assert config_vocab_size({"text_config": {"vocab_size": 512}}) == 512
    with pytest.raises(ValueError, match="vocab_size"):
        config_vocab_size({"text_config": {}})


def test_tp2_bench_flush_waits_while_the_scheduler_drains(monkeypatch):
    """SGLang answers /flush_cache with 400 until its scheduler is idle: the probe waits for it, and gives up with the
    server's error past its deadline."""
    mod = _load_script("tp2_bench")
    answers = iter([400, 400, 200])
    calls = []

    class Resp:
        def __init__(self, code):
            self.status_code, self.ok = code, code == 200

        def raise_for_status(self):
            raise RuntimeError(f"HTTP {self.status_code}")

    def post(url, timeout):
        calls.append(url)
        return Resp(next(answers))

    monkeypatch.setattr(mod.requests, "post", post)
    monkeypatch.setattr(mod.time, "sleep", lambda s: None)
    mod._flush_cache("http://x")
    assert calls == ["http://x/flush_cache"] * 3
    monkeypatch.setattr(mod.requests, "post", lambda url, timeout: Resp(400))
    with pytest.raises(RuntimeError, match="HTTP 400"):
        mod._flush_cache("http://x", timeout_s=0.0)


def test_bench_one_batch_unit_norms_for_a_stock_dummy_run(monkeypatch):
    """--dummy-unit-norms: after SGLang loads a dummy model, every RMSNorm weight is 1 (as PagedWeight sets them), and
    the flag is refused for a model loaded from a checkpoint."""
    import types

    import torch
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.model_executor import model_runner

    def fake_load(self):
        self.model = torch.nn.Sequential(RMSNorm(8), torch.nn.Linear(8, 8), RMSNorm(8))
        for m in self.model:
            torch.nn.init.uniform_(m.weight, -1e-3, 1e-3)

    monkeypatch.setattr(model_runner.ModelRunner, "load_model", fake_load)
    _load_script("bench_one_batch").install_unit_norms()
    runner = types.SimpleNamespace(server_args=types.SimpleNamespace(load_format="dummy"))
    model_runner.ModelRunner.load_model(runner)
    norms, linear = [runner.model[0], runner.model[2]], runner.model[1]
    assert all(torch.equal(n.weight, torch.ones(8)) for n in norms)
    assert linear.weight.abs().max() <= 1e-3  # only the norms change
    runner.server_args.load_format = "auto"
    with pytest.raises(SystemExit, match="--load-format dummy"):
        model_runner.ModelRunner.load_model(runner)


def test_bench_one_batch_warms_up_every_batch_size(monkeypatch):
    """--warmup-every-batch: SGLang's warmup covers the first size; every other (batch size, input length) of the sweep
    runs once untimed (fresh requests, 8 output tokens, nothing printed) right before its timed run, whose result is
    the one returned."""
    from sglang.benchmark import one_batch

    calls = []

    def fake_run_once(run_name, model_runner, rank_print, reqs, batch_size, input_len, output_len, log_decode_step,
                      profile, profile_record_shapes, profile_activities, profile_prefix, profile_stage, tp_rank,
                      profile_start_step=None, profile_steps=None):
        calls.append((batch_size, input_len, output_len, reqs, rank_print == printed.append, profile))
        return {"batch_size": batch_size, "output_len": output_len}

    printed = []
    monkeypatch.setattr(one_batch, "latency_test_run_once", fake_run_once)
    monkeypatch.setattr(one_batch, "prepare_synthetic_inputs_for_latency_test", lambda bs, il: f"warm-{bs}-{il}")
    _load_script("bench_one_batch").install_warmup_every_batch()
    run = one_batch.latency_test_run_once
    run("r", None, printed.append, "w", 1, 2048, 32, log_decode_step=0, profile=False, profile_record_shapes=False,
        profile_activities=("CPU",), profile_prefix="", profile_stage="all", tp_rank=0)  # SGLang's warmup
    results = [run("r", None, printed.append, f"timed-{bs}", bs, 2048, 64, 5, True, False, ("CPU",), "", "all", 0)
               for bs in (1, 16, 16)]
    assert [c[:3] for c in calls] == [(1, 2048, 32), (1, 2048, 64), (16, 2048, 8), (16, 2048, 64), (16, 2048, 64)]
    assert calls[2][3] == "warm-16-2048" and not calls[2][4] and calls[2][5] is False  # fresh, silent, unprofiled
    assert calls[3][3] == "timed-16" and calls[3][4] and calls[3][5] is True
    assert [r["output_len"] for r in results] == [64, 64, 64]
    assert printed == ["bench_one_batch: --warmup-every-batch: untimed run at batch size 16, input length 2048"]



def test_bench_one_batch_writes_each_batch_size_as_measured(tmp_path, monkeypatch):
    """--result-filename: every timed size's row is in the file as soon as it is measured (a later size that dies
    leaves the earlier rows), SGLang's warmup is not written, SGLang's own end-of-sweep write gets an empty name."""
    import json

    from sglang.benchmark import one_batch

    script = _load_script("bench_one_batch")
    argv = ["x", "--batch-size", "1", "64", "--result-filename", str(tmp_path / "r.jsonl"), "--input-len", "2048"]
    assert script.take_result_filename(argv) == str(tmp_path / "r.jsonl")
    assert argv == ["x", "--batch-size", "1", "64", "--result-filename", "", "--input-len", "2048"]
    argv = ["x", f"--result-filename={tmp_path / 'q.jsonl'}"]
    assert script.take_result_filename(argv) == str(tmp_path / "q.jsonl") and argv == ["x", "--result-filename="]
    assert script.take_result_filename(["x", "--batch-size", "1"]) is None

    def fake_run_once(run_name, model_runner, rank_print, reqs, batch_size, input_len, output_len, log_decode_step,
                      profile, profile_record_shapes, profile_activities, profile_prefix, profile_stage, tp_rank,
                      profile_start_step=None, profile_steps=None):
        if batch_size == 64:
            raise RuntimeError("CUDA out of memory")
        return {"batch_size": batch_size, "output_len": output_len}

    monkeypatch.setattr(one_batch, "latency_test_run_once", fake_run_once)
    path = tmp_path / "r.jsonl"
    script.install_result_per_batch(str(path))
    run = one_batch.latency_test_run_once
    run("r", None, print, "w", 1, 2048, 32, 0, False, False, ("CPU",), "", "all", 0)  # SGLang's warmup
    assert not path.exists()
    run("r", None, print, "t", 1, 2048, 64, 0, False, False, ("CPU",), "", "all", 0)
    run("r", None, print, "t", 16, 2048, 64, 0, False, False, ("CPU",), "", "all", tp_rank=1)  # not rank 0
    with pytest.raises(RuntimeError, match="out of memory"):
        run("r", None, print, "t", 64, 2048, 64, 0, False, False, ("CPU",), "", "all", 0)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"batch_size": 1, "output_len": 64}]


def test_bench_one_batch_writes_rows_with_every_batch_warmed_up(tmp_path, monkeypatch):
    """Both wrappers as the script's main installs them (the warm-up first, the per-batch writer over it): the writer
    still binds SGLang's arguments (tp_rank; session 33 died on a KeyError here) and writes the timed rows only."""
    import json

    from sglang.benchmark import one_batch

    def fake_run_once(run_name, model_runner, rank_print, reqs, batch_size, input_len, output_len, log_decode_step,
                      profile, profile_record_shapes, profile_activities, profile_prefix, profile_stage, tp_rank,
                      profile_start_step=None, profile_steps=None):
        return {"batch_size": batch_size, "output_len": output_len, "reqs": reqs}

    monkeypatch.setattr(one_batch, "latency_test_run_once", fake_run_once)
    monkeypatch.setattr(one_batch, "prepare_synthetic_inputs_for_latency_test", lambda bs, il: f"warm-{bs}-{il}")
    script = _load_script("bench_one_batch")
    script.install_warmup_every_batch()
    path = tmp_path / "r.jsonl"
    script.install_result_per_batch(str(path))
    run = one_batch.latency_test_run_once
    run("r", None, print, "w", 1, 2048, 32, 0, False, False, ("CPU",), "", "all", 0)  # SGLang's warmup
    for bs in (1, 16):
        run("r", None, print, f"timed-{bs}", bs, 2048, 64, 0, False, False, ("CPU",), "", "all", 0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"batch_size": 1, "output_len": 64, "reqs": "timed-1"},
                    {"batch_size": 16, "output_len": 64, "reqs": "timed-16"}]


def test_summarize_e2e_writes_the_issue_headline_keys(tmp_path, monkeypatch, capsys):
    """summarize_e2e.py: per model and batch, decode throughput of PagedWeight over stock fp8 / bf16 (both scopes) and
    stock's prefill time over PagedWeight's; a model missing a system has no entry there; a run with fewer layers
    is named by its family; merged keys and the merged file's other models survive, this call's replace theirs."""
    import json
    import sys

    def write(model, system, rows):
        lines = [json.dumps({"batch_size": bs, "median_decode_throughput": dec, "prefill_latency": pre})
                 for bs, dec, pre in rows]
        (tmp_path / f"e2e_{model}_{system}.jsonl").write_text("\n".join(lines) + "\n")

    write("qwen15moe", "bf16", [(1, 200.0, 0.030), (16, 1400.0, 0.40)])
    write("qwen15moe", "fp8", [(1, 250.0, 0.020), (16, 1600.0, 0.25)])
    write("qwen15moe", "ap4", [(1, 300.0, 0.040), (16, 1760.0, 0.50)])
    write("qwen15moe", "ap4_all", [(1, 320.0, 0.045)])
    write("mixtral_16l", "bf16", [(1, 100.0, 0.050)])
    write("mixtral_16l", "ap4", [(1, 150.0, 0.040)])
    old = tmp_path / "e2e_decode.json"
    old_row = {"batch_size": 1, "median_decode_throughput": 110.0, "prefill_latency": 0.02}
    old.write_text(json.dumps({"meta": {"session": 8}, "cases": [1, 2], "e2e_meta": {"qwen3moe": {"session": 26}},
                               "e2e_runs": {"qwen3moe": {"fp8": [dict(old_row, median_decode_throughput=100.0)],
                                                         "ap4": [old_row]},
                                            "qwen15moe": {"ap4": [dict(old_row, batch_size=64)]}}}))
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["summarize_e2e.py", "--dir", str(tmp_path), "--out", str(out), "--merge", str(old),
                                      "--meta", '{"session": 27}'])
    _load_script("summarize_e2e").main()
    doc = json.loads(out.read_text())
    h = doc["headline"]
    assert h["decode_ratio_vs_stock_fp8"] == {"qwen15moe": {"1": 1.2, "16": 1.1}, "qwen3moe": {"1": 1.1}}
    assert h["decode_ratio_vs_stock_fp8_scope_all"] == {"qwen15moe": {"1": 1.28}}
    assert h["decode_ratio_vs_stock_bf16"] == {"qwen15moe": {"1": 1.5, "16": 1.257}, "mixtral": {"1": 1.5}}
    assert h["prefill_ratio_vs_stock_bf16"] == {"qwen15moe": {"1": 0.75, "16": 0.8}, "mixtral": {"1": 1.25}}
    assert doc["headline_layers"] == {"mixtral": 16}
    assert doc["e2e_meta"] == {"qwen3moe": {"session": 26}, "qwen15moe": {"session": 27}, "mixtral_16l": {"session": 27}}
    assert h["prefill_ratio_vs_stock_fp8"] == {"qwen15moe": {"1": 0.5, "16": 0.5}, "qwen3moe": {"1": 1.0}}
    assert doc["meta"] == {"session": 8} and doc["cases"] == [1, 2] and doc["headline_meta"] == {"session": 27}
    assert [r["batch_size"] for r in doc["e2e_runs"]["qwen15moe"]["ap4"]] == [1, 16]  # this call's, not the file's 64
    assert doc["e2e_runs"]["qwen3moe"]["ap4"] == [old_row]
    assert "| qwen15moe | 16 | 1400.0 / 1600.0 / 1760.0 / - | 1.1 |" in capsys.readouterr().out


def test_grouped_sweep_reads_config_tags_and_counts_the_blocks_padding():
    """grouped_sweep.py: every tag reaches its GroupedConfig field, and block_fill is the real pairs over the slots of
    the blocks the alignment makes (each expert padded to whole blocks; -1, another rank's expert, takes none)."""
    import torch

    sweep = _load_script("grouped_sweep")
    cfg = sweep.parse_config("2.3.r256.ow.lag2")
    fields = (cfg.wn, cfg.stages, cfg.rows, cfg.offset_in_weights, cfg.refill_lag, cfg.red_v4)
    assert fields == (2, 3, 256, True, 2, False)
    assert sweep.parse_config("1.3.rv").red_v4 and sweep.parse_config("1.3").refill_lag == 1
    assert sweep.parse_config("4.3.rv") == sweep.GroupedConfig(4, 3, red_v4=True)
    ids = torch.tensor([[0, 1], [0, -1], [2, 1], [0, 1]])  # expert 0: 3 pairs, 1: 3, 2: 1
    assert sweep.block_fill(ids, 4, 2) == 7 / 10  # blocks of 2: 2 + 2 + 1
    assert sweep.block_fill(ids, 4, 4) == 7 / 12


def test_prefill_bench_memory_table_is_ours_against_stock_bf16():
    """prefill_bench's memory table: the default u4 call's transient MiB beside SGLang bf16's at the same model and M
    (extra = ours - stock, negative where ours needs less); forced variants, other cases and rows without a stock
    measurement stay out."""
    pb = _load_script("prefill_bench")
    mib = 2**20
    rows = [
        dict(model="qwen3moe", case="u4", M=8192, variant="default", transient_bytes=227 * mib,
             stock_bf16_transient_bytes=576 * mib, extra_vs_stock_bf16_bytes=-349 * mib),
        dict(model="qwen3moe", case="u4", M=256, variant="default", transient_bytes=10 * mib),
        dict(model="qwen3moe", case="u4", M=8192, variant="tiles", transient_bytes=900 * mib,
             stock_bf16_transient_bytes=576 * mib, extra_vs_stock_bf16_bytes=324 * mib),
        dict(model="qwen3moe", case="u8", M=8192, variant="default", transient_bytes=227 * mib,
             stock_bf16_transient_bytes=576 * mib, extra_vs_stock_bf16_bytes=-349 * mib),
    ]
    assert pb.memory_table(rows) == {"qwen3moe": {"8192": dict(ours_mib=227.0, stock_bf16_mib=576.0,
                                                               extra_vs_stock_bf16_mib=-349.0)}}


def test_trace_kernels_sums_each_forward_by_category_against_the_first(tmp_path, capsys):
    """trace_kernels.py: GPU kernel events (not CPU ops) summed by name and category from gzip and plain chrome
    traces; the first trace is the baseline of every difference, per forward and per layer; a trace without GPU
    kernels and a --trace without LABEL= are refused in one line."""
    import gzip

    tk = _load_script("trace_kernels")

    def kernel(name, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "dur": dur, "ts": 0}

    stock = [kernel("fused_moe_kernel", 300.0), kernel("fused_moe_kernel", 200.0),
             kernel("moe_align_block_size_kernel", 10.0), kernel("_fwd_kernel", 120.0),
             kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", 80.0), kernel("FusedAddRMSNormKernel", 6.0),
             {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 999.0}]
    ours = [kernel("ap_grouped_gemm", 400.0), kernel("ap_grouped_gemm", 260.0), kernel("ap_grouped_prep", 9.0),
            kernel("ap_moe_align", 7.0), kernel("_fwd_kernel", 121.0),
            kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", 80.0), kernel("FusedAddRMSNormKernel", 6.0),
            kernel("void at::native::index_put_kernel", 3.0), kernel("mystery", 1.0)]
    a = tmp_path / "stock.trace.json.gz"
    with gzip.open(a, "wt") as f:
        json.dump({"traceEvents": stock}, f)
    b = tmp_path / "ours.trace.json"
    b.write_text(json.dumps({"traceEvents": ours}))
    out = tmp_path / "k.json"
    assert tk.main(["--trace", f"bf16={a}", "--trace", f"ap4={b}", "--out", str(out), "--layers", "2",
                    "--top", "3"]) == 0
    rep = json.loads(out.read_text())
    assert rep["baseline"] == "bf16"
    s, o = rep["traces"]["bf16"], rep["traces"]["ap4"]
    assert s["by_category_us"]["moe_stock"] == 510.0 and s["by_category_us"]["moe_ap"] == 0.0
    assert s["total_us"] == 716.0 and s["kernels"] == 6  # the CPU op is not a kernel
    assert o["by_category_us"]["moe_ap"] == 676.0 and o["by_category_us"]["attention"] == 121.0
    assert o["by_category_us"]["gemm"] == 80.0 and o["by_category_us"]["norm"] == 6.0
    assert o["by_category_us"]["copy_cast"] == 3.0 and o["by_category_us"]["other"] == 1.0
    assert o["diff_vs_baseline_us"]["moe_ap"] == 676.0 and o["diff_vs_baseline_us"]["moe_stock"] == -510.0
    assert o["total_diff_vs_baseline_us"] == round(o["total_us"] - 716.0, 1) == 171.0
    assert o["diff_vs_baseline_us_per_layer"]["attention"] == 0.5
    assert [k["name"] for k in o["top_kernels"]] == ["ap_grouped_gemm", "_fwd_kernel",
                                                     "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT"]
    assert o["top_kernels"][0] == {"name": "ap_grouped_gemm", "us": 660.0, "launches": 2, "category": "moe_ap"}
    printed = capsys.readouterr().out
    assert "| moe_ap | 0.0 | 676.0 | +676.0 |" in printed and "| total | 716.0 | 887.0 | +171.0 |" in printed
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [stock[-1]]}))
    with pytest.raises(SystemExit, match="no GPU kernel events"):
        tk.main(["--trace", f"x={empty}", "--out", str(out)])
    with pytest.raises(SystemExit):
        tk.main(["--trace", str(b), "--out", str(out)])
    assert "--trace takes LABEL=PATH" in capsys.readouterr().err
