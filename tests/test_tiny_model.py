"""Tiny MoE generator: per-expert HF names, reloadable by transformers, tokenizer, determinism, errors."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedweight.cli import main as cli_main
from pagedweight.tools.tiny_model import (
    EOS_TOKEN,
    FUSED_EXPERT_ARCHS,
    IM_END,
    TINY_ARCHS,
    TinyMoESizes,
    _ensure_per_expert_names,
    make_tiny_moe,
)

SIZES = TinyMoESizes(num_layers=2, num_experts=4, vocab_size=320)

EXPERT_PATTERNS = {
    "qwen2_moe": r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight",
    "qwen3_moe": r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight",
    "mixtral": r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight",
    "olmoe": r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight",
    "glm4_moe": r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight",
    "deepseek_v2": r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight",
}


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


# the families saved with per-expert names (Gemma-4 keeps its fused experts: tests/test_convert_gemma4.py)
@pytest.fixture(scope="module", params=[a for a in TINY_ARCHS if a not in FUSED_EXPERT_ARCHS])
def tiny(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_tiny_moe(tmp_path_factory.mktemp(arch) / "model", arch, seed=0, sizes=SIZES)


def test_expert_tensors_use_per_expert_hf_names(tiny):
    arch, path = tiny
    state = load_file(str(path / "model.safetensors"))
    assert not [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))], "fused expert tensors"
    experts = {}
    for key, tensor in state.items():
        m = re.fullmatch(EXPERT_PATTERNS[arch], key)
        if m:
            experts[(int(m[1]), int(m[2]), m[3])] = tensor
    projs = ("w1", "w2", "w3") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    first_moe = 1 if arch in ("glm4_moe", "deepseek_v2") else 0  # first_k_dense_replace = 1: layer 0 is dense
    moe_layers = range(first_moe, SIZES.num_layers)
    assert set(experts) == {(l, e, p) for l in moe_layers for e in range(SIZES.num_experts) for p in projs}
    down = "w2" if arch == "mixtral" else "down_proj"
    gate = "w1" if arch == "mixtral" else "gate_proj"
    assert experts[(first_moe, 0, down)].shape == (SIZES.hidden_size, SIZES.moe_intermediate_size)
    assert experts[(first_moe, 0, gate)].shape == (SIZES.moe_intermediate_size, SIZES.hidden_size)
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    if arch == "qwen2_moe":
        assert state["model.layers.1.mlp.shared_expert.down_proj.weight"].shape == (
            SIZES.hidden_size,
            SIZES.shared_expert_intermediate_size,
        )
    if arch in ("glm4_moe", "deepseek_v2"):
        assert state["model.layers.0.mlp.down_proj.weight"].shape == (SIZES.hidden_size, SIZES.shared_expert_intermediate_size)
        n_shared = 2 if arch == "deepseek_v2" else 1  # the shared experts are one MLP of n_shared x the width
        assert state["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (
            SIZES.hidden_size, n_shared * SIZES.moe_intermediate_size)


def test_transformers_reloads_model_and_tokenizer(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch, path = tiny
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    # The reloaded expert weights are the ones on disk (name mapping round-trips).
    saved = load_file(str(path / "model.safetensors"))
    down_name = "w2" if arch == "mixtral" else "down_proj"
    module = "block_sparse_moe" if arch == "mixtral" else "mlp"
    on_disk = saved[f"model.layers.1.{module}.experts.3.{down_name}.weight"]
    in_memory = model.model.layers[1].mlp.experts.down_proj[3]
    assert torch.equal(on_disk, in_memory)

    ids = tokenizer("The river ran quietly.").input_ids
    assert ids[0] == tokenizer.bos_token_id == 0
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The river ran quietly."
    assert len(tokenizer) <= model.config.vocab_size
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.convert_tokens_to_ids(IM_END) == 4


def test_deterministic_for_seed(tmp_path):
    a = make_tiny_moe(tmp_path / "a", "mixtral", seed=3, sizes=SIZES)
    b = make_tiny_moe(tmp_path / "b", "mixtral", seed=3, sizes=SIZES)
    c = make_tiny_moe(tmp_path / "c", "mixtral", seed=4, sizes=SIZES)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]
    assert _digest(a)["tokenizer.json"] == _digest(c)["tokenizer.json"]


def test_fused_expert_tensors_are_split(tmp_path):
    gate_up = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)
    down = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    path = tmp_path / "model.safetensors"
    save_file(
        {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down}, str(path)
    )
    _ensure_per_expert_names(path, "mixtral")
    state = load_file(str(path))
    assert sorted(state) == [f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in (0, 1) for w in ("w1", "w2", "w3")]
    assert torch.equal(state["model.layers.0.block_sparse_moe.experts.1.w1.weight"], gate_up[1, :3])
    assert torch.equal(state["model.layers.0.block_sparse_moe.experts.1.w3.weight"], gate_up[1, 3:])
    assert torch.equal(state["model.layers.0.block_sparse_moe.experts.0.w2.weight"], down[0])


def test_bad_inputs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny arch"):
        make_tiny_moe(tmp_path / "x", "llama")
    with pytest.raises(ValueError, match="multiples of 8"):
        make_tiny_moe(tmp_path / "x", "mixtral", sizes=TinyMoESizes(moe_intermediate_size=60))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--force"):
        make_tiny_moe(tmp_path / "full", "mixtral", sizes=SIZES)
    assert (tmp_path / "full" / "keep.txt").exists()


def test_cli_make_tiny(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = cli_main(["make-tiny", "--arch", "qwen3_moe", "--out", str(out), "--num-experts", "4", "--vocab-size", "320"])
    assert rc == 0 and (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert "qwen3_moe" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["make-tiny", "--out", str(tmp_path / "y"), "--hidden-size", "60"])
