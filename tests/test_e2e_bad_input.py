"""Bad input refuses to start, with one clear message, and leaves no server process behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.server import run_to_exit

pytestmark = pytest.mark.e2e


def _ap_files(ap_dir: Path) -> list[Path]:
    return sorted((ap_dir / "pagedweight").glob("*.safetensors"))


@pytest.fixture
def ap_copy(ap_qwen2_moe, tmp_path) -> Path:
    dst = tmp_path / "ap"
    shutil.copytree(ap_qwen2_moe, dst)
    return dst


def _refuses(model, flags, env, cpu_server_flags, tmp_path, *needles: str) -> str:
    code, log, _ = run_to_exit(model, flags + cpu_server_flags, env, tmp_path / "refused.log")
    assert code != 0, f"server started instead of refusing:\n{log[-3000:]}"
    for n in needles:
        assert n in log, f"expected {n!r} in the error, got:\n{log[-3000:]}"
    assert "PagedWeight error:" in log and "Traceback" not in log, log[-3000:]
    return log


def _no_server_left(tmp_path):
    import psutil

    left = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes left running: {[p.info['cmdline'] for p in left]}"


def test_truncated_ap_file(ap_copy, server_env, cpu_server_flags, tmp_path):
    f = _ap_files(ap_copy)[0]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    _refuses(ap_copy, ["--enable-paged-weight"], server_env, cpu_server_flags, tmp_path, f.name)
    _no_server_left(tmp_path)


def test_corrupt_ap_file_fails_hash_check(ap_copy, server_env, cpu_server_flags, tmp_path):
    f = _ap_files(ap_copy)[0]
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF  # flip bits inside tensor data: same size, valid header
    f.write_bytes(bytes(data))
    _refuses(ap_copy, ["--enable-paged-weight"], server_env, cpu_server_flags, tmp_path, f.name, "SHA-256")
    _no_server_left(tmp_path)


def _poison_first_table(ap_dir: Path) -> str:
    """Write fp16 NaN over the first value of the first table tensor, in place (file size and header unchanged);
    returns the block name."""
    import struct

    for f in _ap_files(ap_dir):
        raw = bytearray(f.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        for tensor, meta in header.items():
            if tensor != "__metadata__" and meta["dtype"] == "F16" and not tensor.endswith(".planes"):
                start = 8 + n + meta["data_offsets"][0]
                raw[start : start + 2] = b"\x00\x7e"  # 0x7E00: fp16 NaN
                f.write_bytes(bytes(raw))
                return tensor.rsplit(".", 2)[0]
    raise AssertionError("no table tensor found")


def test_nan_table_is_refused_without_hash_verification(ap_copy, server_env, cpu_server_flags, tmp_path):
    block = _poison_first_table(ap_copy)
    log = _refuses(ap_copy, ["--enable-paged-weight", "--no-paged-weight-verify"], server_env, cpu_server_flags,
                   tmp_path, block, "non-finite")
    assert sum("PagedWeight error:" in line for line in log.splitlines()) == 1, log[-3000:]
    _no_server_left(tmp_path)


def test_manifest_hash_mismatch(ap_copy, server_env, cpu_server_flags, tmp_path):
    m = ap_copy / "pagedweight" / "manifest.json"
    manifest = json.loads(m.read_text())
    name = next(iter(manifest["files"]))
    manifest["files"][name]["sha256"] = "0" * 64
    m.write_text(json.dumps(manifest))
    _refuses(ap_copy, ["--enable-paged-weight"], server_env, cpu_server_flags, tmp_path, name)


def test_checkpoint_for_another_model(tiny_qwen2_moe, tiny_mixtral, work_dir, server_env, cpu_server_flags, tmp_path):
    from pagedweight.tools.convert import convert_checkpoint

    ap_mixtral = convert_checkpoint(tiny_mixtral, tmp_path / "ap-mixtral", bits_min=2, bits_max=8, seed=0)
    _refuses(
        tiny_qwen2_moe,
        ["--enable-paged-weight", "--paged-weight-path", str(ap_mixtral)],
        server_env,
        cpu_server_flags,
        tmp_path,
        "another model",
    )


def test_model_without_moe_layers(work_dir, server_env, cpu_server_flags, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=128)
    dense = tmp_path / "dense-llama"
    LlamaForCausalLM(cfg).save_pretrained(dense)
    _refuses(dense, ["--enable-paged-weight"], server_env, cpu_server_flags, tmp_path, "no MoE layers")


def test_bits_outside_stored_range(ap_qwen2_moe, server_env, cpu_server_flags, tmp_path):
    _refuses(
        ap_qwen2_moe,
        ["--enable-paged-weight", "--paged-weight-bits", "1"],
        server_env,
        cpu_server_flags,
        tmp_path,
        "outside the range 2..8",
    )


def test_scope_all_needs_dense_blocks(ap_qwen2_moe, server_env, cpu_server_flags, tmp_path):
    _refuses(
        ap_qwen2_moe,
        ["--enable-paged-weight", "--paged-weight-scope", "all"],
        server_env,
        cpu_server_flags,
        tmp_path,
        "has no dense blocks",
        "pagedweight convert --dense-linears",
    )


def test_scope_all_tp_shards_must_fall_on_groups(tiny_qwen2_moe, work_dir, server_env, cpu_server_flags, tmp_path):
    """o_proj has 64 inputs at group 64: two ranks would each keep half a group. Refused at launch."""
    from pagedweight.tools.convert import convert_checkpoint

    ap = convert_checkpoint(tiny_qwen2_moe, work_dir / "ap-qwen2-moe-dense-g64", bits_min=2, bits_max=8, seed=0,
                            dense_linears=True, progress=False)
    _refuses(
        ap,
        ["--enable-paged-weight", "--paged-weight-scope", "all", "--tp", "2"],
        server_env,
        cpu_server_flags,
        tmp_path,
        "self_attn.o_proj has 64 inputs, so each rank would keep 32",
        "re-convert with a smaller --group-size",
    )


def test_dense_bits_need_scope_all(ap_qwen2_moe, server_env, cpu_server_flags, tmp_path):
    _refuses(
        ap_qwen2_moe,
        ["--enable-paged-weight", "--paged-weight-dense-bits", "4"],
        server_env,
        cpu_server_flags,
        tmp_path,
        "only --paged-weight-scope all serves",
    )


def test_missing_ap_checkpoint(tiny_qwen2_moe, server_env, cpu_server_flags, tmp_path):
    _refuses(tiny_qwen2_moe, ["--enable-paged-weight"], server_env, cpu_server_flags, tmp_path, "pagedweight convert")


@pytest.mark.parametrize(
    "blocks, needle",
    [
        ([[0, 0, "w13", 9, 8]], "at 9 bits is outside 2..8"),
        ([[0, 99, "w13", 4, 4]], "is not in this model"),
        ("not a list", "no 'blocks' list"),
    ],
)
def test_bad_bits_map(blocks, needle, ap_qwen2_moe, server_env, cpu_server_flags, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"blocks": blocks}))
    _refuses(ap_qwen2_moe, ["--enable-paged-weight", "--paged-weight-bits-map", str(plan)], server_env,
             cpu_server_flags, tmp_path, "--paged-weight-bits-map", needle)
    _no_server_left(tmp_path)
