"""Model families beyond the first three, end to end on the CPU engine (issue #23): tiny random OLMoE, GLM-4.5 MoE and
Gemma-4 MoE checkpoints made by transformers, converted to AP and served with --enable-paged-weight, against stock
SGLang on their bf16 sources."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tests.support.logprob_probe import distributions, mean_kl

pytestmark = pytest.mark.e2e

PROMPT = "the river ran quietly past the old mill and the miller counted the sacks of grain before the sun went down"


def _argmax(row: list[float]) -> int:
    return max(range(len(row)), key=row.__getitem__)


def _margin(row: list[float]) -> float:
    top2 = sorted(row, reverse=True)[:2]
    return top2[0] - top2[1]


@pytest.mark.parametrize("arch", ["olmoe", "glm4_moe"])
def test_family_parent_matches_stock_and_bits_matter(arch, work_dir, server_env):
    """OLMoE: no shared expert, query / key norms. GLM-4.5 MoE: sigmoid routing with a score-correction bias, a
    shared expert (quantized, and kept in bf16 for --paged-weight-scope experts), a dense first layer."""
    from pagedweight.tools.convert import convert_checkpoint
    from pagedweight.tools.tiny_model import make_tiny_moe

    model = make_tiny_moe(work_dir / f"tiny-{arch}", arch=arch, seed=0)
    ap = convert_checkpoint(model, work_dir / f"ap-{arch}", bits_min=2, bits_max=8, seed=0)
    ref = distributions(model, {}, server_env, PROMPT)
    at8 = distributions(ap, {"enable_paged_weight": True, "paged_weight_bits": 8}, server_env, PROMPT)
    at2 = distributions(ap, {"enable_paged_weight": True, "paged_weight_bits": 2}, server_env, PROMPT)
    kl8, kl2 = mean_kl(ref, at8), mean_kl(ref, at2)
    print(f"{arch} mean KL(stock bf16 || paged):", {8: kl8, 2: kl2})
    assert all(math.isfinite(v) for row in at8 for v in row if v > -math.inf)
    assert kl8 < 1e-3, kl8
    assert kl2 > 5 * kl8, (kl8, kl2)  # the experts really run from the planes, at the committed bits
    # teacher-forced greedy: the parent picks stock's next token wherever stock's choice is not a near tie
    decided = [i for i, row in enumerate(ref) if _margin(row) > 1e-2]
    assert len(decided) >= len(ref) // 2
    assert [_argmax(at8[i]) for i in decided] == [_argmax(ref[i]) for i in decided]


# stock SGLang's CPU MoE asserts SiLU; this folder's sitecustomize sends its GELU layers to SGLang's own torch MoE
_GELU_MOE_SHIM = Path(__file__).parent / "support" / "cpu_gelu_moe"
# SGLang serves Gemma-4 with the triton attention backend only (the interpreter runs it on the CPU engine), and its
# processor needs image files a text-only test does not have
_GEMMA4_ENGINE = {"attention_backend": "triton", "enable_multimodal": False}
_SWA_ELASTIC_LINE = "; full-attention pool elastic, sliding-window pool fixed at "


def test_gemma4_parent_matches_stock_and_bits_matter(work_dir, server_env):
    """Gemma-4 MoE (the multimodal `gemma4` checkpoint, experts stored fused, a dense GELU MLP beside GELU-gated
    experts, sliding-window layers): converted at 8 bits and served with --enable-paged-weight, it matches stock
    SGLang on the bf16 source, starts with the full-attention part of its hybrid sliding-window KV pool elastic
    (one log line), and its experts really run from the planes (2 bits is measurably worse).

    The reference is stock SGLang 0.5.17 with one change: its CPU MoE method asserts SiLU experts, so the reference
    server alone runs with tests/support/cpu_gelu_moe, which routes GELU layers to SGLang's own torch MoE
    (moe_forward_native); everything else is stock. (transformers' Gemma-4 disagrees with SGLang's Gemma-4 on this
    tiny model, stock and PagedWeight alike, so it is not the reference here.)"""
    from pagedweight.tools.convert import convert_checkpoint
    from pagedweight.tools.tiny_model import make_tiny_moe

    model = make_tiny_moe(work_dir / "tiny-gemma4", arch="gemma4", seed=0)
    ap = convert_checkpoint(model, work_dir / "ap-gemma4", bits_min=2, bits_max=8, seed=0)
    stock_env = {**server_env, "PW_TEST_CPU_GELU_MOE": "1",
                 "PYTHONPATH": os.pathsep.join(p for p in (str(_GELU_MOE_SHIM), server_env.get("PYTHONPATH", "")) if p)}
    ref = distributions(model, _GEMMA4_ENGINE, stock_env, PROMPT)
    log8 = work_dir / "gemma4-paged-8.log"
    at8 = distributions(ap, {**_GEMMA4_ENGINE, "enable_paged_weight": True, "paged_weight_bits": 8, "log_level": "info"},
                        server_env, PROMPT,
                        log_path=log8)
    at2 = distributions(ap, {**_GEMMA4_ENGINE, "enable_paged_weight": True, "paged_weight_bits": 2}, server_env, PROMPT)
    kl8, kl2 = mean_kl(ref, at8), mean_kl(ref, at2)
    print("gemma4 mean KL(stock bf16 || paged):", {8: kl8, 2: kl2})
    assert all(math.isfinite(v) for row in at8 for v in row if v > -math.inf)
    assert kl8 < 1e-3, kl8
    assert kl2 > 5 * kl8, (kl8, kl2)
    decided = [i for i, row in enumerate(ref) if _margin(row) > 1e-2]
    assert len(decided) >= len(ref) // 2
    assert [_argmax(at8[i]) for i in decided] == [_argmax(ref[i]) for i in decided]
    log = log8.read_text()
    elastic = [line for line in log.splitlines() if "PagedWeight elastic KV:" in line and _SWA_ELASTIC_LINE in line]
    assert len(elastic) == 1, log[-4000:]
    assert "fixed KV pool" not in log, log[-4000:]
    assert sum("gelu-gated experts on the fused AP MoE kernels" in line for line in log.splitlines()) == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
