"""Plumbing of benchmark/quality_curve.py on the tiny random Mixtral (numbers are meaningless here)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmark"))

from quality.experiment import ExperimentConfig, run_experiment  # noqa: E402
from quality.planning import bytes_of, fresh_table, plan_to_budget, spike_then_relax, uniform  # noqa: E402
from quality import bootstrap  # noqa: E402
from quality.report import cheapest_bf16_equivalent, gap_closed, markdown  # noqa: E402
from quality.swap import ExpertBank, runtime_blocks  # noqa: E402

from pagedweight.tools.tiny_model import TINY_CORPUS, TinyMoESizes, make_tiny_moe  # noqa: E402

BITS_MAX = 5  # a short bit range keeps the tiny conversion fast
SIZES = TinyMoESizes(num_layers=2, hidden_size=64, num_experts=4, top_k=2, moe_intermediate_size=64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from pagedweight.tools.calibrate import run_calibrate
    from pagedweight.tools.convert import convert_checkpoint
    from pagedweight.planner.calibration_stats import CalibrateOptions

    root = tmp_path_factory.mktemp("quality")
    model_dir = make_tiny_moe(root / "hf", arch="mixtral", seed=0, sizes=SIZES)
    text = root / "calib.txt"
    text.write_text(TINY_CORPUS * 4)
    ap = {kind: convert_checkpoint(model_dir, root / f"ap-{kind}", table_kind=kind, bits_min=2, bits_max=BITS_MAX,
                                   group_size=64, seed=0) for kind in ("bcq", "ubcq", "kmeans")}
    calib = {kind: run_calibrate(str(model_dir), str(ap[kind]), str(text), str(root / f"calibration-{kind}.json"),
                                 CalibrateOptions(tokens=256, prompt_tokens=32), progress=False)
             for kind in ("bcq", "ubcq")}
    return model_dir, ap, calib


def test_swap_restores_and_decodes(setup):
    from transformers import AutoModelForCausalLM

    from pagedweight.format.checkpoint import APCheckpoint

    model_dir, ap, _ = setup
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ckpt = APCheckpoint.open(ap["bcq"])
    blocks = runtime_blocks(ckpt)
    assert len(blocks) == SIZES.num_layers * SIZES.num_experts * 2
    bank = ExpertBank(model, {"bcq": ckpt})
    experts = bank.layers[0].module
    before = experts.gate_up_proj.detach().clone()
    bank.apply(uniform(blocks, 2))
    assert not torch.equal(experts.gate_up_proj, before)
    key = blocks[0][0]
    assert torch.equal(experts.gate_up_proj[key.expert], bank.weight("bcq", key, 2))
    err2 = (experts.gate_up_proj - before).abs().mean()
    bank.apply(uniform(blocks, BITS_MAX))
    assert (experts.gate_up_proj - before).abs().mean() < err2 / 2
    bank.restore()
    assert torch.equal(experts.gate_up_proj, before)


def test_plans_respect_budgets(setup):
    from pagedweight.format.checkpoint import APCheckpoint
    from pagedweight.planner.calibration import CalibrationData
    from pagedweight.planner.quality_policy import QualityOptions, QualityPolicy

    _, ap, calib = setup
    blocks = runtime_blocks(APCheckpoint.open(ap["bcq"]))
    data = CalibrationData.load(calib["bcq"])
    b3, b2 = bytes_of(blocks, uniform(blocks, 3)), bytes_of(blocks, uniform(blocks, 2))
    assert fresh_table(blocks).desired_bytes() == bytes_of(blocks, uniform(blocks, BITS_MAX))
    p = plan_to_budget(QualityPolicy(data), blocks, b3)
    assert p.bytes <= b3 and sum(p.histogram().values()) == len(blocks)
    q = plan_to_budget(QualityPolicy(data), blocks, b3)
    assert p.assignment == q.assignment  # deterministic
    moved = spike_then_relax(QualityPolicy(data), blocks, (b2 + b3) // 2, b3)
    frozen = spike_then_relax(QualityPolicy(data, QualityOptions(use_page_movement=False)), blocks, (b2 + b3) // 2, b3)
    assert frozen.bytes <= (b2 + b3) // 2 and moved.bytes <= b3 and moved.bytes >= frozen.bytes


def test_calibration_of_an_older_format_is_not_reused(setup, tmp_path):
    import json

    from quality.artifacts import calibration_current

    _, _, calib = setup
    assert calibration_current(Path(calib["bcq"]))
    old = json.loads(Path(calib["bcq"]).read_text())
    old["version"] = 1
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert not calibration_current(tmp_path / "old.json")
    assert not calibration_current(tmp_path / "missing.json")


def test_report_helpers():
    assert gap_closed(12.0, 11.0, 10.0) == pytest.approx(0.5)
    assert gap_closed(10.0, 11.0, 10.0) is None
    pts = [{"bytes": 10, "ppl": 10.05}, {"bytes": 5, "ppl": 10.2}, {"bytes": 8, "ppl": 10.09}]
    saving, best = cheapest_bf16_equivalent(pts, 10.0, 100)
    assert best["bytes"] == 8 and saving == pytest.approx(0.92)
    assert cheapest_bf16_equivalent(pts, 9.0, 100) == (None, None)


def test_window_bootstrap():
    rng = np.random.default_rng(0)
    a = {"window_nll": list(rng.uniform(300, 400, 64)), "tokens": 64 * 100}
    b = {"window_nll": [x + 10.0 for x in a["window_nll"]], "tokens": 64 * 100}  # 0.1 nats/token worse everywhere
    idx = bootstrap.resample_indices(64, 500, seed=1)
    assert idx.shape == (500, 64) and np.array_equal(idx, bootstrap.resample_indices(64, 500, seed=1))
    lo, hi = bootstrap.interval(bootstrap.ppl_samples(a, idx))
    point = float(np.exp(np.mean(a["window_nll"]) / 100))
    assert lo < point < hi
    # paired: b - a is the same on every resample up to the level of a, so its interval is narrow and > 0
    diff = bootstrap.ppl_samples(b, idx) - bootstrap.ppl_samples(a, idx)
    d_lo, d_hi = bootstrap.interval(diff)
    assert 0 < d_lo <= d_hi and d_hi - d_lo < hi - lo
    # the cheapest point within 1% of the reference, per resample
    ref = {"window_nll": a["window_nll"], "tokens": a["tokens"]}
    pts = [dict(a, bytes=50), dict(b, bytes=10)]
    saving = bootstrap.saving_samples(pts, ref, 100, idx)
    assert set(np.unique(saving)) == {0.5}  # b (+10.5% ppl) never qualifies, a always does
    assert bootstrap.interval(np.full(10, np.nan)) is None


def test_experiment_end_to_end(setup):
    model_dir, ap, calib = setup
    ap = {k: ap[k] for k in ("bcq", "kmeans")}
    cfg = ExperimentConfig(model_dir=model_dir, ap_dirs=ap, calibration=calib["bcq"], calib_kind="wiki", shift_kind="news",
                           calib_tokens=64, seq_len=32, windows=2, bits=(3, 4), extra_bits=(3.5,), refine=1,
                           progress=False)
    r = run_experiment(cfg)
    assert set(r["headline"]) >= {"gap_closed_vs_uniform_3bit", "memory_saving_at_bf16_equivalent",
                                  "uncalibrated_default_ppl_at_25pct", "calibrated_policy_ppl_at_25pct",
                                  "uniform_3bit_ppl_at_25pct", "uniform_4bit_ppl"}
    assert set(r["headline_ci95"]) == set(r["headline"])  # an interval beside every headline figure
    for key in ("uncalibrated_default_ppl_at_25pct", "uniform_3bit_ppl_at_25pct", "bf16_ppl"):
        lo, hi = r["headline_ci95"][key]
        assert lo <= r["headline"][key] <= hi
    assert r["headline"]["uncalibrated_default_ppl_at_25pct"] == r["curve"][0]["uncalibrated"]["ppl"]
    assert r["headline"]["uniform_4bit_ppl"] == r["curve"][1]["uniform_bcq"]["ppl"]
    for row in r["curve"]:
        assert row["uncalibrated"]["bytes"] <= row["uniform_bcq"]["bytes"]
        assert min(int(b) for b in row["uncalibrated"]["bits_histogram"]) >= row["uncalibrated"]["floor_bits"]
        assert len(row["uncalibrated"]["window_nll"]) == 2
    assert r["bf16"]["kl"] == pytest.approx(0.0, abs=1e-3)
    assert [row["bits"] for row in r["curve"]] == [3, 4]
    for row in r["curve"]:
        for name in ("pagedweight", "hotness"):
            assert row[name]["bytes"] <= row["uniform_bcq"]["bytes"]
        assert row["uniform_kmeans"]["bytes"] > 0
    assert set(r["ablation"]["rows"]) >= {"full", "w/o routing statistics", "w/o prompt residual",
                                         "w/o global sensitivity", "w/o page movement (spike then relax)"}
    assert set(r["workload_shift"]["rows"]) == {"bf16", "uniform 3-bit bcq", "PagedWeight, calibration statistics only",
                                                "PagedWeight, online statistics from the served text"}
    r.update(command="test", date="today", machine={"summary": "test"})
    text = markdown(r)
    assert "gap_closed_vs_uniform_3bit" in text and "Ablation" in text


def test_experiment_plans_over_ubcq(setup):
    """--table-kind ubcq: PagedWeight and hotness plan over the ubcq checkpoint (its calibration, its uniform
    bytes as budgets); bcq and kmeans are measured at uniform bitwidths beside it."""
    model_dir, ap, calib = setup
    cfg = ExperimentConfig(model_dir=model_dir, ap_dirs=ap, calibration=calib["ubcq"], calib_kind="wiki",
                           shift_kind="news", calib_tokens=64, seq_len=32, windows=2, bits=(3, 4), extra_bits=(),
                           refine=0, progress=False, main_kind="ubcq")
    r = run_experiment(cfg)
    assert r["model"]["planned_table_kind"] == "ubcq"
    for row in r["curve"]:
        for name in ("pagedweight", "hotness"):
            assert row[name]["bytes"] <= row["uniform_ubcq"]["bytes"]
        # two fp16 per group instead of b + 1: fewer bytes than bcq at the same bitwidth
        assert row["uniform_ubcq"]["bytes"] < row["uniform_bcq"]["bytes"]
    assert "uniform 3-bit ubcq" in r["workload_shift"]["rows"]
    assert r["headline_detail"]["uniform_3bit_ubcq_ppl"] == r["curve"][0]["uniform_ubcq"]["ppl"]
    r.update(command="test", date="today", machine={"summary": "test"})
    text = markdown(r)
    assert "uniform ubcq ppl / KL" in text and "uniform bcq ppl / KL (its bytes)" in text
