"""Dense linears in AP form (--paged-weight-scope all): the manifest's "dense" section, `convert
--dense-linears`, and how a TP rank's shard of a fused SGLang linear maps onto the checkpoint's blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedweight.tools.convert import ConversionError, convert_checkpoint
from pagedweight.format.arch import BlockKey
from pagedweight.format.checkpoint import APCheckpoint, APCheckpointWriter
from pagedweight.format.layout import dequantize
from pagedweight.format.manifest import APCheckpointError, ModelInfo
from pagedweight.format.quantize import quantize_block
from pagedweight.tools.tiny_model import TinyMoESizes, make_tiny_moe

CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 32,
          "num_hidden_layers": 1, "num_local_experts": 1, "intermediate_size": 16}


def _write(ap: Path, with_dense: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    writer = APCheckpointWriter(ap, table_kind="bcq", bits_min=2, bits_max=4, group_size=16,
                                model=ModelInfo.from_config(CONFIG), calibration=None, seed=0)
    weights = {}
    for proj, shape in (("w1", (16, 32)), ("w3", (16, 32)), ("w2", (32, 16))):
        w = torch.randn(*shape, generator=g)
        name = f"model.layers.0.block_sparse_moe.experts.0.{proj}"
        writer.add(name, BlockKey(0, 0, {"w1": "gate", "w3": "up", "w2": "down"}[proj]), quantize_block(w, "bcq", 2, 4, 16))
    if with_dense:
        for proj in ("q_proj", "o_proj"):
            weights[proj] = torch.randn(32, 32, generator=g)
            writer.add_dense(f"model.layers.0.self_attn.{proj}", quantize_block(weights[proj], "bcq", 2, 4, 16))
    writer.finish(progress=False)
    return weights


def test_dense_blocks_round_trip_and_stay_out_of_the_expert_views(tmp_path):
    weights = _write(tmp_path / "ap", with_dense=True)
    ckpt = APCheckpoint.open(tmp_path / "ap")
    ckpt.verify(progress=False)
    assert ckpt.dense_names() == ["model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj"]
    assert len(ckpt.names()) == 3 and len(ckpt.blocks()) == 3  # planner/runtime views: experts only
    assert ckpt.has_block("model.layers.0.self_attn.q_proj") and not ckpt.has_block("model.layers.0.self_attn.k_proj")
    name = "model.layers.0.self_attn.q_proj"
    spec = ckpt.spec(name)
    assert (spec.out_features, spec.in_features, spec.group_size) == (32, 32, 16)
    w4 = dequantize(ckpt.planes(name, 4), ckpt.table(name, 4), 4, "bcq", 16)
    w2 = dequantize(ckpt.planes(name, 2), ckpt.table(name, 2), 2, "bcq", 16)
    err4, err2 = (w4 - weights["q_proj"]).norm(), (w2 - weights["q_proj"]).norm()
    assert err4 < 0.5 * err2 < weights["q_proj"].norm()


def test_expert_only_manifest_has_no_dense_key(tmp_path):
    _write(tmp_path / "ap", with_dense=False)
    assert "dense" not in json.loads((tmp_path / "ap" / "manifest.json").read_text())
    assert APCheckpoint.open(tmp_path / "ap").dense_names() == []


def test_dense_manifest_errors(tmp_path):
    ap = tmp_path / "ap"
    _write(ap, with_dense=True)
    original = json.loads((ap / "manifest.json").read_text())

    def edited(edit) -> None:
        data = json.loads(json.dumps(original))
        edit(data)
        (ap / "manifest.json").write_text(json.dumps(data))

    edited(lambda d: d["dense"]["model.layers.0.self_attn.q_proj"].update(file="nope.safetensors"))
    with pytest.raises(APCheckpointError, match="'nope.safetensors', which \"files\" does not list"):
        APCheckpoint.open(ap)
    edited(lambda d: d["dense"]["model.layers.0.self_attn.q_proj"].update(shape=[32]))
    with pytest.raises(APCheckpointError, match="expected \\[out_features, in_features\\]"):
        APCheckpoint.open(ap)
    edited(lambda d: d["dense"].update({"model.layers.0.block_sparse_moe.experts.0.w1":
                                        d["dense"]["model.layers.0.self_attn.q_proj"]}))
    with pytest.raises(APCheckpointError, match="both as an expert block and as a dense block"):
        APCheckpoint.open(ap)
    edited(lambda d: d["dense"].update({"model.layers.0.self_attn.k_proj": d["dense"]["model.layers.0.self_attn.q_proj"]}))
    with pytest.raises(APCheckpointError, match="lacks tensor 'model.layers.0.self_attn.k_proj.planes'"):
        APCheckpoint.open(ap).verify(deep=False, progress=False)


def test_writer_needs_an_expert_block(tmp_path):
    writer = APCheckpointWriter(tmp_path / "ap", table_kind="bcq", bits_min=2, bits_max=4, group_size=16,
                                model=ModelInfo.from_config(CONFIG))
    writer.add_dense("model.layers.0.self_attn.q_proj", quantize_block(torch.randn(32, 32), "bcq", 2, 4, 16))
    with pytest.raises(ValueError, match="no expert blocks were added"):
        writer.finish(progress=False)


def test_convert_dense_linears(tmp_path):
    model = make_tiny_moe(tmp_path / "tiny", "mixtral", sizes=TinyMoESizes(num_layers=1, num_experts=2, vocab_size=320))
    ap = convert_checkpoint(model, tmp_path / "ap", bits_min=2, bits_max=4, dense_linears=True, progress=False)
    ckpt = APCheckpoint.open(ap)
    assert ckpt.dense_names() == ["lm_head"] + [f"model.layers.0.self_attn.{p}_proj" for p in "koqv"]
    # the bf16 attention weights stay in the servable model, for --paged-weight-scope experts
    from safetensors import safe_open

    with safe_open(str(ap / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.self_attn.q_proj.weight" in f.keys()
    plain = convert_checkpoint(model, tmp_path / "plain", bits_min=2, bits_max=4, progress=False)
    assert APCheckpoint.open(plain).dense_names() == []


def test_convert_dense_linears_needs_attention_projections(tmp_path):
    from safetensors.torch import load_file, save_file

    model = make_tiny_moe(tmp_path / "tiny", "mixtral", sizes=TinyMoESizes(num_layers=1, num_experts=2, vocab_size=320))
    state = load_file(str(model / "model.safetensors"))
    renamed = {k.replace("self_attn", "attention").replace("lm_head", "output"): v for k, v in state.items()}
    save_file(renamed, str(model / "model.safetensors"))
    with pytest.raises(ConversionError, match="--dense-linears: .* has no attention projections or lm_head"):
        convert_checkpoint(model, tmp_path / "ap", dense_linears=True, progress=False)
    assert not (tmp_path / "ap").exists()


# ------------------------------------------------------------------------------------------- TP shards
def _layer(cls_name: str, **attrs):
    """An SGLang linear of the given class with just the attributes the shard plan reads (no TP group needed)."""
    import sglang.srt.layers.linear as linear

    layer = object.__new__(getattr(linear, cls_name))
    layer.__dict__.update(attrs)
    return layer


def test_ap_names_for_fused_linears():
    from pagedweight.serving.dense_linear import ap_names_for, is_dense_ap_name

    assert ap_names_for("model.layers.3.self_attn.qkv_proj") == tuple(
        f"model.layers.3.self_attn.{p}_proj" for p in "qkv")
    assert ap_names_for("model.layers.3.mlp.shared_expert.gate_up_proj") == (
        "model.layers.3.mlp.shared_expert.gate_proj", "model.layers.3.mlp.shared_expert.up_proj")
    assert ap_names_for("model.layers.3.self_attn.o_proj") == ("model.layers.3.self_attn.o_proj",)
    assert is_dense_ap_name("model.layers.3.self_attn.o_proj")
    assert is_dense_ap_name("model.layers.3.mlp.shared_expert.down_proj")
    assert is_dense_ap_name("lm_head")
    assert not is_dense_ap_name("model.layers.3.mlp.gate")


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_qkv_shards_follow_sglang_heads_and_kv_replicas(rank):
    from pagedweight.serving.dense_linear import shard_plan

    # 8 query heads, 2 KV heads of 16 over 4 ranks: 2 query heads per rank, each KV head on two ranks
    layer = _layer("QKVParallelLinear", tp_rank=rank, tp_size=4, num_heads=2, num_kv_heads=1, head_size=16,
                   v_head_size=16, num_kv_head_replicas=2)
    names = ("q", "k", "v")
    plan = shard_plan(layer, names, {"q": 128, "k": 32, "v": 32}, 64)
    kv = rank // 2
    assert [(r.name, r.start, r.stop) for r in plan.rows] == [
        ("q", 32 * rank, 32 * rank + 32), ("k", 16 * kv, 16 * kv + 16), ("v", 16 * kv, 16 * kv + 16)]
    assert plan.cols is None and plan.out_features == 64


def test_merged_column_and_row_parallel_shards():
    from pagedweight.serving.dense_linear import shard_plan

    gate_up = _layer("MergedColumnParallelLinear", tp_rank=1, tp_size=2, output_sizes=[128, 128])
    plan = shard_plan(gate_up, ("gate", "up"), {"gate": 128, "up": 128}, 64)
    assert [(r.name, r.start, r.stop) for r in plan.rows] == [("gate", 64, 128), ("up", 64, 128)]
    down = _layer("RowParallelLinear", tp_rank=1, tp_size=2, input_size_per_partition=64)
    plan = shard_plan(down, ("down",), {"down": 64}, 128)
    assert plan.cols == (64, 128) and [(r.start, r.stop) for r in plan.rows] == [(0, 64)]
    whole = _layer("RowParallelLinear", tp_rank=0, tp_size=1, input_size_per_partition=128)
    assert shard_plan(whole, ("down",), {"down": 64}, 128).cols is None
    presharded = _layer("RowParallelLinear", tp_rank=0, tp_size=2, input_size_per_partition=64,
                        use_presharded_weights=True)
    with pytest.raises(ValueError, match="pre-sharded"):
        shard_plan(presharded, ("down",), {"down": 64}, 128)


@pytest.mark.parametrize("rank", [0, 1])
def test_lm_head_shard_is_the_ranks_original_vocabulary(rank):
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from pagedweight.serving.dense_linear import shard_plan

    # vocab 500 padded to 512 over two ranks: rank 0 owns rows 0..255, rank 1 rows 256..499 (+12 padding rows)
    layer = object.__new__(VocabParallelEmbedding)
    layer.__dict__.update(shard_indices=VocabParallelEmbedding._get_indices(512, 512, 500, 500, rank, 2),
                          num_added_embeddings=0, tp_rank=rank, tp_size=2)
    plan = shard_plan(layer, ("lm_head",), {"lm_head": 500}, 64)
    assert [(r.start, r.stop) for r in plan.rows] == ([(0, 256)] if rank == 0 else [(256, 500)])


class _KOnlyCheckpoint:
    """An AP checkpoint whose attention layer ships q_proj and k_proj only (Gemma-4's attention_k_eq_v layers)."""

    table_kind = "ubcq"

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.blocks = {f"model.language_model.layers.5.self_attn.{p}_proj": n for p, n in (("q", 64), ("k", 32))}
        self.planes_of = {b: torch.randint(0, 256, (8, n, 16), dtype=torch.uint8, generator=g)
                          for b, n in self.blocks.items()}
        self.tables_of = {b: torch.rand(2, n, 1, generator=g).half() for b, n in self.blocks.items()}

    def has_block(self, name: str) -> bool:
        return name in self.blocks

    def spec(self, name: str):
        from pagedweight.format.layout import BlockSpec

        return BlockSpec(self.blocks[name], 128, 2, 8, "ubcq", 128)

    def planes(self, name: str, bits: int) -> torch.Tensor:
        return self.planes_of[name][:bits]

    def table(self, name: str, bits: int) -> torch.Tensor:
        return self.tables_of[name]


def test_k_eq_v_layers_read_v_from_k_and_only_under_the_flag():
    from pagedweight.serving.dense_linear import CheckpointDenseSource, ap_names_for

    names = ap_names_for("model.language_model.layers.5.self_attn.qkv_proj")
    ckpt = _KOnlyCheckpoint()
    with pytest.raises(ValueError, match=r"only some blocks of a fused linear: \['model.language_model.layers.5.self_attn"
                                         r".v_proj'\] are missing"):
        CheckpointDenseSource(ckpt).has_blocks(names)  # without attention_k_eq_v a missing v_proj is a broken file
    source = CheckpointDenseSource(ckpt, k_eq_v=True)
    assert source.has_blocks(names)
    layer = _layer("QKVParallelLinear", tp_rank=0, tp_size=1, num_heads=4, num_kv_heads=2, head_size=16,
                   v_head_size=16, num_kv_head_replicas=1, output_partition_sizes=[64, 32, 32],
                   input_size_per_partition=128, input_size=128)
    w = source.load(layer, "model.language_model.layers.5.self_attn.qkv_proj", names, 4, torch.device("cpu"))
    k = ckpt.planes_of["model.language_model.layers.5.self_attn.k_proj"][:4]
    planes = torch.stack(w.planes)
    assert planes.shape == (4, 128, 16)
    assert torch.equal(planes[:, 64:96], k) and torch.equal(planes[:, 96:], k)  # V's rows are K's
    assert torch.equal(w.table[:, 96:], ckpt.tables_of["model.language_model.layers.5.self_attn.k_proj"])


def test_model_config_attention_k_eq_v_is_read_under_text_config(tmp_path):
    import json

    from pagedweight.patches.linear import _attention_k_eq_v

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4",
                                                      "text_config": {"attention_k_eq_v": True}}))
    assert _attention_k_eq_v(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_moe"}))
    assert not _attention_k_eq_v(str(tmp_path)) and not _attention_k_eq_v(str(tmp_path / "missing"))
