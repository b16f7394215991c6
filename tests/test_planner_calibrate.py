"""Calibration on a tiny random MoE (transformers, CPU): sensitivities, routing masses and residual heads
checked against an independent recomputation from the model's own router and weights."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pagedweight.planner.calibration_stats import APBlocks, CalibrateOptions, calibrate_model, prompts_from_text
from pagedweight.format.layout import BlockSpec
from pagedweight.format.quantize import quantize_block
from pagedweight.planner.calibration import APIdentity, CalibrationData
from pagedweight.planner.moe_capture import find_moe_layers
from pagedweight.planner.quality_policy import QualityPolicy
from pagedweight.tools.tiny_model import TINY_CORPUS, TinyMoESizes, make_tiny_moe

SIZES = TinyMoESizes(num_layers=2, hidden_size=64, num_experts=4, top_k=2, moe_intermediate_size=64,
                     shared_expert_intermediate_size=64)
OPTIONS = CalibrateOptions(tokens=1024, prompt_tokens=32, min_prompt_tokens=2)


class QuantizedBlocks:
    """APBlocks from quantizing the model's expert weights in memory (no files)."""

    def __init__(self, model, bits_min: int = 2, bits_max: int = 4) -> None:
        self.identity = APIdentity("bcq", bits_min, bits_max, "in-memory")
        self.blocks = {}
        for ref in find_moe_layers(model):
            for e in range(ref.num_experts):
                gate, up = ref.gate_up(e)
                for proj, w in (("gate", gate), ("up", up), ("down", ref.down(e))):
                    self.blocks[f"{ref.layer}.{e}.{proj}"] = quantize_block(w, "bcq", bits_min, bits_max, group_size=64)

    def block_name(self, layer: int, expert: int, proj: str) -> str:
        return f"{layer}.{expert}.{proj}"

    def spec(self, name: str) -> BlockSpec:
        return self.blocks[name].spec

    def weight_at(self, name: str, bits: int) -> torch.Tensor:
        return self.blocks[name].dequantize(bits)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "glm4_moe", "deepseek_v2"])
def calibrated(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_moe(tmp_path_factory.mktemp(request.param), arch=request.param, seed=0, sizes=SIZES,
                         dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    blocks = QuantizedBlocks(model)
    assert isinstance(blocks, APBlocks)
    text = TINY_CORPUS * 3
    data = calibrate_model(model, tok, blocks, text, OPTIONS, source={"text": "tiny"}, progress=False)
    return model, tok, blocks, text, data


def routing_by_hand(model, tok, text, sites, prompts=None) -> dict:
    """Per MoE layer: (hidden [T, H], ids [T, k], weights [T, k], dloss/dout [T, H]) over the calibration prompts
    (`prompts`: token id lists, default prompts_from_text).
    `sites`: (layer, in_module, route, grad_module, grad_of_input) per MoE layer: `route(in_module, x)` maps the
    input of `in_module` to the experts' (hidden, ids, weights); dloss/dout is the gradient of the prompt's summed
    next-token loss at `grad_module`'s output (its input when grad_of_input)."""
    out, outputs = {}, {}
    hooks = []
    for layer, in_module, route, grad_module, grad_of_input in sites:
        def pre_hook(mod, args, layer=layer, route=route):
            with torch.no_grad():
                h, ids, weights = route(mod, args[0].reshape(-1, args[0].shape[-1]).detach().float())
            out.setdefault(layer, []).append([h, ids.reshape(h.shape[0], -1), weights.reshape(h.shape[0], -1).float()])

        def keep(y, layer):
            y.retain_grad()
            outputs[layer] = y

        hooks.append(in_module.register_forward_pre_hook(pre_hook))
        if grad_of_input:
            hooks.append(grad_module.register_forward_pre_hook(lambda mod, args, layer=layer: keep(args[0], layer)))
        else:
            hooks.append(grad_module.register_forward_hook(
                lambda mod, args, y, layer=layer: keep(y[0] if isinstance(y, tuple) else y, layer)))
    with torch.enable_grad():
        for ids in prompts if prompts is not None else prompts_from_text(text, tok, OPTIONS):
            x = torch.tensor([ids])
            logits = model(input_ids=x, use_cache=False).logits
            torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").backward()
            for layer, y in outputs.items():
                out[layer][-1].append(y.grad.reshape(-1, y.shape[-1]).float())
    model.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    return {k: tuple(torch.cat(x) for x in zip(*v)) for k, v in out.items()}


def _route_with_gate(mod, h):
    if hasattr(mod, "route_tokens_to_experts"):  # glm4_moe, deepseek_v2: the gate gives logits only
        ids, weights = mod.route_tokens_to_experts(mod.gate(h[None]))  # [1, T, H] in
    else:
        _, weights, ids = mod.gate(h)
    return h, ids, weights


def _independent_routing(model, tok, text):
    """The sparse block's input, its router, and the gradient at the block's output."""
    sites = []
    for ref in find_moe_layers(model):
        block = model.get_submodule(ref.name.rsplit(".", 1)[0])
        sites.append((ref.layer, block, _route_with_gate, block, False))
    return routing_by_hand(model, tok, text, sites)


def silu_and_grad(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(g), silu'(g)) in closed form."""
    sig = torch.sigmoid(g)
    return torch.nn.functional.silu(g), sig * (1 + g * (1 - sig))


def assert_matches_routing(data, model, blocks, routing, act_and_grad=silu_and_grad) -> None:
    """Routing masses (eq. 1) and the w13 / w2 sensitivities at every bit of experts 0 and E-1 of each MoE layer,
    recomputed by hand from `routing` ({layer: (hidden, ids, weights, dloss/dout)}) and the closed-form activation
    and its derivative `act_and_grad`."""
    for ref in find_moe_layers(model):
        hidden, ids, weights, grad = routing[ref.layer]
        # eq. 1 by hand
        mass = np.array([float(weights[ids == e].sum()) for e in range(ref.num_experts)]) / float(weights.sum())
        assert data.routing_mass[ref.layer] == pytest.approx(mass, rel=1e-5)
        for e in (0, ref.num_experts - 1):
            routed = (ids == e).any(dim=1)
            x = hidden[routed].double()
            assert x.shape[0] > 0
            r = (weights * (ids == e)).sum(dim=1)[routed].double()
            f = r[:, None] ** 2 * grad[routed].double() ** 2  # loss weight per token and output dimension
            gate, up = (w.double() for w in ref.gate_up(e))
            down = ref.down(e).double()
            g, u = x @ gate.T, x @ up.T
            act_g, act_grad = act_and_grad(g)
            a = act_g * u
            # gate/up errors through the gating Jacobian (closed form) and down's columns, weighted by f
            j_gate, j_up = act_grad * u, act_g  # [T, I]
            c = f @ down**2  # [T, I]
            for b in range(blocks.identity.bits_min, blocks.identity.bits_max + 1):
                wg, wu, wd = (blocks.weight_at(blocks.block_name(ref.layer, e, p), b).double()
                              for p in ("gate", "up", "down"))
                s13 = float(sum(torch.einsum("tn,tn,tk,nk->", c, j**2, x**2, (w - wq) ** 2) / x.shape[0]
                                for j, w, wq in ((j_gate, gate, wg), (j_up, up, wu))))
                s2 = float(torch.einsum("tm,tj,mj->", f, a**2, (down - wd) ** 2) / x.shape[0])
                assert data.sensitivity[(ref.layer, e, "w13")].s(b) == pytest.approx(s13, rel=1e-3)
                assert data.sensitivity[(ref.layer, e, "w2")].s(b) == pytest.approx(s2, rel=1e-3)
            # more bits, less damage (on these random weights the fitted error shrinks with every plane)
            s = data.sensitivity[(ref.layer, e, "w13")]
            assert s.s(2) > s.s(3) > s.s(4) > 0


def test_sensitivity_and_mass_match_independent_recomputation(calibrated):
    model, tok, blocks, text, data = calibrated
    assert_matches_routing(data, model, blocks, _independent_routing(model, tok, text))


def test_features_heads_and_buckets_are_consistent(calibrated):
    model, tok, blocks, text, data = calibrated
    moe = [ref.layer for ref in find_moe_layers(model)]
    assert np.isfinite(data.residual.ref_norm[moe]).all()  # every expert routed on this text
    assert set(data.residual.heads) <= {f"{p}:{b}->{b - 1}" for p in ("w13", "w2") for b in (3, 4)}
    assert len(data.residual.heads) >= 2
    for head in data.residual.heads.values():
        assert 0.0 <= head.confidence <= 1.0 and head.rho_min <= head.rho_max and head.num_samples >= 5
    # targets are log-ratios of like quantities: typical prompts sit near 0, not orders of magnitude away
    for head in data.residual.heads.values():
        assert abs(head.predict(np.ones(3))) < 2.0
    # s^b of w13 and of w2 both predict the measured error of the expert's output (one scale): the median
    # log(measured / predicted) of every transition is near 0 for both projections
    medians = data.source["residual_target_median"]
    assert {k.split(":")[0] for k in medians} == {"w13", "w2"}
    assert all(abs(v) < 1.0 for v in medians.values()), medians
    normalized = data.routing_mass[moe] * data.num_experts
    labels = [data.buckets.bucket(v) for v in normalized.reshape(-1)]
    assert labels.count("hot") >= 1 and labels.count("cold") >= 1
    assert data.buckets.mu["hot"] > data.buckets.mu["warm"] > data.buckets.mu["cold"]
    assert data.source["num_prompts"] == len(prompts_from_text(text, tok, OPTIONS))


def test_calibration_file_round_trip_drives_the_quality_policy(calibrated, tmp_path):
    model, tok, blocks, text, data = calibrated
    path = data.save(tmp_path / "calibration.json")
    loaded = CalibrationData.load(path)
    assert json.loads(path.read_text())["format"] == "pagedweight-calibration"
    assert loaded.sensitivity == data.sensitivity
    from tests.test_planner_policies import Row, Table
    from pagedweight.runtime.blocks import BlockKey

    rows = []
    for (layer, e, proj), _ in sorted(loaded.sensitivity.items()):
        spec = blocks.spec(f"{layer}.{e}.{'gate' if proj == 'w13' else 'down'}")
        if proj == "w13":
            spec = BlockSpec(2 * spec.out_features, spec.in_features, 2, 4, "bcq", spec.group_size)
        rows.append(Row(len(rows), BlockKey(layer, e, proj), spec, 4, 4, 2, 4))
    table = Table(rows)
    pol = QualityPolicy(loaded)
    from pagedweight.runtime.planner_api import Observation, plan_bytes_delta, validate_plan

    target = sum(r.bytes_at(4) - r.bytes_at(3) for r in rows) // 2
    plan = pol.plan(table, target, Observation())
    validate_plan(table, plan, "offload")
    assert plan_bytes_delta(table, plan) >= target and pol.last_report.feasible
    assert math.isfinite(pol.last_report.predicted_damage)


def test_prompts_from_text_rejects_short_text(calibrated):
    _, tok, *_ = calibrated
    with pytest.raises(ValueError, match="fewer than two prompts"):
        prompts_from_text("a few words", tok, OPTIONS)


# ---- end to end: tiny model -> AP checkpoint on disk -> `pagedweight calibrate` ------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from pagedweight.tools.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("e2e")
    model_dir = make_tiny_moe(root / "hf", arch="qwen2_moe", seed=1, sizes=SIZES)
    ap_dir = convert_checkpoint(model_dir, root / "ap", bits_min=2, bits_max=4, group_size=64, progress=False)
    text = root / "calib.txt"
    text.write_text(TINY_CORPUS * 3)
    return model_dir, ap_dir, text


def _cli(argv):
    from pagedweight.cli import main

    return main(argv)


def test_calibrate_cli_end_to_end(converted, capsys):
    from pagedweight.format.checkpoint import APCheckpoint
    from pagedweight.format.layout import DEFAULT_TABLE_KIND
    from pagedweight.planner.calibration import load_for_checkpoint

    model_dir, ap_dir, text = converted
    rc = _cli(["calibrate", "--model", str(model_dir), "--ap", str(ap_dir), "--text", str(text),
               "--tokens", "512", "--prompt-tokens", "32"])
    assert rc == 0, capsys.readouterr().err
    ckpt = APCheckpoint.open(ap_dir)
    data = load_for_checkpoint(ckpt.directory)
    assert (data.ap.bits_min, data.ap.bits_max, data.ap.table_kind) == (2, 4, DEFAULT_TABLE_KIND)
    # one w13 and one w2 sensitivity table per routed expert of every MoE layer
    want = {(layer, e, p) for layer in ckpt.layers() for e in ckpt.experts(layer) if isinstance(e, int)
            for p in ("w13", "w2")}
    assert set(data.sensitivity) == want
    assert data.source["num_prompts"] >= 2 and np.allclose(data.routing_mass.sum(axis=1), 1.0)
    # the decoded 4-bit weights are the best: s^4 < s^2 everywhere
    assert all(t.s(4) < t.s(2) for t in data.sensitivity.values())


def test_calibrate_cli_refuses_bad_input(converted, tmp_path, capsys):
    model_dir, ap_dir, text = converted
    assert _cli(["calibrate", "--model", str(model_dir), "--ap", str(tmp_path), "--text", str(text)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert _cli(["calibrate", "--model", str(model_dir), "--ap", str(ap_dir), "--text", str(tmp_path / "none.txt")]) == 2
    assert "--text" in capsys.readouterr().err
    other = make_tiny_moe(tmp_path / "other", arch="qwen2_moe", seed=1,
                          sizes=TinyMoESizes(num_layers=3, hidden_size=64, num_experts=4, top_k=2,
                                             moe_intermediate_size=64, shared_expert_intermediate_size=64))
    assert _cli(["calibrate", "--model", str(other), "--ap", str(ap_dir), "--text", str(text)]) == 2
    assert "converted from another model" in capsys.readouterr().err
