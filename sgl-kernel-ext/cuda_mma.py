"""Small-batch AP MoE and linear over ubcq planes on tensor cores (cuda_mma_gemv.cu, NVRTC).

Each warp rebuilds fp16 weights from the plane words in registers (SWAR bit transposition, the fp16
exponent trick, one fma per weight pair with the group's scale and offset) and multiplies them with
mma.sync, the (token, slot) pairs of a block in the MMA's N dimension. Unlike the LUT kernel
(cuda_lut.py), whose lookups scale with the pairs of a block, the cost here is per weight up to 8 pairs per
n-tile, so it serves the sizes between one token and the prefill path. The activations are first written
once per call as fp16 in the fragment order (`ap_mma_prep`, with a power-of-two scale per row so that no
value overflows fp16).

Scope: CUDA, ubcq tables (one scale and offset per group: the weight is affine in the code), group size a
power of two >= 32, K a multiple of 64 (where it is not one of 128 the planes load in 8-byte halves), plane
addresses 16-byte aligned. `mma_unsupported` says why a
block is not eligible; callers then use another kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedweight.kernels.activation import act_defines
from pagedweight.kernels.align import moe_align_block_size
from pagedweight.kernels.config import expected_experts_hit
from pagedweight.kernels.nvrtc import compile_cubin, load_kernel
from pagedweight.kernels.weights import APMoEWeights

CHUNK = 128  # inputs per lane and step (one 16-byte load per plane and row)
# K may also end half way through a chunk (e.g. Qwen1.5-MoE's intermediate 1408 split over 2 ranks: 704): the kernel
# then loads the planes in 8-byte halves (its rows are only 8-byte aligned) and skips the missing half (`KH`)
HALF_CHUNK = CHUNK // 2
STEP = 4 * CHUNK  # inputs per warp step
NWARPS = 4
ROWS_PER_BLOCK = 16 * NWARPS
N_TILES = (1, 2, 4)  # n-tiles of 8 (token, slot) pairs per block
_SOURCE = Path(__file__).with_name("cuda_mma_gemv.cu")
_XT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# each lane loads 16 bytes of a row; asking L2 for the whole 128-byte line on a miss lets HBM serve whole lines
# (benchmark/mma_sweep.py, docs/results/kernel.md session 15)
DEFAULT_L2_PREFETCH = 128

MODE_W13, MODE_W2, MODE_LINEAR = 0, 1, 2


@dataclass(frozen=True)
class MMAConfig:
    n_tiles: int  # 8 (token, slot) pairs each, all of one expert per block (rows of x for a linear)
    k_per_split: int  # inputs per block; K slices are summed with float32 atomics
    direct: bool = False  # one pair per block in routing order, its expert read from topk_ids (no alignment)
    min_blocks: int = 1  # blocks per SM the register allocation must allow (__launch_bounds__)
    l2_prefetch: int = DEFAULT_L2_PREFETCH  # L2 prefetch size (bytes) of the plane loads: 0, 128 or 256

    def __post_init__(self) -> None:
        if self.n_tiles not in N_TILES:
            raise ValueError(f"n_tiles must be one of {N_TILES}, got {self.n_tiles}")
        if self.k_per_split <= 0 or self.k_per_split % CHUNK:
            raise ValueError(f"k_per_split must be a positive multiple of {CHUNK}, got {self.k_per_split}")
        if not 1 <= self.min_blocks <= 16:
            raise ValueError(f"min_blocks must be in 1..16, got {self.min_blocks}")
        if self.l2_prefetch not in (0, 128, 256):
            raise ValueError(f"l2_prefetch must be 0, 128 or 256, got {self.l2_prefetch}")
        if self.direct and self.n_tiles != 1:
            raise ValueError("direct (one pair per block) needs n_tiles 1")

    @property
    def slots(self) -> int:
        return 1 if self.direct else 8 * self.n_tiles


def mma_unsupported(w: APMoEWeights) -> str | None:
    """Why the tensor-core kernel cannot serve `w` (None when it can)."""
    if w.table_kind != "ubcq":
        return f"table kind {w.table_kind!r} (the MMA kernel reads ubcq tables, whose weights are affine in the code)"
    g = w.group_size
    if g < 32 or g & (g - 1) or w.K % g:
        return f"ubcq group size {g} is not a power of two >= 32 dividing K={w.K}"
    if w.K % HALF_CHUNK:
        return f"K={w.K} is not a multiple of {HALF_CHUNK}"
    if not w.page_table.is_cuda:
        return "the page table is not on a CUDA device"
    return None


def require_mma(name: str, w: APMoEWeights) -> None:
    why = mma_unsupported(w)
    if why is not None:
        raise ValueError(f"{name}: the MMA kernel cannot run: {why}")


def n_tiles_for(pairs_per_block: float) -> int:
    """The fewest n-tiles holding a block's pairs (more blocks per expert re-read its planes)."""
    return next((nt for nt in N_TILES if pairs_per_block <= 8 * nt), N_TILES[-1])


# H200, 4 bits, Mixtral and Qwen1.5-MoE experts at M = 1..64 (benchmark/mma_sweep.py, docs/results/kernel.md;
# ncu: L1/TEX-bound): more resident warps hide the load latency better, so registers are capped for 4 blocks
# (16 warps) per SM (Mixtral M=16: 404 us vs 457 uncapped), one n-tile per block (two n-tiles cost more
# registers than re-reading an expert's planes for a second block: Mixtral M=64 1155 vs 1305 us), and the K
# split that fills ~6 blocks per SM (twice or half as many slices: 2-20% slower).
DEFAULT_MIN_BLOCKS = 4


def default_mma_config(active_blocks_m: int, n_tiles: int, n: int, k: int, num_sms: int, *, direct: bool = False,
                       blocks_per_sm: int = 6, min_blocks: int = DEFAULT_MIN_BLOCKS) -> MMAConfig:
    """K split (in whole 512-input steps while possible) until the grid has ~`blocks_per_sm` blocks per SM."""
    n_blocks = -(-n // ROWS_PER_BLOCK)
    kc = -(-k // STEP) * STEP
    while kc > STEP and active_blocks_m * n_blocks * -(-k // kc) < blocks_per_sm * num_sms:
        kc = -(-(kc // 2) // STEP) * STEP if kc // 2 >= STEP else STEP
    return MMAConfig(n_tiles=n_tiles, k_per_split=kc, direct=direct, min_blocks=min_blocks)


def kernel_defines(mode: int, n_tiles: int, bits_max: int, group_size: int, direct: bool = False,
                   min_blocks: int = 1, l2_prefetch: int = DEFAULT_L2_PREFETCH, k: int = CHUNK) -> list[str]:
    """NVRTC defines of one variant; `k` (the projection's K) only says whether K ends half way through a chunk."""
    return [f"-DMODE={mode}", f"-DNT={n_tiles}", f"-DPMAX={bits_max}", f"-DG={group_size}", f"-DDIRECT={int(direct)}",
            f"-DMINB={min_blocks}", f"-DL2PF={l2_prefetch}", f"-DKH={int(k % CHUNK != 0)}"]


def prep_defines(mode: int, x_dtype: torch.dtype, activation: str = "silu") -> list[str]:
    """MODE_W2's prep forms act(gate) * up from the float32 h (activation.py)."""
    return [f"-DMODE={mode}", f"-DXT={_XT[x_dtype]}"] + (act_defines(activation) if mode == MODE_W2 else [])


def compile_to_cubin(defines: list[str], compute_capability: str, name: str = "ap_mma_gemv") -> bytes:
    return compile_cubin(_SOURCE, name, compute_capability, defines)


@functools.lru_cache(maxsize=None)
def _compiled(name: str, defines: tuple[str, ...], device_index: int):
    """One compiled kernel per variant and device (once per process)."""
    return load_kernel(_SOURCE, name, list(defines), device_index)


def _prep(mode: int, x: torch.Tensor, rows: int, k: int, *, topk_weights=None, topk: int = 1,
          per_pair: bool = False, activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Activations in the fragment order as fp16 [rows, k], and the per-row factor the output is multiplied by."""
    xp = torch.empty(rows, k, dtype=torch.float16, device=x.device)
    xscale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return xp, xscale
    kernel = _compiled("ap_mma_prep", tuple(prep_defines(mode, x.dtype if mode != MODE_W2 else torch.float32, activation)),
                       x.device.index or 0)
    kernel(grid=(rows, 1, 1), block=(256, 1, 1),
           args=[x, topk_weights if topk_weights is not None else xscale, xp, xscale, k, x.stride(0), topk,
                 int(per_pair)])
    return xp, xscale


def _launch(mode: int, xp: torch.Tensor, xscale: torch.Tensor, out: torch.Tensor, w: APMoEWeights, cfg: MMAConfig,
            grid_m: int, *, topk_weights=None, sorted_ids=None, expert_ids=None, post_pad=None, num_pairs: int,
            topk: int, row_index: int = 0, apply_w_in: bool = False, xp_per_pair: bool = True) -> None:
    kernel = _compiled("ap_mma_gemv", tuple(kernel_defines(mode, cfg.n_tiles, w.bits_max, w.group_size, cfg.direct,
                                                         cfg.min_blocks, cfg.l2_prefetch, w.K)),
                       out.device.index or 0)
    dummy = xscale
    grid = (grid_m, -(-w.N // ROWS_PER_BLOCK), -(-w.K // cfg.k_per_split))
    kernel(
        grid=grid, block=(32 * NWARPS, 1, 1),
        args=[
            xp, xscale, out, w.page_table,
            topk_weights if topk_weights is not None else dummy,
            sorted_ids if sorted_ids is not None else dummy,
            expert_ids if expert_ids is not None else dummy,
            post_pad if post_pad is not None else dummy,
            num_pairs, topk, w.N, w.K, out.stride(0), w.page_table.stride(0), cfg.k_per_split, row_index,
            int(apply_w_in), int(xp_per_pair), w.num_experts,
        ],
    )


def default_moe_mma_configs(m: int, topk: int, num_experts: int, w13: APMoEWeights, w2: APMoEWeights,
                            device: torch.device) -> tuple[MMAConfig, MMAConfig]:
    """One pair per block (no alignment launch) for a single token; otherwise blocks of up to 8 of one
    expert's pairs (one n-tile: see DEFAULT_MIN_BLOCKS)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    pairs = m * topk
    if m == 1:
        return (default_mma_config(pairs, 1, w13.N, w13.K, sms, direct=True),
                default_mma_config(pairs, 1, w2.N, w2.K, sms, direct=True))
    hit = max(1.0, expected_experts_hit(m, topk, num_experts))
    active = max(int(hit), -(-pairs // 8))
    return (default_mma_config(active, 1, w13.N, w13.K, sms), default_mma_config(active, 1, w2.N, w2.K, sms))


def ap_fused_moe_mma(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: APMoEWeights, w2: APMoEWeights,
    *, activation: str = "silu", apply_router_weight_on_input: bool = False,
    configs: tuple[MMAConfig, MMAConfig] | None = None,
) -> torch.Tensor:
    """gate/up -> act(gate) * up -> down with routing weights: activations to fp16 fragments, w13 into a float32 h,
    h's act(gate) * up (activation.py) to fp16 fragments, w2 into the output (both summed with float32 atomics, one zeroed buffer)."""
    require_mma("w13", w13)
    require_mma("w2", w2)
    m, topk = topk_ids.shape
    num_pairs = m * topk
    if configs is None:
        configs = default_moe_mma_configs(m, topk, w13.num_experts, w13, w2, hidden.device)
    if (configs[0].slots, configs[0].direct) != (configs[1].slots, configs[1].direct):
        raise ValueError("w13 and w2 MMA configs must share the block layout (one alignment)")
    x = hidden.contiguous()
    tw = topk_weights.contiguous().float()
    common = dict(topk_weights=tw, num_pairs=num_pairs, topk=topk, apply_w_in=apply_router_weight_on_input)
    if configs[0].direct:
        grid_m = num_pairs
        common.update(expert_ids=topk_ids.reshape(-1).to(torch.int32))
    else:
        align = moe_align_block_size(topk_ids, configs[0].slots, w13.num_experts)
        grid_m = align.max_blocks
        common.update(sorted_ids=align.sorted_ids, expert_ids=align.expert_ids, post_pad=align.num_tokens_post_padded)
    per_pair = apply_router_weight_on_input  # the routing weight scales each pair's copy of its token
    xp, xs = _prep(MODE_W13, x, num_pairs if per_pair else m, w13.K, topk_weights=tw, topk=topk, per_pair=per_pair)
    acc = torch.zeros(num_pairs * w13.N + m * w2.N, dtype=torch.float32, device=x.device)
    h = acc[: num_pairs * w13.N].view(num_pairs, w13.N)
    out = acc[num_pairs * w13.N :].view(m, w2.N)
    _launch(MODE_W13, xp, xs, h, w13, configs[0], grid_m, xp_per_pair=per_pair, **common)
    hp, hs = _prep(MODE_W2, h, num_pairs, w2.K, activation=activation)
    _launch(MODE_W2, hp, hs, out, w2, configs[1], grid_m, xp_per_pair=True, **common)
    return out.to(hidden.dtype)


def ap_linear_mma(x: torch.Tensor, w: APMoEWeights, row: int, bias: torch.Tensor | None,
                  config: MMAConfig | None = None) -> torch.Tensor:
    """y = x @ W_row^T (+ bias): the rows of x in blocks of 8 * n_tiles."""
    require_mma("linear", w)
    m = x.shape[0]
    x = x.contiguous()
    if config is None:
        nt = n_tiles_for(m)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        config = default_mma_config(-(-m // (8 * nt)), nt, w.N, w.K, sms)
    if config.direct:
        raise ValueError("a dense linear has no routing: direct (one pair per block) is for the MoE modes")
    out = torch.zeros(m, w.N, dtype=torch.float32, device=x.device)
    xp, xs = _prep(MODE_LINEAR, x, m, w.K)
    _launch(MODE_LINEAR, xp, xs, out, w, config, -(-m // config.slots), num_pairs=m, topk=1, row_index=row)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
