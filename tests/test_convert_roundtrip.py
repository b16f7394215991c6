"""Converter round trip on tiny Qwen2-MoE and Mixtral models, both table kinds, plus calibration."""

from __future__ import annotations

import hashlib
import shutil
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedweight.cli import main as cli_main
from pagedweight.tools.convert import convert_checkpoint
from pagedweight.format.arch import ADAPTERS, PROJS, SHARED, BlockKey
from pagedweight.format.block import weighted_error
from pagedweight.format.checkpoint import APCheckpoint
from pagedweight.format.hessian import LayerInputs, calibration_windows, collect_moe_inputs, expert_hessians
from pagedweight.format.layout import codes_from_planes
from pagedweight.tools.tiny_model import TINY_CORPUS, TinyMoESizes, make_tiny_moe

SIZES = TinyMoESizes(num_layers=2, num_experts=4, vocab_size=320, moe_intermediate_size=64)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    archs = ("qwen2_moe", "mixtral", "glm4_moe", "deepseek_v2")
    return {arch: make_tiny_moe(root / arch, arch, seed=1, sizes=SIZES) for arch in archs}


# (MoE layers, has a shared expert) of each tiny model: GLM-4.5 and DeepSeek-V2 start with one dense layer
LAYOUT = {"qwen2_moe": ((0, 1), True), "mixtral": ((0, 1), False), "glm4_moe": ((1,), True),
          "deepseek_v2": ((1,), True)}
KINDS = {"qwen2_moe": ("bcq", "ubcq", "kmeans"), "mixtral": ("bcq", "ubcq", "kmeans"), "glm4_moe": ("ubcq",),
         "deepseek_v2": ("ubcq",)}


@pytest.fixture(scope="module")
def converted(models, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("ap")
    return {
        (arch, kind): convert_checkpoint(models[arch], root / f"{arch}-{kind}", table_kind=kind, progress=False)
        for arch in models
        for kind in KINDS[arch]
    }


def _tree_digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("arch,kind", [(a, k) for a in LAYOUT for k in KINDS[a]])
def test_round_trip(models, converted, arch, kind):
    src_dir, out = models[arch], converted[(arch, kind)]
    source = load_file(str(src_dir / "model.safetensors"))
    adapter = ADAPTERS[arch]
    expert_names = {n: adapter.classify(n) for n in source if adapter.classify(n) is not None}
    moe_layers, shared = LAYOUT[arch]
    expected_keys = {BlockKey(l, e, p) for l in moe_layers for e in range(4) for p in PROJS}
    if shared:
        expected_keys |= {BlockKey(l, SHARED, p) for l in moe_layers for p in PROJS}
    assert set(expert_names.values()) == expected_keys

    ckpt = APCheckpoint.open(out)
    ckpt.verify(deep=True, progress=False)
    ckpt.check_model_config(json.loads((src_dir / "config.json").read_text()))
    assert ckpt.table_kind == kind and list(ckpt.bitwidths) == list(range(2, 9))
    assert set(ckpt.blocks()) == expected_keys
    for hf_name, key in expert_names.items():
        name = ckpt.name_of(key.layer, key.expert, key.proj)
        assert name == hf_name.removesuffix(".weight")
        w = source[hf_name].float()
        block = ckpt.block(name)
        assert (block.spec.out_features, block.spec.in_features) == tuple(w.shape)
        errors = [weighted_error(w, block.dequantize(b)) for b in ckpt.bitwidths]
        assert all(a >= b for a, b in zip(errors, errors[1:])), (name, errors)
        rel8 = errors[-1] / w.square().sum().item()
        assert rel8 < (1e-4 if kind == "kmeans" else 2e-3), (name, rel8)
        assert errors[0] / w.square().sum().item() < 0.2  # the 2-bit seed is a real fit
        # Prefix property: the first b stored planes are the b-bit model's planes.
        assert torch.equal(ckpt.planes(name, 3), block.planes[:3])
        if kind == "kmeans":
            assert torch.equal(codes_from_planes(block.planes, 3), codes_from_planes(block.planes, 8) >> 5)

    # Top level: a complete model without the routed expert tensors (SGLang serves shared experts as dense
    # layers, so their bf16 weights stay), every other tensor unchanged, side files copied.
    dense = load_file(str(out / "model.safetensors"))
    routed = {n for n, key in expert_names.items() if key.expert != SHARED}
    assert set(dense) == set(source) - routed
    assert all(torch.equal(dense[n], source[n]) for n in dense)
    for side in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / side).read_bytes() == (src_dir / side).read_bytes()
    assert not list(out.parent.glob(f"{out.name}.partial-*"))


def test_conversion_is_deterministic(models, converted, tmp_path):
    again = convert_checkpoint(models["mixtral"], tmp_path / "again", table_kind="kmeans", progress=False)
    assert _tree_digest(again) == _tree_digest(converted[("mixtral", "kmeans")])
    other = convert_checkpoint(models["mixtral"], tmp_path / "b3", table_kind="kmeans", bits_min=3, progress=False)
    assert _tree_digest(other)["pagedweight/manifest.json"] != _tree_digest(again)["pagedweight/manifest.json"]


def test_standalone_ap_dir_and_sharding(models, tmp_path):
    out = convert_checkpoint(
        models["qwen2_moe"], tmp_path / "sa", standalone_ap_dir=True, bits_min=3, bits_max=6,
        group_size=32, max_shard_bytes=20_000, progress=False,
    )
    assert sorted(p.name for p in out.iterdir()) == ["pagedweight"]
    ckpt = APCheckpoint.open(out / "pagedweight")
    assert len(ckpt.manifest.files) > 1 and list(ckpt.bitwidths) == [3, 4, 5, 6]
    assert {e.group_size for e in ckpt.manifest.tensors.values()} == {32}
    ckpt.verify(deep=True, progress=False)


def test_calibration_windows_are_seeded_and_bounded():
    ids = list(range(1000))
    a = calibration_windows(ids, 300, 100, seed=0)
    assert sum(map(len, a)) == 300 and all(len(w) == 100 for w in a)
    assert a == calibration_windows(ids, 300, 100, seed=0)
    assert a != calibration_windows(ids, 300, 100, seed=1)
    assert sum(map(len, calibration_windows(ids[:50], 300, 100, seed=0))) == 50


def test_captured_inputs_are_the_moe_block_inputs(models):
    """The experts' pre-hook captures what the MoE block consumes and the router's top-k of it; the shared expert
    sees the same block input (qwen2_moe)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    inputs, used = collect_moe_inputs(models["qwen2_moe"], TINY_CORPUS, 40, seed=0, layers=[0, 1], window=20)
    assert used == 40 and inputs[1].routed.shape == (40, SIZES.hidden_size) and inputs[1].topk_ids.shape == (40, 2)
    model = AutoModelForCausalLM.from_pretrained(models["qwen2_moe"], dtype=torch.float32).eval()
    block_in = []
    handle = model.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: block_in.append(a[0].reshape(-1, SIZES.hidden_size)))
    ids = AutoTokenizer.from_pretrained(models["qwen2_moe"])(TINY_CORPUS, add_special_tokens=False).input_ids
    with torch.no_grad():
        for window in calibration_windows(ids, 40, 20, seed=0):
            model(torch.tensor([window]))
        handle.remove()
        x = torch.cat(block_in)
        top2 = (x @ model.model.layers[1].mlp.gate.weight.T).topk(2, dim=-1).indices
    assert torch.allclose(inputs[1].routed, x, atol=1e-6) and torch.allclose(inputs[1].shared, x, atol=1e-6)
    assert torch.equal(inputs[1].topk_ids.sort(-1).values, top2.sort(-1).values)


def test_expert_hessians_match_direct_computation():
    g = torch.Generator().manual_seed(0)
    x, shared_x = torch.randn(50, 16, generator=g), torch.randn(50, 16, generator=g)
    top2 = torch.randn(50, 3, generator=g).topk(2).indices
    weights = {BlockKey(0, e, p): torch.randn(8, 16, generator=g) for e in (0, 1, 2, SHARED) for p in ("gate", "up")}
    gelu = torch.nn.GELU(approximate="tanh")
    hessian, counts = expert_hessians(
        {0: LayerInputs(x, top2, torch.nn.functional.silu, shared_x, gelu)}, expert_weight=lambda key: weights[key],
        experts_of_layer={0: [0, 1, 2, SHARED]},
    )
    for e in (0, 1, 2):
        routed = x[[t for t in range(50) if e in top2[t].tolist()]]
        assert counts[BlockKey(0, e, "down")] == len(routed)
        assert torch.allclose(hessian[BlockKey(0, e, "gate")], routed.square().mean(0))
        act = torch.nn.functional.silu(routed @ weights[BlockKey(0, e, "gate")].T) * (routed @ weights[BlockKey(0, e, "up")].T)
        assert torch.allclose(hessian[BlockKey(0, e, "down")], act.square().mean(0))
    assert counts[BlockKey(0, SHARED, "up")] == 50
    assert torch.allclose(hessian[BlockKey(0, SHARED, "up")], shared_x.square().mean(0))
    act = gelu(shared_x @ weights[BlockKey(0, SHARED, "gate")].T) * (shared_x @ weights[BlockKey(0, SHARED, "up")].T)
    assert torch.allclose(hessian[BlockKey(0, SHARED, "down")], act.square().mean(0))


@pytest.mark.parametrize("kind", ["bcq", "kmeans"])
def test_calibrated_conversion_lowers_hessian_weighted_seed_error(models, converted, tmp_path, kind):
    text = tmp_path / "calib.txt"
    text.write_text(TINY_CORPUS * 3)
    out = convert_checkpoint(
        models["qwen2_moe"], tmp_path / "cal", table_kind=kind, calib_text=text, calib_tokens=200, progress=False
    )
    calibrated, plain = APCheckpoint.open(out), APCheckpoint.open(converted[("qwen2_moe", kind)])
    assert calibrated.manifest.calibration == {"source": "calib.txt", "num_tokens": 200}
    # Score both with the activation statistics of the same text: the calibrated fit must win at the
    # seed bitwidth (where the weighting matters most) in aggregate over all expert blocks.
    inputs, _ = collect_moe_inputs(models["qwen2_moe"], text.read_text(), 200, 0, [0, 1])
    source = load_file(str(models["qwen2_moe"] / "model.safetensors"))
    weights = {calibrated.manifest.tensors[n].key: source[f"{n}.weight"] for n in calibrated.names()}
    hessian, _ = expert_hessians(inputs, weights.__getitem__, {l: calibrated.experts(l) for l in (0, 1)})
    total_cal = total_plain = 0.0
    for name in calibrated.names():
        key = calibrated.manifest.tensors[name].key
        w = weights[key].float()
        total_cal += weighted_error(w, calibrated.block(name).dequantize(2), hessian[key])
        total_plain += weighted_error(w, plain.block(name).dequantize(2), hessian[key])
    assert total_cal < 0.99 * total_plain


def test_cli_convert(models, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["convert", "--model", str(models["mixtral"]), "--out", str(out), "--table-kind", "kmeans",
                     "--bits-min", "3", "--bits-max", "4"]) == 0
    assert "wrote AP checkpoint" in capsys.readouterr().out
    assert list(APCheckpoint.open(out).bitwidths) == [3, 4]
    assert cli_main(["convert", "--model", str(models["mixtral"]), "--out", str(out)]) == 2
    assert "not empty; pass --force" in capsys.readouterr().err


def test_sharded_source_gives_sharded_dense_output(models, tmp_path):
    """A multi-shard source (with index) is read shard by shard; the dense output keeps HF sharding."""
    from safetensors.torch import save_file

    src = tmp_path / "sharded"
    shutil.copytree(models["mixtral"], src)
    state = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, str(src / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))

    out = convert_checkpoint(src, tmp_path / "out", bits_max=3, progress=False)
    written = json.loads((out / "model.safetensors.index.json").read_text())
    dense = {}
    for file in sorted(set(written["weight_map"].values())):
        dense.update(load_file(str(out / file)))
    assert set(written["weight_map"]) == set(dense)
    assert set(dense) == {n for n in state if ".experts." not in n}
    assert written["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in dense.values())
    assert len(APCheckpoint.open(out).names()) == SIZES.num_layers * SIZES.num_experts * 3


def test_cli_bcq_init_uniform_is_recorded_and_served_like_any_bcq(models, tmp_path, capsys):
    """--bcq-init uniform: same layout (the reader and kernels do not care), lower fit error, the choice in
    the manifest; refused for k-means tables."""
    greedy, uniform = tmp_path / "greedy", tmp_path / "uniform"
    base = ["convert", "--model", str(models["mixtral"]), "--bits-min", "2", "--bits-max", "6", "--group-size", "32",
            "--table-kind", "bcq"]
    assert cli_main([*base, "--out", str(greedy)]) == 0
    assert cli_main([*base, "--out", str(uniform), "--bcq-init", "uniform"]) == 0
    manifest = json.loads((uniform / "pagedweight" / "manifest.json").read_text())
    assert manifest["bcq_init"] == "uniform"
    assert "bcq_init" not in json.loads((greedy / "pagedweight" / "manifest.json").read_text())
    a, b = APCheckpoint.open(greedy), APCheckpoint.open(uniform)
    assert a.manifest.bcq_init == "greedy" and b.manifest.bcq_init == "uniform"
    state = load_file(str(models["mixtral"] / "model.safetensors"))
    err = {4: [0.0, 0.0], 6: [0.0, 0.0]}
    for name in a.manifest.tensors:
        w = state[f"{name}.weight"].float()
        for bits in err:
            err[bits][0] += float((a.block(name).dequantize(bits) - w).square().sum())
            err[bits][1] += float((b.block(name).dequantize(bits) - w).square().sum())
    assert all(e_uniform < e_greedy for e_greedy, e_uniform in err.values()), err
    capsys.readouterr()
    assert cli_main([*base[:-2], "--out", str(tmp_path / "km"), "--table-kind", "kmeans", "--bcq-init", "uniform"]) == 2
    assert "--bcq-init uniform applies to --table-kind bcq only" in capsys.readouterr().err


def test_cli_ubcq_tables_are_two_numbers_per_group(models, converted, tmp_path, capsys):
    """--table-kind ubcq: a [2, N, K/G] table per bitwidth (scale, offset), fewer bytes than bcq at every
    bitwidth, the kind in the manifest; --bcq-init is refused with the reason."""
    bcq, ubcq = APCheckpoint.open(converted[("mixtral", "bcq")]), APCheckpoint.open(converted[("mixtral", "ubcq")])
    assert json.loads((ubcq.directory / "manifest.json").read_text())["table_kind"] == "ubcq"
    for name in ubcq.names():
        spec = ubcq.spec(name)
        for b in ubcq.bitwidths:
            assert tuple(ubcq.table(name, b).shape) == (2, spec.out_features, spec.num_groups)
            assert spec.bytes_at(b) < bcq.spec(name).bytes_at(b)
    base = ["convert", "--model", str(models["mixtral"]), "--bits-max", "4", "--table-kind", "ubcq"]
    assert cli_main([*base, "--out", str(tmp_path / "u")]) == 0
    assert list(APCheckpoint.open(tmp_path / "u").bitwidths) == [2, 3, 4]
    capsys.readouterr()
    assert cli_main([*base, "--out", str(tmp_path / "u2"), "--bcq-init", "uniform"]) == 2
    assert "ubcq planes are always the uniform grid" in capsys.readouterr().err
