"""The CUDA fold kernel (cuda_fold.py): ubcq planes on tensor cores with scale and offset applied per group.

CPU (CI): every variant compiles with NVRTC for sm_90; an exact emulation of what each lane hands mma.sync
(bit transposition, code pairs, the activation order of the prep kernel) and of the fold algebra (the
BIAS * S term and the group's scale and offset) for every bitwidth; the config rules and the refusals.
CUDA: against the torch reference on random and adversarial shapes (N not a multiple of the block, K with a
partial ring stage, group 256, every bitwidth mixed in one launch, padding slots, one expert taking every
token, empty experts, three activation dtypes, router weight on the input, expert id -1, every block layout
and K split) and page-table rows rewritten between CUDA-graph replays.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pagedweight.kernels import ap_fused_moe, ap_linear
from pagedweight.kernels.config import prefer_fold
from pagedweight.kernels import cuda_fold
from pagedweight.kernels.cuda_fold import (
    CHUNK,
    DEFAULT_RING_KB,
    FoldConfig,
    ap_fused_moe_fold,
    ap_linear_fold,
    compile_to_cubin,
    default_fold_configs,
    fold_moe_unsupported,
    fold_unsupported,
    gemv_defines,
    prep_defines,
)
from pagedweight.kernels.reference import ap_fused_moe_reference, ap_linear_reference
from pagedweight.kernels.testing import random_ap_projection
from pagedweight.kernels.weights import PT_TABLE
from tests.support.cuda_kernel_cases import (MOE_REFERENCE_CASES, assert_cubins, check_graph_replay,
                                             check_moe_dtypes, compile_in_parallel, mixed_bits, rel_err, routing,
                                             sass_of, tol)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="the fold kernel is CUDA only")


# ---------------------------------------------------------------- CPU: build, fragment order, algebra, configs


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_every_variant_compiles_for_sm90(mode):
    jobs = []
    # Each config compiles at one of the two (bits_max, group, compute) points, alternating, so both points meet
    # every feature across the list without compiling the whole cross product (CI time).
    for i, cfg in enumerate((
                FoldConfig(1), FoldConfig(2), FoldConfig(1), FoldConfig(2), FoldConfig(1, wk=2), FoldConfig(2, wk=4),
                FoldConfig(1, wk=2, row_tiles=2, min_blocks=3), FoldConfig(2, row_tiles=4, ring_kb=16, min_blocks=2),
                FoldConfig(1, wk=2, pdl=True), FoldConfig(2, row_tiles=2, pdl=True),
                FoldConfig(1, shared_act=True, pdl=True), FoldConfig(2, wk=2, shared_act=True),
                FoldConfig(1, wk=2, shared_act=True, ring_kb=32, stage_chunks=8),
                FoldConfig(2, row_tiles=2, ring_kb=16, shared_act=True, pdl=True, min_blocks=3),
                FoldConfig(1, shared_act=True, sa_stages=3, ring_kb=12, split_chains=True), FoldConfig(2, split_chains=True),
                FoldConfig(1, shared_act=True, warps=8, min_blocks=2, pdl=True),
                FoldConfig(2, shared_act=True, warps=16, min_blocks=1), FoldConfig(2, wk=2, warps=8, min_blocks=2),
                FoldConfig(1, shared_act=True, sums_in_ring=True, pdl=True),
                FoldConfig(1, wk=2, shared_act=True, sums_in_ring=True, stage_chunks=8, ring_kb=32),
                FoldConfig(2, shared_act=True, sums_in_ring=True, warps=16, min_blocks=1),
                FoldConfig(1, wk=2, sums_ahead=True), FoldConfig(2, sums_ahead=True, pdl=True),
                FoldConfig(1, shared_act=True, stage_chunks=2, sa_stages=4, pdl=True),
                FoldConfig(2, shared_act=True, stage_chunks=2, sa_stages=4, sums_in_ring=True, row_tiles=2,
                           ring_kb=16, min_blocks=3), FoldConfig(1, wk=2, stage_chunks=2))):
        bits_max, group, compute = ((8, 128, 0), (4, 256, 1))[(i + mode) % 2]
        jobs.append(functools.partial(compile_to_cubin, gemv_defines(mode, cfg, bits_max, group, compute, out=compute),
                                      "90"))
    # fp16 at an 8-plane parent: the byte-code bodies (5-7 bits) under fp16's MAGIC, at one and two n-tiles
    for cfg in (FoldConfig(1), FoldConfig(2, split_chains=True)):
        jobs.append(functools.partial(compile_to_cubin, gemv_defines(mode, cfg, 8, 128, 1, out=1), "90"))
    if mode != 2:
        for cfg in (FoldConfig(1, direct=True), FoldConfig(1, direct=True, wk=4),
                    FoldConfig(1, direct=True, sums_ahead=True, pdl=True)):
            jobs.append(functools.partial(compile_to_cubin, gemv_defines(mode, cfg, 8, 128, 0, 2), "90"))
    if mode == 0:  # the prep kernel does not depend on the mode
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for cfg in (FoldConfig(1), FoldConfig(2), FoldConfig(1, direct=True), FoldConfig(1, pdl=True)):
                jobs.append(functools.partial(compile_to_cubin, prep_defines(cfg, 128, 0, dtype), "90",
                                              name="ap_fold_prep"))
    assert_cubins(compile_in_parallel(jobs))


def test_plane_copies_carry_the_l2_prefetch_hint():
    """The default config's cp.async plane copies ask L2 for whole 128-byte lines (LDGSTS .LTC128B); 0 asks for
    nothing; other sizes are refused."""
    defaults = sass_of(compile_to_cubin(gemv_defines(0, FoldConfig(1, wk=2), 4, 128, 0), "90"))
    plain = sass_of(compile_to_cubin(gemv_defines(0, FoldConfig(1, wk=2, l2_prefetch=0), 4, 128, 0), "90"))
    copies = [line for line in defaults.splitlines() if "LDGSTS" in line]
    assert copies and all("LTC128B" in line for line in copies)
    assert "LDGSTS" in plain and "LTC128B" not in plain and "LTC256B" not in plain
    with pytest.raises(ValueError, match="l2_prefetch"):
        FoldConfig(l2_prefetch=64)


def test_programmatic_launch_reaches_the_sass():
    """pdl: the kernels wait for the one before (ACQBULK) and let the next one launch (PREEXIT); a build without it has
    neither."""
    default = sass_of(compile_to_cubin(gemv_defines(1, FoldConfig(1, pdl=False), 4, 128, 0), "90"))
    pdl = sass_of(compile_to_cubin(gemv_defines(1, FoldConfig(1, pdl=True), 4, 128, 0), "90"))
    prep = sass_of(compile_to_cubin(prep_defines(FoldConfig(1, pdl=True), 128, 0, torch.bfloat16), "90",
                                    name="ap_fold_prep"))
    assert "ACQBULK" not in default and "PREEXIT" not in default
    assert "ACQBULK" in pdl and "PREEXIT" in pdl and "ACQBULK" in prep and "PREEXIT" in prep


def test_shared_activations_size_their_ring_and_are_refused_where_they_do_not_apply():
    """shared_act adds a two-stage activation ring per K range (wk of them) to the plane rings, needs two plane stages
    in each warp's ring, and is refused for one pair per block and beyond a block's shared memory."""
    base = FoldConfig(1, wk=2)
    assert FoldConfig(1, wk=2, shared_act=True).shared_bytes == base.shared_bytes + 2 * 2 * 4 * 2048
    assert FoldConfig(2, shared_act=True, stage_chunks=8, ring_kb=16).shared_bytes == 4 * 16384 + 2 * 8 * 2 * 2048
    assert FoldConfig(1, shared_act=True).min_ring_bytes(8) == 2 * FoldConfig(1).min_ring_bytes(8) == 8 * 1024
    assert "-DSA=1" in gemv_defines(1, FoldConfig(shared_act=True), 8, 128, 0)
    three = FoldConfig(1, shared_act=True, sa_stages=3, ring_kb=12)
    assert three.shared_bytes == 4 * 12 * 1024 + 3 * 4 * 2048 and three.min_ring_bytes(8) == 8 * 1024
    assert "-DSAS=3" in gemv_defines(1, three, 8, 128, 0)
    # narrow stages: four activation stages of two chunks take the shared memory two of four took
    four = FoldConfig(1, shared_act=True, sa_stages=4, stage_chunks=2)
    assert four.shared_bytes == FoldConfig(1, shared_act=True).shared_bytes and "-DSC=2" in gemv_defines(1, four, 8, 128, 0)
    with pytest.raises(ValueError, match="sa_stages must be one of"):
        FoldConfig(1, shared_act=True, sa_stages=5)
    with pytest.raises(ValueError, match="stage_chunks must be one of"):
        FoldConfig(1, stage_chunks=16)
    # the plane ring must hold two stages of the parent's planes (more stages run where it holds more)
    with pytest.raises(ValueError, match=r"ring_kb >= 32 \(2 stage\(s\) of 8 planes\)"):
        FoldConfig(1, shared_act=True, stage_chunks=8, ring_kb=16).check_ring(8)
    FoldConfig(1, shared_act=True, sa_stages=3).check_ring(8)
    with pytest.raises(ValueError, match="shared_act needs blocks of 8 n_tiles slots"):
        FoldConfig(1, direct=True, shared_act=True)
    with pytest.raises(ValueError, match="more than the .* a block may have"):
        FoldConfig(2, wk=4, ring_kb=40, stage_chunks=8, shared_act=True)
    with pytest.raises(RuntimeError, match="SA needs blocks of 8 NT slots"):
        compile_to_cubin(gemv_defines(0, FoldConfig(1, direct=True), 8, 128, 0) + ["-DSA=1"], "90")


def test_group_sums_in_the_ring_or_a_stage_ahead_size_and_refuse():
    """sums_in_ring adds one float per slot and chunk to each activation ring stage (and rides only that ring);
    sums_ahead is the path without the ring; the kernel refuses either where it does not apply."""
    ring = FoldConfig(2, wk=2, shared_act=True)
    assert dataclasses.replace(ring, sums_in_ring=True).shared_bytes == ring.shared_bytes + 2 * 2 * 4 * 16 * 4
    assert FoldConfig(1, sums_ahead=True).shared_bytes == FoldConfig(1).shared_bytes
    assert "-DSUMR=1" in gemv_defines(1, dataclasses.replace(ring, sums_in_ring=True), 4, 128, 0)
    assert "-DSAH=1" in gemv_defines(0, FoldConfig(1, direct=True, sums_ahead=True), 4, 128, 0)
    with pytest.raises(ValueError, match="sums_in_ring needs shared_act"):
        FoldConfig(1, sums_in_ring=True)
    with pytest.raises(ValueError, match="sums_ahead is for the path without shared_act"):
        FoldConfig(1, shared_act=True, sums_ahead=True)
    with pytest.raises(RuntimeError, match="SUMR needs SA"):
        compile_to_cubin(gemv_defines(1, FoldConfig(1), 4, 128, 0) + ["-DSUMR=1"], "90")
    with pytest.raises(RuntimeError, match="SAH is for the path without SA"):
        compile_to_cubin(gemv_defines(1, FoldConfig(1, shared_act=True), 4, 128, 0) + ["-DSAH=1"], "90")


def test_warps_per_block_size_the_block_rings_and_registers():
    """warps=8 / 16: each warp keeps its ring, the block covers 2 / 4 times the rows, one activation ring per K range
    serves them all; min_blocks counts blocks of that size and may not ask for more warps than an SM holds."""
    four, eight = FoldConfig(2, shared_act=True), FoldConfig(2, shared_act=True, warps=8, min_blocks=2)
    assert eight.rows_per_block == 2 * four.rows_per_block == 128
    assert eight.shared_bytes - four.shared_bytes == 4 * DEFAULT_RING_KB * 1024  # four more plane rings, one act ring
    assert FoldConfig(1, warps=16, min_blocks=1, wk=2).rows_per_block == 128
    assert "-DNW=16" in gemv_defines(0, FoldConfig(1, warps=16, min_blocks=1), 4, 128, 0)
    with pytest.raises(ValueError, match="warps must be one of"):
        FoldConfig(warps=6)
    with pytest.raises(ValueError, match="exceed the 64 warps an SM holds"):
        FoldConfig(warps=16, min_blocks=5)
    with pytest.raises(RuntimeError, match="NW must be 4, 8 or 16"):
        compile_to_cubin(gemv_defines(1, FoldConfig(1), 4, 128, 0) + ["-DNW=2"], "90")


def test_direct_layout_is_refused_where_it_does_not_apply():
    with pytest.raises(RuntimeError, match="DIRECT needs NT 1"):
        compile_to_cubin(gemv_defines(2, FoldConfig(1), 8, 128, 0) + ["-DDIRECT=1"], "90")
    with pytest.raises(ValueError, match="direct"):
        FoldConfig(n_tiles=2, direct=True)
    with pytest.raises(ValueError, match="wk"):
        FoldConfig(wk=3)
    with pytest.raises(ValueError, match="k_per_split"):
        FoldConfig(k_per_split=100)
    with pytest.raises(ValueError, match="row_tiles"):
        FoldConfig(row_tiles=3)


def test_row_tiles_scale_the_block_and_its_ring():
    """A warp of r row tiles covers 16 r rows; one ring stage holds r tiles of bits_max planes, which the launcher
    checks against ring_kb before compiling."""
    assert FoldConfig(1, wk=2, row_tiles=2).rows_per_block == 2 * FoldConfig(1, wk=2).rows_per_block == 64
    assert FoldConfig(1, row_tiles=4).rows_per_block == 256
    assert FoldConfig(1).min_ring_bytes(8) == 4 * 1024  # 8 planes x 16 rows x 2 chunks x 16 bytes
    assert FoldConfig(1, row_tiles=4).min_ring_bytes(8) == 16 * 1024  # > the default 8 KB ring
    assert FoldConfig(1, stage_chunks=8).min_ring_bytes(4) == 8 * 1024  # 4 planes x 16 rows x 8 chunks x 16 bytes
    # the kernel's own bound agrees: one stage of 4 tiles of 8 planes does not fit an 8 KB ring
    with pytest.raises(RuntimeError, match="RING must hold one stage"):
        compile_to_cubin(gemv_defines(1, FoldConfig(1, row_tiles=4), 8, 128, 0), "90")


_M32 = 0xFFFFFFFF


def _sel(a: int, b: int, m: int) -> int:  # lop3 0xE4: (a & m) | (b & ~m)
    return ((a & m) | (b & ~m)) & _M32


def _codes_of(planes: list[int], np_: int, top: int = 3, bit0_first: bool = False) -> list[int]:
    """cuda_common.cuh codes_of<NP, TOP, BIT0_FIRST>: the planes reversed (plane p -> bit top - p) through the two
    delta-swap stages (rows r, r + 2 by 2 bits; rows r, r + 1 by 1 bit), in either order."""
    w = [planes[top - r] if r <= top and top - r < np_ else 0 for r in range(4)]
    for stage in ((1, 2) if bit0_first else (2, 1)):
        if stage == 2:
            for r in range(2):
                a, b = w[r], w[r + 2]
                w[r], w[r + 2] = _sel(a, (b << 2) & _M32, 0x33333333), _sel(b, a >> 2, 0xCCCCCCCC)
        else:
            for r in (0, 2):
                a, b = w[r], w[r + 1]
                w[r], w[r + 1] = _sel(a, (b << 1) & _M32, 0x55555555), _sel(b, a >> 1, 0xAAAAAAAA)
    return w


def _byte_code_constants() -> tuple[int, int, int, int, int]:
    """(hi's shift for the even bytes, lo's shift for the odd ones, their lop3 mask, byte_pair's prmt selectors of
    e < 2 and e >= 2) as cuda_common.cuh's byte_codes / byte_pair write them."""
    src = (Path(cuda_fold._SOURCE).parent / "cuda_common.cuh").read_text()
    codes = re.search(r"even = lop3_sel\(hi << (\d+), lo, (0x[0-9A-Fa-f]+)u\);\s*"
                      r"odd = lop3_sel\(hi, lo >> (\d+), (0x[0-9A-Fa-f]+)u\);", src)
    pair = re.search(r"prmt<E < 2 \? (0x[0-9A-Fa-f]+) : (0x[0-9A-Fa-f]+)>\(E & 1 \? odd : even, MAGIC\)", src)
    assert codes and pair, "byte_codes / byte_pair changed form: update this emulation with them"
    assert codes.group(2) == codes.group(4)
    return (int(codes.group(1)), int(codes.group(3)), int(codes.group(2), 16), int(pair.group(1), 16),
            int(pair.group(2), 16))


def _code_widths() -> tuple[int, int, int]:
    """make_coef's bits of the code as the MMA reads it (c << (W - q)) at q <= 4, 5..7 and 8."""
    src = Path(cuda_fold._SOURCE).read_text()
    m = re.search(r"constexpr int W = Q <= 4 \? (\d) : Q <= 7 \? (\d) : (\d);", src)
    assert m, "make_coef changed form: update the emulation with it"
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 (default mode): byte i of the result is byte (sel >> 4 i) & 7 of the 8 bytes {b, a}."""
    both = (b << 32) | a
    return sum(((both >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _byte_pairs(hi: int, lo: int, magic: int) -> list[int]:
    """cuda_common.cuh byte_codes then byte_pair<e> (e = 0..3): the mma operands of nibbles (e, e + 4) as 7-bit byte
    codes under MAGIC."""
    sh_hi, sh_lo, mask, sel_lo, sel_hi = _byte_code_constants()
    even = _sel((hi << sh_hi) & _M32, lo, mask)
    odd = _sel(hi, lo >> sh_lo, mask)
    return [_prmt(odd if e & 1 else even, magic, sel_lo if e < 2 else sel_hi) for e in range(4)]


def _lane_code_pairs(q: int, words: list[int], magic: int) -> list[list[list[int]]]:
    """What one lane hands the mma for one row: per code chain (q <= 7: one; q = 8: hi then lo), per word j, the
    operands of nibbles (e, e + 4), e = 0..3, as warp_rows forms them from the row's q plane words."""
    if 5 <= q <= 7:  # one chain of byte codes c << (7 - q): planes 0-2 (hi, from bit 2) and 3.. (lo, from bit 3)
        hi, lo = _codes_of(words[:3], 3, top=2), _codes_of(words[3:], q - 3, bit0_first=q == 5)
        return [[_byte_pairs(hi[j], lo[j], magic) for j in range(4)]]
    nibble_words = [_codes_of(words[:4], min(q, 4))] + ([_codes_of(words[4:], 4)] if q == 8 else [])
    return [[[((v[j] >> (4 * e)) & 0x000F000F) | magic for e in range(4)] for j in range(4)] for v in nibble_words]


def _half_value(bits: int, compute: int) -> float:
    """A 16-bit pattern as the MMA reads it: bf16 (compute 0) or fp16 (1)."""
    t = torch.tensor([bits - (1 << 16) if bits >= 1 << 15 else bits], dtype=torch.int16)
    return float(t.view(torch.bfloat16 if compute == 0 else torch.float16)[0])


def _act_offset(k: int, s: int, nt_count: int) -> int:
    """cuda_fold_gemv.cu act_offset (16-bit element of input k, slot s, inside one unit)."""
    c, t, kk = k >> 7, (k >> 5) & 3, k & 31
    j, nib = kk & 3, kk >> 2
    e, h = nib & 3, nib >> 2
    nt, lane = s >> 3, ((s & 7) << 2) | t
    return ((c * nt_count + nt) * 4 + j) * 256 + lane * 8 + 2 * e + h


@pytest.mark.parametrize("q", range(1, 9))
def test_lanes_feed_mma_the_folded_dot_product(q):
    """One chunk, 16 rows, 8 slots, emulated lane by lane: the code pairs each lane builds (A), the values the
    prep order puts in its 16-byte loads (B), mma.sync's slot semantics, then the fold epilogue; equal to the
    plain dot product with W = 2 s c + z (float64)."""
    g = torch.Generator().manual_seed(q)
    bias = 128.0
    codes = torch.randint(0, 2**q, (16, CHUNK), generator=g)
    s = torch.rand(16, generator=g, dtype=torch.float64) + 0.5
    o = torch.randn(16, generator=g, dtype=torch.float64)
    x = torch.randn(8, CHUNK, generator=g, dtype=torch.float64)
    # the prep kernel's order: element offsets of every (k, slot) are distinct and fill the unit's chunk
    offs = sorted(_act_offset(k, sl, 1) for k in range(CHUNK) for sl in range(8))
    assert offs == list(range(CHUNK * 8))
    xf = [0.0] * (CHUNK * 8)
    for k in range(CHUNK):
        for sl in range(8):
            xf[_act_offset(k, sl, 1)] = float(x[sl, k])
    chains = 2 if q == 8 else 1  # q = 8: the hi and lo nibble chains (16 acc_hi + acc_lo)
    acc = torch.zeros(chains, 16, 8, dtype=torch.float64)
    for t in range(4):  # lane t of every quad: inputs 32 t .. 32 t + 31 of the chunk
        words = [[sum(((int(codes[r, 32 * t + b]) >> (q - 1 - p)) & 1) << b for b in range(32)) for p in range(q)]
                 for r in range(16)]
        pairs = [_lane_code_pairs(q, words[r], 0x43004300) for r in range(16)]
        for ch in range(chains):
            for j in range(4):
                for e0 in (0, 2):
                    a = torch.zeros(16, 16, dtype=torch.float64)
                    b = torch.zeros(16, 8, dtype=torch.float64)
                    for r in range(16):
                        for slot, e in ((2 * t, e0), (2 * t + 8, e0 + 1)):
                            pair = pairs[r][ch][j][e]
                            a[r, slot], a[r, slot + 1] = _half_value(pair & 0xFFFF, 0), _half_value(pair >> 16, 0)
                    for col in range(8):
                        base = j * 256 + (col * 4 + t) * 8
                        b[2 * t, col], b[2 * t + 1, col] = xf[base + 2 * e0], xf[base + 2 * e0 + 1]
                        b[2 * t + 8, col], b[2 * t + 9, col] = xf[base + 2 * e0 + 2], xf[base + 2 * e0 + 3]
                    acc[ch] += a @ b
    S = x.sum(dim=1)  # group sums per slot
    z = o - s * (2**q - 1)
    width = dict(zip((4, 7, 8), _code_widths()))[4 if q <= 4 else 7 if q <= 7 else 8]
    ca = 2 * s * 2.0 ** (q - width)  # make_coef: A = 2 s 2^(q - W), the code read as c << (W - q)
    if q == 8:
        y = ca[:, None] * (16 * acc[0] + acc[1]) + (z - 17 * bias * ca)[:, None] * S[None, :]
    else:
        y = ca[:, None] * acc[0] + (z - bias * ca)[:, None] * S[None, :]
    w = 2 * s[:, None] * codes.double() + z[:, None]
    torch.testing.assert_close(y, w @ x.t(), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("compute", [0, 1])
@pytest.mark.parametrize("q", [5, 6, 7])
def test_byte_codes_are_exact_for_every_code_at_every_position(q, compute):
    """q = 5..7: every one of the 2^q codes at every input of a lane's 32-input quarter (the hi / lo nibble words of
    codes_of, byte_codes' shifts and mask, byte_pair's selectors as the kernel source writes them) comes out as the
    16-bit pattern MAGIC | (c << (7 - q)) in the slot code_pair puts that input in, which bf16 and fp16 read as
    BIAS + (c << (7 - q)) exactly."""
    magic, bias = (0x43004300, 128.0) if compute == 0 else (0x64006400, 1024.0)
    for r in range(2**q):  # input k holds code (r + k) mod 2^q: every code meets every position once
        codes = [(r + k) % 2**q for k in range(32)]
        words = [sum(((codes[k] >> (q - 1 - p)) & 1) << k for k in range(32)) for p in range(q)]
        (chain,) = _lane_code_pairs(q, words, magic)
        for j in range(4):
            for e in range(4):
                for half in range(2):  # code_pair's slots: nibble e (low half) and e + 4 (high half) of word j
                    k = 4 * (e + 4 * half) + j
                    bits = (chain[j][e] >> (16 * half)) & 0xFFFF
                    c7 = codes[k] << (7 - q)
                    assert bits == (magic & 0xFFFF) | c7, (q, k, codes[k], hex(bits))
                    assert _half_value(bits, compute) == bias + c7


def test_dispatch_rule():
    """One token always; more tokens while the intermediate size gives w2 enough K (measured, config.py)."""
    assert prefer_fold(1, 8, 128, 384) and prefer_fold(1, 2, 8, 14336)
    assert prefer_fold(4, 2, 8, 14336) and prefer_fold(64, 2, 8, 14336) and prefer_fold(64, 4, 60, 1408)
    assert prefer_fold(16, 8, 128, 768) and prefer_fold(64, 8, 128, 768)  # Qwen3-30B-A3B
    assert prefer_fold(4, 8, 128, 384) and prefer_fold(64, 8, 128, 384)  # its TP-2 shard
    assert not prefer_fold(16, 8, 128, 256)  # below FOLD_MIN_INTERMEDIATE: MMA / LUT
    assert not prefer_fold(256, 2, 8, 14336)  # 64 pairs per expert: the tiles / prefill path


def test_configs_and_refusals():
    w13 = random_ap_projection(8, 2 * 1408, 2048, [4] * 8, table_kind="ubcq", bits_min=4).weights
    w2 = random_ap_projection(8, 2048, 1408, [4] * 8, table_kind="ubcq", bits_min=4).weights
    one, one2 = default_fold_configs(1, 4, w13, w2, num_sms=132)
    assert one.direct and one2.direct and one.wk == 2  # the block's warps split K
    assert default_fold_configs(1, 4, w13, w2, num_sms=264)[0].wk == 4  # fewer blocks than the target
    assert one2.k_per_split % w2.group_size == 0 and one2.k_per_split < w2.K
    # blocks of slots keep slices of 14 chunks or more (here: one)
    assert default_fold_configs(4, 4, w13, w2, num_sms=132)[1].k_per_split == w2.K
    big, big2 = default_fold_configs(64, 2, w13, w2, num_sms=132)  # 16 pairs per expert: two n-tiles
    assert not big.direct and big.n_tiles == big2.n_tiles == 2
    # an 8-plane parent keeps one row tile; at <= 4 stored planes and two n-tiles w2's warps hold two row tiles
    # (one activation load feeds both), w13's keep one
    assert big2.row_tiles == big.row_tiles == one2.row_tiles == one.row_tiles == 1
    p4_13 = random_ap_projection(8, 2 * 1408, 2048, [4] * 8, table_kind="ubcq", bits_min=2, bits_max=4).weights
    p4_2 = random_ap_projection(8, 2048, 1408, [4] * 8, table_kind="ubcq", bits_min=2, bits_max=4).weights
    big4, big4_2 = default_fold_configs(64, 2, p4_13, p4_2, num_sms=132)
    assert (big4_2.row_tiles, big4_2.min_blocks, big4.row_tiles) == (2, 3, 1)
    assert big4_2.k_per_split == big2.k_per_split  # the K slices are chosen at one row tile
    assert default_fold_configs(16, 2, p4_13, p4_2, num_sms=132)[1].row_tiles == 1  # one n-tile
    # programmatic dependent launch where the device has it, at one and two n-tiles
    assert not any(c.pdl for c in (one, one2, big, big2))
    for m, topk in ((1, 4), (8, 4), (64, 2)):
        assert all(c.pdl for c in default_fold_configs(m, topk, w13, w2, num_sms=132, pdl=True))
    assert default_fold_configs(64, 2, w13, w2, num_sms=132, pdl=True)[0].n_tiles == 2
    # blocks of slots read their activations through the block-shared ring, w13 on one K range; one pair per block not
    assert all(c.shared_act for c in default_fold_configs(16, 2, w13, w2, num_sms=132) + (big, big2))
    assert default_fold_configs(16, 2, w13, w2, num_sms=132)[0].wk == big.wk == 1
    assert not any(c.shared_act for c in default_fold_configs(1, 4, w13, w2, num_sms=132))
    # the group sums ride the activation ring at two n-tiles only
    assert big.sums_in_ring and big2.sums_in_ring and big4_2.sums_in_ring
    assert not any(c.sums_in_ring or c.sums_ahead for c in default_fold_configs(16, 2, w13, w2, num_sms=132) + (one, one2))
    assert "CUDA" in fold_unsupported(w13)
    bcq = random_ap_projection(1, 64, 256, [4], table_kind="bcq", bits_min=4).weights
    g32 = random_ap_projection(1, 64, 256, [4], table_kind="ubcq", group_size=32, bits_min=4).weights
    assert "ubcq" in fold_unsupported(bcq) and "multiple of 128" in fold_unsupported(g32)
    odd2 = random_ap_projection(1, 2048, 704, [4], table_kind="ubcq", group_size=64, bits_min=4).weights
    assert "group size 64" in fold_unsupported(odd2) and fold_moe_unsupported(w13, odd2) is not None
    # w2 of a long intermediate takes more K slices at one token (towards a full wave), a short one slices of 3 chunks
    mx13 = random_ap_projection(2, 2 * 14336, 256, [4] * 2, table_kind="ubcq", bits_min=4, bits_max=4).weights
    mx2 = random_ap_projection(2, 4096, 14336, [4] * 2, table_kind="ubcq", bits_min=4, bits_max=4).weights
    assert 14336 // default_fold_configs(1, 2, mx13, mx2, num_sms=132)[1].k_per_split == 4  # 4 slices of 28 chunks
    assert one2.k_per_split == 3 * 128  # Qwen1.5-MoE's 11 chunks: 4 slices of 3
    q3_13 = random_ap_projection(8, 2 * 384, 2048, [4] * 8, table_kind="ubcq", bits_min=4).weights
    q3_2 = random_ap_projection(8, 2048, 384, [4] * 8, table_kind="ubcq", bits_min=4).weights
    assert default_fold_configs(1, 8, q3_13, q3_2, num_sms=132)[1].k_per_split == 384  # 3 chunks: one slice
    x = torch.randn(3, 2048)
    with pytest.raises(ValueError, match="not on a CUDA device"):
        ap_linear(x, w13, kernel="fold")


# ---------------------------------------------------------------- CUDA: correctness


@needs_cuda
@pytest.mark.parametrize("n,k,group", [(256, 128, 128), (300, 640, 128), (1000, 1408, 128), (2048, 2048, 256)])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_linear_matches_reference(n, k, group, bits):
    proj = random_ap_projection(1, n, k, [bits], table_kind="ubcq", group_size=group, bits_min=1, seed=bits,
                                device="cuda")
    for m in (1, 5, 8, 9, 33):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(dtype)
            bias = torch.randn(n, device="cuda").to(dtype) if m == 5 else None
            out = ap_linear(x, proj.weights, bias=bias, kernel="fold")
            ref = ap_linear_reference(x.float(), proj.weights, bias=None if bias is None else bias.to(dtype).float())
            assert out.dtype == dtype and out.shape == (m, n)
            assert rel_err(out, ref) < tol(dtype), (m, dtype)


@needs_cuda
def test_linear_explicit_configs_and_large_activations():
    """K cut into one-group slices (many atomics), two n-tiles for three rows (padding slots), and activations
    far beyond fp16's range (bf16 keeps them)."""
    proj = random_ap_projection(1, 520, 1280, [5], table_kind="ubcq", bits_min=2, device="cuda")
    x = torch.randn(3, 1280, device="cuda", dtype=torch.bfloat16)
    ref = ap_linear_reference(x.float(), proj.weights)
    for cfg in (FoldConfig(1, k_per_split=128), FoldConfig(2, k_per_split=384), FoldConfig(2), FoldConfig(1, wk=4),
                FoldConfig(1, row_tiles=2, min_blocks=3), FoldConfig(2, k_per_split=256, row_tiles=4, ring_kb=16)):
        assert rel_err(ap_linear_fold(x, proj.weights, 0, None, cfg), ref) < 2e-2, cfg
    big = (torch.randn(3, 1280, device="cuda") * torch.tensor([[1.0], [1e6], [3e4]], device="cuda")).to(torch.bfloat16)
    out = ap_linear_fold(big, proj.weights, 0, None)
    assert rel_err(out, ap_linear_reference(big.float(), proj.weights)) < 2e-2


@needs_cuda
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_linear_reads_tables_at_any_alignment(bits):
    """A table that starts 2 bytes past a 4-byte boundary, 11 groups per row (rows alternate parity): every
    (scale, offset) value is read where it is, whatever the word alignment."""
    proj = random_ap_projection(1, 200, 1408, [bits], table_kind="ubcq", bits_min=1, seed=bits, device="cuda")
    w = proj.weights
    _, table = w.resident(0)
    buf = torch.empty(table.numel() + 1, dtype=table.dtype, device="cuda")
    shifted = buf[1:].view(table.shape)
    shifted.copy_(table)
    assert shifted.data_ptr() % 4 == 2
    pt = w.page_table.clone()
    pt[0, PT_TABLE] = shifted.data_ptr()
    odd = dataclasses.replace(w, page_table=pt)
    x = torch.randn(9, 1408, device="cuda", dtype=torch.bfloat16)
    ref = ap_linear_reference(x.float(), w)
    for cfg in (FoldConfig(1), FoldConfig(2, k_per_split=384), FoldConfig(1, stage_chunks=8, ring_kb=16)):
        assert rel_err(ap_linear_fold(x, odd, 0, None, cfg), ref) < 2e-2, cfg


def _layer(num_experts, hidden, inter, bits13, bits2, seed=0, group=128):
    p13 = random_ap_projection(num_experts, 2 * inter, hidden, bits13, table_kind="ubcq", group_size=group,
                               bits_min=1, seed=seed, device="cuda")
    p2 = random_ap_projection(num_experts, hidden, inter, bits2, table_kind="ubcq", group_size=group, bits_min=1,
                              seed=seed + 1, device="cuda")
    return p13, p2


def reference_layouts() -> list[tuple[FoldConfig, FoldConfig]]:
    """(w13, w2) config pairs test_moe_matches_reference runs: every block layout, the K split of w13's warps, w2's K
    slices of one group, row tiles, programmatic launches, the shared-activation ring and its options."""
    layouts = [(FoldConfig(nt, wk=wk), FoldConfig(nt, k_per_split=kps)) for nt in (1, 2) for wk, kps in
               ((1, 0), (2, 128), (4, 256))]
    layouts.append((FoldConfig(1, direct=True, wk=4), FoldConfig(1, direct=True, k_per_split=128)))
    layouts.append((FoldConfig(2, stage_chunks=8, ring_kb=16), FoldConfig(2, stage_chunks=8, ring_kb=16)))
    # several row tiles per warp share each chunk's activations (partial last tiles: 384 / 640 rows)
    layouts.append((FoldConfig(1, wk=2, row_tiles=2, min_blocks=3), FoldConfig(1, k_per_split=128, row_tiles=2, min_blocks=3)))
    layouts.append((FoldConfig(2, row_tiles=4, ring_kb=16, min_blocks=2), FoldConfig(2, row_tiles=4, ring_kb=16, min_blocks=2)))
    layouts.append((FoldConfig(1, direct=True, row_tiles=2, min_blocks=3), FoldConfig(1, direct=True, row_tiles=2, min_blocks=3)))
    layouts.append((FoldConfig(2, wk=2), FoldConfig(2, k_per_split=128, row_tiles=2, min_blocks=3)))  # the NT=2 rule
    # launched as programmatic dependents (each kernel copies its first planes before it waits for the one before)
    layouts.append((FoldConfig(1, wk=2, pdl=True), FoldConfig(1, k_per_split=128, pdl=True)))
    layouts.append((FoldConfig(2, pdl=True), FoldConfig(2, row_tiles=2, min_blocks=3, pdl=True)))
    layouts.append((FoldConfig(1, direct=True, pdl=True), FoldConfig(1, direct=True, pdl=True)))
    # the activations through a block-shared ring (K split over 2 / 4 warps: parts of 3 / 2 chunks at K = 640, one of
    # them short; w2 in K slices; rows past the end in the last row block; two n-tiles; row tiles)
    layouts.append((FoldConfig(1, wk=2, shared_act=True), FoldConfig(1, k_per_split=128, shared_act=True)))
    layouts.append((FoldConfig(1, wk=4, shared_act=True, pdl=True), FoldConfig(1, shared_act=True, pdl=True)))
    layouts.append((FoldConfig(2, shared_act=True), FoldConfig(2, k_per_split=256, shared_act=True, pdl=True)))
    layouts.append((FoldConfig(1, shared_act=True, stage_chunks=8, ring_kb=32), FoldConfig(1, shared_act=True, row_tiles=2, ring_kb=16)))
    layouts.append((FoldConfig(2, wk=2, shared_act=True, row_tiles=2, ring_kb=16, min_blocks=3),
                    FoldConfig(2, row_tiles=2, ring_kb=16, min_blocks=3, shared_act=True)))
    # three ring stages; two mma chains per code word (q <= 4; q > 4 ignores it)
    layouts.append((FoldConfig(1, shared_act=True, sa_stages=3, ring_kb=12),
                    FoldConfig(1, k_per_split=128, shared_act=True, sa_stages=3, ring_kb=12, split_chains=True)))
    layouts.append((FoldConfig(2, shared_act=True, split_chains=True), FoldConfig(2, k_per_split=256, split_chains=True)))
    layouts.append((FoldConfig(1, direct=True, split_chains=True), FoldConfig(1, direct=True, split_chains=True)))
    # 8 / 16 warps on one activation ring (a stage of 5-8 planes has fewer copies than a block of 16 warps has lanes;
    # w13 blocks of 64 / 128 outputs past the end of the intermediate size)
    layouts.append((FoldConfig(1, shared_act=True, warps=8, min_blocks=2, pdl=True),
                    FoldConfig(1, k_per_split=256, shared_act=True, warps=16, min_blocks=1)))
    layouts.append((FoldConfig(2, shared_act=True, warps=16, min_blocks=1),
                    FoldConfig(2, shared_act=True, warps=8, min_blocks=2)))
    layouts.append((FoldConfig(2, wk=2, shared_act=True, warps=16, min_blocks=1),
                    FoldConfig(2, wk=2, shared_act=True, warps=8, min_blocks=2, pdl=True)))
    # group sums through the activation ring (K split over warps, w2 slices of one chunk, 8-chunk stages, group 256
    # in test_moe_group_sizes) or loaded a stage ahead (one pair per block, blocks without the ring)
    layouts.append((FoldConfig(1, wk=2, shared_act=True, sums_in_ring=True, pdl=True),
                    FoldConfig(1, k_per_split=128, shared_act=True, sums_in_ring=True)))
    layouts.append((FoldConfig(2, shared_act=True, sums_in_ring=True, stage_chunks=8, ring_kb=32),
                    FoldConfig(2, k_per_split=256, shared_act=True, sums_in_ring=True, row_tiles=2, ring_kb=16,
                               min_blocks=3, pdl=True)))
    layouts.append((FoldConfig(1, direct=True, sums_ahead=True, pdl=True),
                    FoldConfig(1, direct=True, k_per_split=128, sums_ahead=True)))
    layouts.append((FoldConfig(2, wk=2, sums_ahead=True), FoldConfig(2, k_per_split=128, sums_ahead=True)))
    # narrow stages: four (three) ring stages of two chunks at <= 4 planes, two at 5-8 (the activation ring's other
    # slots unused); without the ring, four plane stages of two chunks in each warp's ring
    layouts.append((FoldConfig(1, wk=2, shared_act=True, stage_chunks=2, sa_stages=4, pdl=True),
                    FoldConfig(1, k_per_split=256, shared_act=True, stage_chunks=2, sa_stages=3, sums_in_ring=True)))
    layouts.append((FoldConfig(2, shared_act=True, stage_chunks=2, sa_stages=4, sums_in_ring=True),
                    FoldConfig(2, shared_act=True, stage_chunks=2, sa_stages=4, row_tiles=2, ring_kb=16, min_blocks=3)))
    layouts.append((FoldConfig(1, direct=True, stage_chunks=2, wk=2), FoldConfig(1, direct=True, stage_chunks=2)))
    return layouts


@pytest.fixture(scope="module")
def reference_kernels_built():
    """Every kernel the reference layouts launch (bf16, 8-plane parents, groups of 128) built on all cores first:
    NVRTC releases the GIL, so the GPU test pays a fraction of the ~100 serial builds (the job tuples are
    `_compiled`'s positional arguments as `_gemv` and `_prep` pass them, so its cache serves the launches)."""
    jobs = []
    for c13, c2 in reference_layouts():
        for mode, cfg in ((0, c13), (1, c2)):
            jobs.append((cuda_fold._SOURCE, "ap_fold_gemv", tuple(gemv_defines(mode, cfg, 8, 128, 0, 0)), 0,
                         cfg.shared_bytes))
        jobs.append((cuda_fold._SOURCE, "ap_fold_prep", tuple(prep_defines(c13, 128, 0, torch.bfloat16)), 0))
    def build(job):
        torch.cuda.set_device(0)  # the module load needs the device's context current in this thread
        return cuda_fold._compiled(*job)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(build, set(jobs)))


def test_reference_layouts_share_one_block_layout():
    """The launcher runs w13 and w2 over one alignment, so each pair the GPU reference test runs must agree on it."""
    pairs = reference_layouts()
    assert len(pairs) >= 20
    for c13, c2 in pairs:
        assert (c13.slots, c13.direct) == (c2.slots, c2.direct), (c13, c2)


@needs_cuda
@pytest.mark.parametrize("num_experts,topk,m,pattern", MOE_REFERENCE_CASES)
def test_moe_matches_reference(num_experts, topk, m, pattern, reference_kernels_built):
    hidden, inter = 640, 384  # w13: K = 640 (a partial ring stage); w2: K = 384 (three chunks)
    bits13, bits2 = mixed_bits(num_experts)
    p13, p2 = _layer(num_experts, hidden, inter, bits13, bits2, seed=num_experts + m)
    tw, ids = routing(m, num_experts, topk, pattern, seed=m)
    check_moe_dtypes(p13, p2, tw, ids, m, hidden, "fold")
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights)
    for cfgs in reference_layouts():
        out = ap_fused_moe_fold(x, tw, ids, p13.weights, p2.weights, configs=cfgs)
        assert rel_err(out, ref) < 2e-2, cfgs


@needs_cuda
@pytest.mark.parametrize("group", [128, 256])
def test_moe_group_sizes_and_real_intermediate(group):
    """Qwen1.5-MoE's intermediate size (1408: 11 groups of 128, 5.5 of 256 -> 1408 is refused at 256)."""
    inter = 1408 if group == 128 else 1536
    p13, p2 = _layer(8, 1024, inter, [4, 3, 5, 2, 8, 6, 7, 1], [2, 4, 6, 8, 1, 3, 5, 7], group=group)
    for m in (1, 12):
        tw, ids = routing(m, 8, 2, "random", seed=group + m)
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights)
        assert rel_err(ap_fused_moe(x, tw, ids, p13.weights, p2.weights, kernel="fold"), ref) < 2e-2
        if m > 1:  # two mma chains summed at each group's end (a group of 256: two chunks per chain)
            split = (FoldConfig(1, shared_act=True, split_chains=True), FoldConfig(1, shared_act=True, split_chains=True))
            assert rel_err(ap_fused_moe_fold(x, tw, ids, p13.weights, p2.weights, configs=split), ref) < 2e-2
            # the group sums through the activation ring (a group of 256: only every other chunk's sums are copied)
            sums = (FoldConfig(1, shared_act=True, sums_in_ring=True), FoldConfig(1, shared_act=True, sums_in_ring=True))
            assert rel_err(ap_fused_moe_fold(x, tw, ids, p13.weights, p2.weights, configs=sums), ref) < 2e-2
        else:  # one pair per block, the sums a stage ahead
            ahead = (FoldConfig(1, direct=True, sums_ahead=True), FoldConfig(1, direct=True, sums_ahead=True))
            assert rel_err(ap_fused_moe_fold(x, tw, ids, p13.weights, p2.weights, configs=ahead), ref) < 2e-2


@needs_cuda
@pytest.mark.parametrize("m", [1, 3])
def test_moe_skips_non_local_experts(m):
    num_experts, hidden, inter, topk = 8, 256, 256, 2
    p13, p2 = _layer(num_experts, hidden, inter, [4] * num_experts, [5] * num_experts, seed=m)
    tw, ids = routing(m, num_experts, topk, "random", seed=m)
    ids[0, 1] = -1
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    ref = ap_fused_moe_reference(x.float(), torch.where(ids < 0, 0.0, tw), ids.clamp(min=0), p13.weights, p2.weights)
    for cfgs in ((FoldConfig(1, direct=True),) * 2, (FoldConfig(1),) * 2):
        out = ap_fused_moe_fold(x, tw, ids, p13.weights, p2.weights, configs=cfgs)
        assert rel_err(out, ref) < 2e-2, cfgs


@needs_cuda
def test_moe_graph_replay_follows_rewritten_page_table():
    num_experts = 8
    p13, p2 = _layer(num_experts, 256, 256, [8] * num_experts, [8] * num_experts)
    check_graph_replay(p13, p2, m=12, topk=2, kernel="fold",
                       bit_mixes=([8] * num_experts, [3] * num_experts, [2, 5, 8, 3, 4, 6, 7, 1]))
    check_graph_replay(p13, p2, m=1, topk=2, kernel="fold", bit_mixes=([4] * num_experts, [1, 2, 3, 4, 5, 6, 7, 8]))


@needs_cuda
@pytest.mark.parametrize("m", [1, 12])
def test_moe_graph_replay_with_programmatic_launches(m):
    """prep, w13 and w2 launched as programmatic dependents (each starts while the one before finishes) inside one CUDA
    graph: every replay matches the reference for the page tables it finds."""
    num_experts = 8
    p13, p2 = _layer(num_experts, 256, 256, [8] * num_experts, [8] * num_experts)

    def call(x, tw, ids, w13, w2):
        c13, c2 = default_fold_configs(m, 2, w13, w2, torch.cuda.get_device_properties(0).multi_processor_count)
        cfgs = (dataclasses.replace(c13, pdl=True), dataclasses.replace(c2, pdl=True))
        return ap_fused_moe_fold(x, tw, ids, w13, w2, configs=cfgs)

    check_graph_replay(p13, p2, m=m, topk=2, kernel="fold", call=call,
                       bit_mixes=([8] * num_experts, [3] * num_experts, [2, 5, 8, 3, 4, 6, 7, 1]))
