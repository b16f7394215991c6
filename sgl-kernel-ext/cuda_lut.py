"""Decode-size AP MoE and linear over bcq planes with activation-side tables (cuda_lut_gemv.cu, NVRTC).

Why CUDA C++ here: the kernel's inner step is a lookup into a 16-entry table in shared memory per plane
nibble. Triton has no indexed shared-memory load (its gathers from a table in global memory cost a load
per nibble and were no faster than rebuilding weights: docs/kernels.md), so this one kernel is compiled at
first use with NVRTC (shipped with torch's CUDA wheels; no toolkit needed) and launched on the current
stream, which CUDA graphs capture like any other launch. Everything else stays in Triton.

Scope: CUDA, bcq or ubcq tables with a group size that is a multiple of 128, K a multiple of 128, plane and table
addresses 16-byte aligned (the runtime's arena slots are 256-byte aligned). `lut_unsupported` says why a
block is not eligible; callers then use the Triton tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedweight.kernels.activation import act_defines
from pagedweight.kernels.align import moe_align_block_size
from pagedweight.kernels.nvrtc import compile_cubin, load_kernel
from pagedweight.kernels.weights import APMoEWeights

CHUNK = 128  # inputs per step of the kernel (one 16-byte load per plane and row)
NTHREADS = 256
# per pair and chunk: 32 nibble tables of 16 floats, 16 floats of padding (bank offset), the chunk's sum
TABLE_BYTES_PER_CHUNK = ((CHUNK // 4) * 16 + 16) * 4 + 4
MAX_SHARED_BYTES = 96 * 1024  # two blocks per SM on Hopper
_SOURCE = Path(__file__).with_name("cuda_lut_gemv.cu")
_XT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

MODE_W13, MODE_W2, MODE_LINEAR = 0, 1, 2


@dataclass(frozen=True)
class LUTConfig:
    block_m: int  # (token, slot) pairs of one expert per block (rows of x for a linear): 1, 2, 4 or 8
    n_per_block: int  # output rows per block (a multiple of 256; two threads per row, 128 rows per pass)
    k_per_split: int  # inputs per block; K slices are summed with float32 atomics
    l2_prefetch: int = 0  # L2 prefetch size (bytes) of the plane loads: 0, 128 or 256

    def __post_init__(self) -> None:
        if self.block_m not in (1, 2, 4, 8):
            raise ValueError(f"block_m must be 1, 2, 4 or 8, got {self.block_m}")
        if self.n_per_block <= 0 or self.n_per_block % NTHREADS:
            raise ValueError(f"n_per_block must be a positive multiple of {NTHREADS}, got {self.n_per_block}")
        if self.k_per_split <= 0 or self.k_per_split % CHUNK:
            raise ValueError(f"k_per_split must be a positive multiple of {CHUNK}, got {self.k_per_split}")
        if self.l2_prefetch not in (0, 128, 256):
            raise ValueError(f"l2_prefetch must be 0, 128 or 256, got {self.l2_prefetch}")

    def shared_bytes(self) -> int:
        return self.block_m * (self.k_per_split // CHUNK) * TABLE_BYTES_PER_CHUNK


def lut_unsupported(w: APMoEWeights) -> str | None:
    """Why the LUT kernel cannot serve `w` (None when it can)."""
    if not w.grouped:
        return f"table kind {w.table_kind!r} (the LUT kernel reads binary-coded planes only)"
    if w.group_size % CHUNK:
        return f"{w.table_kind} group size {w.group_size} is not a multiple of {CHUNK}"
    if w.K % CHUNK:
        return f"K={w.K} is not a multiple of {CHUNK}"
    if not w.page_table.is_cuda:
        return "the page table is not on a CUDA device"
    return None


def require_lut(name: str, w: APMoEWeights) -> None:
    """Raise, naming the reason, when the LUT kernel cannot serve `w`."""
    why = lut_unsupported(w)
    if why is not None:
        raise ValueError(f"{name}: the LUT kernel cannot run: {why}")


def block_m_for_rows(m: int) -> int:
    """Rows of x per block of a dense linear: the smallest block_m holding all of them (at most 8)."""
    return next((bm for bm in (1, 2, 4) if m <= bm), 8)


def block_m_for_pairs(num_pairs: int, num_experts: int) -> int:
    """Pairs per block from the mean pairs per expert hit (padding slots cost lookups too)."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    for bm in (1, 2, 4):
        if per_expert <= bm * 1.25:
            return bm
    return 8


def default_lut_config(active_blocks_m: int, block_m: int, n: int, k: int, num_sms: int,
                       blocks_per_sm: int = 4) -> LUTConfig:
    """256 rows per block (two threads per row, two passes); K split until the grid has ~`blocks_per_sm`
    blocks per SM (decode grids are small: Qwen1.5-MoE's w13 at M=1 is 4 experts x 11 row blocks)."""
    nb = NTHREADS
    n_blocks = -(-n // nb)
    kc = -(-k // CHUNK) * CHUNK
    while kc > 2 * CHUNK and (
        active_blocks_m * n_blocks * -(-k // kc) < blocks_per_sm * num_sms
        or LUTConfig(block_m, nb, kc).shared_bytes() > MAX_SHARED_BYTES
    ):
        kc = -(-(kc // 2) // CHUNK) * CHUNK
    while LUTConfig(block_m, nb, kc).shared_bytes() > MAX_SHARED_BYTES:
        kc -= CHUNK
    return LUTConfig(block_m=block_m, n_per_block=nb, k_per_split=kc)


def kernel_defines(mode: int, x_dtype: torch.dtype, block_m: int, bits_max: int, group_size: int,
                   direct: bool = False, uniform: bool = False, l2_prefetch: int = 0, activation: str = "silu") -> list[str]:
    """direct: one pair per block in routing order, its expert read from topk_ids (MoE modes, block_m 1);
    uniform: ubcq tables (one scale and the offset per group); activation: MODE_W2's act(gate) * up."""
    return [f"-DMODE={mode}", f"-DXT={_XT[x_dtype]}", f"-DBM={block_m}", f"-DPMAX={bits_max}", f"-DG={group_size}",
            f"-DDIRECT={int(direct)}", f"-DUNIFORM={int(uniform)}", f"-DL2PF={l2_prefetch}"] + (
                act_defines(activation) if mode == MODE_W2 else [])


def compile_to_cubin(defines: list[str], compute_capability: str) -> bytes:
    return compile_cubin(_SOURCE, "ap_lut_gemv", compute_capability, defines)


@functools.lru_cache(maxsize=None)
def _kernel(mode: int, x_dtype: torch.dtype, block_m: int, bits_max: int, group_size: int, direct: bool,
            uniform: bool, l2_prefetch: int, device_index: int, activation: str = "silu"):
    """The compiled kernel for one variant on one device (compiled once per process)."""
    defines = kernel_defines(mode, x_dtype, block_m, bits_max, group_size, direct, uniform, l2_prefetch, activation)
    return load_kernel(_SOURCE, "ap_lut_gemv", defines, device_index)


def _launch(mode: int, x: torch.Tensor, out: torch.Tensor, w: APMoEWeights, cfg: LUTConfig, grid_m: int,
            *, topk_weights=None, sorted_ids=None, expert_ids=None, post_pad=None, num_pairs: int, topk: int,
            row_index: int = 0, apply_w_in: bool = False, direct: bool = False, activation: str = "silu") -> None:
    if x.data_ptr() % 16:  # the kernel reads 4 activations per vector load
        x = x.clone()
    kernel = _kernel(mode, x.dtype, cfg.block_m, w.bits_max, w.group_size, direct, w.table_kind == "ubcq",
                     cfg.l2_prefetch, x.device.index or 0, activation)
    smem = cfg.shared_bytes()
    if smem > kernel._max_shared_mem_bytes:
        kernel.set_shared_memory_config(smem)
    dummy = out
    grid = (grid_m, -(-w.N // cfg.n_per_block), -(-w.K // cfg.k_per_split))
    kernel(
        grid=grid, block=(NTHREADS, 1, 1), shared_mem=smem,
        args=[
            x, out, w.page_table,
            topk_weights if topk_weights is not None else dummy,
            sorted_ids if sorted_ids is not None else dummy,
            expert_ids if expert_ids is not None else dummy,
            post_pad if post_pad is not None else dummy,
            num_pairs, topk, w.N, w.K, x.stride(0), out.stride(0), w.page_table.stride(0),
            cfg.k_per_split, cfg.n_per_block, row_index, int(apply_w_in), w.num_experts,
        ],
    )


def ap_fused_moe_lut(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: APMoEWeights, w2: APMoEWeights,
    *, activation: str = "silu", apply_router_weight_on_input: bool = False,
    configs: tuple[LUTConfig, LUTConfig] | None = None,
) -> torch.Tensor:
    """gate/up -> act(gate) * up -> down with routing weights, over the page tables: w13 into a float32 h, then w2
    with act(gate) * up (activation.py) applied while its tables are built, after the token/expert alignment. At one pair per block
    (block_m 1, the M=1 decode case) the kernels take the pairs in routing order with their experts read
    from topk_ids, so no alignment is launched; h and the output share one zeroed buffer (one memset)."""
    require_lut("w13", w13)
    require_lut("w2", w2)
    m, topk = topk_ids.shape
    num_pairs = m * topk
    if configs is None:
        configs = default_moe_lut_configs(m, topk, w13.num_experts, w13, w2, hidden.device)
    bm = configs[0].block_m
    if configs[1].block_m != bm:
        raise ValueError("w13 and w2 LUT configs must share block_m (one alignment)")
    x = hidden.contiguous()
    tw = topk_weights.contiguous().float()
    common = dict(topk_weights=tw, num_pairs=num_pairs, topk=topk, apply_w_in=apply_router_weight_on_input)
    if bm == 1:
        grid_m = num_pairs
        common.update(expert_ids=topk_ids.reshape(-1).to(torch.int32), direct=True)
    else:
        align = moe_align_block_size(topk_ids, bm, w13.num_experts)
        grid_m = align.max_blocks
        common.update(sorted_ids=align.sorted_ids, expert_ids=align.expert_ids, post_pad=align.num_tokens_post_padded)
    # both are summed into with float32 atomics (K slices; w2 also sums the top-k slots): one zeroed buffer
    acc = torch.zeros(num_pairs * w13.N + m * w2.N, dtype=torch.float32, device=x.device)
    h = acc[: num_pairs * w13.N].view(num_pairs, w13.N)
    out = acc[num_pairs * w13.N :].view(m, w2.N)
    _launch(MODE_W13, x, h, w13, configs[0], grid_m, **common)
    _launch(MODE_W2, h, out, w2, configs[1], grid_m, activation=activation, **common)
    return out.to(hidden.dtype)


def default_moe_lut_configs(m: int, topk: int, num_experts: int, w13: APMoEWeights, w2: APMoEWeights,
                            device: torch.device) -> tuple[LUTConfig, LUTConfig]:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    pairs = m * topk
    bm = block_m_for_pairs(pairs, num_experts)
    active = max(min(pairs, num_experts), -(-pairs // bm))  # blocks that do work (lower estimate)
    return (default_lut_config(active, bm, w13.N, w13.K, sms), default_lut_config(active, bm, w2.N, w2.K, sms))


def ap_linear_lut(x: torch.Tensor, w: APMoEWeights, row: int, bias: torch.Tensor | None,
                  config: LUTConfig | None = None) -> torch.Tensor:
    """y = x @ W_row^T (+ bias) for small M (every row of x is a pair; blocks of block_m rows)."""
    require_lut("linear", w)
    m = x.shape[0]
    x = x.contiguous()
    if config is None:
        bm = block_m_for_rows(m)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        config = default_lut_config(-(-m // bm), bm, w.N, w.K, sms)
    out = torch.zeros(m, w.N, dtype=torch.float32, device=x.device)
    _launch(MODE_LINEAR, x, out, w, config, -(-m // config.block_m), num_pairs=m, topk=1, row_index=row)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
