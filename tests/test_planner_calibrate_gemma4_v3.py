"""Calibration of Gemma-4 (GELU experts stored fused beside the dense MLP, a router with its own norm and scales) and
DeepSeek-V3 (sigmoid scores, a correction bias, grouped top-k, an MTP layer, FP8 block sources), both kinds:
`pagedweight calibrate`'s routing masses and sensitivities, and `convert --calib-text`'s input second moments,
equal a recomputation by hand from the tiny model's own tensors, with the router written out here (not taken
from transformers' modules); an FP8 source calibrates like its dequantized twin."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedweight.format.arch import BlockKey
from pagedweight.planner.calibration import load_for_checkpoint
from pagedweight.planner.calibration_stats import calibrate_model
from pagedweight.planner.moe_capture import find_moe_layers
from pagedweight.tools.calibrate import CheckpointBlocks, run_calibrate
from pagedweight.tools.convert import convert_checkpoint
from pagedweight.tools.source_format import SCALE_SUFFIX, load_source_model
from pagedweight.tools.tiny_model import TINY_CORPUS, TinyMoESizes, make_tiny_moe
from tests.test_convert_fp8_source import _fp8_blocks
from tests.test_planner_calibrate import OPTIONS, SIZES, QuantizedBlocks, assert_matches_routing, routing_by_hand

TEXT = TINY_CORPUS * 3


def gelu_tanh_and_grad(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gelu_tanh(g), its derivative) in closed form (Gemma-4's hidden_activation gelu_pytorch_tanh)."""
    c = math.sqrt(2 / math.pi)
    t = torch.tanh(c * (g + 0.044715 * g**3))
    return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t**2) * c * (1 + 3 * 0.044715 * g**2)


# ---- Gemma-4 -----------------------------------------------------------------------------------------
def _perturbed_gemma4(root: Path) -> Path:
    """The tiny Gemma-4 with its router scales and the norms before the experts and the MLP made to matter (the tiny
    model's are ones), so that a capture that skips one is wrong."""
    path = make_tiny_moe(root, arch="gemma4", seed=0, sizes=SIZES, dtype="float32")
    state = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for i in range(SIZES.num_layers):
        prefix = f"model.language_model.layers.{i}."
        state[prefix + "router.proj.weight"] = state[prefix + "router.proj.weight"] * 20
        for name in ("router.scale", "router.per_expert_scale", "pre_feedforward_layernorm_2.weight",
                     "pre_feedforward_layernorm.weight"):
            state[prefix + name] = 0.5 + torch.rand(state[prefix + name].shape, generator=gen)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _perturbed_gemma4(tmp_path_factory.mktemp("gemma4"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    blocks = QuantizedBlocks(model)
    data = calibrate_model(model, tok, blocks, TEXT, OPTIONS, source={"text": "tiny"}, progress=False)
    return path, model, tok, blocks, data


def _gemma4_route(layer):
    """Gemma-4's router by hand on the layer's residual stream r (the input of pre_feedforward_layernorm): softmax of
    proj(rms(r) * scale / sqrt(H)), top-k, renormalised, times per_expert_scale; the experts see
    pre_feedforward_layernorm_2(r)."""
    router, k = layer.router, SIZES.top_k

    def route(_mod, r):
        normed = r * (r.pow(2).mean(-1, keepdim=True) + router.eps).pow(-0.5)
        logits = (normed * router.scale / math.sqrt(r.shape[-1])) @ router.proj.weight.T
        probs, ids = logits.softmax(-1).topk(k, dim=-1)
        weights = probs / probs.sum(-1, keepdim=True) * router.per_expert_scale[ids]
        return layer.pre_feedforward_layernorm_2(r), ids, weights

    return route


def test_gemma4_masses_and_sensitivities_match_a_recomputation_by_hand(gemma4):
    _, model, tok, blocks, data = gemma4
    layers = model.model.language_model.layers
    assert [ref.layer for ref in find_moe_layers(model)] == list(range(SIZES.num_layers))
    assert data.num_layers == SIZES.num_layers and data.num_experts == SIZES.num_experts
    # the experts' output enters the layer through post_feedforward_layernorm_2: the gradient at its input
    sites = [(i, layer.pre_feedforward_layernorm, _gemma4_route(layer), layer.post_feedforward_layernorm_2, True)
             for i, layer in enumerate(layers)]
    routing = routing_by_hand(model, tok, TEXT, sites)
    # per_expert_scale is in the routing weights: they do not sum to one per token
    assert not torch.allclose(routing[0][2].sum(-1), torch.ones(1))
    assert_matches_routing(data, model, blocks, routing, gelu_tanh_and_grad)


def test_gemma4_calibrate_cli_on_a_converted_checkpoint(gemma4, tmp_path):
    path = gemma4[0]
    ap_dir = convert_checkpoint(path, tmp_path / "ap", bits_min=2, bits_max=4, group_size=64, progress=False)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    out = run_calibrate(str(path), str(ap_dir), str(text), options=OPTIONS, progress=False)
    blocks = CheckpointBlocks(ap_dir)
    data = load_for_checkpoint(blocks.dir)
    assert out == blocks.dir / "calibration.json"
    # every routed expert of both layers, from the multimodal checkpoint (decoder sizes under text_config)
    assert set(data.sensitivity) == {(layer, e, p) for layer in range(SIZES.num_layers)
                                     for e in range(SIZES.num_experts) for p in ("w13", "w2")}
    model, _ = load_source_model(Path(path))
    sites = [(i, layer.pre_feedforward_layernorm, _gemma4_route(layer), layer.post_feedforward_layernorm_2, True)
             for i, layer in enumerate(model.model.language_model.layers)]
    assert_matches_routing(data, model, blocks, routing_by_hand(model, gemma4[2], TEXT, sites), gelu_tanh_and_grad)


# ---- DeepSeek-V3 ---------------------------------------------------------------------------------------
V3_SIZES = TinyMoESizes(num_layers=2, hidden_size=64, num_experts=4, top_k=2, moe_intermediate_size=64,
                        shared_expert_intermediate_size=128, vocab_size=320)
V3_ROUTING = dict(n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)


def _as_v3_sources(root: Path) -> tuple[Path, Path]:
    """The tiny DeepSeek-V2 as V3 (grouped sigmoid routing with a correction bias, one MTP layer): an FP8 block
    source and its float32 twin holding the dequantized values."""
    base = make_tiny_moe(root / "v2", "deepseek_v2", seed=5, sizes=V3_SIZES, dtype="float32")
    state = load_file(str(base / "model.safetensors"))
    gen = torch.Generator().manual_seed(2)
    state["model.layers.1.mlp.gate.weight"] = state["model.layers.1.mlp.gate.weight"] * 50
    state["model.layers.1.mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(V3_SIZES.num_experts, generator=gen)
    for name, tensor in list(state.items()):  # the MTP layer: a copy of the MoE layer plus its projections
        if name.startswith("model.layers.1."):
            state[name.replace("model.layers.1.", "model.layers.2.", 1)] = tensor.clone()
    state["model.layers.2.eh_proj.weight"] = torch.randn(64, 128, generator=gen)
    state["model.layers.2.enorm.weight"] = torch.ones(64)
    fp8, twin = {}, {}
    for name, tensor in state.items():
        if name.endswith("_proj.weight"):  # experts, shared experts, attention, eh_proj: FP8 like DeepSeek-V3
            q, s, deq = _fp8_blocks(tensor)
            fp8[name], fp8[name + SCALE_SUFFIX], twin[name] = q, s, deq
        else:
            fp8[name] = twin[name] = tensor
    config = json.loads((base / "config.json").read_text())
    config.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=1,
                  scoring_func="sigmoid", topk_method="noaux_tc", **V3_ROUTING)
    dirs = root / "fp8", root / "twin"
    for d, weights, quant in ((dirs[0], fp8, True), (dirs[1], twin, False)):
        shutil.copytree(base, d, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(config)
        if quant:
            cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [48, 40], "fmt": "e4m3",
                                          "activation_scheme": "dynamic"}
        (d / "config.json").write_text(json.dumps(cfg))
    return dirs


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3")
    fp8_dir, twin_dir = _as_v3_sources(root)
    text = root / "calib.txt"
    text.write_text(TEXT)
    out = {}
    for name, src in (("fp8", fp8_dir), ("twin", twin_dir)):
        ap_dir = convert_checkpoint(src, root / f"ap-{name}", bits_min=2, bits_max=4, group_size=64, progress=False)
        run_calibrate(str(src), str(ap_dir), str(text), options=OPTIONS, progress=False)
        blocks = CheckpointBlocks(ap_dir)
        out[name] = (src, blocks, load_for_checkpoint(blocks.dir))
    return out


def _v3_route(mlp):
    """DeepSeek-V3's noaux_tc routing by hand: scores = sigmoid(logits); the groups with the largest sum of their top-2
    (scores + bias) keep their experts; top-k of (scores + bias) among them; weights = the scores without the bias,
    normalised and times routed_scaling_factor."""
    k, groups, keep = V3_SIZES.top_k, V3_ROUTING["n_group"], V3_ROUTING["topk_group"]

    def route(_mod, x):
        scores = (x @ mlp.gate.weight.T).sigmoid()
        choice = scores + mlp.gate.e_score_correction_bias
        per_group = choice.view(x.shape[0], groups, -1)
        best = per_group.topk(2, dim=-1).values.sum(-1).topk(keep, dim=-1).indices  # [T, keep]
        allowed = torch.zeros(x.shape[0], groups, dtype=torch.bool).scatter_(1, best, True)
        allowed = allowed[:, :, None].expand_as(per_group).reshape(x.shape[0], -1)
        ids = choice.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        return x, ids, weights / weights.sum(-1, keepdim=True) * V3_ROUTING["routed_scaling_factor"]

    return route


def test_v3_fp8_source_calibrates_like_its_dequantized_twin(v3):
    (_, _, a), (_, _, b) = v3["fp8"], v3["twin"]
    assert set(a.sensitivity) == {(1, e, p) for e in range(V3_SIZES.num_experts) for p in ("w13", "w2")}
    assert set(a.sensitivity) == set(b.sensitivity)
    for key, table in a.sensitivity.items():
        for bits in (2, 3, 4):
            assert table.s(bits) == pytest.approx(b.sensitivity[key].s(bits), rel=1e-6), key
    np.testing.assert_allclose(a.routing_mass, b.routing_mass, rtol=1e-6)
    assert not a.source["unrouted_experts"]


def test_v3_fp8_model_loads_dequantized_without_the_mtp_layer(v3):
    fp8_dir, twin_dir = v3["fp8"][0], v3["twin"][0]
    model, info = load_source_model(fp8_dir)
    twin = load_file(str(twin_dir / "model.safetensors"))
    params = dict(model.named_parameters())
    experts = params["model.layers.1.mlp.experts.gate_up_proj"]
    for e in range(V3_SIZES.num_experts):  # the fused experts hold the dequantized per-expert weights, float32
        want = torch.cat([twin[f"model.layers.1.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")])
        assert experts.dtype == torch.float32 and torch.equal(experts[e], want)
    assert torch.equal(params["model.layers.0.self_attn.o_proj.weight"], twin["model.layers.0.self_attn.o_proj.weight"])
    bias = dict(model.named_buffers())["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(bias, twin["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert not info["missing_keys"] and not any(n.startswith("model.layers.2.") for n in info["unexpected_keys"])


def test_v3_masses_and_sensitivities_match_grouped_sigmoid_routing_by_hand(v3):
    from transformers import AutoTokenizer

    src, blocks, data = v3["fp8"]
    model, _ = load_source_model(src)
    model.eval()
    tok = AutoTokenizer.from_pretrained(src)
    mlp = model.model.layers[1].mlp
    routing = routing_by_hand(model, tok, TEXT, [(1, mlp, _v3_route(mlp), mlp, False)])
    hidden, ids = routing[1][0], routing[1][1]
    # the bias and the groups change the choice: plain top-k of the logits would route some tokens elsewhere
    plain = (hidden @ mlp.gate.weight.T).topk(V3_SIZES.top_k, dim=-1).indices
    assert (plain.sort(-1).values != ids.sort(-1).values).any(-1).sum() > 0
    assert_matches_routing(data, model, blocks, routing)


# ---- `convert --calib-text`: the converter's input second moments --------------------------------------------
CALIB_TOKENS = 300  # a window of 256 and one of 44


def _converter_hessians(model_dir: Path, text: Path):
    """HessianStats of `convert --calib-text` on model_dir."""
    from pagedweight.tools.convert import ConvertOptions, SourceModel, _calibrate

    return _calibrate(SourceModel.scan(model_dir), ConvertOptions(calib_text=text, calib_tokens=CALIB_TOKENS))


def _calibration_windows(tok) -> list[list[int]]:
    from pagedweight.format.hessian import calibration_windows

    return calibration_windows(tok(TEXT, add_special_tokens=False).input_ids, CALIB_TOKENS, 256, seed=0)


def _assert_hessians(stats, layer: int, routing, shared_x, expert, act, shared_act) -> None:
    """h of every routed expert (tokens the router chose, by hand) and of the shared expert (all tokens of its
    input), with the activation written out: `expert(e)` -> (W_gate, W_up) of a routed expert, "shared" too."""
    hidden, ids = routing[layer][0], routing[layer][1]
    for e in [*range(SIZES.num_experts), "shared"]:
        x = shared_x if e == "shared" else hidden[(ids == e).any(-1)]
        gate, up = expert(e)
        a = (shared_act if e == "shared" else act)(x @ gate.T)[0] * (x @ up.T)
        assert stats.tokens_per_block[BlockKey(layer, e, "gate")] == x.shape[0] > 0
        for proj, h in (("gate", x.square().mean(0)), ("up", x.square().mean(0)), ("down", a.square().mean(0))):
            torch.testing.assert_close(stats.hessian[BlockKey(layer, e, proj)], h, rtol=1e-4, atol=1e-7)


def test_gemma4_convert_calib_text_hessians_follow_its_router_and_gelu(gemma4, tmp_path):
    path, _, tok, _, _ = gemma4
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    stats = _converter_hessians(path, text)
    assert stats.num_tokens == CALIB_TOKENS
    model, _ = load_source_model(path)
    layers = model.model.language_model.layers
    shared_in = {i: [] for i in range(len(layers))}

    def route_and_keep_mlp_input(i, layer):
        route = _gemma4_route(layer)

        def both(mod, r):
            norm = layer.pre_feedforward_layernorm  # what the dense MLP (the shared expert) sees: its RMS norm of r
            shared_in[i].append(r * (r.pow(2).mean(-1, keepdim=True) + norm.eps).pow(-0.5) * norm.weight)
            return route(mod, r)

        return both

    sites = [(i, layer.pre_feedforward_layernorm, route_and_keep_mlp_input(i, layer), layer.post_feedforward_layernorm_2,
              True) for i, layer in enumerate(layers)]
    routing = routing_by_hand(model, tok, TEXT, sites, prompts=_calibration_windows(tok))
    state = load_file(str(path / "model.safetensors"))
    inter = SIZES.moe_intermediate_size
    for i in range(SIZES.num_layers):
        prefix = f"model.language_model.layers.{i}."

        def expert(e, prefix=prefix):
            if e == "shared":
                return state[prefix + "mlp.gate_proj.weight"], state[prefix + "mlp.up_proj.weight"]
            fused = state[prefix + "experts.gate_up_proj"][e]  # gate rows first
            return fused[:inter], fused[inter:]

        _assert_hessians(stats, i, routing, torch.cat(shared_in[i]), expert, gelu_tanh_and_grad, gelu_tanh_and_grad)


def test_gemma4_converts_with_calib_text(gemma4, tmp_path):
    from pagedweight.format.checkpoint import APCheckpoint

    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    out = convert_checkpoint(gemma4[0], tmp_path / "ap", bits_min=2, bits_max=4, group_size=64, calib_text=text,
                             calib_tokens=CALIB_TOKENS, progress=False)
    ckpt = APCheckpoint.open(out)
    assert ckpt.manifest.calibration == {"source": "calib.txt", "num_tokens": CALIB_TOKENS}
    ckpt.verify(deep=True, progress=False)


def test_v3_convert_calib_text_hessians_follow_grouped_sigmoid_routing(v3, tmp_path):
    from transformers import AutoTokenizer

    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    fp8_dir, twin_dir = v3["fp8"][0], v3["twin"][0]
    stats, twin_stats = _converter_hessians(fp8_dir, text), _converter_hessians(twin_dir, text)
    assert set(stats.hessian) == set(twin_stats.hessian)
    for key, h in stats.hessian.items():  # the FP8 source calibrates like its dequantized twin
        torch.testing.assert_close(h, twin_stats.hessian[key], rtol=1e-6, atol=0)
    model, _ = load_source_model(twin_dir)
    tok = AutoTokenizer.from_pretrained(twin_dir)
    mlp = model.model.layers[1].mlp
    routing = routing_by_hand(model, tok, TEXT, [(1, mlp, _v3_route(mlp), mlp, False)],
                              prompts=_calibration_windows(tok))
    state = load_file(str(twin_dir / "model.safetensors"))
    prefix = "model.layers.1.mlp."

    def expert(e):
        name = prefix + ("shared_experts" if e == "shared" else f"experts.{e}")
        return state[f"{name}.gate_proj.weight"], state[f"{name}.up_proj.weight"]

    silu = lambda g: (torch.nn.functional.silu(g), None)  # noqa: E731
    _assert_hessians(stats, 1, routing, routing[1][0], expert, silu, silu)
    assert {k.layer for k in stats.hessian} == {1}  # the MTP layer 2 is not calibrated (nor paged)
