"""Launch configurations of the AP kernels and the default choice per problem size.

The defaults come from the H200 measurements in docs/results/kernel.md (benchmark/kernel_bench.py
sweeps the candidates); callers may pass their own `APKernelConfig` to override them.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton


# who rebuilds the prefill scratch (triton_dequant_moe.dequantize_chunk)
DEQUANT_KERNELS = ("auto", "cuda", "triton")


@dataclass(frozen=True)
class APKernelConfig:
    block_m: int = 16  # (token, slot) pairs per block, all of one expert; >= 16 (tl.dot minimum)
    block_n: int = 64  # output rows per block
    block_k: int = 128  # inputs per step; divides K and, for bcq, the group size
    split_k: int = 1  # K slices summed with float32 atomics (w2, linear, and w13 when not fused)
    num_warps: int = 4
    num_stages: int = 2
    prefetch: bool = False  # double-buffer plane words in registers (use with num_stages=1)
    fuse_gate_up: bool = False  # w13 only: gate and up tiles + silu in one program (vs. one tile + silu kernel)
    maxnreg: int | None = None  # register cap per thread: more resident warps to hide plane-load latency
    # w13 config only, prefill: > 0 = dequantize experts once per call, this many at a time, into a bf16/fp16
    # scratch (chunk x N x K x 2 bytes per projection) and run dense grouped GEMMs (triton_dequant_moe.py)
    dequant_chunk: int = 0
    # w13 config only, with dequant_chunk > 0: who runs the dense GEMMs on the scratch. "triton": ours
    # (triton_dequant_moe._dense_moe_kernel); "sglang": SGLang's own bf16 fused-MoE kernel with the config
    # SGLang picks (block_m then follows it). H200, M=2048 at 4 bits: equal on Mixtral (5.57 vs 5.48 ms),
    # ours 14% faster on Qwen1.5-MoE (1.64 vs 1.91 ms), so ours is the default (docs/results/kernel.md).
    dense_gemm: str = "triton"
    # w13 config only, with dequant_chunk > 0: who rebuilds the scratch ("auto": the CUDA kernel for bcq planes
    # on CUDA, Triton otherwise; triton_dequant_moe.dequantize_chunk), and whether chunk c + 1 is rebuilt on a
    # side stream while chunk c's GEMMs run (two scratch buffers of dequant_chunk experts each)
    dequant_kernel: str = "auto"
    dequant_overlap: bool = False

    def launch_options(self, on_cuda: bool) -> dict:
        """Triton launch keywords (the interpreter takes no register cap)."""
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None and on_cuda:
            opts["maxnreg"] = self.maxnreg
        return opts

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.block_k < 32:
            raise ValueError(f"block_k must be >= 32 (one plane word), got {self.block_k}")
        if self.dequant_chunk < 0:
            raise ValueError(f"dequant_chunk must be >= 0, got {self.dequant_chunk}")
        if self.dequant_kernel not in DEQUANT_KERNELS:
            raise ValueError(f"dequant_kernel must be one of {DEQUANT_KERNELS}, got {self.dequant_kernel!r}")
        if self.dense_gemm not in ("sglang", "triton"):
            raise ValueError(f"dense_gemm must be 'sglang' or 'triton', got {self.dense_gemm!r}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


def largest_block_k(k: int, group_size: int | None, cap: int = 128) -> int:
    """Largest power-of-two block_k <= cap dividing K (and the bcq group size)."""
    bk = cap
    while bk > 32 and (k % bk or (group_size is not None and group_size % bk)):
        bk //= 2
    if k % bk:
        raise ValueError(f"K={k} is not a multiple of 32")
    return bk


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Pairs per block from the mean pairs per expert: decode pads to 16, prefill amortizes tile rebuilds."""
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        return 16
    if per_expert <= 48:
        return 32
    if per_expert <= 192:
        return 64
    return 128


def split_k_for(blocks: int, k_tiles: int, num_sms: int, per_sm: int = 2) -> int:
    """Enough K slices that the grid holds about `per_sm` programs per SM (at most one slice per K tile)."""
    split = 1
    while blocks * split < per_sm * num_sms and split * 2 <= k_tiles:
        split *= 2
    return split


# Dequantize-then-GEMM once an expert has this many (token, slot) pairs on average, with the per-projection
# scratch of a chunk of experts capped at this many bytes. The dequantization is a fixed cost per call (every
# expert rebuilt once); the tile kernels rebuild every weight once per block of tokens instead, so the tiles win
# with few pairs per expert and the rebuild with many (both timed side by side: docs/results/kernel.md, session 7).
DEQUANT_MIN_PAIRS_PER_EXPERT = 64
DEQUANT_SCRATCH_BYTES = 512 * 2**20


def default_moe_configs(
    num_tokens: int, topk: int, num_experts: int, inter: int, hidden: int,
    k13: tuple[int, int | None], k2: tuple[int, int | None], num_sms: int = 132,
    dequant_min_pairs_per_expert: float = DEQUANT_MIN_PAIRS_PER_EXPERT,
) -> tuple[APKernelConfig, APKernelConfig]:
    """(w13 config, w2 config). k13/k2 = (K, bcq group size or None). The prefill (dequantize-then-GEMM)
    path is picked from `dequant_min_pairs_per_expert` pairs per expert on average."""
    pairs = num_tokens * topk
    bm = block_m_for(pairs, num_experts)
    experts_hit = min(num_experts, pairs)
    m_blocks = max(experts_hit, triton.cdiv(pairs, bm))  # every expert hit owns at least one block
    big = bm >= 64
    bk13 = largest_block_k(*k13)
    bk2 = largest_block_k(*k2)
    if pairs >= dequant_min_pairs_per_expert * num_experts:
        # prefill: the tile kernels would rebuild each weight once per block of tokens (4x the bf16 GEMM's
        # time at M=2048 on Mixtral, measured); dequantize each expert once and run dense GEMMs instead
        chunk = max(1, DEQUANT_SCRATCH_BYTES // (2 * inter * k13[0] * 2))
        bkd = 64 if k13[0] % 64 == 0 and (k13[1] is None or k13[1] % 64 == 0) else bk13
        bkd2 = 64 if k2[0] % 64 == 0 and (k2[1] is None or k2[1] % 64 == 0) else bk2
        warps = 8 if bm >= 128 else 4
        cfg13 = APKernelConfig(block_m=bm, block_n=128, block_k=bkd, num_warps=warps, num_stages=3, dequant_chunk=chunk)
        cfg2 = APKernelConfig(block_m=bm, block_n=128, block_k=bkd2, num_warps=warps, num_stages=3)
        return cfg13, cfg2
    if big:  # large blocks: fused gate/up tiles, wide blocks, Triton-pipelined loads
        cfg13 = APKernelConfig(block_m=bm, block_n=128, block_k=bk13, num_warps=8, num_stages=2, fuse_gate_up=True)
        split = split_k_for(m_blocks * triton.cdiv(hidden, 128), k2[0] // bk2, num_sms)
        cfg2 = APKernelConfig(block_m=bm, block_n=128, block_k=bk2, split_k=split, num_warps=8, num_stages=2)
        return cfg13, cfg2
    # decode: block_n = 16 * num_warps (the MMA gives each warp 16 rows; a smaller block_n makes warps rebuild
    # the same rows), one tile per program, plane words double-buffered in registers, registers capped at
    # 128 so 4 programs share an SM (ncu: 8% achieved occupancy and 54% no-eligible cycles uncapped)
    # 4 such programs fit an SM: split K until the grid has ~4 per SM (Qwen M=1: 4 experts x 44 blocks)
    split13 = split_k_for(m_blocks * triton.cdiv(2 * inter, 64), k13[0] // bk13, num_sms, per_sm=4)
    cfg13 = APKernelConfig(block_m=bm, block_n=64, block_k=bk13, split_k=split13, num_warps=4, num_stages=1,
                           prefetch=True, maxnreg=128)
    split = split_k_for(m_blocks * triton.cdiv(hidden, 64), k2[0] // bk2, num_sms, per_sm=4)
    cfg2 = APKernelConfig(block_m=bm, block_n=64, block_k=bk2, split_k=split, num_warps=4, num_stages=1,
                          prefetch=True, maxnreg=128)
    return cfg13, cfg2


# Dense AP linears (ap_linear) dequantize their weight once per call from this many rows of x on: the same
# trade as DEQUANT_MIN_PAIRS_PER_EXPERT for one expert (benchmark/linear_bench.py times both paths).
LINEAR_DEQUANT_MIN_M = 128


def default_linear_config(m: int, n: int, k: int, group_size: int | None, num_sms: int = 132,
                          dequant_min_m: int = LINEAR_DEQUANT_MIN_M) -> APKernelConfig:
    """Tile rebuild (split-K at small M) below `dequant_min_m` rows; from there dequantize-then-GEMM
    (dequant_chunk = 1: the weight rebuilt once into a scratch, then one cuBLAS GEMM)."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 256 else 128
    if m >= dequant_min_m:
        return APKernelConfig(block_m=bm, block_n=64, block_k=largest_block_k(k, group_size), dequant_chunk=1)
    bn = 128 if bm >= 64 else 64
    bk = largest_block_k(k, group_size)
    split = split_k_for(triton.cdiv(m, bm) * triton.cdiv(n, bn), k // bk, num_sms)
    return APKernelConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=8 if bm >= 64 else 4)


# The activation-side-table kernel (cuda_lut.py, CUDA, bcq) serves decode sizes. Its cost grows with the
# (token, slot) pairs (one table lookup per pair and plane nibble), the tile kernels' with the experts hit
# (tensor cores take an expert's pairs for free). So the LUT kernel runs while the pairs per expert expected to be
# hit stay at most LUT_MAX_PAIRS_PER_EXPERT, and ap_linear while x has at most LINEAR_LUT_MAX_M rows (the
# crossovers measured: docs/results/kernel.md, the LUT kernel's sessions; benchmark/linear_bench.py).
LUT_MAX_PAIRS_PER_EXPERT = 2.0
LINEAR_LUT_MAX_M = 4


def expected_experts_hit(num_tokens: int, topk: int, num_experts: int) -> float:
    """Experts hit by num_tokens tokens routing to topk distinct experts each, under uniform routing."""
    if num_experts <= 0:
        return 0.0
    miss = 1.0 - min(topk, num_experts) / num_experts
    return num_experts * (1.0 - miss**num_tokens)


def prefer_lut(num_tokens: int, topk: int, num_experts: int,
               max_pairs_per_expert: float = LUT_MAX_PAIRS_PER_EXPERT) -> bool:
    """Whether the LUT kernel is the default for this routing size (no device sync: expected, not actual hits)."""
    hit = expected_experts_hit(num_tokens, topk, num_experts)
    return num_tokens * topk <= max_pairs_per_expert * max(hit, 1.0)


# The tensor-core kernel (cuda_mma.py, CUDA, ubcq) serves the sizes between one pair per expert and the
# prefill path: its cost is per weight (the pairs of a block ride in the MMA's N dimension), the LUT kernel's per
# pair, so it takes over from the LUT kernel above MMA_MIN_PAIRS_PER_EXPERT and hands over to the tiles / prefill
# path above MMA_MAX_PAIRS_PER_EXPERT (all timed in one run: docs/results/kernel.md, session 9).
MMA_MIN_PAIRS_PER_EXPERT = 1.3
MMA_MAX_PAIRS_PER_EXPERT = 12.0


def prefer_mma(num_tokens: int, topk: int, num_experts: int) -> bool:
    """Whether the MMA kernel is the default for this routing size (ubcq tables; other kinds fall through to
    the LUT / tile / prefill rules)."""
    hit = max(expected_experts_hit(num_tokens, topk, num_experts), 1.0)
    per_expert = num_tokens * topk / hit
    return num_tokens > 1 and MMA_MIN_PAIRS_PER_EXPERT < per_expert <= MMA_MAX_PAIRS_PER_EXPERT


# The fold kernel (cuda_fold.py, CUDA, ubcq, groups of a multiple of 128) is asked before the MMA and LUT kernels for
# one token, and for more tokens while the intermediate size is at least FOLD_MIN_INTERMEDIATE and the pairs per
# expected expert hit stay <= FOLD_MAX_PAIRS_PER_EXPERT. Below that intermediate size w2 has too few chunks of K
# to fill its ring and the MMA / LUT kernels are ahead (the kernels side by side: docs/results/kernel.md,
# session 16: fold behind at Qwen3's TP-2 shard, I = 384; with the block-shared activations, sessions 19-20: ahead
# there too).
FOLD_MAX_PAIRS_PER_EXPERT = 24.0
FOLD_MIN_INTERMEDIATE = 384


def prefer_fold(num_tokens: int, topk: int, num_experts: int, intermediate: int) -> bool:
    """Whether the fold kernel is the default for this routing size and expert shape (ubcq tables it can read;
    others fall through to the MMA / LUT / tile / prefill rules)."""
    if num_tokens == 1:
        return True
    hit = max(expected_experts_hit(num_tokens, topk, num_experts), 1.0)
    per_expert = num_tokens * topk / hit
    return num_tokens > 1 and intermediate >= FOLD_MIN_INTERMEDIATE and per_expert <= FOLD_MAX_PAIRS_PER_EXPERT


# The grouped kernel (cuda_grouped.py, CUDA, ubcq, groups of a multiple of 128) is asked after the fold, MMA and LUT
# kernels: from GROUPED_MIN_PAIRS_PER_EXPERT pairs per expected expert hit it replaces the tile kernels and the
# dequantize-then-GEMM prefill path at every larger size (it decodes the planes in its mainloop: no scratch of
# dequantized experts). A call past its own size limits (grouped_call_unsupported: 32-bit activation offsets, 65535
# token blocks) still falls to the Triton path (api.auto_moe_kernel). Measured against that path above 1024 pairs
# per expert: docs/results/kernel.md, session 37.
GROUPED_MIN_PAIRS_PER_EXPERT = 16.0


def prefer_grouped(num_tokens: int, topk: int, num_experts: int) -> bool:
    """Whether the grouped kernel is the default for this routing size (ubcq tables it can read; others fall
    through to the tile / prefill rules)."""
    hit = max(expected_experts_hit(num_tokens, topk, num_experts), 1.0)
    return GROUPED_MIN_PAIRS_PER_EXPERT <= num_tokens * topk / hit
