"""AP checkpoint writer/reader: round trip, lazy access, validation and every error path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pagedweight.format.checkpoint as checkpoint_module
from pagedweight.format.arch import SHARED, BlockKey
from pagedweight.format.checkpoint import APCheckpoint, APCheckpointWriter
from pagedweight.format.manifest import FORMAT_VERSION, APCheckpointError, ModelInfo, config_sha256
from pagedweight.format.quantize import quantize_block

CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_experts": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "intermediate_size": 24,
}


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # Tiny tensors: intra-op threads only add contention on a shared CPU.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _blocks(table_kind: str) -> dict[str, tuple[BlockKey, object, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(2):
        for expert in (0, 1, SHARED):
            inter = 24 if expert == SHARED else 16
            base = f"model.layers.{layer}.mlp." + ("shared_expert" if expert == SHARED else f"experts.{expert}")
            for proj, shape in (("gate", (inter, 32)), ("up", (inter, 32)), ("down", (32, inter))):
                w = torch.randn(*shape, generator=g) * 0.05
                block = quantize_block(w, table_kind, 2, 5, group_size=8)
                out[f"{base}.{proj}_proj"] = (BlockKey(layer, expert, proj), block, w)
    return out


def _write(directory: Path, table_kind: str = "bcq", max_shard_bytes: int = 1 << 30):
    blocks = _blocks(table_kind)
    writer = APCheckpointWriter(
        directory, table_kind=table_kind, bits_min=2, bits_max=5, group_size=8,
        model=ModelInfo.from_config(CONFIG), calibration=None, seed=0, max_shard_bytes=max_shard_bytes,
    )
    for name, (key, block, _) in reversed(list(blocks.items())):  # order of adding must not matter
        writer.add(name, key, block)
    writer.finish(progress=False)
    return blocks


@pytest.mark.parametrize("table_kind", ["bcq", "kmeans"])
def test_round_trip_with_several_shards(tmp_path, table_kind):
    blocks = _write(tmp_path / "ap", table_kind, max_shard_bytes=3000)
    ckpt = APCheckpoint.open(tmp_path / "ap")
    assert len(ckpt.manifest.files) > 2
    assert ckpt.table_kind == table_kind and list(ckpt.bitwidths) == [2, 3, 4, 5]
    assert set(ckpt.names()) == set(blocks)
    for name, (key, block, _) in blocks.items():
        assert ckpt.name_of(key.layer, key.expert, key.proj) == name
        assert ckpt.blocks()[key] == name
        assert ckpt.spec(name) == block.spec
        assert torch.equal(ckpt.planes(name), block.planes)
        assert torch.equal(ckpt.planes(name, 3), block.planes[:3])
        for b in range(2, 6):
            assert torch.equal(ckpt.table(name, b), block.tables[b])
            assert torch.equal(ckpt.block(name).dequantize(b), block.dequantize(b))
    assert ckpt.layers() == [0, 1]
    assert ckpt.experts(1) == [0, 1, SHARED]
    assert [ckpt.manifest.tensors[n].key for n in ckpt.names()][:4] == [
        BlockKey(0, 0, "gate"), BlockKey(0, 0, "up"), BlockKey(0, 0, "down"), BlockKey(0, 1, "gate")
    ]
    ckpt.verify(deep=True, progress=False)


def test_open_is_lazy_and_does_not_hash(tmp_path, monkeypatch):
    _write(tmp_path / "model" / "pagedweight")

    def no_hashing(*args, **kwargs):
        raise AssertionError("open() must not hash files")

    monkeypatch.setattr(checkpoint_module, "sha256_file", no_hashing)
    ckpt = APCheckpoint.open(tmp_path / "model")  # a model folder with pagedweight/ inside
    assert ckpt.directory == tmp_path / "model" / "pagedweight"
    assert ckpt._handles == {}  # no data file opened yet
    ckpt.verify(deep=False, progress=False)


def _only_file(ap: Path) -> Path:
    (data,) = sorted(ap.glob("ap-*.safetensors"))
    return data


def test_hash_mismatch_is_found_by_deep_verify(tmp_path):
    _write(tmp_path / "ap")
    data = _only_file(tmp_path / "ap")
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF  # inside tensor data: header and size stay valid
    data.write_bytes(bytes(raw))
    ckpt = APCheckpoint.open(tmp_path / "ap")
    ckpt.verify(deep=False, progress=False)
    with pytest.raises(APCheckpointError, match=r"SHA-256 .* does not match.*re-run `pagedweight convert`"):
        ckpt.verify(deep=True, progress=False)


def test_non_finite_table_is_refused_even_when_the_hashes_match(tmp_path):
    blocks = _write(tmp_path / "clean")
    assert APCheckpoint.open(tmp_path / "clean").check_tables_finite(progress=False) == len(blocks) * 4
    bad = _blocks("bcq")
    name = sorted(bad)[3]
    bad[name][1].tables[3][1, 0, 0] = float("nan")  # what a broken converter would write: hashed as written
    writer = APCheckpointWriter(
        tmp_path / "bad", table_kind="bcq", bits_min=2, bits_max=5, group_size=8,
        model=ModelInfo.from_config(CONFIG), calibration=None, seed=0,
    )
    for n, (k, b, _) in bad.items():
        writer.add(n, k, b)
    writer.finish(progress=False)
    ckpt = APCheckpoint.open(tmp_path / "bad")
    ckpt.verify(deep=True, progress=False)  # the hashes cannot see it
    with pytest.raises(APCheckpointError, match=rf"block '{name}' holds 1 non-finite value\(s\).*3-bit table"):
        ckpt.check_tables_finite(progress=False)


def test_truncated_and_missing_files(tmp_path):
    _write(tmp_path / "ap")
    data = _only_file(tmp_path / "ap")
    raw = data.read_bytes()
    data.write_bytes(raw[:-100])
    with pytest.raises(APCheckpointError, match=f"{data.name} has .* bytes.*truncated"):
        APCheckpoint.open(tmp_path / "ap")
    data.unlink()
    with pytest.raises(APCheckpointError, match=f"{data.name} is missing"):
        APCheckpoint.open(tmp_path / "ap")


def test_corrupt_header(tmp_path):
    _write(tmp_path / "ap")
    data = _only_file(tmp_path / "ap")
    raw = bytearray(data.read_bytes())
    raw[8:40] = b"\x00" * 32  # garbage JSON header, same size
    data.write_bytes(bytes(raw))
    ckpt = APCheckpoint.open(tmp_path / "ap")
    with pytest.raises(APCheckpointError, match="corrupt"):
        ckpt.planes(ckpt.names()[0])


def _edit_manifest(ap: Path, edit) -> None:
    path = ap / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_manifest_errors(tmp_path):
    ap = tmp_path / "ap"
    _write(ap)
    original = (ap / "manifest.json").read_text()

    _edit_manifest(ap, lambda d: d.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(APCheckpointError, match="format_version 2 is not supported"):
        APCheckpoint.open(ap)

    (ap / "manifest.json").write_text(original[:50])
    with pytest.raises(APCheckpointError, match="manifest.json: unreadable"):
        APCheckpoint.open(ap)

    (ap / "manifest.json").write_text(original)
    _edit_manifest(ap, lambda d: d.update(format="something-else"))
    with pytest.raises(APCheckpointError, match="not a PagedWeight AP manifest"):
        APCheckpoint.open(ap)

    (ap / "manifest.json").write_text(original)
    _edit_manifest(ap, lambda d: d.update(bits_min=0))
    with pytest.raises(APCheckpointError, match="bit range 0..5 is invalid"):
        APCheckpoint.open(ap)

    (ap / "manifest.json").write_text(original)
    _edit_manifest(ap, lambda d: d["tensors"]["model.layers.0.mlp.experts.0.gate_proj"].update(file="nope.safetensors"))
    with pytest.raises(APCheckpointError, match="'nope.safetensors', which the manifest's \"files\" does not list"):
        APCheckpoint.open(ap)

    # A tensor the manifest promises but the file lacks.
    (ap / "manifest.json").write_text(original)
    entry = json.loads(original)["tensors"]["model.layers.0.mlp.experts.0.gate_proj"]
    _edit_manifest(ap, lambda d: d["tensors"].update({"model.layers.0.mlp.experts.9.gate_proj": {**entry, "expert": 9}}))
    ckpt = APCheckpoint.open(ap)
    with pytest.raises(APCheckpointError, match=r"lacks tensor 'model.layers.0.mlp.experts.9.gate_proj.planes'"):
        ckpt.planes("model.layers.0.mlp.experts.9.gate_proj")
    with pytest.raises(APCheckpointError, match="lacks tensor"):
        ckpt.verify(deep=False, progress=False)


def test_block_keys_are_derived_from_names_when_absent(tmp_path):
    ap = tmp_path / "ap"
    _write(ap)

    def strip(d):
        for entry in d["tensors"].values():
            for k in ("layer", "expert", "proj"):
                entry.pop(k)

    _edit_manifest(ap, strip)
    ckpt = APCheckpoint.open(ap)
    assert ckpt.name_of(1, SHARED, "down") == "model.layers.1.mlp.shared_expert.down_proj"
    assert ckpt.name_of(0, 1, "up") == "model.layers.0.mlp.experts.1.up_proj"


def test_missing_manifest_and_missing_directory(tmp_path):
    ap = tmp_path / "ap"
    _write(ap)
    (ap / "manifest.json").unlink()
    with pytest.raises(APCheckpointError, match="conversion did not finish"):
        APCheckpoint.open(ap)
    with pytest.raises(APCheckpointError, match="does not exist"):
        APCheckpoint.open(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(APCheckpointError, match="no manifest.json.*pagedweight convert"):
        APCheckpoint.open(tmp_path / "empty")


def test_model_config_check(tmp_path):
    _write(tmp_path / "ap")
    ckpt = APCheckpoint.open(tmp_path / "ap")
    ckpt.check_model_config(CONFIG)
    # Aliases and default-valued keys do not change the identity.
    ckpt.check_model_config({**CONFIG, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 7})
    assert config_sha256({**CONFIG, "num_local_experts": 2, "num_experts": None}) == config_sha256(CONFIG)
    with pytest.raises(APCheckpointError, match="another model.*hidden_size: checkpoint 32 vs model 64"):
        ckpt.check_model_config({**CONFIG, "hidden_size": 64})

    class FakeConfig:
        def to_dict(self):
            return {**CONFIG, "num_experts": 4}

    with pytest.raises(APCheckpointError, match="num_experts: checkpoint 2 vs model 4"):
        ckpt.check_model_config(FakeConfig())


def test_bits_and_names_outside_the_checkpoint(tmp_path):
    _write(tmp_path / "ap")
    ckpt = APCheckpoint.open(tmp_path / "ap")
    name = ckpt.names()[0]
    with pytest.raises(APCheckpointError, match="bitwidth 6 requested.*stores 2..5"):
        ckpt.table(name, 6)
    with pytest.raises(APCheckpointError, match="bitwidth 1 requested"):
        ckpt.planes(name, 1)
    with pytest.raises(APCheckpointError, match="no tensor 'model.layers.7"):
        ckpt.spec("model.layers.7.mlp.experts.0.gate_proj")
    with pytest.raises(APCheckpointError, match="no block for layer 5, expert 0"):
        ckpt.name_of(5, 0, "gate")


def test_writer_refusals(tmp_path):
    _write(tmp_path / "ap")
    with pytest.raises(APCheckpointError, match="already holds an AP checkpoint"):
        APCheckpointWriter(tmp_path / "ap", table_kind="bcq", bits_min=2, bits_max=5, group_size=8,
                           model=ModelInfo.from_config(CONFIG))
    writer = APCheckpointWriter(tmp_path / "other", table_kind="bcq", bits_min=2, bits_max=5, group_size=8,
                                model=ModelInfo.from_config(CONFIG))
    with pytest.raises(ValueError, match="no expert blocks were added"):
        writer.finish(progress=False)
    writer = APCheckpointWriter(tmp_path / "third", table_kind="kmeans", bits_min=2, bits_max=5, group_size=8,
                                model=ModelInfo.from_config(CONFIG))
    key, block, _ = next(iter(_blocks("bcq").values()))
    with pytest.raises(ValueError, match="was quantized as"):
        writer.add("x", key, block)
    assert not (tmp_path / "third" / "manifest.json").exists()
