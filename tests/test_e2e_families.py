"""Model families beyond the first three, end to end on the CPU engine (issue #23): tiny random OLMoE and GLM-4.5 MoE
checkpoints made by transformers, converted to AP and served with --enable-paged-weight, against stock SGLang on
their bf16 sources."""

from __future__ import annotations

import math

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
