"""The measurements of benchmark/quality_curve.py, on a model + AP checkpoints + calibration that exist.

All points are measured on one transformers model whose expert weights are swapped in place
(swap.ExpertBank); a point whose assignment was already measured on the same text is not measured again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pagedweight.format.checkpoint import APCheckpoint
from pagedweight.format.weight_errors import WeightErrors
from pagedweight.moefy import text as texts
from pagedweight.moefy.perplexity import evaluate, reference_logits, token_windows
from pagedweight.planner.calibration import load_for_checkpoint
from pagedweight.planner.hotness_policy import HotnessPolicy
from pagedweight.planner.quality_policy import QualityOptions, QualityPolicy
from pagedweight.planner.routing_stats import BlockBuckets
from pagedweight.planner.uncalibrated_policy import UncalibratedPolicy
from pagedweight.runtime.planner_api import Observation

from . import bootstrap
from .planning import PlannedPoint, bytes_of, plan_to_budget, spike_then_relax, uniform
from .report import cheapest_bf16_equivalent, gap_closed
from .swap import ExpertBank, runtime_blocks
from .traffic import RecordedTraffic, TrafficRecorder, record_traffic


@dataclass
class ExperimentConfig:
    model_dir: Path
    ap_dirs: dict  # table kind -> AP checkpoint dir (main_kind required; others are compared at uniform bits)
    calibration: Path  # calibration.json for the main_kind checkpoint
    calib_kind: str = "wiki"
    shift_kind: str | None = "news"
    calib_tokens: int = 8192
    seq_len: int = 512
    windows: int = 65  # 65 x 511 = 33,215 predicted tokens (>= 32k: the bootstrap interval of gap closed ~ +-0.05)
    bits: tuple[int, ...] = (3, 4, 5, 6)
    extra_bits: tuple[float, ...] = (4.5, 5.5, 7.0)
    refine: int = 1
    progress: bool = True
    memo_path: Path | None = None  # persisted measurements (resume); None: in memory only
    only_shift: bool = False  # measure only the workload-shift section (can run beside a main run)
    stage_slack: float | None = None  # QualityOptions.stage_slack of every quality-policy run; None: its default
    main_kind: str = "bcq"  # the table kind PagedWeight and hotness plan over; budgets are its uniform bytes
    ablation: bool = True  # measure the ablation table at the 3-bit budget
    hotness: bool = True  # measure the hotness policy on the curve
    resamples: int = bootstrap.RESAMPLES  # window-bootstrap resamples of the headline intervals


@dataclass
class TextSet:
    kind: str
    ids: torch.Tensor
    reference: torch.Tensor
    served: RecordedTraffic  # routing of the bf16 model on this text (what the MoE forward would record)


@dataclass
class Evaluator:
    """Measures assignments; results are memoised (and persisted to `memo_path`, keyed by a hash of the
    model, checkpoint, token windows and assignment, so an interrupted run resumes without re-measuring)."""

    model: torch.nn.Module
    bank: ExpertBank
    progress: bool
    memo_path: Path | None = None
    identity: str = ""
    main_kind: str = "bcq"  # the kind measured when none is named (the planned kind)
    memo: dict = field(default_factory=dict)
    evaluations: int = 0
    reused: int = 0

    def __post_init__(self) -> None:
        if self.memo_path is not None and Path(self.memo_path).is_file():
            self.memo = json.loads(Path(self.memo_path).read_text())

    def measure(self, ts: TextSet, assignment: dict, kind: str | None = None) -> dict:
        kind = kind or self.main_kind
        body = json.dumps([self.identity, ts.kind, hashlib.sha256(ts.ids.numpy().tobytes()).hexdigest(), kind,
                           sorted([list(k), int(b)] for k, b in assignment.items())])
        key = hashlib.sha256(body.encode()).hexdigest()
        if key in self.memo and "window_nll" in self.memo[key]:
            self.reused += 1
        else:
            self.bank.apply(assignment, kind)
            r = evaluate(self.model, ts.ids, ts.reference, progress=self.progress, per_window=True)
            self.evaluations += 1
            self.memo[key] = {k: r[k] for k in ("ppl", "kl", "nll", "tokens", "window_nll", "window_kl")}
            if self.memo_path is not None:
                tmp = Path(f"{self.memo_path}.tmp")
                tmp.write_text(json.dumps(self.memo))
                tmp.replace(self.memo_path)
        return dict(self.memo[key])


def _point(result: dict, planned: PlannedPoint | None = None, bytes_: int | None = None, **extra) -> dict:
    out = dict(result)
    if planned is not None:
        out.update(bytes=planned.bytes, budget=planned.budget, within_budget=planned.bytes <= planned.budget,
                   bits_histogram=planned.histogram(), plan=planned.reason)
    else:
        out["bytes"] = int(bytes_)
    out.update(extra)
    return out


def _text_set(model, bank: ExpertBank, tokenizer, kind: str, cfg: ExperimentConfig) -> TextSet:
    ids = token_windows(tokenizer, texts.evaluation_text(kind), cfg.seq_len, cfg.windows)
    bank.restore()
    with TrafficRecorder(model) as rec:
        ref = reference_logits(model, ids, progress=cfg.progress)
    return TextSet(kind, ids, ref, rec.snapshot())


def _masses(weight_sums: np.ndarray) -> np.ndarray:
    tot = weight_sums.sum(axis=1, keepdims=True)
    return np.where(tot > 0, weight_sums / np.where(tot > 0, tot, 1), 1.0 / weight_sums.shape[1])


def _budget_at(budgets: dict[int, int], bits: float, blocks) -> int:
    lo, hi = int(np.floor(bits)), int(np.ceil(bits))
    b_lo = budgets.get(lo) or bytes_of(blocks, uniform(blocks, lo))
    b_hi = budgets.get(hi) or bytes_of(blocks, uniform(blocks, hi))
    return int(round(b_lo + (bits - lo) * (b_hi - b_lo)))


def run_experiment(cfg: ExperimentConfig, on_section=None) -> dict:
    """All measurements; `on_section(partial_results)` is called after each section (partial results file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out: dict = {"headline": {"gap_closed_vs_uniform_3bit": None, "memory_saving_at_bf16_equivalent": None},
                 "headline_ci95": {}}

    def section(**parts) -> None:
        out.update(parts)
        if on_section is not None:
            on_section(dict(out))

    model_dir = Path(cfg.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf_config = json.loads((model_dir / "config.json").read_text())
    ckpts = {k: APCheckpoint.open(d) for k, d in cfg.ap_dirs.items()}
    for c in ckpts.values():
        c.check_model_config(hf_config)
    blocks = {k: runtime_blocks(c) for k, c in ckpts.items()}
    main_kind = cfg.main_kind
    planned_blocks = blocks[main_kind]  # the planned kind's blocks (bcq or ubcq)
    calib = load_for_checkpoint(ckpts[main_kind].directory, cfg.calibration)
    bank = ExpertBank(model, ckpts)
    identity = json.dumps([str(model_dir.resolve()),
                           {k: hashlib.sha256((Path(c.directory) / "manifest.json").read_bytes()).hexdigest()
                            for k, c in ckpts.items()}])
    ev = Evaluator(model, bank, cfg.progress, cfg.memo_path, identity, main_kind=main_kind)
    bf16_bytes = sum(spec.out_features * spec.in_features * 2 for _, spec in planned_blocks)

    if cfg.only_shift:
        return _shift_only(cfg, model, bank, tokenizer, calib, planned_blocks, ev, bf16_bytes, out)
    main = _text_set(model, bank, tokenizer, cfg.calib_kind, cfg)
    calib_windows = max(1, cfg.calib_tokens // cfg.seq_len)
    calib_ids = token_windows(tokenizer, texts.calibration_text(cfg.calib_kind), cfg.seq_len, calib_windows)
    calib_traffic = record_traffic(model, calib_ids, cfg.progress, desc="calibration-split routing counts")
    hot_obs = Observation(now_s=0.0, routing_counts=calib_traffic.counts)

    def quality(observer_from: TextSet | None = main, **options) -> QualityPolicy:
        return QualityPolicy(calib, QualityOptions(**_slack(cfg), **options),
                             observer_from.served.observer() if observer_from is not None else None)

    errors = WeightErrors.load(ckpts[main_kind].directory)
    spec0 = planned_blocks[0][1]
    errors.check_matches(main_kind, spec0.bits_min, spec0.bits_max)

    def uncalibrated() -> UncalibratedPolicy:
        """What `--paged-weight-policy auto` serves without calibration.json (the server's defaults)."""
        return UncalibratedPolicy.from_errors(errors, [tuple(k) for k, _ in planned_blocks], errors.bits_min,
                                              errors.bits_max, errors.bits_min)

    bf16 = _point(ev.measure(main, {}), bytes_=bf16_bytes)
    budgets = {b: bytes_of(planned_blocks, uniform(planned_blocks, b)) for b in sorted({2, *cfg.bits})}

    # ---- curves at equal bytes -----------------------------------------------------------------
    curve = []
    pw_points = []
    for b in cfg.bits:
        row = {"bits": b}
        for kind in blocks:
            a = uniform(blocks[kind], b)
            row[f"uniform_{kind}"] = _point(ev.measure(main, a, kind), bytes_=bytes_of(blocks[kind], a))
        planned = plan_to_budget(quality(), planned_blocks, budgets[b])
        row["pagedweight"] = _point(ev.measure(main, planned.assignment), planned)
        pw_points.append({"bits": b, **row["pagedweight"]})
        policy = uncalibrated()
        planned = plan_to_budget(policy, planned_blocks, budgets[b])
        row["uncalibrated"] = _point(ev.measure(main, planned.assignment), planned, floor_bits=policy.floor.bits,
                                     floor_reason=policy.floor.reason)
        if cfg.hotness:
            planned = plan_to_budget(HotnessPolicy(), planned_blocks, budgets[b], hot_obs)
            row["hotness"] = _point(ev.measure(main, planned.assignment), planned)
        u = row[f"uniform_{main_kind}"]
        for name in ("pagedweight", "uncalibrated", "hotness"):
            if name in row:
                row[f"{name}_gap_closed"] = gap_closed(u["ppl"], row[name]["ppl"], bf16["ppl"])
        curve.append(row)
        print(f"[quality] {b}-bit: uniform {main_kind} {u['ppl']:.3f}, PagedWeight {row['pagedweight']['ppl']:.3f}, "
              f"uncalibrated {row['uncalibrated']['ppl']:.3f}, "
              f"hotness {row['hotness']['ppl'] if 'hotness' in row else float('nan'):.3f}, bf16 {bf16['ppl']:.3f}",
              flush=True)

    n_params = sum(spec.out_features * spec.in_features for _, spec in planned_blocks)
    out["headline"], out["headline_ci95"] = _headline(cfg, curve, pw_points, bf16, bf16_bytes, main_kind)
    section(
        model={
            "dir": str(model_dir),
            "description": f"{hf_config.get('model_type')} with {hf_config.get('num_hidden_layers')} layers, "
                           f"{hf_config.get('num_local_experts')} experts (top-{hf_config.get('num_experts_per_tok')}), "
                           f"expert width {hf_config.get('intermediate_size')}, {n_params:,} expert weights",
            "ap_dirs": {k: str(v) for k, v in cfg.ap_dirs.items()},
            "planned_table_kind": main_kind,
            "group_size": {k: sorted({spec.group_size for _, spec in v}) for k, v in blocks.items()},
            "calibration": str(cfg.calibration),
            "calibration_source": calib.source,
        },
        evaluation={"text_kind": cfg.calib_kind, "seq_len": cfg.seq_len, "windows": int(main.ids.shape[0]),
                    "intervals": f"window bootstrap, {cfg.resamples} resamples of the {int(main.ids.shape[0])} "
                                 "windows, paired across points (benchmark/quality/bootstrap.py); headline_ci95 "
                                 "holds the 95% interval of every headline figure",
                    "tokens": int(main.ids.shape[0] * (main.ids.shape[1] - 1)),
                    "online_traffic": "the quality policy's RoutingObserver is fed the routed inputs of the "
                                      "evaluated text from the bf16 forward (what the MoE forward records while "
                                      "serving it), except where a row says 'calibration statistics only'",
                    "hotness_traffic": f"routing counts of {calib_traffic.tokens} calibration-split tokens"},
        bf16=bf16, curve=curve)

    # ---- extra budgets: the cheapest bf16-equivalent PagedWeight point -------------------------
    extra = []

    def pw_at(bits_equiv: float) -> dict:
        planned = plan_to_budget(quality(), planned_blocks, _budget_at(budgets, bits_equiv, planned_blocks))
        p = {"bits": round(bits_equiv, 3), **_point(ev.measure(main, planned.assignment), planned)}
        extra.append(p)
        pw_points.append(p)
        return p

    for x in cfg.extra_bits:
        pw_at(x)
    for _ in range(cfg.refine):
        _, best = cheapest_bf16_equivalent(pw_points, bf16["ppl"], bf16_bytes)
        if best is None:
            break
        cheaper = [p for p in pw_points if p["bytes"] < best["bytes"]]
        lower = max(cheaper, key=lambda p: p["bytes"])["bits"] if cheaper else 2.0
        mid = (lower + best["bits"]) / 2
        if abs(mid - best["bits"]) < 0.05:
            break
        pw_at(mid)
    extra.sort(key=lambda p: p["bytes"])
    saving, best = cheapest_bf16_equivalent(pw_points, bf16["ppl"], bf16_bytes)
    out["headline"], out["headline_ci95"] = _headline(cfg, curve, pw_points, bf16, bf16_bytes, main_kind)
    section(extra_budgets=extra)

    # ---- ablation at the 3-bit budget ----------------------------------------------------------
    b3 = budgets[min(cfg.bits)]
    spike = (budgets[2] + b3) // 2
    variants = {
        "full": lambda: plan_to_budget(quality(), planned_blocks, b3),
        "w/o routing statistics": lambda: plan_to_budget(quality(use_routing_stats=False), planned_blocks, b3),
        "w/o prompt residual": lambda: plan_to_budget(quality(use_prompt_residual=False), planned_blocks, b3),
        "w/o global sensitivity": lambda: plan_to_budget(quality(use_global_sensitivity=False), planned_blocks, b3),
        "full, spike then relax": lambda: spike_then_relax(quality(), planned_blocks, spike, b3),
        "w/o page movement (spike then relax)": lambda: spike_then_relax(quality(use_page_movement=False), planned_blocks, spike, b3),
        "full, calibration statistics only (no online traffic)": lambda: plan_to_budget(quality(None), planned_blocks, b3),
    } if cfg.ablation else {}
    ablation_rows = {}
    full_assignment = None
    for name, make in variants.items():
        planned = make()
        if full_assignment is None:
            full_assignment = planned.assignment
        ablation_rows[name] = _point(ev.measure(main, planned.assignment), planned,
                                     same_assignment_as_full=planned.assignment == full_assignment)
    u3 = curve[0][f"uniform_{main_kind}"]["ppl"]
    for p in ablation_rows.values():
        p["gap_closed"] = gap_closed(u3, p["ppl"], bf16["ppl"])
    if ablation_rows:
        section(ablation={"budget_bytes": b3, "spike_budget_bytes": spike, "rows": ablation_rows})

    shift = _workload_shift(cfg, model, bank, tokenizer, calib, planned_blocks, ev, bf16_bytes, b3) if cfg.shift_kind else None

    out["evaluation"]["evaluations"] = ev.evaluations
    out["evaluation"]["evaluations_reused_from_cache"] = ev.reused
    out["headline_detail"] = {
        f"uniform_3bit_{main_kind}_ppl": curve[0][f"uniform_{main_kind}"]["ppl"],
        "pagedweight_3bit_budget_ppl": curve[0]["pagedweight"]["ppl"],
        "bf16_ppl": bf16["ppl"],
        "bf16_equivalent_point": best,
        "tolerance": "ppl <= 1.01 * bf16 ppl",
        "goals": {"gap_closed_vs_uniform_3bit": ">= 0.40", "memory_saving_at_bf16_equivalent": ">= 0.60"},
    }
    out["workload_shift"] = shift
    out["complete"] = True
    return out


def _headline(cfg: ExperimentConfig, curve: list[dict], pw_points: list[dict], bf16: dict, bf16_bytes: int,
              main_kind: str) -> tuple[dict, dict]:
    """The headline figures and their window-bootstrap 95% intervals (bootstrap.py), from what is measured so far.

    25% = the uniform 3-bit budget of the planned kind (ubcq at group 32: 3 plane bits + 1 table bit of 16).
    """
    by_bits = {row["bits"]: row for row in curve}
    r3, r4 = by_bits.get(3), by_bits.get(4)
    u = f"uniform_{main_kind}"
    saving, _ = cheapest_bf16_equivalent(pw_points, bf16["ppl"], bf16_bytes)
    head = {
        "gap_closed_vs_uniform_3bit": r3["pagedweight_gap_closed"] if r3 else None,
        "memory_saving_at_bf16_equivalent": saving,
        "uncalibrated_default_ppl_at_25pct": r3["uncalibrated"]["ppl"] if r3 else None,
        "calibrated_policy_ppl_at_25pct": r3["pagedweight"]["ppl"] if r3 else None,
        "uniform_3bit_ppl_at_25pct": r3[u]["ppl"] if r3 else None,
        "uniform_4bit_ppl": r4[u]["ppl"] if r4 else None,
        "uncalibrated_default_ppl_at_uniform_4bit_bytes": r4["uncalibrated"]["ppl"] if r4 else None,
        "bf16_ppl": bf16["ppl"],
        # < 0: the uncalibrated default is better than uniform 3 bits at the same bytes (issue #24: must not be > 0)
        "uncalibrated_minus_uniform_3bit_ppl": (r3["uncalibrated"]["ppl"] - r3[u]["ppl"]) if r3 else None,
    }
    s = bootstrap.ppl_samples
    figures = {"bf16_ppl": lambda i: s(bf16, i),
               "memory_saving_at_bf16_equivalent": lambda i: bootstrap.saving_samples(pw_points, bf16, bf16_bytes, i)}
    if r3:
        figures.update({
            "gap_closed_vs_uniform_3bit": lambda i: bootstrap.gap_closed_samples(s(r3[u], i), s(r3["pagedweight"], i), s(bf16, i)),
            "uncalibrated_default_ppl_at_25pct": lambda i: s(r3["uncalibrated"], i),
            "calibrated_policy_ppl_at_25pct": lambda i: s(r3["pagedweight"], i),
            "uniform_3bit_ppl_at_25pct": lambda i: s(r3[u], i),
            "uncalibrated_minus_uniform_3bit_ppl": lambda i: s(r3["uncalibrated"], i) - s(r3[u], i),
        })
    if r4:
        figures.update({"uniform_4bit_ppl": lambda i: s(r4[u], i),
                        "uncalibrated_default_ppl_at_uniform_4bit_bytes": lambda i: s(r4["uncalibrated"], i)})
    n_windows = len(bf16["window_nll"])
    ci = bootstrap.headline_intervals(figures, n_windows, cfg.resamples) if n_windows >= 2 else {}
    return head, {k: ci.get(k) for k in head}


def _shift_only(cfg, model, bank, tokenizer, calib, planned_blocks, ev, bf16_bytes, out) -> dict:
    b3 = bytes_of(planned_blocks, uniform(planned_blocks, min(cfg.bits)))
    out["workload_shift"] = _workload_shift(cfg, model, bank, tokenizer, calib, planned_blocks, ev, bf16_bytes, b3)
    out["complete"] = False
    return out


def _slack(cfg: ExperimentConfig) -> dict:
    return {} if cfg.stage_slack is None else {"stage_slack": cfg.stage_slack}


def _workload_shift(cfg, model, bank, tokenizer, calib, planned_blocks, ev, bf16_bytes, b3) -> dict:
    def quality(observer_from=None, **options) -> QualityPolicy:
        return QualityPolicy(calib, QualityOptions(**_slack(cfg), **options),
                             observer_from.served.observer() if observer_from is not None else None)

    ts = _text_set(model, bank, tokenizer, cfg.shift_kind, cfg)
    rows = {"bf16": _point(ev.measure(ts, {}), bytes_=bf16_bytes)}
    u3_name = f"uniform 3-bit {ev.main_kind}"
    rows[u3_name] = _point(ev.measure(ts, uniform(planned_blocks, min(cfg.bits))), bytes_=b3)
    offline = plan_to_budget(quality(None), planned_blocks, b3)
    rows["PagedWeight, calibration statistics only"] = _point(ev.measure(ts, offline.assignment), offline)
    online_policy = quality(ts)
    online = plan_to_budget(online_policy, planned_blocks, b3)
    rows["PagedWeight, online statistics from the served text"] = _point(ev.measure(ts, online.assignment), online)
    for p in rows.values():
        p["gap_closed"] = gap_closed(rows[u3_name]["ppl"], p["ppl"], rows["bf16"]["ppl"])
    served_mass = _masses(ts.served.traffic.routing.weight_sums)
    calib_mass = np.asarray(calib.routing_mass)
    online_mass = online_policy.stats.mass()
    before = BlockBuckets.from_stats(calib.buckets, calib_mass * calib.num_experts).labels
    after = BlockBuckets.from_stats(calib.buckets, online_policy.stats.normalized_mass()).labels
    return {
        "calibration_kind": cfg.calib_kind,
        "evaluation_kind": cfg.shift_kind,
        "budget_bytes": b3,
        "tokens": int(ts.ids.shape[0] * (ts.ids.shape[1] - 1)),
        "rows": rows,
        "plans_differ": offline.assignment != online.assignment,
        "blocks_with_different_bits": sum(offline.assignment[k] != online.assignment[k] for k in offline.assignment),
        "routing_adaptation": {
            "l1_calibration_vs_served": float(np.abs(calib_mass - served_mass).sum(axis=1).mean()),
            "l1_online_vs_served": float(np.abs(online_mass - served_mass).sum(axis=1).mean()),
            "bucket_changes": sum(before[k] != after[k] for k in before),
            "served_tokens": ts.served.tokens,
        },
    }
