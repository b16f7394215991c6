"""The CUDA grouped kernel (cuda_grouped.py): prefill-size MoE over ubcq planes, decoded in the GEMM's mainloop.

CPU (CI): every variant compiles with NVRTC for sm_90; an exact emulation of what each lane hands mma.sync (the
ldmatrix word transposition, the bit transposition, the code pairs, the permuted activation order of the prep
kernel and of w13's epilogue, the packed c * A weights and the z * S offsets) for every bitwidth; the dispatch
rule, configs and refusals.
CUDA: against the torch reference with every bitwidth mixed in one launch, three activation dtypes, the router
weight on the input, padding slots, an expert with no tokens, one expert taking every token, expert id -1, group
256, both block widths and every pipeline depth, Qwen3-30B-A3B's intermediate size, and page-table rows rewritten
between CUDA-graph replays.
"""

from __future__ import annotations

import collections
import functools
import re

import pytest
import torch

from pagedweight.kernels import ap_fused_moe, ap_linear
from pagedweight.kernels.config import prefer_grouped
from pagedweight.kernels.cuda_grouped import (
    CHUNK,
    SHARED_LIMIT,
    GroupedConfig,
    ap_fused_moe_grouped,
    compile_to_cubin,
    default_grouped_config,
    gemm_arch,
    gemm_defines,
    grouped_layer_config,
    grouped_moe_unsupported,
    grouped_unsupported,
    prebuild_grouped,
    prep_defines,
)
from pagedweight.kernels.nvrtc import cached_kernel
from pagedweight.kernels.reference import ap_fused_moe_reference
from pagedweight.kernels.testing import random_ap_projection
from tests.support.cuda_kernel_cases import (assert_cubins, ptxas_report, check_graph_replay, check_moe_dtypes,
                                             compile_in_parallel, rel_err, routing, sass_of)
from tests.test_kernel_fold import _half_value, _lane_code_pairs

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="the grouped kernel is CUDA only")
# the warp-specialized kernel: both block widths, a two-stage pipeline (every refill waits on the consumers) and
# four stages
WS_MAIN = (GroupedConfig(1, 3, ws=True), GroupedConfig(2, 3, ws=True))
WS_CONFIGS = (*WS_MAIN, GroupedConfig(2, 2, ws=True), GroupedConfig(1, 4, ws=True))
# 256-row blocks (two warpgroups along the rows): both pair widths, and every pipeline depth that fits; w2's results
# added by 16-byte vector reductions (red_v4, also at 128 rows, and where its staged results outgrow two stages)
R256_MAIN = (GroupedConfig(1, 4, rows=256), GroupedConfig(2, 3, rows=256), GroupedConfig(2, 3, rows=256, red_v4=True))
R256_CONFIGS = (*R256_MAIN, GroupedConfig(1, 2, rows=256), GroupedConfig(2, 2, rows=256),
                GroupedConfig(2, 2, rows=256, red_v4=True), GroupedConfig(1, 3, red_v4=True))
# the offset inside the weights (no fp32 offset pass): 256 x 128, 128 x 64 and mma.sync
OW_CONFIGS = (GroupedConfig(2, 3, rows=256, offset_in_weights=True), GroupedConfig(1, 3, offset_in_weights=True),
              GroupedConfig(1, 3, wgmma=False, offset_in_weights=True))
# refills of the slot read two chunks ago (no drain before a refill): with and without the offset in the weights, and
# at four stages (two chunks of copies in flight; 256 x 128 sized per bitwidth: four stages up to 4-bit blocks, three
# above); K of five and three chunks covers refills past the last chunk
LAG_CONFIGS = (GroupedConfig(2, 3, rows=256, offset_in_weights=True, refill_lag=2),
               GroupedConfig(2, 3, rows=256, refill_lag=2), GroupedConfig(1, 4, offset_in_weights=True, refill_lag=2),
               GroupedConfig(2, 4, rows=256, offset_in_weights=True, refill_lag=2, red_v4=True))
# 128 rows x 256 pairs (wgmma m64n256k16; stages sized per bitwidth: three up to 4-bit blocks, two above at an 8-bit
# parent): plain, with w2's vector reductions, with the lagged refill (which falls back where two stages fit) and the
# offset in the weights, and two stages throughout
W256_CONFIGS = (GroupedConfig(4, 3), GroupedConfig(4, 3, red_v4=True),
                GroupedConfig(4, 3, offset_in_weights=True, refill_lag=2, red_v4=True), GroupedConfig(4, 2, red_v4=True))
W256_U4_CONFIGS = W256_CONFIGS[:3]
# one block per SM walking the tiles, the next tile's first chunks issued before the epilogue: 256 x 128 (w2's staged
# results leave one stage free), with the offset in the weights and the lagged refill, 128 x 64 and mma.sync
PERSIST_CONFIGS = (GroupedConfig(2, 3, rows=256, red_v4=True, persistent=True),
                   GroupedConfig(2, 3, rows=256, red_v4=True, offset_in_weights=True, refill_lag=2, persistent=True),
                   GroupedConfig(1, 3, persistent=True), GroupedConfig(1, 2, wgmma=False, persistent=True))
# where each chunk's refill copies go among its k16 steps, two steps of MMAs in flight, and 64 rows per warpgroup, on
# the 256 x 128 default (four warpgroups also with the fp32 offset pass at three stages) and on 128 x 64 (two)
_SERVED_R256 = dict(rows=256, red_v4=True, offset_in_weights=True, refill_lag=2)
SCHED_CONFIGS = (GroupedConfig(2, 4, **_SERVED_R256, copy_step=3), GroupedConfig(2, 4, **_SERVED_R256, mma_depth=2),
                 GroupedConfig(2, 4, **_SERVED_R256, copy_step=3, mma_depth=2),
                 GroupedConfig(2, 4, **_SERVED_R256, row_warpgroups=4),
                 GroupedConfig(2, 4, **_SERVED_R256, row_warpgroups=4, copy_step=2),
                 GroupedConfig(2, 3, rows=256, row_warpgroups=4), GroupedConfig(1, 3, copy_step=1),
                 GroupedConfig(1, 3, row_warpgroups=2),
                 GroupedConfig(1, 4, row_warpgroups=2, offset_in_weights=True, refill_lag=2, copy_step=2))
# the GPU correctness cases per family (`-k "moe_matches and w256"` runs one)
CONFIG_GROUPS = {
    "base": (GroupedConfig(1, 2), GroupedConfig(2, 3), GroupedConfig(2, 4), GroupedConfig(1, 3, wgmma=False),
             GroupedConfig(2, 2, wgmma=False)),
    "ws": WS_CONFIGS, "r256": R256_CONFIGS, "ow": OW_CONFIGS, "lag": LAG_CONFIGS,
    "w256": W256_CONFIGS, "persist": PERSIST_CONFIGS, "sched": SCHED_CONFIGS,
}


# ---------------------------------------------------------------- CPU: build, fragment order, algebra, configs


@pytest.mark.parametrize("mode", [0, 1])
def test_every_variant_compiles_for_sm90(mode):
    jobs = []
    for wn in (1, 2):
        for bits_max, group, compute, stages in ((8, 128, 0, 3), (4, 256, 1, 4), (3, 128, 0, 2)):
            for wgmma in (True, False):
                cfg = GroupedConfig(wn=wn, stages=stages, wgmma=wgmma)
                jobs.append(functools.partial(compile_to_cubin, gemm_defines(mode, cfg, bits_max, group, compute),
                                              gemm_arch(cfg, "90")))
    for wn in (1, 2):  # 256-row blocks, within one block's shared memory
        for bits_max, group, compute, stages in ((8, 128, 0, 4 - wn), (4, 256, 1, 4), (3, 128, 0, 2)):
            cfg = GroupedConfig(wn=wn, stages=stages, rows=256)
            assert cfg.shared_bytes(bits_max) <= SHARED_LIMIT
            jobs.append(functools.partial(compile_to_cubin, gemm_defines(mode, cfg, bits_max, group, compute),
                                          gemm_arch(cfg, "90")))
    for cfg in (GroupedConfig(2, 2, rows=256, red_v4=True), GroupedConfig(1, 3, red_v4=True)):  # w2's vector reductions
        assert cfg.shared_bytes(8) <= SHARED_LIMIT
        jobs.append(functools.partial(compile_to_cubin, gemm_defines(mode, cfg, 8, 128, 0), gemm_arch(cfg, "90")))
    for cfg, bits_max, group, compute in zip(OW_CONFIGS, (8, 4, 3), (128, 256, 128), (0, 1, 0)):  # offset in weights
        jobs.append(functools.partial(compile_to_cubin, gemm_defines(mode, cfg, bits_max, group, compute),
                                      gemm_arch(cfg, "90")))
    for cfg, bits_max, group, compute in zip(LAG_CONFIGS, (8, 4, 3), (128, 256, 128), (0, 1, 0)):  # refill lag 2
        assert cfg.shared_bytes(bits_max) <= SHARED_LIMIT
        jobs.append(functools.partial(compile_to_cubin, gemm_defines(mode, cfg, bits_max, group, compute),
                                      gemm_arch(cfg, "90")))
    for cfg, bits_max, group, compute in zip(PERSIST_CONFIGS, (8, 4, 3, 8), (128, 256, 128, 128), (0, 1, 0, 0)):
        assert cfg.shared_bytes(bits_max) <= SHARED_LIMIT  # persistent, the next tile's copies before the epilogue
        jobs.append(functools.partial(compile_to_cubin, gemm_defines(mode, cfg, bits_max, group, compute),
                                      gemm_arch(cfg, "90")))
    for cfg, bits_max, group, compute in zip((*W256_CONFIGS, *W256_U4_CONFIGS), (8, 8, 8, 3, 4, 4, 5),
                                             (128, 256, 128, 128, 128, 256, 128), (0, 1, 0, 0, 0, 1, 0)):  # 128 x 256
        assert cfg.shared_bytes(bits_max) <= SHARED_LIMIT
        jobs.append(functools.partial(compile_to_cubin, gemm_defines(mode, cfg, bits_max, group, compute),
                                      gemm_arch(cfg, "90")))
    for wn in (1, 2):  # the warp-specialized kernel, within one block's shared memory
        for bits_max, group, compute, stages in ((8, 128, 0, 3), (4, 256, 1, 2), (3, 128, 0, 4 - wn)):
            cfg = GroupedConfig(wn=wn, stages=stages, ws=True)
            assert cfg.shared_bytes(bits_max) <= SHARED_LIMIT
            jobs.append(functools.partial(compile_to_cubin, gemm_defines(mode, cfg, bits_max, group, compute),
                                          gemm_arch(cfg, "90"), name=cfg.kernel_name, source=cfg.source))
    # 5-7-bit byte codes and 8-bit nibble pairs in fp16 (wgmma and mma.sync, with and without the offset in the
    # weights, the warp-specialized kernel) and the 64-tail (groups of 64) at an 8-plane parent
    for cfg in (GroupedConfig(2, 3), GroupedConfig(2, 3, wgmma=False), *OW_CONFIGS[1:], WS_MAIN[1]):
        assert cfg.shared_bytes(8) <= SHARED_LIMIT
        jobs.append(functools.partial(compile_to_cubin, gemm_defines(mode, cfg, 8, 128, 1), gemm_arch(cfg, "90"),
                                      name=cfg.kernel_name, source=cfg.source))
    for compute in (0, 1):
        jobs.append(functools.partial(compile_to_cubin, gemm_defines(mode, default_grouped_config(2048, 2, 8), 8, 64,
                                                                     compute, tail64=True), "90a"))
    if mode == 0:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            jobs.append(functools.partial(compile_to_cubin, prep_defines(128, 0, dtype), "90", name="ap_grouped_prep"))
    assert_cubins(compile_in_parallel(jobs))


def _perm(k: int) -> int:
    """Position of input k (inside its chunk of 128) in the prep kernel's order: piece (j, e), element 2 t + h."""
    t, i, j = k >> 5, (k >> 2) & 7, k & 3
    e, h = i & 3, i >> 2
    return (4 * j + e) * 8 + 2 * t + h


def test_activation_orders_agree():
    """The prep order is a permutation of each chunk, and w13's epilogue (64 outputs per block, the block's half of
    a chunk; or 128, a whole chunk, at 256 rows) writes every output exactly where the prep order puts that input
    of w2 (grouped_common.cuh store_w2_input: element 4 half + 2 tt + h of piece (j, e) <- tile column
    32 tt + 4 (e + 4 h) + j)."""
    assert sorted(_perm(k) for k in range(CHUNK)) == list(range(CHUNK))
    for outs in (64, 128):
        for row_tile in range(4):
            n0 = outs * row_tile
            half = (n0 >> 6) & 1 if outs == 64 else 0
            locals_ = []
            for piece in range(16):
                j, e = piece >> 2, piece & 3
                for tt in range(outs // 32):
                    for h in range(2):
                        n_local = 32 * tt + 4 * (e + 4 * h) + j
                        pos = (n0 >> 7) * CHUNK + piece * 8 + 4 * half + 2 * tt + h
                        assert pos == (n0 + n_local) // CHUNK * CHUNK + _perm((n0 + n_local) % CHUNK)
                        locals_.append(n_local)
            assert sorted(locals_) == list(range(outs))  # every output of the block, once


def _bf16(v: float) -> float:
    return torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).double().item()


def _grouped_common() -> str:
    from pathlib import Path

    import pagedweight.kernels as kernels

    return (Path(kernels.__file__).parent / "grouped_common.cuh").read_text()


def _code_widths() -> dict[int, int]:
    """grouped_common.cuh's code_bits per bitwidth (the code as the weight pairs read it: c << (W - q)), with the
    row coefficients' forms that the emulation below follows (A = 2 s 2^(q-W), K0 = (2^q - 1) 2^(W-1-q), bf16's C
    and the offset in the weights' KC = 2^(W - 1)) checked in the source."""
    src = _grouped_common()
    m = re.search(r"return Q <= 4 \? (\d) : Q <= 7 \? (\d) : (\d);", src)
    forms = (r"__int_as_float\(\(127 \+ Q - code_bits<Q>\(\)\) << 23\)",  # code_step
             r"\(float\)\(\(1 << Q\) - 1\) \* __int_as_float\(\(127 \+ W - 1 - Q\) << 23\)",  # K0
             r"const float k = W == 8 \? k0 : 128\.f \+ k0;",  # bf16: C = round(-k A)
             r"\(float\)\(1 << \(code_bits<Q>\(\) - 1\)\) \* code_step<Q>\(s\)")  # centred_offset's KC
    assert m and all(re.search(f, src) for f in forms), "make_row_coef / code_bits changed form: update the emulation"
    w4, w7, w8 = map(int, m.groups())
    return {q: w4 if q <= 4 else w7 if q <= 7 else w8 for q in range(1, 9)}


def _coef(s: float, o: float, q: int, ct: int = 0) -> tuple[float, float, float, float, int]:
    """grouped_common.cuh make_row_coef: (A rounded to the compute type, C, the fp32 offset factor, K0, W)."""
    w = _code_widths()[q]
    rnd = _bf16 if ct == 0 else _f16
    a = 2 * s * 2.0 ** (q - w)
    k0 = (2**q - 1) * 2.0 ** (w - 1 - q)  # the middle of the code range, in units of c << (W - q)
    ar = rnd(a)
    if ct == 0:
        k = 128 + k0 if w < 8 else k0  # q = 8 forms c exactly first
        c = rnd(-k * ar)
        eps = c + k * ar
    else:
        c, eps = -k0, 0.0
        assert rnd(c) == c
    return ar, c, (o - s * (2**q - 1)) + k0 * a - eps, k0, w


def _f16(v: float) -> float:
    return torch.tensor(v, dtype=torch.float64).to(torch.float16).double().item()


@functools.lru_cache(maxsize=None)
def _check_plane_split() -> None:
    """grouped_common.cuh's plane_codes splits the planes as tests/test_kernel_fold.py's _lane_code_pairs emulates:
    q = 5..7 planes 0-2 one bit lower and 3.. (bit-0 stage first at 5 bits) joined by byte_codes, else nibbles of
    planes 0-3 and (q = 8) 4-7."""
    src = _grouped_common()
    body = src[src.index("void plane_codes("):src.index("u32 magic_pair(")]
    split = (r"codes_of<3, 2>\(h \? wb : wa, hi\[h\]\);\s*"
             r"codes_of<Q - 3, 3, Q == 5>\(\(h \? wb : wa\) \+ 3, lo\[h\]\);\s*#pragma unroll\s*"
             r"for \(int j = 0; j < 4; \+\+j\) byte_codes\(hi\[h\]\[j\], lo\[h\]\[j\], hi\[h\]\[j\], lo\[h\]\[j\]\);",
             r"codes_of<Q < 4 \? Q : 4>\(wa, hi\[0\]\);", r"codes_of<4>\(wa \+ 4, lo\[0\]\);")
    assert all(re.search(f, body) for f in split), "plane_codes changed its plane split: update this emulation"


def _lane_codes(q: int, words: list[int]) -> list[list[list[int]]]:
    """The codes a lane's weight pairs read, per word j and nibble pair e: [j][e] = (code of nibble e, of e + 4) (c <<
    (W - q)), from the bf16 mma operands the kernel forms from the row's q plane words (plane_codes, then code_pair,
    byte_pair or q = 8's two nibble sets; tests/test_kernel_fold.py's emulation of the same cuda_common.cuh helpers,
    whose plane split plane_codes is checked to keep)."""
    _check_plane_split()
    chains = _lane_code_pairs(q, words, 0x43004300)
    vals = [[[[int(_half_value((p >> (16 * h)) & 0xFFFF, 0)) - 128 for h in range(2)] for p in word] for word in ch]
            for ch in chains]
    if q == 8:  # 16 hi + lo
        return [[[16 * hv + lv for hv, lv in zip(vals[0][j][e], vals[1][j][e])] for e in range(4)] for j in range(4)]
    return vals[0]


def _weight(code: int, q: int, ar: float, c: float) -> float:
    """The packed bf16 weight the kernel builds from one code c << (W - q): fma(BIAS + code, A, C) (q = 8: the code
    formed exactly first, fma(code, A, C)), one rounding."""
    return _bf16((128 + code) * ar + c) if q <= 7 else _bf16(code * ar + c)


@pytest.mark.parametrize("q", range(1, 9))
def test_lanes_feed_mma_the_dot_product(q):
    """One chunk (one group), 16 rows, 8 pairs, emulated lane by lane: the code words ldmatrix gives lane t, the
    code pairs it builds (nibbles at 1-4 bits, 7-bit bytes at 5-7, two nibble sets at 8) and their centred packed
    weights fma(BIAS + c, A, C), the B fragments ldmatrix reads from the prep order, mma.sync's slot semantics, then
    y += (z + K0 A - eps) S. Equal (float64) to the dot product of the same per-weight values in input order, and
    within bf16 rounding of the exact W = 2 s c + z even for all-positive activations (large S, where an uncentred
    weight loses the offset)."""
    g = torch.Generator().manual_seed(q)
    codes = torch.randint(0, 2**q, (16, CHUNK), generator=g)
    s = (torch.rand(16, generator=g, dtype=torch.float64) + 0.5) * 2.0 ** -(q - 1)
    o = torch.randn(16, generator=g, dtype=torch.float64) * 0.1
    for x in (torch.randn(8, CHUNK, generator=g, dtype=torch.float64),
              torch.rand(8, CHUNK, generator=g, dtype=torch.float64) * 1e4):
        xp = torch.zeros(8, CHUNK, dtype=torch.float64)
        for k in range(CHUNK):
            xp[:, _perm(k)] = x[:, k]
        coef = [_coef(float(s[r]), float(o[r]), q) for r in range(16)]
        acc = torch.zeros(16, 8, dtype=torch.float64)
        for t in range(4):
            # ldmatrix: lane t's word of each plane row = inputs 32 t .. 32 t + 31 of the chunk
            words = [[sum(((int(codes[r, 32 * t + b]) >> (q - 1 - p)) & 1) << b for b in range(32)) for p in range(q)]
                     for r in range(16)]
            lane = [_lane_codes(q, words[r]) for r in range(16)]
            for j in range(4):
                for e0 in (0, 2):
                    a = torch.zeros(16, 16, dtype=torch.float64)
                    b = torch.zeros(16, 8, dtype=torch.float64)
                    for r in range(16):
                        for slot, e in ((2 * t, e0), (2 * t + 8, e0 + 1)):
                            for half in range(2):
                                a[r, slot + half] = _weight(lane[r][j][e][half], q, coef[r][0], coef[r][1])
                    for col in range(8):  # B: pieces (j, e0), (j, e0 + 1) of pair row col, elements 2 t, 2 t + 1
                        for slot, piece in ((2 * t, 4 * j + e0), (2 * t + 8, 4 * j + e0 + 1)):
                            b[slot, col] = xp[col, piece * 8 + 2 * t]
                            b[slot + 1, col] = xp[col, piece * 8 + 2 * t + 1]
                    acc += a @ b
        zc = torch.tensor([cf[2] for cf in coef], dtype=torch.float64)
        y = acc + zc[:, None] * x.sum(dim=1)[None, :]
        shift = coef[0][4] - q  # the code the pairs read: c << (W - q)
        w_kernel = torch.tensor([[_weight(int(codes[r, k]) << shift, q, coef[r][0], coef[r][1])
                                  for k in range(CHUNK)] for r in range(16)], dtype=torch.float64)
        torch.testing.assert_close(y, w_kernel @ x.t() + zc[:, None] * x.sum(dim=1)[None, :], rtol=1e-12, atol=1e-9)
        exact = (2 * s[:, None] * codes.double() + (o - s * (2**q - 1))[:, None]) @ x.t()
        err = float((y - exact).norm() / exact.norm())
        assert err < 1e-2, err  # (uncentred, all-positive activations: 2-20 %)


@pytest.mark.parametrize("offw", [False, True], ids=["offset_pass", "offset_in_weights"])
@pytest.mark.parametrize("ct", [0, 1], ids=["bf16", "fp16"])
@pytest.mark.parametrize("q", [5, 6, 7])
def test_byte_code_weights_are_within_one_rounding_of_exact(q, ct, offw):
    """q = 5..7, every code at every input of a lane's quarter: the operand the lane forms is BIAS + c7 exactly (c7 = c
    << (7 - q), the bits the kernel's helpers give), and the weight the kernel builds from it (CodeConst's constants
    as grouped_common.cuh writes them, make_row_coef's A, K0 and C) is within the rounding it claims of the exact
    W = 2 s c + z: bf16 one fma (BIAS + c7) A + C plus the fp32 offset z + K0 A - eps; fp16 c7, then c7 - K0, both
    exact, then one multiply by A; the offset in the weights (c7 - 64) exactly, then one fma with z + 64 A rounded once.
    Each weight's error is the rounding of A (relative, on the centred term) plus one rounding of what the fma
    forms (plus the centred offset's own rounding in the weights): bounded by the centred weight and offset, never by
    z, which is what centring buys."""
    dtype = torch.bfloat16 if ct == 0 else torch.float16
    bias, u = (128.0, 2.0**-8) if ct == 0 else (1024.0, 2.0**-11)  # unit roundoff of the compute type
    k = _code_constants(ct)
    assert (k["NEG_BIAS"], k["ONE"], k["NEG_BIAS_64"]) == (-bias, 1.0, -(bias + 64))
    kc = 2.0 ** (_code_widths()[q] - 1)  # the offset in the weights' centring: 64 7-bit units (CodeConst's BIAS + 64)
    src = _grouped_common()
    forms = (r"if constexpr \(Q <= 7\) return pfma\(magic_pair<Q>\(hi, lo, e\), K::ONE, CENTRED \? K::NEG_BIAS_64 : "
             r"K::NEG_BIAS\);",  # exact_code_pair: BIAS + c7 less BIAS (+ 64)
             r"if constexpr \(Q <= 7\) return pfma\(magic_pair<Q>\(hi, lo, e\), rc\.a2, rc\.c2\);",  # bf16 weight_pair
             r"return pfma\(pfma\(exact_code_pair<Q>\(hi, lo, e\), K::ONE, rc\.c2\), rc\.a2, K::NEG_ZERO\);",  # fp16
             r"return pfma\(exact_code_pair<Q, true>\(hi, lo, e\), a2, zc2\);")  # weight_pair_ow
    assert all(re.search(f, src) for f in forms), "the weight pairs changed form: update this emulation"

    def rnd(v: torch.Tensor) -> torch.Tensor:  # one rounding to the compute type (v exact in float64)
        return v.to(dtype).double()

    # every code at every position (input k holds code (r + k) mod 2^q), as the operand bits a lane forms
    codes, pairs = [], []
    for r in range(2**q):
        cs = [(r + kk) % 2**q for kk in range(32)]
        words = [sum(((cs[kk] >> (q - 1 - p)) & 1) << kk for kk in range(32)) for p in range(q)]
        (chain,) = _lane_code_pairs(q, words, 0x43004300 if ct == 0 else 0x64006400)
        for j in range(4):
            for e in range(4):
                for half in range(2):
                    codes.append(cs[4 * (e + 4 * half) + j])
                    pairs.append(_half_value((chain[j][e] >> (16 * half)) & 0xFFFF, ct))
    c = torch.tensor(codes, dtype=torch.float64)
    c7 = c * 2 ** (7 - q)
    pair = torch.tensor(pairs, dtype=torch.float64)
    assert torch.equal(pair, bias + c7)
    assert sorted(set(codes)) == list(range(2**q)) and len(codes) == 2**q * 32
    # rows: small and large offsets against the scale, scales off and on powers of two (A rounded or not)
    for s, o in ((0.0123, 0.0), (0.0123, 1.7), (1.0 / 64, -3.0), (0.37, 0.05), (3e-4, 2e-3)):
        ar, cc, zf, k0, w = _coef(s, o, q, ct)
        a, z = 2 * s * 2.0 ** (q - w), o - s * (2**q - 1)  # make_row_coef's A (the bytes are c7: W = 7)
        exact = 2 * s * c + z
        slack = 2.0**-20 * (abs(z) + a * 128)  # the fp32 offset arithmetic
        if not offw and ct == 0:
            wp = rnd(pair * ar + cc)  # one fma
            eps = cc + (128 + k0) * ar
            got = wp + zf
            bound = u * (2 * (1 + u) * (a * (c7 - k0)).abs() + abs(eps)) + slack
            assert (wp.abs() <= (1 + 2 * u) * a * k0 + abs(eps) + u * a).all()  # as small as the centred weight
        elif not offw:
            cx = rnd(pair * k["ONE"] + k["NEG_BIAS"])
            centred = rnd(cx * k["ONE"] + cc)
            assert torch.equal(cx, c7) and torch.equal(centred, c7 - k0)  # exact
            got = rnd(centred * ar) + zf
            bound = u * 2 * (1 + u) * (a * (c7 - k0)).abs() + slack
        else:
            centred = rnd(pair * k["ONE"] + k["NEG_BIAS_64"])
            assert torch.equal(centred, c7 - kc)
            zc = rnd(torch.tensor(z + kc * a, dtype=torch.float64))  # centred_offset, splat in the compute type
            got = rnd(centred * ar + zc)
            bound = u * (1 + u) * (2 * (a * (c7 - kc)).abs() + 2 * abs(z + kc * a)) + slack
        err = (got - exact).abs()
        assert (err <= bound).all(), (s, o, float((err - bound).max()), int(c[(err - bound).argmax()]))


def test_dispatch_rule():
    """From 16 pairs per expected expert hit up, at every size (the fold, MMA and LUT rules are asked first); the
    dequantize-then-GEMM path keeps only calls past the kernel's own size limits."""
    assert prefer_grouped(256, 2, 8) and prefer_grouped(2048, 8, 128) and prefer_grouped(512, 4, 60)
    assert prefer_grouped(2048, 2, 8) and prefer_grouped(8192, 8, 128) and prefer_grouped(8192, 4, 60)
    assert not prefer_grouped(16, 2, 8) and not prefer_grouped(64, 8, 128) and not prefer_grouped(1, 8, 128)
    # past the old bound of 1024 pairs per expert: Mixtral M = 8192, Qwen3-30B-A3B 32768 (e2e batch 16 x 2048)
    assert prefer_grouped(4096, 2, 8) and prefer_grouped(8192, 2, 8) and prefer_grouped(32768, 8, 128)


def test_prefill_of_any_size_takes_the_grouped_kernel(monkeypatch):
    """kernel="auto" on a GPU: a 16 x 2048-token prefill of Qwen3-30B-A3B (32768 tokens in one forward, 2048 pairs per
    expert) and Mixtral at 8192 tokens run the grouped kernel, not the dequantize-then-GEMM path and its scratch."""
    from types import SimpleNamespace

    import pagedweight.kernels.cuda_fold as cuda_fold
    import pagedweight.kernels.cuda_grouped as cuda_grouped
    import pagedweight.kernels.cuda_lut as cuda_lut
    import pagedweight.kernels.cuda_mma as cuda_mma
    from pagedweight.kernels.api import auto_moe_kernel

    # as if on a GPU: every CUDA kernel can take ubcq planes of these shapes, so only the size rules choose
    for module, name in ((cuda_grouped, "grouped_unsupported"), (cuda_fold, "fold_unsupported"),
                         (cuda_mma, "mma_unsupported"), (cuda_lut, "lut_unsupported")):
        monkeypatch.setattr(module, name, lambda w: None)
    monkeypatch.setattr(cuda_grouped, "grouped_moe_unsupported", lambda a, b: None)
    monkeypatch.setattr(cuda_fold, "fold_moe_unsupported", lambda a, b: None)
    for e, topk, h, i, m in ((128, 8, 2048, 768, 32768), (8, 2, 4096, 14336, 8192), (60, 4, 2048, 1408, 16384)):
        w13 = SimpleNamespace(K=h, N=2 * i, num_experts=e, group_size=128, table_kind="ubcq", grouped=False)
        w2 = SimpleNamespace(K=i, N=h, num_experts=e, group_size=128, table_kind="ubcq", grouped=False)
        assert auto_moe_kernel(m, topk, w13, w2) == "grouped", (e, m)


def test_calls_past_the_size_limits_go_elsewhere(monkeypatch):
    """A call past the grouped kernel's 32-bit activation offsets (or 65535 token blocks) is refused by the kernel in
    one line and never picked by kernel="auto", whatever the pairs-per-expert rule says: Mixtral's shapes, grouped at
    8192 tokens, the Triton path at 131072 (w2's input: 262144 pairs x 14336 inputs), and the top-k times larger input rows when the router weight is applied on the input."""
    from types import SimpleNamespace

    import pagedweight.kernels.cuda_grouped as cuda_grouped
    from pagedweight.kernels.api import auto_moe_kernel
    from pagedweight.kernels.cuda_grouped import grouped_call_unsupported

    # k-means tables: the fold, MMA and LUT kernels refuse them before their size rules are asked
    w13 = SimpleNamespace(K=4096, N=2 * 14336, num_experts=8, group_size=128, table_kind="kmeans", grouped=False)
    w2 = SimpleNamespace(K=14336, N=4096, num_experts=8, group_size=128, table_kind="kmeans", grouped=False)
    assert grouped_call_unsupported(8192, 2, w13, w2, 128, False) is None
    why = grouped_call_unsupported(131072, 2, w13, w2, 128, False)
    assert why.startswith("131072 tokens x top-2 exceed the grouped kernel's 32-bit activation offsets")
    # apply_router_weight_on_input: w13 reads one row per pair (M x top-k rows of the hidden size)
    wide13 = SimpleNamespace(K=8192, N=2 * 1024, num_experts=8, group_size=128)
    narrow2 = SimpleNamespace(K=1024, N=8192, num_experts=8, group_size=128)
    assert grouped_call_unsupported(200000, 2, wide13, narrow2, 128, False) is None
    assert grouped_call_unsupported(200000, 2, wide13, narrow2, 128, True) is not None
    assert grouped_call_unsupported(8_000_000, 1, SimpleNamespace(K=128, num_experts=8),
                                    SimpleNamespace(K=128), 64, False).endswith("65535 blocks of 64 pairs at hidden 128 "
                                                                                "/ intermediate 128")

    monkeypatch.setattr(cuda_grouped, "grouped_unsupported", lambda w: None)  # as if on a GPU
    monkeypatch.setattr(cuda_grouped, "grouped_moe_unsupported", lambda a, b: None)
    assert auto_moe_kernel(8192, 2, w13, w2) == "grouped"
    assert auto_moe_kernel(131072, 2, w13, w2) is None
    with pytest.raises(ValueError, match="kernel='grouped' cannot run: 131072 tokens x top-2 exceed"):
        auto_moe_kernel(131072, 2, w13, w2, kernel="grouped")


def test_red_v4_adds_w2_results_by_16_byte_reductions():
    """red_v4: w2's output additions compile to REDG.E.ADD.F32x4 (one per 4 output rows of a pair), and no scalar
    float32 reduction is left in that kernel; without it, one scalar reduction per value."""
    for rows, wn in ((256, 2), (128, 1)):
        vec = sass_of(compile_to_cubin(gemm_defines(1, GroupedConfig(wn, 3, rows=rows, red_v4=True), 4, 128, 0), "90a"))
        plain = sass_of(compile_to_cubin(gemm_defines(1, GroupedConfig(wn, 3, rows=rows), 4, 128, 0), "90a"))
        reds = [line for line in vec.splitlines() if "REDG" in line or "ATOMG" in line]
        assert reds and all("F32x4" in line for line in reds), rows
        assert not any("F32x4" in line for line in plain.splitlines()) and "REDG.E.ADD.F32" in plain


def test_diag_knob_leaves_out_what_it_names():
    """grouped_diag.py's DIAG bits (measurement only): 1 drops the planes' shared reads and the decode, 2 the MMAs
    but keeps the decode (its fragments feed a sink, so the time left is the decode's); 0 is the served kernel."""
    cfg = GroupedConfig(1, 3)

    def ops(diag):
        sass = sass_of(compile_to_cubin(gemm_defines(1, cfg, 4, 128, 0) + [f"-DDIAG={diag}"], "90a"))
        return {op: sum(f" {op}" in line for line in sass.splitlines()) for op in ("HGMMA", "LDSM", "HFMA2")}

    served, no_decode, no_mma = ops(0), ops(1), ops(2)
    assert served["HGMMA"] and served["LDSM"] and served["HFMA2"]
    assert no_decode["LDSM"] == 0 and no_decode["HGMMA"] == served["HGMMA"] and no_decode["HFMA2"] < served["HFMA2"] / 4
    assert no_mma["HGMMA"] == 0 and no_mma["LDSM"] == served["LDSM"] and no_mma["HFMA2"] >= served["HFMA2"]


@pytest.mark.parametrize("cfg", [GroupedConfig(2, 4, **_SERVED_R256), *SCHED_CONFIGS[:4], *SCHED_CONFIGS[-2:]],
                         ids=["served", "copy_step3", "depth2", "copy_step3_depth2", "four_warpgroups",
                              "r128_two_warpgroups", "r128_two_warpgroups_copy_step2"])
def test_wgmma_steps_stay_asynchronous(cfg):
    """ptxas keeps the k16 steps' MMAs in flight (one wait for MMA_DEPTH steps back per step) rather than serializing
    every wgmma, which it does silently (no warning in NVRTC's log) for some placements of the refill copies
    (copy_step 0, or 1 with two steps in flight: then every step's wait is a full drain)."""
    sass = sass_of(compile_to_cubin(gemm_defines(0, cfg, 4, 128, 0), "90a"))
    steps = 4 * 8  # 4 bitwidths x 8 k16 steps
    waits = collections.Counter(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", sass))
    assert sass.count("HGMMA") == steps * (1 if cfg.split_rows else 2)  # one wgmma per 64-row tile
    # full drains: at most three per bitwidth (before a lag-1 refill, the fp32 offset pass, after the mainloop)
    assert waits[str(cfg.mma_depth)] == steps and waits["0"] <= 3 * 4, dict(waits)
    assert sass.count("WARPGROUP.ARRIVE") == steps


def _wg_desc(addr: int, lbo: int, sbo: int) -> int:
    """grouped_common.cuh's wg_desc: the shared-memory matrix descriptor with the 128-byte swizzle."""
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 62)


def test_wgmma_descriptor_per_step_is_the_chunks_plus_an_offset():
    """The mainloop builds one descriptor per chunk and warpgroup and adds each k16 step's offset (in 16-byte units)
    to it: the same descriptor as building it from the step's address, for every stage base one block can have
    (1024-aligned, the stages inside 227 KB, so the address never reaches the field's 18 bits), block width and
    warpgroup column; in the SASS the per-step address work is gone (the uniform lop3s that masked and merged each
    step's address: 68-77 per kernel before, at most 24 now, for both served block shapes, w13 and w2)."""
    limit = 227 * 1024
    for bm, npw, wns in ((128, 128, (0,)), (64, 64, (0,)), (128, 64, (0, 1)), (256, 256, (0,))):
        for wn in wns:
            for sb in range(0, limit, 1024):
                if sb + bm * 256 > limit:  # the stage's activations (two atoms of [bm][128 bytes]) end inside
                    break
                desc0 = _wg_desc(sb + npw * wn * 128, 16, 1024)
                for p0 in range(16):
                    off = (p0 >> 3) * bm * 128 + (p0 & 7) * 16
                    assert desc0 + (off >> 4) == _wg_desc(sb + npw * wn * 128 + off, 16, 1024), (bm, wn, sb, p0)
    for cfg in (default_grouped_config(2048, 8, 128), default_grouped_config(256, 8, 128)):
        for mode in (0, 1):
            sass = sass_of(compile_to_cubin(gemm_defines(mode, cfg, 4, 128, 0), "90a"))
            assert sass.count("HGMMA") == 4 * 8
            assert len(re.findall(r"ULOP3\.LUT", sass)) <= 24, (cfg, mode)


def _code_constants(ct: int) -> dict[str, float]:
    """grouped_common.cuh's CodeConst for compute type `ct` (0 bf16, 1 fp16), each packed half decoded."""
    import struct
    from pathlib import Path

    import pagedweight.kernels as kernels

    text = (Path(kernels.__file__).parent / "grouped_common.cuh").read_text()
    body = text[text.index("struct CodeConst {"):]
    branch = body.split("#else")[ct].split("#endif")[0]
    out = {}
    for name, value in re.findall(r"(\w+) = 0x([0-9A-F]{8})u", branch):
        hi, lo = int(value[:4], 16), int(value[4:], 16)
        assert hi == lo, name  # both halves alike
        bits = struct.pack("<I", lo << 16) if ct == 0 else struct.pack("<H", lo)
        out[name] = struct.unpack("<f" if ct == 0 else "<e", bits)[0]
    return out


@pytest.mark.parametrize("ct", [0, 1], ids=["bf16", "fp16"])
def test_byte_codes_are_exact_in_two_packed_fmas(ct):
    """q = 8: the code c = 16 hi + lo (less 128 when centred) from the two nibble codes in two packed fmas, 16 (BIAS +
    hi) - 17 BIAS (- 128), then (BIAS + lo) plus that: every constant is the value it names, and both fma results are
    exact in the compute type (each rounds to itself) for all 256 codes, so the weights are the bits they were with
    three fmas."""
    dtype = torch.bfloat16 if ct == 0 else torch.float16
    k = _code_constants(ct)
    bias = 128.0 if ct == 0 else 1024.0
    assert (k["NEG_BIAS"], k["ONE"], k["SIXTEEN"], k["NEG_BIAS_8"]) == (-bias, 1.0, 16.0, -(bias + 8))
    assert (k["NEG_17BIAS"], k["NEG_17BIAS_128"]) == (-17 * bias, -(17 * bias + 128))

    def exact(v: float) -> bool:
        return torch.tensor([v], dtype=torch.float64).to(dtype).double().item() == v

    for centred, const in ((False, k["NEG_17BIAS"]), (True, k["NEG_17BIAS_128"])):
        for hi in range(16):
            h16 = (bias + hi) * 16.0 + const  # the first fma, before its one rounding
            assert exact(h16), (centred, hi, h16)
            for lo in range(16):
                code = (bias + lo) * 1.0 + h16
                assert exact(code) and code == 16 * hi + lo - (128 if centred else 0), (centred, hi, lo, code)


def test_sched_knobs_are_checked():
    with pytest.raises(ValueError, match="copy_step"):
        GroupedConfig(2, 4, **_SERVED_R256, copy_step=0)
    with pytest.raises(ValueError, match="copy_step"):
        GroupedConfig(2, 3, ws=True, copy_step=3)
    with pytest.raises(ValueError, match="mma_depth"):
        GroupedConfig(1, 3, wgmma=False, mma_depth=2)
    with pytest.raises(ValueError, match="row_warpgroups=4"):
        GroupedConfig(1, 3, row_warpgroups=4)
    with pytest.raises(ValueError, match="row_warpgroups=2"):
        GroupedConfig(1, 3, wgmma=False, row_warpgroups=2)
    assert GroupedConfig(2, 4, rows=256, row_warpgroups=4).threads == 512
    assert GroupedConfig(1, 3, row_warpgroups=2).threads == 256 and GroupedConfig(1, 3).threads == 128
    assert GroupedConfig(2, 4, rows=256) == GroupedConfig(2, 4, rows=256, row_warpgroups=2)  # the usual form resolved


@pytest.mark.parametrize("cfg", [GroupedConfig(2, 3, rows=256), GroupedConfig(2, 3, rows=256, red_v4=True),
                                 GroupedConfig(1, 3), GroupedConfig(4, 3, red_v4=True)],
                         ids=["r256", "r256_red_v4", "r128_wn1", "w256_red_v4"])
def test_wgmma_variants_assemble_without_serialization_or_spills(cfg):
    """The served wgmma kernels (w13 and w2, up to 4 and 8 bits): ptxas keeps their MMAs asynchronous (no C7510 /
    C7515 serialization warning, which would make every wgmma wait for the one before) and spills nothing up to 4
    bits; at 256 x 128 the 8-bit w13 spills 8 bytes and red_v4's w2 4 (docs/kernels.md), no more."""
    for mode, bits in ((0, 4), (1, 4), (0, 8)):
        report = ptxas_report(cfg.source, "ap_grouped_gemm", "90a", gemm_defines(mode, cfg, bits, 128, 0))
        gemm = report[report.index("entry function 'ap_grouped_gemm'"):]
        serialized = [line for line in report.splitlines() if "ptxas" in line and "warning" in line
                      and ("wgmma" in line or "C751" in line)]
        assert not serialized, (cfg, mode, bits, serialized)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", gemm)
        assert spill, gemm[:400]
        allowed = 8 if cfg.rows == 256 and (bits == 8 or (cfg.red_v4 and mode == 1)) else 0
        assert max(int(spill[1]), int(spill[2])) <= allowed, (cfg, mode, bits, spill[0])


def test_offset_in_weights_builds_whole_weights_and_drops_the_offset_pass():
    """offset_in_weights: two packed fmas per weight pair (the centred code exactly, then (c - KC) A + (z + KC A))
    where the default has one, and w2 keeps none of the default's fp32 offset fmas (64 per chunk and bitwidth at
    128 x 64; w2's only other fp32 math is a handful)."""

    def ops(cfg):
        sass = sass_of(compile_to_cubin(gemm_defines(1, cfg, 4, 128, 0), "90a"))
        return {op: sum(f" {op}" in line for line in sass.splitlines()) for op in ("HFMA2", "FFMA", "HGMMA")}

    served, whole = ops(GroupedConfig(1, 3)), ops(GroupedConfig(1, 3, offset_in_weights=True))
    assert whole["HGMMA"] == served["HGMMA"]
    assert whole["HFMA2"] >= 1.9 * served["HFMA2"]
    # the default: 4 bitwidths x 64 offset fmas per chunk; the offset in the weights: only the row coefficients of each
    # group (the centred offset, a few fmas per bitwidth)
    assert served["FFMA"] >= 4 * 64 and whole["FFMA"] <= 4 * 8


def test_refill_lag_two_drains_the_mmas_only_after_the_mainloop():
    """refill_lag=2: no wgmma.wait_group 0 before a refill. With the offset in the weights the only full drain left
    per bitwidth is the one after the mainloop (one per instantiated bitwidth, 4 at a 4-bit parent), where refilling
    the chunk just read drains once more per chunk; the k16 steps' waits for all but the newest MMA stay."""

    def waits(cfg):
        sass = sass_of(compile_to_cubin(gemm_defines(0, cfg, 4, 128, 0), "90a"))
        return {n: sum(f"WARPGROUP.DEPBAR.LE gsb0, 0x{n}" in line for line in sass.splitlines()) for n in (0, 1)}

    lag1 = waits(GroupedConfig(2, 3, rows=256, offset_in_weights=True))
    lag2 = waits(GroupedConfig(2, 3, rows=256, offset_in_weights=True, refill_lag=2))
    assert lag2[0] == 4 and lag1[0] == 2 * lag2[0], (lag1, lag2)
    assert lag2[1] == lag1[1] > 0
    # 128 x 256 at an 8-bit parent: bitwidths 1-4 keep three stages and the lag (one drain each), 5-8 fit two stages
    # and drain before each refill (two each)
    w256 = GroupedConfig(4, 3, offset_in_weights=True, refill_lag=2)
    sass = sass_of(compile_to_cubin(gemm_defines(0, w256, 8, 128, 0), "90a"))
    assert sum("WARPGROUP.DEPBAR.LE gsb0, 0x0" in line for line in sass.splitlines()) == 4 * 1 + 4 * 2
    # 256 x 128 at four stages, 8-bit parent: bitwidths 1-4 run four stages, 5-8 three: the lag holds throughout (one
    # drain each)
    r256s4 = GroupedConfig(2, 4, rows=256, offset_in_weights=True, refill_lag=2)
    sass = sass_of(compile_to_cubin(gemm_defines(0, r256s4, 8, 128, 0), "90a"))
    assert sum("WARPGROUP.DEPBAR.LE gsb0, 0x0" in line for line in sass.splitlines()) == 8


def test_w256_halves_the_decode_per_mma():
    """128 x 256: one m64n256k16 per warpgroup and k16 step (half the 256 x 128 kernel's MMA instructions, each twice
    as wide) on half the decode per warp (16 rows, not 32): half the packed fmas."""

    def mix(cfg):
        sass = sass_of(compile_to_cubin(gemm_defines(0, cfg, 4, 128, 0), "90a"))
        return collections.Counter(re.findall(r"HGMMA\.(64x(?:64|128|256)x16)\.F32", sass)), sass.count(" HFMA2")

    (served, fmas), (w256, w256_fmas) = mix(GroupedConfig(2, 3, rows=256)), mix(GroupedConfig(4, 3))
    assert set(served) == {"64x128x16"} and served["64x128x16"] > 0
    assert w256 == {"64x256x16": served["64x128x16"] // 2}
    assert fmas // 2 <= w256_fmas <= fmas // 2 + 2  # + the epilogue's few


def test_prebuild_skips_configs_whose_stages_do_not_fit():
    """A sweep's parallel prebuild leaves out (and names) a config that cannot run at the layer's parent bitwidth,
    before anything needs a GPU: the warp-specialized kernel at four stages holds up to 4-bit planes."""
    w13 = random_ap_projection(4, 2 * 256, 256, [8] * 4, table_kind="ubcq", bits_min=4).weights
    w2 = random_ap_projection(4, 256, 256, [8] * 4, table_kind="ubcq", bits_min=4).weights
    too_big = GroupedConfig(2, 4, ws=True)
    skipped = prebuild_grouped([too_big, too_big], w13, w2, torch.bfloat16)
    assert len(skipped) == 1 and "wn=2, stages=4" in skipped[0] and "shared memory" in skipped[0]


@needs_cuda
def test_prebuild_builds_what_the_calls_use():
    p13, p2 = _layer(8, 256, 256, [4] * 8, [3] * 8, seed=2)
    configs = [GroupedConfig(4, 3, red_v4=True), GroupedConfig(2, 3, rows=256, red_v4=True)]
    assert prebuild_grouped(configs, p13.weights, p2.weights, torch.bfloat16) == []
    tw, ids = routing(90, 8, 2, "random", seed=4)
    x = torch.randn(90, 256, device="cuda", dtype=torch.bfloat16)
    ap_fused_moe_grouped(x, tw, ids, p13.weights, p2.weights, config=configs[0])  # builds the prep kernel
    before = cached_kernel.cache_info().misses
    for cfg in configs:
        ap_fused_moe_grouped(x, tw, ids, p13.weights, p2.weights, config=cfg)
    assert cached_kernel.cache_info().misses == before


def test_l2_prefetch_hint_reaches_both_grouped_kernels():
    for ws in (False, True):
        for pf, tag in ((0, None), (128, "LTC128B"), (256, "LTC256B")):
            cfg = GroupedConfig(wn=1, ws=ws, l2_prefetch=pf)
            sass = sass_of(compile_to_cubin(gemm_defines(0, cfg, 4, 128, 0), gemm_arch(cfg, "90"), name=cfg.kernel_name,
                                            source=cfg.source))
            copies = [line for line in sass.splitlines() if "LDGSTS" in line and ".128" in line]
            assert copies, "no 16-byte cp.async in the kernel"
            assert all((tag in line) if tag else ("LTC" not in line) for line in copies), (ws, pf)
    with pytest.raises(ValueError, match="l2_prefetch"):
        GroupedConfig(l2_prefetch=64)


def test_configs_and_refusals():
    # 256 rows x 128 pairs from 48 pairs per expert (four warpgroups), 128 rows x 64 pairs below (two)
    assert default_grouped_config(2048, 2, 8) == GroupedConfig(wn=2, stages=4, rows=256, row_warpgroups=4, red_v4=True,
                                                               offset_in_weights=True, refill_lag=2, copy_step=2)
    assert default_grouped_config(2048, 2, 8).threads == 512
    assert default_grouped_config(2048, 8, 128).rows == 256 and default_grouped_config(512, 2, 8).rows == 256
    assert default_grouped_config(1024, 8, 128).rows == 256 and default_grouped_config(192, 2, 8).rows == 256  # 64, 48
    small = GroupedConfig(wn=1, stages=3, row_warpgroups=2)
    assert default_grouped_config(512, 8, 128) == small == default_grouped_config(188, 2, 8) and small.threads == 256
    # the routing's size check reads the block width without building the config: the same at every size
    from pagedweight.kernels.cuda_grouped import default_block_m

    for m, topk, experts in ((188, 2, 8), (192, 2, 8), (512, 8, 128), (1024, 8, 128), (32768, 8, 128), (1, 4, 60)):
        assert default_block_m(m, topk, experts) == default_grouped_config(m, topk, experts).block_m
    assert GroupedConfig(wn=2, stages=3).shared_bytes(8) == 3 * 49 * 1024 + 1024  # 48.5 KB stages, 1 KB aligned
    with pytest.raises(ValueError, match="wn"):
        GroupedConfig(wn=3)
    with pytest.raises(ValueError, match="stages"):
        GroupedConfig(stages=5)
    with pytest.raises(ValueError, match="wgmma=True"):
        GroupedConfig(ws=True, wgmma=False)
    with pytest.raises(ValueError, match="red_v4"):
        GroupedConfig(ws=True, red_v4=True)
    with pytest.raises(ValueError, match="offset_in_weights"):
        GroupedConfig(ws=True, offset_in_weights=True)
    # red_v4 stages w2's [128 pairs][256 + 4 rows] float32 results (130 KB) in the ring: more than two 49 KB stages
    # of a 4-bit parent, less than three 65 KB stages of an 8-bit one
    assert GroupedConfig(wn=2, stages=2, rows=256, red_v4=True).ring_bytes(4) == 130 * 1024
    assert GroupedConfig(wn=2, stages=2, rows=256).ring_bytes(4) == 2 * 49 * 1024
    assert GroupedConfig(wn=2, stages=3, rows=256, red_v4=True).ring_bytes(8) == 3 * 65 * 1024
    assert "-DREDV=1" in gemm_defines(1, GroupedConfig(rows=256, red_v4=True), 8, 128, 0)
    assert "-DREDV=0" in gemm_defines(0, GroupedConfig(rows=256, red_v4=True), 8, 128, 0)  # w13 has no reduction
    with pytest.raises(ValueError, match="rows must be 128 or 256"):
        GroupedConfig(rows=192)
    for bad in (dict(refill_lag=3), dict(refill_lag=2, stages=2), dict(refill_lag=2, wgmma=False),
                dict(refill_lag=2, ws=True)):
        with pytest.raises(ValueError, match="refill_lag"):
            GroupedConfig(**bad)
    assert "-DLAG=2" in gemm_defines(0, GroupedConfig(refill_lag=2), 8, 128, 0)
    for bad in (dict(ws=True), dict(wgmma=False)):
        with pytest.raises(ValueError, match="single-role wgmma"):
            GroupedConfig(rows=256, **bad)
    r256 = GroupedConfig(wn=2, stages=3, rows=256)
    assert r256.threads == 256 and r256.shared_bytes(8) == 3 * 65 * 1024 + 1024  # 128 pairs + 8 planes x 256 rows
    assert GroupedConfig(wn=1, stages=4, rows=256).shared_bytes(8) <= SHARED_LIMIT < r256.shared_bytes(8) + 65 * 1024
    # 128 rows x 256 pairs: two warpgroups (64 rows each), 64 KB of activations per stage; three whole stages fit up
    # to 4-bit planes; at an 8-bit parent the ring is what one block holds (224 KB beside the alignment and the slot
    # arrays), three stages for the blocks up to 4 bits and two above
    w256 = GroupedConfig(wn=4, stages=3)
    assert w256.threads == 256 and w256.block_m == 256 and w256.shared_bytes(4) == 3 * 73 * 1024 + 1024
    assert w256.ring_bytes(8) == 224 * 1024 and w256.shared_bytes(8) <= SHARED_LIMIT
    assert GroupedConfig(wn=4, stages=2).ring_bytes(8) == 2 * 81 * 1024
    assert {"-DWGR=2", "-DTPW=1", "-DQFIT=1"} <= set(gemm_defines(0, w256, 4, 128, 0))
    assert "-DQFIT=0" in gemm_defines(0, r256, 4, 128, 0)
    # 256 x 128 at four stages: sized per bitwidth, the ring is what one block holds (225 KB): four stages up to
    # 4-bit planes (49 KB each), three above (65 KB) at an 8-bit parent
    r256s4 = GroupedConfig(wn=2, stages=4, rows=256)
    assert r256s4.q_fit and r256s4.ring_bytes(8) == 225 * 1024 and r256s4.shared_bytes(8) <= SHARED_LIMIT
    assert r256s4.ring_bytes(8) // (49 * 1024) == 4 and r256s4.ring_bytes(8) // (65 * 1024) == 3
    assert "-DQFIT=1" in gemm_defines(0, r256s4, 8, 128, 0) and not GroupedConfig(1, 4, rows=256).q_fit
    # persistent: stages of one size only (the next tile's copies land in the same stages whatever its bitwidth)
    for bad in (dict(wn=4), dict(wn=2, stages=4, rows=256), dict(ws=True)):
        with pytest.raises(ValueError, match="persistent applies"):
            GroupedConfig(persistent=True, **bad)
    assert "-DPERSIST=1" in gemm_defines(1, GroupedConfig(2, 3, rows=256, persistent=True), 8, 128, 0)
    assert "-DPERSIST=0" in gemm_defines(1, r256, 8, 128, 0)
    assert {"-DWGR=2", "-DTPW=2"} <= set(gemm_defines(0, r256, 4, 128, 0))
    assert {"-DWGR=1", "-DTPW=2"} <= set(gemm_defines(0, GroupedConfig(wn=2), 4, 128, 0))
    for bad in (dict(rows=256), dict(ws=True), dict(wgmma=False)):
        with pytest.raises(ValueError, match="wn=4"):
            GroupedConfig(wn=4, **bad)
    ws = GroupedConfig(wn=2, stages=3, ws=True)
    assert ws.threads == 384 and ws.shared_bytes(8) == 3 * 49 * 1024 + 2 * 32 * 1024 + 1024  # + two weight tiles
    assert GroupedConfig(wn=2, stages=4, ws=True).shared_bytes(8) > SHARED_LIMIT

    with pytest.raises(ValueError, match="sm_90"):
        gemm_arch(GroupedConfig(), "80")
    assert gemm_arch(GroupedConfig(wgmma=False), "80") == "80"
    w13 = random_ap_projection(4, 2 * 384, 256, [4] * 4, table_kind="ubcq", bits_min=4).weights
    w2 = random_ap_projection(4, 256, 384, [4] * 4, table_kind="ubcq", bits_min=4).weights
    assert "CUDA" in grouped_unsupported(w13)
    bcq = random_ap_projection(1, 64, 256, [4], table_kind="bcq", bits_min=4).weights
    g32 = random_ap_projection(1, 64, 256, [4], table_kind="ubcq", group_size=32, bits_min=4).weights
    assert "ubcq" in grouped_unsupported(bcq) and "neither 64 nor a multiple of 128" in grouped_unsupported(g32)
    assert "CUDA" in grouped_moe_unsupported(w13, w2)
    x = torch.randn(3, 256)
    tw, ids = torch.rand(3, 2), torch.randint(0, 4, (3, 2))
    with pytest.raises(ValueError, match="not on a CUDA device"):
        ap_fused_moe(x, tw, ids, w13, w2, kernel="grouped")
    with pytest.raises(ValueError, match="MoE layer"):
        ap_linear(x, w13, kernel="grouped")


def test_tail64_layers_take_the_offset_in_the_weights_and_their_own_kernels():
    """Groups of 64 (an intermediate size that is an odd multiple of 64, Qwen1.5-MoE's TP-2 shard or Gemma-4's 704,
    converted with --group-size 64) are read with the offset in the weights on the plain launch: a default config
    takes it on, an explicit one without it is refused naming the fix; the 64-tail's kernels build with -DTAIL64 (the
    others' defines, hence their cubins, are unchanged), the prep builds at groups of 64, and the GEMM itself refuses
    groups of 64 without the offset in the weights."""
    w13 = random_ap_projection(2, 640, 256, [4] * 2, table_kind="ubcq", bits_min=4).weights
    w13_64 = random_ap_projection(2, 640, 256, [4] * 2, table_kind="ubcq", group_size=64, bits_min=4).weights
    w2 = random_ap_projection(2, 256, 320, [4] * 2, table_kind="ubcq", group_size=64, bits_min=4).weights
    w2_128 = random_ap_projection(2, 256, 384, [4] * 2, table_kind="ubcq", bits_min=4).weights
    plain, with_ow = GroupedConfig(1, 3), GroupedConfig(1, 3, offset_in_weights=True)
    assert grouped_layer_config(plain, w13, w2, explicit=False) == with_ow
    assert grouped_layer_config(plain, w13_64, w2_128, explicit=False) == with_ow  # w13's groups of 64 too
    served = default_grouped_config(2048, 2, 8)
    assert grouped_layer_config(served, w13, w2, explicit=True) == served  # the default already has it
    assert grouped_layer_config(plain, w13, w2_128, explicit=True) == plain
    for bad in (plain, GroupedConfig(2, 3, ws=True), GroupedConfig(1, 3, offset_in_weights=True, persistent=True)):
        with pytest.raises(ValueError, match="offset_in_weights=True, persistent=False, ws=False"):
            grouped_layer_config(bad, w13_64, w2, explicit=True)
    assert "-DOFFW=1" in prep_defines(64, 0, torch.bfloat16) and "-DOFFW=1" not in prep_defines(128, 0, torch.bfloat16)
    assert_cubins([compile_to_cubin(prep_defines(64, 0, torch.bfloat16), "90a", name="ap_grouped_prep")])
    with pytest.raises(ValueError, match="plain single-role launch"):
        gemm_defines(1, GroupedConfig(1, 3, offset_in_weights=True, persistent=True), 4, 64, 0, tail64=True)
    assert "-DTAIL64=1" in gemm_defines(1, served, 4, 64, 0, tail64=True)
    assert not any("TAIL64" in d for d in gemm_defines(1, served, 4, 128, 0))
    cubins = [compile_to_cubin(gemm_defines(mode, cfg, 4, group, 0, tail64=True), "90a")
              for cfg in (served, GroupedConfig(1, 3, offset_in_weights=True)) for mode in (0, 1)
              for group in ((64, 128) if mode == 0 else (64,))]
    assert_cubins(cubins)
    with pytest.raises(RuntimeError, match="groups of 64|multiple of 128"):
        compile_to_cubin(gemm_defines(1, GroupedConfig(1, 3), 4, 64, 0, tail64=True), "90a")


def test_tail64_w2_copies_its_plane_rows_in_8_byte_halves():
    """K = 64 (mod 128): w2's plane rows are K / 8 = 8 (mod 16) bytes long, so every other one starts 8 bytes off a
    16-byte boundary, where a 16-byte cp.async reads the wrong bytes (session 34 on the GPU: every other output row
    wrong). Its -DTAIL64 build copies each 16-byte plane piece as two 8-byte copies; the activations (rows padded to
    whole chunks) keep their 16-byte copies."""
    served = default_grouped_config(2048, 2, 8)
    copies = {}
    for tail in (False, True):
        sass = sass_of(compile_to_cubin(gemm_defines(1, served, 4, 64, 0, tail64=tail), "90a"))
        copies[tail] = collections.Counter(re.sub(r"\.(BYPASS|ZFILL)", "", c)
                                           for c in re.findall(r"LDGSTS\.E[\w.]*", sass))
    plain_planes = copies[False]["LDGSTS.E.128"] - copies[True]["LDGSTS.E.128"]
    assert plain_planes > 0 and copies[False]["LDGSTS.E.64"] == 0
    assert copies[True]["LDGSTS.E.64"] == 2 * plain_planes


# ---------------------------------------------------------------- CUDA: correctness


def _layer(num_experts, hidden, inter, bits13, bits2, seed=0, group=128):
    p13 = random_ap_projection(num_experts, 2 * inter, hidden, bits13, table_kind="ubcq", group_size=group,
                               bits_min=1, seed=seed, device="cuda")
    p2 = random_ap_projection(num_experts, hidden, inter, bits2, table_kind="ubcq", group_size=group, bits_min=1,
                              seed=seed + 1, device="cuda")
    return p13, p2


@needs_cuda
@pytest.mark.parametrize(
    "num_experts,topk,m,pattern",
    [(8, 2, 64, "random"), (8, 2, 300, "random"), (8, 1, 200, "one_expert"), (16, 8, 97, "one_expert"),
     (60, 4, 130, "random"), (4, 1, 257, "all_one")],
)
@pytest.mark.parametrize("group", list(CONFIG_GROUPS))
def test_moe_matches_reference(num_experts, topk, m, pattern, group):
    hidden, inter = 640, 384  # w13: five chunks of K; w2: three (a partial pipeline at 4 stages)
    bits13 = [1 + (e % 8) for e in range(num_experts)]  # every bitwidth 1..8, mixed in one launch
    bits2 = [1 + ((e + 3) % 8) for e in range(num_experts)]
    p13, p2 = _layer(num_experts, hidden, inter, bits13, bits2, seed=num_experts + m)
    if pattern == "all_one":  # one expert takes every token, the others none
        tw, ids = routing(m, num_experts, topk, "random", seed=m)
        ids.fill_(1)
    else:
        tw, ids = routing(m, num_experts, topk, pattern, seed=m)
    if group == "base":
        check_moe_dtypes(p13, p2, tw, ids, m, hidden, "grouped")
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights)
    for cfg in CONFIG_GROUPS[group]:
        out = ap_fused_moe_grouped(x, tw, ids, p13.weights, p2.weights, config=cfg)
        assert rel_err(out, ref) < 2e-2, cfg


@needs_cuda
@pytest.mark.parametrize("group,inter", [(128, 768), (256, 1536)])
def test_moe_group_sizes_and_real_intermediate(group, inter):
    p13, p2 = _layer(8, 1024, inter, [4, 3, 5, 2, 8, 6, 7, 1], [2, 4, 6, 8, 1, 3, 5, 7], group=group)
    for m in (200, 1000):
        tw, ids = routing(m, 8, 2, "random", seed=group + m)
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights)
        assert rel_err(ap_fused_moe(x, tw, ids, p13.weights, p2.weights, kernel="grouped"), ref) < 2e-2
        for cfg in (*WS_MAIN, *R256_MAIN):
            assert rel_err(ap_fused_moe_grouped(x, tw, ids, p13.weights, p2.weights, config=cfg), ref) < 2e-2, cfg


@needs_cuda
@pytest.mark.parametrize("m,group13", [(40, 128), (700, 128), (700, 64)])
def test_moe_intermediate_odd_multiple_of_64(m, group13):
    """Intermediate 320 (five groups of 64: w2 reads two and a half chunks, w13's last 256-row block holds 64 outputs),
    like Qwen1.5-MoE's TP-2 shard (704): the defaults (both block shapes, by m), four warpgroups and two, and 128 x 64
    with the offset in the weights, every bitwidth mixed, w13 in groups of 128 or (a --group-size 64 conversion) 64,
    against the reference."""
    p13 = random_ap_projection(8, 2 * 320, 640, [1 + e for e in range(8)], table_kind="ubcq", group_size=group13,
                               bits_min=1, seed=m, device="cuda")
    p2 = random_ap_projection(8, 640, 320, [8 - e for e in range(8)], table_kind="ubcq", group_size=64, bits_min=1,
                              seed=m + 1, device="cuda")
    assert grouped_moe_unsupported(p13.weights, p2.weights) is None
    tw, ids = routing(m, 8, 2, "random", seed=m)
    x = torch.randn(m, 640, device="cuda", dtype=torch.bfloat16)
    ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights)
    assert rel_err(ap_fused_moe(x, tw, ids, p13.weights, p2.weights, kernel="grouped"), ref) < 2e-2
    for cfg in (GroupedConfig(2, 4, **_SERVED_R256, row_warpgroups=4, copy_step=2), GroupedConfig(2, 4, **_SERVED_R256),
                GroupedConfig(1, 3, offset_in_weights=True), GroupedConfig(1, 3, row_warpgroups=2,
                                                                          offset_in_weights=True)):
        out = ap_fused_moe_grouped(x, tw, ids, p13.weights, p2.weights, config=cfg)
        assert rel_err(out, ref) < 2e-2, cfg
    with pytest.raises(ValueError, match="offset_in_weights=True"):
        ap_fused_moe_grouped(x, tw, ids, p13.weights, p2.weights, config=GroupedConfig(1, 3))


@needs_cuda
def test_moe_large_activations_and_uniform_bits():
    """Activations far beyond fp16's range (bf16 keeps them), all positive (large group sums: the z S term), 4 bits.
    The offset in the weights must be centred here: its rounding adds up coherently over a group's inputs, and an
    uncentred z = o - 15 s missed the bound (4.1e-2, H100 session 31)."""
    p13, p2 = _layer(8, 512, 256, [4] * 8, [4] * 8, seed=3)
    tw, ids = routing(150, 8, 2, "random", seed=5)
    x = (torch.rand(150, 512, device="cuda") * 1e5).to(torch.bfloat16)
    ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights)
    assert rel_err(ap_fused_moe(x, tw, ids, p13.weights, p2.weights, kernel="grouped"), ref) < 2e-2
    for cfg in (*WS_MAIN, *R256_MAIN, *W256_U4_CONFIGS, *OW_CONFIGS, LAG_CONFIGS[0]):
        assert rel_err(ap_fused_moe_grouped(x, tw, ids, p13.weights, p2.weights, config=cfg), ref) < 2e-2, cfg


@needs_cuda
def test_moe_skips_non_local_experts():
    p13, p2 = _layer(8, 256, 256, [4] * 8, [5] * 8, seed=1)
    tw, ids = routing(100, 8, 2, "random", seed=1)
    ids[::3, 1] = -1
    x = torch.randn(100, 256, device="cuda", dtype=torch.bfloat16)
    ref = ap_fused_moe_reference(x.float(), torch.where(ids < 0, 0.0, tw), ids.clamp(min=0), p13.weights, p2.weights)
    for cfg in (GroupedConfig(1), GroupedConfig(2, wgmma=False), *WS_MAIN, *R256_MAIN, *W256_U4_CONFIGS):
        assert rel_err(ap_fused_moe_grouped(x, tw, ids, p13.weights, p2.weights, config=cfg), ref) < 2e-2, cfg


@needs_cuda
def test_moe_graph_replay_follows_rewritten_page_table():
    p13, p2 = _layer(8, 256, 256, [8] * 8, [8] * 8)
    check_graph_replay(p13, p2, m=120, topk=2, kernel="grouped",
                       bit_mixes=([8] * 8, [3] * 8, [2, 5, 8, 3, 4, 6, 7, 1]))
    for cfg in (*R256_MAIN, W256_CONFIGS[1]):
        check_graph_replay(p13, p2, m=120, topk=2, kernel="grouped", bit_mixes=([3] * 8, [2, 5, 8, 3, 4, 6, 7, 1]),
                           call=lambda x, tw, ids, w13, w2, cfg=cfg: ap_fused_moe_grouped(x, tw, ids, w13, w2,
                                                                                          config=cfg))
