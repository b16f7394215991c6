"""The CUDA activation-side-table kernel (cuda_lut.py) for bcq planes at decode sizes.

CPU (CI): every variant of the source compiles with NVRTC for sm_90; the config rules; the dispatch's
refusals. CUDA: against the torch reference on random and adversarial shapes (N not a multiple of the
block, K with a partial last slice, every bitwidth, mixed per-expert bitwidths, padding pairs in a block,
one expert taking every token, empty experts, all three activation dtypes), and page-table rows rewritten
between CUDA-graph replays.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pagedweight.kernels import ap_linear
from pagedweight.kernels.config import expected_experts_hit, prefer_lut
from pagedweight.kernels.cuda_lut import (
    CHUNK,
    MAX_SHARED_BYTES,
    LUTConfig,
    ap_fused_moe_lut,
    ap_linear_lut,
    block_m_for_rows,
    compile_to_cubin,
    default_lut_config,
    kernel_defines,
    lut_unsupported,
)
from pagedweight.kernels.reference import ap_fused_moe_reference, ap_linear_reference
from pagedweight.kernels.testing import random_ap_projection
from tests.support.cuda_kernel_cases import (assert_cubins, check_graph_replay, check_moe_dtypes,
                                             compile_in_parallel, rel_err, routing, sass_of, tol)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="the LUT kernel is CUDA only")


# ---------------------------------------------------------------- CPU: build, configs, refusals


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("block_m", [1, 2, 4, 8])
def test_every_variant_compiles_for_sm90(mode, block_m):
    dtypes = [torch.bfloat16] if mode == 1 else [torch.bfloat16, torch.float16, torch.float32]
    directs = [False, True] if block_m == 1 and mode != 2 else [False]
    points = ((8, 128, False), (4, 256, False), (8, 128, True))
    # with three dtypes each meets one point, rotated with block_m, so every (dtype, point) pair compiles across the
    # block sizes without the whole cross product at each (CI time); one dtype meets every point
    pairs = ([(dtypes[0], pt) for pt in points] if len(dtypes) == 1 else
             [(dtype, points[(i + block_m.bit_length()) % len(points)]) for i, dtype in enumerate(dtypes)])
    jobs = [functools.partial(compile_to_cubin, kernel_defines(mode, dtype, block_m, bits_max, group, direct, uniform), "90")
            for dtype, (bits_max, group, uniform) in pairs for direct in directs]
    assert_cubins(compile_in_parallel(jobs))


def test_direct_layout_is_refused_where_it_does_not_apply():
    for mode, block_m in ((0, 2), (2, 1)):
        with pytest.raises(RuntimeError, match="DIRECT needs BM 1"):
            compile_to_cubin(kernel_defines(mode, torch.bfloat16, block_m, 8, 128, direct=True), "90")


def test_config_validation_and_shared_memory_cap():
    with pytest.raises(ValueError, match="block_m"):
        LUTConfig(block_m=3, n_per_block=256, k_per_split=128)
    with pytest.raises(ValueError, match="n_per_block"):
        LUTConfig(block_m=1, n_per_block=100, k_per_split=128)
    with pytest.raises(ValueError, match="k_per_split"):
        LUTConfig(block_m=1, n_per_block=256, k_per_split=200)
    with pytest.raises(ValueError, match="l2_prefetch"):
        LUTConfig(block_m=1, n_per_block=256, k_per_split=128, l2_prefetch=64)
    for bm in (1, 2, 4, 8):
        for k in (128, 1408, 4096, 14336):
            cfg = default_lut_config(1, bm, 4096, k, num_sms=132)
            assert cfg.shared_bytes() <= MAX_SHARED_BYTES and cfg.k_per_split % CHUNK == 0
            assert cfg.k_per_split <= -(-k // CHUNK) * CHUNK
    assert [block_m_for_rows(m) for m in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    # a small grid splits K; a large one does not
    small = default_lut_config(4, 1, 2816, 2048, num_sms=132)
    large = default_lut_config(512, 1, 28672, 4096, num_sms=132)
    assert small.k_per_split < large.k_per_split
    assert LUTConfig(1, 256, 2 * large.k_per_split).shared_bytes() > MAX_SHARED_BYTES  # as wide as shared memory allows


def test_plane_loads_carry_the_l2_prefetch_hint():
    for pf, tag in ((0, None), (128, "LTC128B"), (256, "LTC256B")):
        sass = sass_of(compile_to_cubin(kernel_defines(1, torch.bfloat16, 1, 4, 128, uniform=True, l2_prefetch=pf),
                                        "90"))
        loads = [line for line in sass.splitlines() if "LDG.E" in line and ".128" in line]
        assert loads, "no 16-byte plane load in the kernel"
        assert any(tag in line for line in loads) if tag else not any("LTC" in line for line in loads), pf


def test_prefer_lut_follows_pairs_per_expert():
    assert expected_experts_hit(1, 4, 60) == pytest.approx(4.0)
    assert expected_experts_hit(1000, 2, 8) == pytest.approx(8.0)
    # H200 measurements (docs/results/kernel.md): LUT at Mixtral M=1, 4 and Qwen1.5-MoE M=1, 4, 16; tiles beyond
    assert prefer_lut(1, 2, 8) and prefer_lut(4, 2, 8)
    assert prefer_lut(1, 4, 60) and prefer_lut(4, 4, 60) and prefer_lut(16, 4, 60)
    assert not prefer_lut(16, 2, 8) and not prefer_lut(64, 4, 60) and not prefer_lut(64, 2, 8)


def test_refusals_name_the_reason():
    bcq = random_ap_projection(1, 64, 256, [4], table_kind="bcq", group_size=128, bits_min=4).weights
    km = random_ap_projection(1, 64, 256, [4], table_kind="kmeans", bits_min=4).weights
    g64 = random_ap_projection(1, 64, 256, [4], table_kind="bcq", group_size=64, bits_min=4).weights
    assert "k-means" in lut_unsupported(km) or "kmeans" in lut_unsupported(km)
    assert "group size 64" in lut_unsupported(g64)
    assert "CUDA" in lut_unsupported(bcq)
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="not on a CUDA device"):
        ap_linear(x, bcq, kernel="lut")
    with pytest.raises(ValueError, match="kernel must be"):
        ap_linear(x, bcq, kernel="fast")
    # auto on CPU is the torch reference, bit for bit
    torch.testing.assert_close(ap_linear(x, bcq), ap_linear_reference(x, bcq), rtol=0, atol=0)


# ---------------------------------------------------------------- CUDA: correctness


@needs_cuda
@pytest.mark.parametrize("kind", ["bcq", "ubcq"])
@pytest.mark.parametrize("n,k,group", [(256, 128, 128), (300, 384, 128), (1000, 1408, 128), (2048, 2048, 256)])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_linear_matches_reference(kind, n, k, group, bits):
    proj = random_ap_projection(1, n, k, [bits], table_kind=kind, group_size=group, bits_min=2, seed=bits,
                                device="cuda")
    for m in (1, 2, 3, 5, 8):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(dtype)
            bias = torch.randn(n, device="cuda").to(dtype) if m == 3 else None
            out = ap_linear(x, proj.weights, bias=bias, kernel="lut")
            ref = ap_linear_reference(x.float(), proj.weights, bias=None if bias is None else bias.float())
            assert out.dtype == dtype and out.shape == (m, n)
            assert rel_err(out, ref) < tol(dtype), (m, dtype)


@needs_cuda
def test_linear_small_k_slices_and_blocks():
    """Explicit configs: K cut into 128-wide slices (many atomics), block_m larger than M (padding rows)."""
    proj = random_ap_projection(1, 520, 640, [5], bits_min=2, device="cuda")
    x = torch.randn(3, 640, device="cuda")
    ref = ap_linear_reference(x, proj.weights)
    for cfg in (LUTConfig(1, 256, 128), LUTConfig(8, 512, 384), LUTConfig(2, 256, 640)):
        assert rel_err(ap_linear_lut(x, proj.weights, 0, None, cfg), ref) < 5e-3, cfg


def _layer(num_experts, hidden, inter, bits13, bits2, seed=0, kind="bcq"):
    p13 = random_ap_projection(num_experts, 2 * inter, hidden, bits13, table_kind=kind, bits_min=2, seed=seed,
                               device="cuda")
    p2 = random_ap_projection(num_experts, hidden, inter, bits2, table_kind=kind, bits_min=2, seed=seed + 1,
                              device="cuda")
    return p13, p2


@needs_cuda
@pytest.mark.parametrize("kind", ["bcq", "ubcq"])
@pytest.mark.parametrize(
    "num_experts,topk,m,pattern",
    [(8, 2, 1, "random"), (8, 2, 4, "random"), (8, 1, 3, "one_expert"), (60, 4, 1, "random"),
     (60, 4, 16, "random"), (16, 8, 5, "one_expert"), (64, 6, 2, "random")],
)
def test_moe_matches_reference(kind, num_experts, topk, m, pattern):
    hidden, inter = 512, 384  # w2: K = 384 = three 128-input chunks
    bits13 = [2 + (e % 7) for e in range(num_experts)]  # every bitwidth 2..8, mixed in one launch
    bits2 = [2 + ((e + 3) % 7) for e in range(num_experts)]
    p13, p2 = _layer(num_experts, hidden, inter, bits13, bits2, seed=num_experts + m, kind=kind)
    tw, ids = routing(m, num_experts, topk, pattern, seed=m)
    check_moe_dtypes(p13, p2, tw, ids, m, hidden, "lut")
    # every block_m (padding pairs inside a block) and K slices of one chunk
    x = torch.randn(m, hidden, device="cuda")
    ref = ap_fused_moe_reference(x, tw, ids, p13.weights, p2.weights)
    for bm in (1, 2, 4, 8):
        for pf in (0, 128):
            cfgs = (LUTConfig(bm, 256, 128, pf), LUTConfig(bm, 512, 256, pf))
            out = ap_fused_moe_lut(x, tw, ids, p13.weights, p2.weights, configs=cfgs)
            assert rel_err(out, ref) < 5e-3, (bm, pf)


@needs_cuda
@pytest.mark.parametrize("m", [1, 3])
def test_moe_skips_non_local_experts(m):
    """Expert id -1 (SGLang's mark for experts of another rank under expert parallelism) contributes nothing,
    in the one-pair-per-block layout (block_m 1, no alignment) and in the aligned one."""
    num_experts, hidden, inter, topk = 8, 256, 256, 2
    p13, p2 = _layer(num_experts, hidden, inter, [4] * num_experts, [5] * num_experts, seed=m)
    tw, ids = routing(m, num_experts, topk, "random", seed=m)
    ids[0, 1] = -1
    x = torch.randn(m, hidden, device="cuda")
    # the reference sees the same routing with the -1 pair's weight zeroed (and a valid id in its place)
    ref = ap_fused_moe_reference(x, torch.where(ids < 0, 0.0, tw), ids.clamp(min=0), p13.weights, p2.weights)
    for bm in (1, 2):
        cfgs = (LUTConfig(bm, 256, 128), LUTConfig(bm, 256, 128))
        out = ap_fused_moe_lut(x, tw, ids, p13.weights, p2.weights, configs=cfgs)
        assert rel_err(out, ref) < 5e-3, bm


@needs_cuda
def test_moe_graph_replay_follows_rewritten_page_table():
    num_experts = 8
    p13, p2 = _layer(num_experts, 256, 256, [8] * num_experts, [8] * num_experts)
    check_graph_replay(p13, p2, m=2, topk=2, kernel="lut",
                       bit_mixes=([8] * num_experts, [3] * num_experts, [2, 5, 8, 3, 4, 6, 7, 2]))
