"""Small-batch AP MoE and linear over ubcq planes on tensor cores, scale and offset folded out of the
per-weight work (cuda_fold_gemv.cu, NVRTC).

The tensor cores multiply the raw q-bit codes (bit-transposed from the planes in registers) with the
activations in their own 16-bit type; each group's scale and offset are applied once per (row, group,
token) in fp32 from the group's activation sum (docs/kernels.md, "The fold kernel"). Against the MMA kernel
(cuda_mma.py) this removes the per-weight fp16 subtract and fma, the activation range scaling, and the
activation loads that made that kernel L1-bound: the plane bytes pass through a per-warp cp.async ring and
reach the lanes by ldmatrix, the activations come in one coalesced load per lane from a layout written once
per call. One call is prep (activations in the fragment order, their group sums, and the zeroing of every
accumulator) + w13 (silu(gate) * up in its epilogue, written in w2's order) + w2 (the last block of each row
block writes the output dtype), plus the alignment for more than one token.

Scope: CUDA, ubcq tables, group sizes multiples of 128, K (and the intermediate size) multiples of 128,
plane addresses 16-byte aligned. `fold_unsupported` says why a projection is not eligible.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pagedweight.kernels.activation import act_defines
from pagedweight.kernels.align import moe_align_block_size
from pagedweight.kernels.config import expected_experts_hit
from pagedweight.kernels.nvrtc import compile_cubin, launch, load_kernel
from pagedweight.kernels.weights import APMoEWeights

CHUNK = 128
NWARPS = 4  # the default warps per block (FoldConfig.warps)
WARPS = (4, 8, 16)
MAX_WARPS_PER_SM = 64
# Resident warps matter more than stages in flight: an 8 KB ring per warp (two stages at 4 bits) with registers
# capped for 4 blocks (16 warps) per SM beat larger rings at fewer blocks, and w13 with its K split over 2 warps was
# even or faster on every shape (benchmark/fold_sweep.py; docs/results/kernel.md, session 11).
DEFAULT_RING_KB = 8
N_TILES = (1, 2)
ROW_TILES = (1, 2, 4)
_SOURCE = Path(__file__).with_name("cuda_fold_gemv.cu")
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

MODE_W13, MODE_W2, MODE_LINEAR = 0, 1, 2
# prep source modes (ap_fold_prep): unit = token, pair (router weight on the input), m-block of pairs
# (plain / router weight on the input), block of rows of a dense linear
SRC_TOKEN, SRC_PAIR, SRC_BLOCK, SRC_BLOCK_WEIGHTED, SRC_ROWS = 0, 1, 2, 3, 4
DEFAULT_MIN_BLOCKS = 4
# A stage copies 64 bytes of each row and plane; asking L2 to fetch the whole 128-byte line on a miss lets HBM
# serve whole lines (benchmark/plane_read_bench.py: row-major 64-byte pieces alone cap the read rate far below
# 128-byte ones; fold_sweep.py, docs/results/kernel.md session 15)
DEFAULT_L2_PREFETCH = 128
# w2's K slices: beyond the 1.5 blocks per SM, more slices while the grid holds fewer than 3.5 blocks per SM and
# each slice keeps >= 14 chunks (a long w2 gains from more slices at one token, a short one loses: fold_sweep.py,
# docs/results/kernel.md session 14)
W2_FILL_BLOCKS_PER_SM = 3.5
W2_MIN_SLICE_CHUNKS = 14
# one pair per block (one token): a grid below a wave at 4 blocks per SM gains from slices down to 3 chunks (a short
# w2 too: Qwen1.5-MoE 4 slices of 3 chunks, Qwen3 2 of 3; fold_sweep.py w2s2, docs/results/kernel.md session 22)
W2_MIN_SLICE_CHUNKS_DIRECT = 3
# w2 at two n-tiles of a parent of at most 4 planes: two 16-row tiles per warp share each chunk's activation load,
# at 3 blocks per SM for the registers (the split count is chosen at one row tile, as measured). Where experts may
# commit up to 8 planes, one tile measured faster at 8 bits and on mixed bitwidths (with an 8 or a 16 KB ring), and
# so it is at one n-tile, where the registers cost more than the shared load saves (fold_sweep.py rt1w2 / rt2w2_*,
# docs/results/kernel.md session 17). The rule reads the stored planes, not the committed ones, so a captured CUDA
# graph stays right for every plan.
W2_ROW_TILES_MAX_PLANES = 4
W2_ROW_TILES_AT_TWO_N_TILES = 2
W2_MIN_BLOCKS_AT_TWO_N_TILES = 3
# Programmatic dependent launch (sm_90): prep, w13 and w2 each start while the kernel before finishes, their first plane
# copies in flight before they wait for its outputs. Measured 1-11% faster at one n-tile on every shape; at two n-tiles
# (Mixtral M = 64) even at 4 bits and 4-7% faster at 8 bits once the activation loads were plain ones (fold_sweep.py
# pdl / nopdl, docs/results/kernel.md sessions 18-19), so every call takes it where the device has it.
PDL_MIN_CAPABILITY = 9
# shared_act: stages of the block's activation ring (the plane rings then run as many); the kernel's SA_STAGES
SA_STAGES = (2, 3, 4)
STAGE_CHUNKS = (2, 4, 8)
MAX_SHARED_BYTES = 227 * 1024  # dynamic shared memory one block may take on sm_90


@dataclass(frozen=True)
class FoldConfig:
    n_tiles: int = 1  # 8 slots each, all of one expert per block (rows of x for a linear)
    direct: bool = False  # one pair per block in routing order, its expert read from topk_ids (no alignment)
    wk: int = 1  # warps of a block splitting its K range (MODE 0: summed in shared memory before silu)
    k_per_split: int = 0  # MODE 1/2: inputs per block (0: all of K); summed with float32 atomics
    min_blocks: int = DEFAULT_MIN_BLOCKS
    stage_chunks: int = 4  # 128-input chunks per ring stage: 32-byte (2), 64-byte (4) or 128-byte (8) row pieces per plane
    ring_kb: int = DEFAULT_RING_KB  # shared memory of each warp's ring (one stage of bits_max planes at least)
    scale_stages: int = 3  # stages ahead that the (scale, offset) loads run (the tables come from DRAM)
    act_prefetch: bool = True  # one n-tile: the next chunk's activations in flight (16 registers)
    l2_prefetch: int = DEFAULT_L2_PREFETCH  # L2 prefetch size (bytes) of the plane copies: 0, 128 or 256
    row_tiles: int = 1  # 16-row tiles per warp, all fed by one load of each chunk's activations: 1, 2 or 4
    # programmatic dependent launch (sm_90): the kernel starts while the one before it finishes and copies its first
    # planes before it waits for that kernel's outputs (w13's flag also covers the prep kernel)
    pdl: bool = False
    # the activations through a ring in shared memory that the warps sharing a K range fill together (each unit's
    # activations leave L2 once per block, not once per warp), in lockstep: a block barrier per stage
    shared_act: bool = False
    # shared_act: stages of the activation ring (2, 3 or 4); each plane ring runs as many where it holds that many stages
    # of the committed planes, else fewer (two at least): narrow stages (stage_chunks 2) keep more of them in flight
    sa_stages: int = 2
    # q <= 4: the two mma of each code word accumulate into two registers sets (two dependent chains of half the length
    # per chunk, summed at the group's end); q > 4 ignores it (5-7 bits: one chain of byte codes, 8 bits: two chains
    # already, its high and low nibbles)
    split_chains: bool = False
    # warps per block (4, 8 or 16); min_blocks counts blocks of this size. With shared_act every warp on a K range reads
    # the same activation ring, so more warps per block read each stage's activations from L2 once for more rows
    warps: int = NWARPS
    # where each stage's group sums (one float per slot and group) come from: shared_act, copied into the activation
    # ring with the stage's activations and read from shared memory at each group's end; without shared_act, loaded
    # from L2 a stage ahead into registers. Off: loaded from L2 at the start of the stage that uses them
    sums_in_ring: bool = False
    sums_ahead: bool = False

    def __post_init__(self) -> None:
        if self.stage_chunks not in STAGE_CHUNKS:
            raise ValueError(f"stage_chunks must be one of {STAGE_CHUNKS}, got {self.stage_chunks}")
        if not 4 <= self.ring_kb <= 56:
            raise ValueError(f"ring_kb must be in 4..56, got {self.ring_kb}")
        if not 1 <= self.scale_stages <= 4:
            raise ValueError(f"scale_stages must be in 1..4, got {self.scale_stages}")
        if self.l2_prefetch not in (0, 128, 256):
            raise ValueError(f"l2_prefetch must be 0, 128 or 256, got {self.l2_prefetch}")
        if self.row_tiles not in ROW_TILES:
            raise ValueError(f"row_tiles must be one of {ROW_TILES}, got {self.row_tiles}")
        if self.n_tiles not in N_TILES:
            raise ValueError(f"n_tiles must be one of {N_TILES}, got {self.n_tiles}")
        if self.wk not in (1, 2, 4):
            raise ValueError(f"wk must be 1, 2 or 4, got {self.wk}")
        if self.k_per_split < 0 or self.k_per_split % CHUNK:
            raise ValueError(f"k_per_split must be 0 or a positive multiple of {CHUNK}, got {self.k_per_split}")
        if self.direct and self.n_tiles != 1:
            raise ValueError("direct (one pair per block) needs n_tiles 1")
        if not 1 <= self.min_blocks <= 16:
            raise ValueError(f"min_blocks must be in 1..16, got {self.min_blocks}")
        if self.warps not in WARPS:
            raise ValueError(f"warps must be one of {WARPS}, got {self.warps}")
        if self.warps * self.min_blocks > MAX_WARPS_PER_SM:
            raise ValueError(f"min_blocks={self.min_blocks} blocks of {self.warps} warps exceed the {MAX_WARPS_PER_SM} "
                             f"warps an SM holds")
        if self.sa_stages not in SA_STAGES:
            raise ValueError(f"sa_stages must be one of {SA_STAGES}, got {self.sa_stages}")
        if self.sums_in_ring and not self.shared_act:
            raise ValueError("sums_in_ring needs shared_act (the sums ride the block-shared activation ring)")
        if self.sums_ahead and self.shared_act:
            raise ValueError("sums_ahead is for the path without shared_act (with it, use sums_in_ring)")
        if self.shared_act and self.direct:
            raise ValueError("shared_act needs blocks of 8 n_tiles slots (not direct: one pair has no activations to share)")
        if self.shared_bytes > MAX_SHARED_BYTES:
            raise ValueError(f"ring_kb={self.ring_kb}, wk={self.wk}, n_tiles={self.n_tiles}, stage_chunks={self.stage_chunks}"
                             f"{', shared_act' if self.shared_act else ''} need {self.shared_bytes} bytes of shared memory "
                             f"per block, more than the {MAX_SHARED_BYTES} a block may have")

    @property
    def slots(self) -> int:
        return 1 if self.direct else 8 * self.n_tiles

    @property
    def shared_bytes(self) -> int:
        chunk_bytes = self.n_tiles * CHUNK * 8 * 2 + (self.slots * 4 if self.sums_in_ring else 0)
        act = self.wk * self.sa_stages * self.stage_chunks * chunk_bytes if self.shared_act else 0
        return self.warps * self.ring_kb * 1024 + act

    @property
    def rows_per_block(self) -> int:  # A rows of one block (MODE 0: half are gate rows, half up rows)
        return 16 * self.row_tiles * self.warps // self.wk

    def min_ring_bytes(self, bits_max: int) -> int:
        """One ring stage of `bits_max` planes (the kernel halves 4-chunk stages to 2 where too few would fit); with
        shared_act two such stages (the block steps through at least two; more where the ring holds them)."""
        one = self.row_tiles * bits_max * 16 * 16 * (8 if self.stage_chunks == 8 else 2)
        return 2 * one if self.shared_act else one

    def check_ring(self, bits_max: int) -> None:
        """Raises ValueError where each warp's ring cannot hold what the kernel streams at `bits_max` planes."""
        if self.ring_kb * 1024 < self.min_ring_bytes(bits_max):
            raise ValueError(f"stage_chunks={self.stage_chunks}, row_tiles={self.row_tiles} at bits_max={bits_max} needs "
                             f"ring_kb >= {-(-self.min_ring_bytes(bits_max) // 1024)} "
                             f"({2 if self.shared_act else 1} stage(s) of {bits_max} planes), got {self.ring_kb}")


def fold_unsupported(w: APMoEWeights) -> str | None:
    """Why the fold kernel cannot serve `w` (None when it can)."""
    if w.table_kind != "ubcq":
        return f"table kind {w.table_kind!r} (the fold kernel reads ubcq tables, whose weights are affine in the code)"
    if w.group_size % CHUNK:
        return f"ubcq group size {w.group_size} is not a multiple of {CHUNK}"
    if w.K % w.group_size:
        return f"K={w.K} is not a multiple of the group size {w.group_size}"
    if not w.page_table.is_cuda:
        return "the page table is not on a CUDA device"
    return None


def fold_moe_unsupported(w13: APMoEWeights, w2: APMoEWeights) -> str | None:
    why = fold_unsupported(w13) or fold_unsupported(w2)
    if why is None and w2.K % CHUNK:
        return f"the intermediate size {w2.K} is not a multiple of {CHUNK}"
    return why


def require_fold(name: str, why: str | None) -> None:
    if why is not None:
        raise ValueError(f"{name}: the fold kernel cannot run: {why}")


def gemv_defines(mode: int, cfg: FoldConfig, bits_max: int, group_size: int, compute: int, out: int = 0) -> list[str]:
    return [f"-DMODE={mode}", f"-DNT={cfg.n_tiles}", f"-DPMAX={bits_max}", f"-DG={group_size}", f"-DCT={compute}",
            f"-DOT={out}", f"-DWK={cfg.wk}", f"-DMINB={cfg.min_blocks}", f"-DDIRECT={int(cfg.direct)}",
            f"-DRING={cfg.ring_kb * 1024}", f"-DSC={cfg.stage_chunks}", f"-DSPD={cfg.scale_stages}", f"-DBPF={int(cfg.act_prefetch)}",
            f"-DL2PF={cfg.l2_prefetch}", f"-DRT={cfg.row_tiles}", f"-DPDL={int(cfg.pdl)}",
            f"-DSA={int(cfg.shared_act)}", f"-DSAS={cfg.sa_stages}", f"-DSPLIT={int(cfg.split_chains)}",
            f"-DNW={cfg.warps}", f"-DSUMR={int(cfg.sums_in_ring)}", f"-DSAH={int(cfg.sums_ahead)}"]


def prep_defines(cfg: FoldConfig, group_size: int, compute: int, x_dtype: torch.dtype) -> list[str]:
    return [f"-DMODE={MODE_W13}", f"-DNT={cfg.n_tiles}", f"-DG={group_size}", f"-DCT={compute}",
            f"-DXT={_DTYPE_CODE[x_dtype]}", f"-DDIRECT={int(cfg.direct)}", f"-DPDL={int(cfg.pdl)}"]


def compile_to_cubin(defines: list[str], compute_capability: str, name: str = "ap_fold_gemv") -> bytes:
    return compile_cubin(_SOURCE, name, compute_capability, defines)


@functools.lru_cache(maxsize=None)
def _compiled(source: Path, name: str, defines: tuple[str, ...], device_index: int, shared_bytes: int = 0):
    """One compiled kernel per source, variant and device (once per process; benchmark/fold_source_ab.py swaps
    `_SOURCE` to time other sources in the same process)."""
    kernel = load_kernel(source, name, list(defines), device_index)
    if shared_bytes:
        kernel.set_shared_memory_config(shared_bytes)
    return kernel


def compute_code(dtype: torch.dtype) -> int:
    """The activations' 16-bit type: fp16 for fp16 inputs, bf16 for bf16 and fp32 (fp16's range is too small)."""
    return 1 if dtype == torch.float16 else 0


def _split_chunks(total_chunks: int, group_chunks: int, splits: int) -> int:
    """Inputs per K slice: whole groups, about total / splits."""
    groups = total_chunks // group_chunks
    per = -(-groups // max(1, splits))
    return per * group_chunks * CHUNK


def default_fold_configs(m: int, topk: int, w13: APMoEWeights, w2: APMoEWeights, num_sms: int,
                         blocks_per_sm: float = 1.5, pdl: bool = False) -> tuple[FoldConfig, FoldConfig]:
    """One pair per block for one token (w13 splits K across 2 warps of a block, 4 while the grid holds fewer than
    `blocks_per_sm` blocks per SM); else blocks of 8 (or 16) slots of one expert whose activations pass through the
    block-shared ring (shared_act). w2 splits K across blocks until the grid holds that many; at two n-tiles and a
    parent of <= 4 planes w2's warps hold two row tiles each.
    `pdl` (the device supports programmatic dependent launch): the calls launch that way."""
    pairs = m * topk
    if m == 1:
        nt, direct, units = 1, True, float(pairs)
    else:
        hit = max(1.0, expected_experts_hit(m, topk, w13.num_experts))
        nt = 1 if pairs / hit <= 10 else 2
        direct, units = False, max(hit, pairs / (8 * nt))
    target = blocks_per_sm * num_sms
    inter = w2.K
    chunks13, gc13 = w13.K // CHUNK, w13.group_size // CHUNK
    wk = 2 if chunks13 // gc13 >= 2 else 1
    while wk < 4 and units * -(-inter // (8 * NWARPS // wk)) < target and chunks13 // gc13 >= 2 * wk:
        wk *= 2
    chunks2, gc2 = w2.K // CHUNK, w2.group_size // CHUNK
    row_blocks2 = -(-w2.N // (16 * NWARPS))
    splits = 1
    while units * row_blocks2 * splits < target and splits * 2 <= chunks2 // gc2:
        splits *= 2
    # then towards a full wave at the register-bound occupancy, while each slice keeps enough stages
    min_slice = W2_MIN_SLICE_CHUNKS_DIRECT if direct else W2_MIN_SLICE_CHUNKS
    while (units * row_blocks2 * splits < W2_FILL_BLOCKS_PER_SM * num_sms and splits * 2 <= chunks2 // gc2
           and -(-chunks2 // (splits * 2)) >= min_slice):
        splits *= 2
    # blocks of slots: the activations through the block-shared ring, w13's 4 warps on one K range (4 readers of each
    # stage; splitting K over 2 or 4 warps measured slower with the ring)
    shared_act = not direct
    # at two n-tiles each stage's group sums ride the activation ring (twice the sums per stage: read from L2 at the
    # stage's start they cost more than the ring's extra bytes; at one n-tile they measured even or slower)
    sums = shared_act and nt == 2
    cfg13 = FoldConfig(n_tiles=nt, direct=direct, wk=1 if shared_act else wk, pdl=pdl, shared_act=shared_act,
                       sums_in_ring=sums)
    cfg2 = FoldConfig(n_tiles=nt, direct=direct, k_per_split=_split_chunks(chunks2, gc2, splits), pdl=pdl,
                      shared_act=shared_act, sums_in_ring=sums)
    if nt == 2 and w2.bits_max <= W2_ROW_TILES_MAX_PLANES:
        cfg2 = replace(cfg2, row_tiles=W2_ROW_TILES_AT_TWO_N_TILES, min_blocks=W2_MIN_BLOCKS_AT_TWO_N_TILES)
    return cfg13, cfg2


def device_launch_facts(device: torch.device) -> tuple[int, bool]:
    """(SMs, whether it has programmatic dependent launch) of a device, for default_fold_configs."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.major >= PDL_MIN_CAPABILITY


def _gemv(mode: int, cfg: FoldConfig, w: APMoEWeights, compute: int, out_code: int, device: torch.device,
          grid: tuple[int, int, int], *, xf, xs, topk_weights, sorted_ids, expert_ids, post_pad, xf_out, xs_out,
          acc_out, out, counters, bias, num_pairs: int, topk: int, n_out: int, m_rows: int, k_per_split: int,
          row_index: int, apply_w_in: bool, g_out: int, xunit_per_pair: bool, has_bias: bool = False,
          activation: str = "silu") -> None:
    cfg.check_ring(w.bits_max)
    defines = gemv_defines(mode, cfg, w.bits_max, w.group_size, compute, out_code) + act_defines(activation)
    kernel = _compiled(_SOURCE, "ap_fold_gemv", tuple(defines), device.index or 0, cfg.shared_bytes)
    launch(kernel, grid, (32 * cfg.warps, 1, 1), shared_mem=cfg.shared_bytes, pdl=cfg.pdl,
           args=[xf, xs, w.page_table, topk_weights, sorted_ids, expert_ids, post_pad, xf_out, xs_out, acc_out, out,
                 counters, bias, num_pairs, topk, n_out, w.N, w.K, m_rows, k_per_split, row_index, int(apply_w_in),
                 w.num_experts, w.page_table.stride(0), g_out, int(xunit_per_pair), int(has_bias)])


def _prep(cfg: FoldConfig, x: torch.Tensor, group_size: int, compute: int, units: int, src_mode: int, *,
          topk_weights, sorted_ids, post_pad, num_pairs: int, topk: int, m_rows: int, zero: torch.Tensor,
          dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations in the fragment order, their group sums) for `units` units; zeroes `zero` too."""
    k = x.shape[1]
    xf = torch.empty(units * (k // CHUNK) * cfg.n_tiles * 1024, dtype=torch.int16, device=x.device)
    xs = torch.empty(units * (k // group_size) * cfg.slots, dtype=torch.float32, device=x.device)
    kernel = _compiled(_SOURCE, "ap_fold_prep", tuple(prep_defines(cfg, group_size, compute, x.dtype)), x.device.index or 0)
    launch(kernel, (units, k // group_size, 1), (256, 1, 1), pdl=cfg.pdl,
           args=[x, x.stride(0), topk_weights if topk_weights is not None else dummy,
                 sorted_ids if sorted_ids is not None else dummy, post_pad if post_pad is not None else dummy,
                 int(post_pad is not None), xf, xs, num_pairs, topk, k, m_rows, src_mode, zero, zero.numel()])
    return xf, xs


def ap_fused_moe_fold(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: APMoEWeights, w2: APMoEWeights,
    *, activation: str = "silu", apply_router_weight_on_input: bool = False,
    configs: tuple[FoldConfig, FoldConfig] | None = None,
) -> torch.Tensor:
    """gate/up -> act(gate) * up -> down with routing weights (act: activation.py); [M, H] in hidden's dtype."""
    require_fold("moe", fold_moe_unsupported(w13, w2))
    m, topk = topk_ids.shape
    num_pairs = m * topk
    dev = hidden.device
    if configs is None:
        sms, pdl = device_launch_facts(dev)
        configs = default_fold_configs(m, topk, w13, w2, sms, pdl=pdl)
    c13, c2 = configs
    if (c13.slots, c13.direct) != (c2.slots, c2.direct):
        raise ValueError("w13 and w2 fold configs must share the block layout (one alignment)")
    x = hidden.contiguous()
    tw = topk_weights.contiguous().float()
    compute = compute_code(x.dtype)
    inter, H = w2.K, w2.N
    if c13.direct:
        units = num_pairs
        x_units, src = (num_pairs, SRC_PAIR) if apply_router_weight_on_input else (m, SRC_TOKEN)
        sorted_ids = post_pad = None
        expert_ids = topk_ids.reshape(-1).to(torch.int32)
    else:
        align = moe_align_block_size(topk_ids, c13.slots, w13.num_experts)
        units = x_units = align.max_blocks
        src = SRC_BLOCK_WEIGHTED if apply_router_weight_on_input else SRC_BLOCK
        sorted_ids, expert_ids, post_pad = align.sorted_ids, align.expert_ids, align.num_tokens_post_padded
    row_blocks2 = -(-H // c2.rows_per_block)
    ng2 = inter // w2.group_size
    # one zeroed buffer (by the prep kernel): w2's float32 output, w2's activation sums, w2's row-block counters
    zero = torch.empty(m * H + units * ng2 * c2.slots + row_blocks2, dtype=torch.float32, device=dev)
    acc = zero[: m * H]
    xs2 = zero[m * H : m * H + units * ng2 * c2.slots]
    counters = zero[m * H + units * ng2 * c2.slots :].view(torch.int32)
    xf13, xs13 = _prep(c13, x, w13.group_size, compute, x_units, src, topk_weights=tw, sorted_ids=sorted_ids,
                       post_pad=post_pad, num_pairs=num_pairs, topk=topk, m_rows=m, zero=zero, dummy=tw)
    xf2 = torch.empty(units * (inter // CHUNK) * c2.n_tiles * 1024, dtype=torch.int16, device=dev)
    out = torch.empty(m, H, dtype=hidden.dtype, device=dev)
    dummy = tw
    common = dict(topk_weights=tw, sorted_ids=sorted_ids if sorted_ids is not None else dummy,
                  expert_ids=expert_ids, post_pad=post_pad if post_pad is not None else dummy,
                  num_pairs=num_pairs, topk=topk, m_rows=m, row_index=0, apply_w_in=apply_router_weight_on_input)
    row_blocks13 = -(-inter // (c13.rows_per_block // 2))
    _gemv(MODE_W13, c13, w13, compute, 0, dev, (units, row_blocks13, 1),
          xf=xf13, xs=xs13, xf_out=xf2, xs_out=xs2, acc_out=dummy, out=dummy, counters=dummy, bias=dummy,
          n_out=inter, k_per_split=w13.K, g_out=w2.group_size, xunit_per_pair=apply_router_weight_on_input,
          activation=activation, **common)
    kps = c2.k_per_split or inter
    _gemv(MODE_W2, c2, w2, compute, _DTYPE_CODE[hidden.dtype], dev, (units, row_blocks2, -(-inter // kps)),
          xf=xf2, xs=xs2, xf_out=dummy, xs_out=dummy, acc_out=acc, out=out, counters=counters, bias=dummy,
          n_out=H, k_per_split=kps, g_out=w2.group_size, xunit_per_pair=True, **common)
    return out


def default_linear_fold_config(m: int, w: APMoEWeights, num_sms: int, blocks_per_sm: int = 3) -> FoldConfig:
    nt = 1 if m <= 8 else 2
    blocks = -(-m // (8 * nt)) * -(-w.N // (16 * NWARPS))
    chunks, gc = w.K // CHUNK, w.group_size // CHUNK
    splits = 1
    while blocks * splits < blocks_per_sm * num_sms and splits * 2 <= chunks // gc:
        splits *= 2
    return FoldConfig(n_tiles=nt, k_per_split=_split_chunks(chunks, gc, splits))


def ap_linear_fold(x: torch.Tensor, w: APMoEWeights, row: int, bias: torch.Tensor | None,
                   config: FoldConfig | None = None) -> torch.Tensor:
    """y = x @ W_row^T (+ bias): the rows of x in blocks of 8 * n_tiles."""
    require_fold("linear", fold_unsupported(w))
    m = x.shape[0]
    x = x.contiguous()
    dev = x.device
    cfg = config or default_linear_fold_config(m, w, torch.cuda.get_device_properties(dev).multi_processor_count)
    if cfg.direct:
        raise ValueError("a dense linear has no routing: direct (one pair per block) is for the MoE modes")
    compute = compute_code(x.dtype)
    units = -(-m // cfg.slots)
    row_blocks = -(-w.N // cfg.rows_per_block)
    zero = torch.empty(m * w.N + row_blocks, dtype=torch.float32, device=dev)
    acc, counters = zero[: m * w.N], zero[m * w.N :].view(torch.int32)
    dummy = zero
    xf, xs = _prep(cfg, x, w.group_size, compute, units, SRC_ROWS, topk_weights=None, sorted_ids=None, post_pad=None,
                   num_pairs=m, topk=1, m_rows=m, zero=zero, dummy=dummy)
    out = torch.empty(m, w.N, dtype=x.dtype, device=dev)
    kps = cfg.k_per_split or w.K
    b = bias.to(x.dtype).contiguous() if bias is not None else None
    _gemv(MODE_LINEAR, cfg, w, compute, _DTYPE_CODE[x.dtype], dev, (units, row_blocks, -(-w.K // kps)),
          xf=xf, xs=xs, topk_weights=dummy, sorted_ids=dummy, expert_ids=dummy, post_pad=dummy, xf_out=dummy,
          xs_out=dummy, acc_out=acc, out=out, counters=counters, bias=b if b is not None else dummy, num_pairs=m,
          topk=1, n_out=w.N, m_rows=m, k_per_split=kps, row_index=row, apply_w_in=False, g_out=w.group_size,
          xunit_per_pair=True, has_bias=b is not None)
    return out
