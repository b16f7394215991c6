"""End to end: --paged-weight-scope all serves the attention projections, shared experts and lm_head from AP planes.

The oracle is a copy of the converted model whose attention, shared-expert and lm_head bf16 weights are replaced by
their q-bit AP dequantizations, served with the experts from AP at the same q (scope experts). A scope-all
server on the original conversion must answer with the same distributions (up to the bf16 rounding of the
oracle's weights), and measurably differently from scope experts, whose attention is the bf16 original.
"""

from __future__ import annotations

import shutil
import statistics

import pytest
import requests
from safetensors.torch import load_file, save_file

from pagedweight.format.arch import SHARED
from tests.support.logprob_probe import distributions, mean_kl
from tests.support.server import launch_server, wait_healthy

pytestmark = pytest.mark.e2e

PROMPT = "the cat sat on the mat and the dog ran in the park while the sun was bright over the hills"
BITS = 3


@pytest.fixture(scope="module")
def ap_dense(work_dir, tiny_qwen2_moe):
    from pagedweight.tools.convert import convert_checkpoint

    return convert_checkpoint(tiny_qwen2_moe, work_dir / "ap-qwen2-moe-dense", bits_min=2, bits_max=8, seed=0,
                              dense_linears=True, progress=False)


def _dequantized_copy(ap_dir, out_dir, bits: int):
    """The converted model with every dense AP block's (and shared expert's) bf16 weight replaced by its `bits`-bit
    dequantization."""
    from pagedweight.format.checkpoint import APCheckpoint
    from pagedweight.format.layout import dequantize

    shutil.copytree(ap_dir, out_dir)
    ckpt = APCheckpoint.open(ap_dir)
    names = ckpt.dense_names() + [n for n in ckpt.names() if ckpt.manifest.tensors[n].key.expert == SHARED]
    tensors = load_file(str(out_dir / "model.safetensors"))
    for name in names:
        spec = ckpt.spec(name)
        w = dequantize(ckpt.planes(name, bits), ckpt.table(name, bits), bits, spec.table_kind, spec.group_size)
        tensors[f"{name}.weight"] = w.to(tensors[f"{name}.weight"].dtype)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir, len(names)


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_scope_all_matches_the_dequantized_model(ap_dense, server_env, tmp_path):
    oracle_dir, n_blocks = _dequantized_copy(ap_dense, tmp_path / "oracle", BITS)
    assert n_blocks == 2 * 4 + 1 + 2 * 3  # 2 layers x (q, k, v, o) + lm_head + 2 shared experts x (gate, up, down)
    experts = {"enable_paged_weight": True, "paged_weight_bits": BITS}
    oracle = distributions(oracle_dir, experts, server_env, PROMPT)
    scope_all = distributions(ap_dense, {**experts, "paged_weight_scope": "all"}, server_env, PROMPT)
    scope_experts = distributions(ap_dense, experts, server_env, PROMPT)
    kl_all, kl_experts = mean_kl(oracle, scope_all), mean_kl(oracle, scope_experts)
    diff_all, diff_experts = _max_diff(oracle, scope_all), _max_diff(oracle, scope_experts)
    print(f"vs the dequantized model: scope all KL {kl_all:.3e} max |dlogp| {diff_all:.3e}; "
          f"scope experts KL {kl_experts:.3e} max |dlogp| {diff_experts:.3e}")
    # the dense blocks really are served from AP (scope experts differs by their quantization error) ...
    assert diff_experts > 1e-3, diff_experts
    # ... and at the right bits, with the right shards and tables (what is left is the oracle's bf16 rounding)
    assert diff_all < 0.1 * diff_experts, (diff_all, diff_experts)
    assert kl_all < 0.01 * kl_experts, (kl_all, kl_experts)


def _per_position(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [max(abs(x - y) for x, y in zip(ra, rb)) for ra, rb in zip(a, b)]


def test_gemma4_scope_all_matches_the_dequantized_model(work_dir, server_env, tmp_path):
    """Gemma-4's multimodal checkpoint names its text layers `model.language_model.layers.N`: `convert --dense-linears`
    quantizes their attention projections, and scope all serves them (QKV and o_proj of a sliding and a
    full-attention layer, which differ in head size) and the dense GELU MLP (the shared expert) from AP, matching
    the dequantized model served with scope experts; the embeddings are tied, so there is no lm_head block.

    Every expert is routed (top_k = num_experts), so no routing flip amplifies the oracle's bf16 rounding. Even so a
    few positions of this tiny model move by up to ~0.2 in some log-probability under a 0.4% random perturbation of
    its attention weights (measured while writing this test), so the per-position max |d logp| is compared by its
    median: ~0.005 for scope all (bf16 rounding), ~0.3 for scope experts (the dense blocks' 3-bit error)."""
    from pagedweight.format.checkpoint import APCheckpoint
    from pagedweight.tools.convert import convert_checkpoint
    from pagedweight.tools.tiny_model import TinyMoESizes, make_tiny_moe
    from tests.test_e2e_families import _GEMMA4_ENGINE, _argmax, _margin

    model = make_tiny_moe(work_dir / "tiny-gemma4-dense", arch="gemma4", seed=0,
                          sizes=TinyMoESizes(num_experts=4, top_k=4))
    ap = convert_checkpoint(model, work_dir / "ap-gemma4-dense", bits_min=2, bits_max=8, seed=0, dense_linears=True,
                            progress=False)
    layers = "model.language_model.layers"
    assert APCheckpoint.open(ap).dense_names() == [f"{layers}.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "koqv"]
    oracle_dir, n_blocks = _dequantized_copy(ap, tmp_path / "oracle", BITS)
    assert n_blocks == 2 * 4 + 2 * 3  # 2 layers x (q, k, v, o) + 2 dense MLPs x (gate, up, down)
    experts = {**_GEMMA4_ENGINE, "enable_paged_weight": True, "paged_weight_bits": BITS}
    oracle = distributions(oracle_dir, experts, server_env, PROMPT)
    log = tmp_path / "scope-all.log"
    scope_all = distributions(ap, {**experts, "paged_weight_scope": "all", "log_level": "info"}, server_env, PROMPT,
                              log_path=log)
    scope_experts = distributions(ap, experts, server_env, PROMPT)
    kl_all, kl_experts = mean_kl(oracle, scope_all), mean_kl(oracle, scope_experts)
    med_all = statistics.median(_per_position(oracle, scope_all))
    med_experts = statistics.median(_per_position(oracle, scope_experts))
    print(f"gemma4 vs the dequantized model: scope all KL {kl_all:.3e} median max |dlogp| {med_all:.3e}; "
          f"scope experts KL {kl_experts:.3e} median max |dlogp| {med_experts:.3e}")
    # the dense blocks really are served from AP (scope experts differs by their quantization error) ...
    assert med_experts > 0.05, med_experts
    # ... at the right bits, with the right rows and tables
    assert med_all < 0.05 * med_experts, (med_all, med_experts)
    assert kl_all < 0.1 * kl_experts, (kl_all, kl_experts)
    # teacher-forced greedy: scope all picks the dequantized model's token wherever that is not a near tie
    decided = [i for i, row in enumerate(oracle) if _margin(row) > 1e-2]
    assert len(decided) >= len(oracle) // 2
    assert [_argmax(scope_all[i]) for i in decided] == [_argmax(oracle[i]) for i in decided]
    line = next((l for l in log.read_text().splitlines() if "PagedWeight: scope all:" in l), None)
    assert line is not None, log.read_text()[-3000:]
    # 2 layers x (qkv, o) + 2 dense MLPs x (gate_up, down)
    assert f"8 dense linears at {BITS} bits (fixed)" in line and "lm_head bf16 (tied" in line, line


def test_server_scope_all_reports_dense_linears(ap_dense, server_env, cpu_server_flags, work_dir):
    srv = launch_server(
        ap_dense,
        ["--enable-paged-weight", "--paged-weight-bits", "4", "--paged-weight-scope", "all",
         "--paged-weight-dense-bits", "5"] + cpu_server_flags,
        server_env,
        work_dir / "server-scope-all.log",
    )
    try:
        wait_healthy(srv)
        r = requests.post(srv.url + "/generate", json={"text": "a b c", "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}, timeout=120)
        r.raise_for_status()
        assert r.json()["meta_info"]["completion_tokens"] == 6
        line = next((l for l in srv.log().splitlines() if "PagedWeight: scope all:" in l), None)
        assert line is not None, srv.log()[-3000:]
        # 2 layers x (qkv, o) + 2 shared experts x (gate_up, down) + lm_head; the routers (`gate`) stay bf16
        assert "9 dense linears at 5 bits (fixed)" in line, line
        assert "linears kept in bf16: gate; lm_head from AP;" in line, line
        assert any("expert blocks at 4 bits" in l for l in srv.log().splitlines())
    finally:
        srv.stop()


def test_scope_all_under_tp2_matches_tp1(tiny_qwen2_moe, server_env, work_dir):
    """Two CPU ranks: QKV rows by heads, gate/up rows, o_proj/down input columns (bytes and bcq groups)."""
    from pagedweight.tools.convert import convert_checkpoint

    from tests.support.cpu_engine import cpu_tp_env

    ap = convert_checkpoint(tiny_qwen2_moe, work_dir / "ap-qwen2-moe-dense-g32", bits_min=2, bits_max=8, seed=0,
                            group_size=32, dense_linears=True, progress=False)
    kwargs = {"enable_paged_weight": True, "paged_weight_bits": BITS, "paged_weight_scope": "all"}
    tp1 = distributions(ap, kwargs, server_env, PROMPT)
    tp2 = distributions(ap, {**kwargs, "tp_size": 2}, cpu_tp_env(server_env, 2), PROMPT)
    experts_tp2 = distributions(ap, {**kwargs, "paged_weight_scope": "experts", "tp_size": 2},
                                cpu_tp_env(server_env, 2), PROMPT)
    diff, diff_experts = _max_diff(tp1, tp2), _max_diff(tp1, experts_tp2)
    print(f"scope all, tp2 vs tp1: max |dlogp| {diff:.3e}; scope experts tp2 vs scope all tp1: {diff_experts:.3e}")
    assert diff_experts > 1e-3, diff_experts
    assert diff < 0.1 * diff_experts, (diff, diff_experts)
