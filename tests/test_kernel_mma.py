"""The CUDA tensor-core kernel (cuda_mma.py) for ubcq planes at small batches.

CPU (CI): every variant of the source compiles with NVRTC for sm_90; the fragment order of the bit
transposition (an exact emulation of what each lane feeds mma.sync, every bitwidth); the config rules and
the refusals. CUDA: against the torch reference on random and adversarial shapes (N not a multiple of the
block, K with partial steps and slices, every bitwidth mixed in one launch, padding pairs, one expert
taking every token, empty experts, three activation dtypes, activations beyond fp16's range), the
non-local expert id -1, and page-table rows rewritten between CUDA-graph replays.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pagedweight.kernels import ap_fused_moe, ap_linear
from pagedweight.kernels.api import auto_moe_kernel, moe_kernel_rules
from pagedweight.kernels.config import prefer_lut, prefer_mma
from pagedweight.kernels.cuda_mma import (
    CHUNK,
    STEP,
    MMAConfig,
    ap_fused_moe_mma,
    ap_linear_mma,
    compile_to_cubin,
    default_mma_config,
    kernel_defines,
    mma_unsupported,
    n_tiles_for,
    prep_defines,
)
from pagedweight.kernels.reference import ap_fused_moe_reference, ap_linear_reference
from pagedweight.kernels.testing import random_ap_projection
from tests.support.cuda_kernel_cases import (MOE_REFERENCE_CASES, assert_cubins, check_graph_replay,
                                             check_moe_dtypes, compile_in_parallel, mixed_bits, rel_err, routing,
                                             sass_of, tol)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="the MMA kernel is CUDA only")


# ---------------------------------------------------------------- CPU: build, fragment order, configs


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_every_variant_compiles_for_sm90(mode):
    jobs = []
    for n_tiles in (1, 2, 4):
        for direct in ([False, True] if n_tiles == 1 and mode != 2 else [False]):
            for bits_max, group in ((8, 128), (4, 32)):
                jobs.append(functools.partial(compile_to_cubin, kernel_defines(mode, n_tiles, bits_max, group, direct), "90"))
    # K ending half way through a chunk (8-byte plane loads, the last chunk's second half skipped)
    jobs.append(functools.partial(compile_to_cubin, kernel_defines(mode, 1, 8, 64, mode != 2, k=704), "90"))
    jobs.append(functools.partial(compile_to_cubin, kernel_defines(mode, 2, 4, 32, k=192), "90"))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        jobs.append(functools.partial(compile_to_cubin, prep_defines(mode, dtype), "90", name="ap_mma_prep"))
    assert_cubins(compile_in_parallel(jobs))


def test_half_chunk_k_builds_the_eight_byte_loads():
    """K = 704 (Qwen1.5-MoE's intermediate over two ranks): the plane rows are 88 bytes, so the kernel must not
    issue 16-byte plane loads; a K that is a multiple of 128 keeps them."""
    half = sass_of(compile_to_cubin(kernel_defines(1, 1, 4, 64, k=704), "90"))
    whole = sass_of(compile_to_cubin(kernel_defines(1, 1, 4, 64, k=1408), "90"))
    assert "LDG.E.LTC128B.64" in half and "LDG.E.LTC128B.128" not in half
    assert "LDG.E.LTC128B.128" in whole
    assert "-DKH=1" in kernel_defines(1, 1, 4, 64, k=704) and "-DKH=0" in kernel_defines(1, 1, 4, 64, k=1408)


def test_direct_layout_is_refused_where_it_does_not_apply():
    with pytest.raises(RuntimeError, match="DIRECT needs NT 1"):
        compile_to_cubin(kernel_defines(0, 2, 8, 128, direct=True), "90")
    with pytest.raises(ValueError, match="direct"):
        MMAConfig(n_tiles=2, k_per_split=512, direct=True)


def _transpose_codes(words: list[int], q: int, j: int) -> int:
    """cuda_mma_gemv.cu transpose_codes<Q>(w, j), in Python."""
    ones = 0x11111111 if q <= 4 else 0x01010101
    v = 0
    for p in range(q):
        sh = q - 1 - p
        moved = words[p] >> (j - sh) if j >= sh else (words[p] << (sh - j)) & 0xFFFFFFFF
        v |= moved & ((ones << sh) & 0xFFFFFFFF)
    return v


@pytest.mark.parametrize("q", range(1, 9))
def test_fragment_order_matches_the_activation_permutation(q):
    """What every lane hands mma.sync for one 32-input word, emulated exactly: the A slots (transposed codes
    through the half2 masks) and the B slots (ap_mma_prep's permutation) multiply to the plain dot product."""
    g = torch.Generator().manual_seed(q)
    codes = torch.randint(0, 2**q, (16, 32), generator=g)
    words = [[int(sum(((int(codes[r, k]) >> (q - 1 - p)) & 1) << k for k in range(32))) for p in range(q)]
             for r in range(16)]
    x = torch.randn(32, generator=g, dtype=torch.float64)
    perm = [(pos >> 3) + 8 * ((pos >> 2) & 1) + 4 * ((pos >> 1) & 1) + 16 * (pos & 1) for pos in range(32)]
    assert sorted(perm) == list(range(32))
    xp = x[perm]
    mask = 0x000F000F if q <= 4 else 0x00FF00FF
    y = torch.zeros(16, dtype=torch.float64)
    for j in range(4):
        for m in range(2):
            a = torch.zeros(16, 16, dtype=torch.float64)
            for row in range(16):
                if q <= 4:
                    v = _transpose_codes(words[row], q, j)
                    lo, hi = (v >> (8 * m)) & mask, (v >> (8 * m + 4)) & mask
                else:
                    lo = (_transpose_codes(words[row], q, j) >> (8 * m)) & mask
                    hi = (_transpose_codes(words[row], q, j + 4) >> (8 * m)) & mask
                for t in range(1):  # slots 2t..2t+1 (lo) and 2t+8..2t+9 (hi); every lane t sees its own word
                    a[row, 2 * t], a[row, 2 * t + 1] = lo & 0xFFFF, lo >> 16
                    a[row, 2 * t + 8], a[row, 2 * t + 9] = hi & 0xFFFF, hi >> 16
            b = torch.zeros(16, dtype=torch.float64)
            base = 8 * j + 4 * m
            b[0], b[1], b[8], b[9] = xp[base], xp[base + 1], xp[base + 2], xp[base + 3]
            y += a @ b
    torch.testing.assert_close(y, codes.double() @ x)


def test_configs_and_dispatch_rules():
    for k in (128, 1408, 2048, 4096, 14336):
        cfg = default_mma_config(2, 1, 4096, k, num_sms=132, direct=True)
        assert cfg.k_per_split % CHUNK == 0 and cfg.k_per_split <= -(-k // STEP) * STEP
    small = default_mma_config(2, 1, 4096, 14336, num_sms=132)
    large = default_mma_config(512, 1, 28672, 4096, num_sms=132)
    assert small.k_per_split < large.k_per_split
    assert [n_tiles_for(p) for p in (1, 8, 9, 16, 17, 40)] == [1, 1, 2, 2, 4, 4]
    with pytest.raises(ValueError, match="n_tiles"):
        MMAConfig(n_tiles=3, k_per_split=512)
    with pytest.raises(ValueError, match="k_per_split"):
        MMAConfig(n_tiles=1, k_per_split=100)
    with pytest.raises(ValueError, match="l2_prefetch"):
        MMAConfig(n_tiles=1, k_per_split=512, l2_prefetch=64)
    assert MMAConfig(n_tiles=1, k_per_split=512).l2_prefetch == 128  # whole lines by default
    hinted = sass_of(compile_to_cubin(kernel_defines(0, 1, 4, 128, l2_prefetch=128), "90"))
    plain = sass_of(compile_to_cubin(kernel_defines(0, 1, 4, 128, l2_prefetch=0), "90"))
    assert "LDG.E.LTC128B.128" in hinted and "LTC128B" not in plain
    # the MMA kernel takes the sizes between one pair per expert and the tiles (measured, config.py); where
    # both CUDA kernels qualify, ap_fused_moe asks the MMA kernel first
    assert not prefer_mma(1, 2, 8) and not prefer_mma(1, 4, 60) and not prefer_mma(4, 4, 60)
    assert prefer_mma(4, 2, 8) and prefer_mma(16, 2, 8) and prefer_mma(16, 4, 60) and prefer_mma(64, 4, 60)
    assert not prefer_mma(64, 2, 8) and not prefer_mma(256, 4, 60) and not prefer_mma(2048, 2, 8)
    assert prefer_lut(1, 2, 8) and prefer_lut(4, 4, 60)
    # where the fold kernel's rule wins but fold cannot run (groups under 128, K half a chunk), the MMA kernel is next
    rules = dict(moe_kernel_rules(1, 4, 60, 704))
    assert rules["fold"] and rules["mma"]
    assert dict(moe_kernel_rules(4, 4, 60, 704))["mma"] and not prefer_mma(4, 4, 60)
    assert not dict(moe_kernel_rules(2048, 4, 60, 704))["mma"]
    # the grouped kernel takes intermediate sizes that are odd multiples of 64 (-DTAIL64: Qwen1.5-MoE's TP-2 shard)
    assert dict(moe_kernel_rules(2048, 4, 60, 704))["grouped"] and dict(moe_kernel_rules(2048, 4, 60, 1408))["grouped"]
    # auto_moe_kernel (what ap_fused_moe runs, and the benchmarks' label) asks the same rules: no CUDA kernel for
    # weights off the GPU, and only the one asked for with kernel=
    ub = random_ap_projection(2, 64, 256, [4] * 2, table_kind="ubcq", bits_min=4).weights
    assert auto_moe_kernel(1, 2, ub, ub) is None
    with pytest.raises(ValueError, match="kernel='mma' cannot run: it is a CUDA kernel"):
        auto_moe_kernel(1, 2, ub, ub, kernel="mma", on_cuda=False)


def test_refusals_name_the_reason():
    bcq = random_ap_projection(1, 64, 256, [4], table_kind="bcq", bits_min=4).weights
    km = random_ap_projection(1, 64, 256, [4], table_kind="kmeans", bits_min=4).weights
    ub = random_ap_projection(1, 64, 256, [4], table_kind="ubcq", bits_min=4).weights
    assert "ubcq" in mma_unsupported(bcq) and "kmeans" in mma_unsupported(km)
    assert "CUDA" in mma_unsupported(ub)
    odd = random_ap_projection(1, 64, 224, [4], table_kind="ubcq", group_size=32, bits_min=4).weights
    assert "K=224 is not a multiple of 64" in mma_unsupported(odd)
    x = torch.randn(16, 256)
    with pytest.raises(ValueError, match="not on a CUDA device"):
        ap_linear(x, ub, kernel="mma")
    torch.testing.assert_close(ap_linear(x, ub), ap_linear_reference(x, ub), rtol=0, atol=0)


# ---------------------------------------------------------------- CUDA: correctness


@needs_cuda
@pytest.mark.parametrize("n,k,group", [(256, 128, 128), (300, 640, 32), (1000, 1408, 128), (2048, 2048, 256),
                                       (300, 704, 64), (130, 192, 32)])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_linear_matches_reference(n, k, group, bits):
    proj = random_ap_projection(1, n, k, [bits], table_kind="ubcq", group_size=group, bits_min=1, seed=bits,
                                device="cuda")
    for m in (1, 5, 8, 9, 33):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(dtype)
            bias = torch.randn(n, device="cuda").to(dtype) if m == 5 else None
            out = ap_linear(x, proj.weights, bias=bias, kernel="mma")
            ref = ap_linear_reference(x.float(), proj.weights, bias=None if bias is None else bias.float())
            assert out.dtype == dtype and out.shape == (m, n)
            assert rel_err(out, ref) < tol(dtype), (m, dtype)


@needs_cuda
def test_linear_explicit_configs_and_huge_activations():
    """K cut into one-chunk slices (many atomics), more n-tiles than rows (padding columns), and rows whose
    activations exceed fp16's range (scaled by a power of two per row, undone on the output)."""
    proj = random_ap_projection(1, 520, 640, [5], table_kind="ubcq", bits_min=2, device="cuda")
    x = torch.randn(3, 640, device="cuda")
    ref = ap_linear_reference(x, proj.weights)
    for cfg in (MMAConfig(1, 128), MMAConfig(4, 384), MMAConfig(2, 640), MMAConfig(2, 256, l2_prefetch=0)):
        assert rel_err(ap_linear_mma(x, proj.weights, 0, None, cfg), ref) < 5e-3, cfg
    big = torch.randn(3, 640, device="cuda") * torch.tensor([[1.0], [1e6], [3e4]], device="cuda")
    out = ap_linear_mma(big, proj.weights, 0, None)
    assert rel_err(out, ap_linear_reference(big, proj.weights)) < 5e-3


def _layer(num_experts, hidden, inter, bits13, bits2, seed=0, group=128):
    p13 = random_ap_projection(num_experts, 2 * inter, hidden, bits13, table_kind="ubcq", group_size=group,
                               bits_min=1, seed=seed, device="cuda")
    p2 = random_ap_projection(num_experts, hidden, inter, bits2, table_kind="ubcq", group_size=group, bits_min=1,
                              seed=seed + 1, device="cuda")
    return p13, p2


@needs_cuda
@pytest.mark.parametrize("num_experts,topk,m,pattern", MOE_REFERENCE_CASES)
def test_moe_matches_reference(num_experts, topk, m, pattern):
    hidden, inter = 512, 384  # w2: K = 384, three chunks: a partial 512-input step
    bits13, bits2 = mixed_bits(num_experts)
    p13, p2 = _layer(num_experts, hidden, inter, bits13, bits2, seed=num_experts + m)
    tw, ids = routing(m, num_experts, topk, pattern, seed=m)
    check_moe_dtypes(p13, p2, tw, ids, m, hidden, "mma")
    # every block layout (padding pairs inside a block) and K slices of one chunk
    x = torch.randn(m, hidden, device="cuda")
    ref = ap_fused_moe_reference(x, tw, ids, p13.weights, p2.weights)
    layouts = [(MMAConfig(nt, 128), MMAConfig(nt, 256)) for nt in (1, 2, 4)]
    layouts.append((MMAConfig(1, 512, direct=True), MMAConfig(1, 128, direct=True)))
    layouts.append((MMAConfig(2, 256, l2_prefetch=0), MMAConfig(2, 128, l2_prefetch=256)))
    for cfgs in layouts:
        out = ap_fused_moe_mma(x, tw, ids, p13.weights, p2.weights, configs=cfgs)
        assert rel_err(out, ref) < 5e-3, cfgs


@needs_cuda
@pytest.mark.parametrize("group", [32, 64, 256])
def test_moe_group_sizes(group):
    p13, p2 = _layer(8, 512, 512, [4, 3, 5, 2, 8, 6, 7, 1], [2, 4, 6, 8, 1, 3, 5, 7], group=group)
    tw, ids = routing(12, 8, 2, "random", seed=group)
    x = torch.randn(12, 512, device="cuda")
    ref = ap_fused_moe_reference(x, tw, ids, p13.weights, p2.weights)
    assert rel_err(ap_fused_moe(x, tw, ids, p13.weights, p2.weights, kernel="mma"), ref) < 5e-3


@needs_cuda
@pytest.mark.parametrize("m,pattern", [(1, "random"), (4, "random"), (16, "random"), (9, "one_expert")])
def test_moe_tp2_shard_of_qwen15moe(m, pattern):
    """Qwen1.5-MoE's expert shard at --tp 2: intermediate 704 per rank (5.5 chunks, 88-byte plane rows), groups
    of 64, mixed bits; the default dispatch (fold cannot take the groups: the MMA kernel), K slices that end in
    the half chunk, and one slice holding it all."""
    p13, p2 = _layer(60, 512, 704, *mixed_bits(60), seed=m, group=64)
    tw, ids = routing(m, 60, 4, pattern, seed=m)
    check_moe_dtypes(p13, p2, tw, ids, m, 512, "mma")
    assert auto_moe_kernel(m, 4, p13.weights, p2.weights) == "mma"  # what ap_fused_moe below runs
    x = torch.randn(m, 512, device="cuda")
    ref = ap_fused_moe_reference(x, tw, ids, p13.weights, p2.weights)
    assert rel_err(ap_fused_moe(x, tw, ids, p13.weights, p2.weights), ref) < 5e-3
    direct = m == 1
    for cfgs in ((MMAConfig(1, 512, direct=direct), MMAConfig(1, 512, direct=direct)),
                 (MMAConfig(1, 512, direct=direct), MMAConfig(1, 1024, direct=direct))):
        assert rel_err(ap_fused_moe_mma(x, tw, ids, p13.weights, p2.weights, configs=cfgs), ref) < 5e-3, cfgs


@needs_cuda
@pytest.mark.parametrize("m", [1, 3])
def test_moe_skips_non_local_experts(m):
    num_experts, hidden, inter, topk = 8, 256, 256, 2
    p13, p2 = _layer(num_experts, hidden, inter, [4] * num_experts, [5] * num_experts, seed=m)
    tw, ids = routing(m, num_experts, topk, "random", seed=m)
    ids[0, 1] = -1
    x = torch.randn(m, hidden, device="cuda")
    ref = ap_fused_moe_reference(x, torch.where(ids < 0, 0.0, tw), ids.clamp(min=0), p13.weights, p2.weights)
    for cfgs in ((MMAConfig(1, 128, direct=True),) * 2, (MMAConfig(1, 128),) * 2):
        out = ap_fused_moe_mma(x, tw, ids, p13.weights, p2.weights, configs=cfgs)
        assert rel_err(out, ref) < 5e-3, cfgs


@needs_cuda
def test_moe_graph_replay_follows_rewritten_page_table():
    num_experts = 8
    p13, p2 = _layer(num_experts, 256, 256, [8] * num_experts, [8] * num_experts)
    check_graph_replay(p13, p2, m=12, topk=2, kernel="mma",
                       bit_mixes=([8] * num_experts, [3] * num_experts, [2, 5, 8, 3, 4, 6, 7, 1]))
