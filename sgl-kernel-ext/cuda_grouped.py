"""Prefill-size AP MoE over ubcq planes: a grouped GEMM that decodes the planes in its mainloop
(cuda_grouped_gemm.cu, NVRTC), so no expert is ever dequantized into a scratch.

Each block multiplies 128 (or, `rows=256`, 256) weight rows by up to 64 * wn (token, slot) pairs of one expert on
tensor cores (the 256 x 128 default as four warpgroups of 64 rows). The plane bytes, the activations and their group
sums pass through a cp.async pipeline in shared memory; every weight pair of an mma fragment is built from the
bit-transposed codes with one lop3 and one packed fma (c A in the compute type), and each group's offset enters in fp32
from the group's activation sum, or (`offset_in_weights`, in the 256 x 128 default) inside each weight, centred
(docs/kernels.md, "The grouped kernel"). One call is the alignment + prep (w13's input in the kernel's chunk order
with its group sums; zeroes the accumulators) + w13 (silu(gate) * up in its epilogue, written in w2's order) + w2
(float32 atomics, routing weights applied) + one cast.

Device memory beyond the output: w13's input in the compute type ([M or M * topk, H]), w2's input ([M * topk,
I]), float32 group sums and the float32 [M, H] accumulator; nothing proportional to the experts.

Scope: CUDA, ubcq tables, group sizes multiples of 128 or 64 (with the offset in the weights), hidden sizes
multiples of 128 (a 256-row block past the hidden size reads zero planes for the rows beyond it and stores nothing of
them), intermediate sizes multiples of 64 (an odd multiple of 64 builds with -DTAIL64: cuda_grouped_gemm.cu).
`grouped_moe_unsupported` says why a layer is not eligible.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedweight.kernels.align import moe_align_block_size
from pagedweight.kernels.cuda_fold import _DTYPE_CODE, compute_code
from pagedweight.kernels.activation import act_defines
from pagedweight.kernels.nvrtc import build_in_parallel, cached_kernel, compile_cubin
from pagedweight.kernels.weights import APMoEWeights

CHUNK = 128
TAIL_GROUP = 64  # the one group size under a chunk it reads (with the offset in the weights): a 704 intermediate
ROWS_PER_BLOCK = 128  # weight rows of one block (w13: 64 gate rows and their up rows); GroupedConfig.rows
_SOURCE = Path(__file__).with_name("cuda_grouped_gemm.cu")
_WS_SOURCE = Path(__file__).with_name("cuda_grouped_ws.cu")
MODE_W13, MODE_W2 = 0, 1
SRC_TOKEN, SRC_PAIR = 0, 1
MAX_GROUPS = 256  # prep's shared group sums per row


SHARED_LIMIT = 227 * 1024  # dynamic shared memory of one block on sm_90
WEIGHT_TILE_BYTES = ROWS_PER_BLOCK * CHUNK * 2  # the warp-specialized kernel's decoded 16-bit weight tile


@dataclass(frozen=True)
class GroupedConfig:
    # 64 * wn pairs per block (the single-role kernel at 128 rows: 4 * wn warps). wn = 4 (rows = 128, wgmma): 128
    # rows x 256 pairs, the two warpgroups 64 rows each by all 256 pairs (wgmma m64n256k16): each decoded weight
    # meets 256 pairs, and an expert of up to 256 pairs is one token block
    wn: int = 2
    stages: int = 3  # chunks of 128 inputs in flight in shared memory
    wgmma: bool = True  # warpgroup MMA (sm_90a: Hopper) rather than mma.sync (any sm_80+ GPU)
    # warp-specialized (cuda_grouped_ws.cu, sm_90a): a producer warpgroup loads and decodes each chunk once into
    # shared memory while two consumer warpgroups run wgmma with both operands there
    ws: bool = False
    l2_prefetch: int = 0  # L2 prefetch size (bytes) of the 16-byte copies: 0, 128 or 256
    # weight rows per block: 256 puts two warpgroups side by side along the rows, each multiplying its 128 rows by
    # all 64 * wn pairs (wgmma m64n(64 wn)k16), so each weight is decoded once per block and each activation byte
    # read from L2 feeds twice the rows (single-role wgmma kernel only)
    rows: int = ROWS_PER_BLOCK
    # warpgroups along the block's rows (None: the block's usual, 2 at 256 rows or 256 pairs, else 1). The split
    # forms give each warpgroup 64 rows (one wgmma per k16 step), so each warp holds half the accumulators and
    # decodes half the rows, and twice the warps per scheduler hide each other's latencies: 256 x 128 as 4 (512
    # threads, registers capped at 128), 128 x 64 as 2 (256 threads, two blocks per SM, registers capped at 128)
    row_warpgroups: int | None = None
    # w2 (single-role kernel): stage the block's results in shared memory and add them into the output with 16-byte
    # vector reductions (sm_90), 4x fewer reduction requests than one float32 atomic per value
    red_v4: bool = False
    # single-role kernel: each weight built whole, A c + z with z in the compute type (the dequantize-then-GEMM path's
    # rounding), so no fp32 group-offset pass waits for the MMAs at every group's end (one more packed fma per pair)
    offset_in_weights: bool = False
    # single-role wgmma kernel, stages >= 3: 2 refills the slot read two chunks ago, which every MMA has finished (each
    # k16 step waits for all but the newest), so no drain of the MMAs precedes a refill; one chunk less of copies in
    # flight. 1 refills the slot of the chunk just read, after a drain
    refill_lag: int = 1
    # single-role kernel, stages of one size (no q_fit): one block per SM walks the tiles and issues the first chunks
    # of its next tile before the current tile's epilogue (into the stages the epilogue's shared memory leaves), so
    # a tile's pipeline no longer fills from empty after the epilogue
    persistent: bool = False
    # single-role wgmma kernel: the k16 step of each chunk (1..7) after whose MMAs are issued the chunk's refill
    # copies; -1 before the first step. Later puts the chunk's first MMAs ahead of the copies' address work, so the
    # tensor cores wait less after each chunk's barrier (after step 0 ptxas serializes the chunk's MMAs)
    copy_step: int = -1
    # single-role wgmma kernel: k16 steps of MMAs left in flight after each step is issued (1: wait for the step
    # before; 2: for the one before that, the A fragments of three steps live at once), so the tensor cores keep a
    # deeper queue while the warps decode
    mma_depth: int = 1

    def __post_init__(self) -> None:
        if self.wn not in (1, 2, 4):
            raise ValueError(f"wn must be 1, 2 or 4, got {self.wn}")
        if self.wn == 4 and (self.rows != 128 or self.ws or not self.wgmma):
            raise ValueError("256-pair blocks (wn=4) are 128 rows on the single-role wgmma kernel: pass rows=128, "
                             "ws=False, wgmma=True")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"stages must be in 2..4, got {self.stages}")
        if self.l2_prefetch not in (0, 128, 256):
            raise ValueError(f"l2_prefetch must be 0, 128 or 256, got {self.l2_prefetch}")
        if self.ws and not self.wgmma:
            raise ValueError("the warp-specialized grouped kernel (ws=True) runs on wgmma: pass wgmma=True")
        if self.rows not in (128, 256):
            raise ValueError(f"rows must be 128 or 256, got {self.rows}")
        usual = 2 if self.rows == 256 or self.wn == 4 else 1
        if self.row_warpgroups is None:
            object.__setattr__(self, "row_warpgroups", usual)
        if self.row_warpgroups != usual and not (self.split_rows and not self.ws and self.wgmma):
            raise ValueError(f"row_warpgroups={self.row_warpgroups}: the split forms are 4 at rows=256, wn=2 and 2 at "
                             f"rows=128, wn=1 (wgmma, ws=False); otherwise leave it at {usual}")
        if self.red_v4 and self.ws:
            raise ValueError("red_v4 applies to the single-role grouped kernel: pass ws=False")
        if self.offset_in_weights and self.ws:
            raise ValueError("offset_in_weights applies to the single-role grouped kernel: pass ws=False")
        if self.refill_lag not in (1, 2):
            raise ValueError(f"refill_lag must be 1 or 2, got {self.refill_lag}")
        if self.refill_lag == 2 and (self.ws or not self.wgmma or self.stages < 3):
            raise ValueError("refill_lag=2 applies to the single-role wgmma kernel with at least 3 stages: pass "
                             "ws=False, wgmma=True, stages>=3")
        if self.persistent and (self.ws or self.q_fit):
            raise ValueError("persistent applies to the single-role grouped kernel with stages of one size: pass "
                             "ws=False, and not wn=4 nor rows=256 at four stages")
        if not (self.copy_step == -1 or 1 <= self.copy_step <= 7):
            raise ValueError(f"copy_step must be -1 or one of a chunk's k16 steps 1..7, got {self.copy_step}")
        if self.copy_step >= 0 and (self.ws or not self.wgmma):
            raise ValueError("copy_step applies to the single-role wgmma kernel: pass ws=False, wgmma=True")
        if self.mma_depth not in (1, 2):
            raise ValueError(f"mma_depth must be 1 or 2, got {self.mma_depth}")
        if self.mma_depth == 2 and (self.ws or not self.wgmma):
            raise ValueError("mma_depth=2 applies to the single-role wgmma kernel: pass ws=False, wgmma=True")
        if self.rows == 256 and (self.ws or not self.wgmma):
            raise ValueError("256-row blocks (rows=256) run on the single-role wgmma kernel: pass ws=False, "
                             "wgmma=True")

    @property
    def block_m(self) -> int:
        return 64 * self.wn

    @property
    def split_rows(self) -> bool:
        """64 rows per warpgroup where the block's usual form has 128: 256 x 128 in four warpgroups, 128 x 64 in two."""
        return (self.rows, self.wn, self.row_warpgroups) in ((256, 2, 4), (128, 1, 2))

    @property
    def threads(self) -> int:
        if self.ws:
            return 384
        if self.split_rows:
            return 128 * self.row_warpgroups
        return 256 if self.rows == 256 or self.wn == 4 else 128 * self.wn

    @property
    def source(self) -> Path:
        return _WS_SOURCE if self.ws else _SOURCE

    @property
    def kernel_name(self) -> str:
        return "ap_grouped_ws_gemm" if self.ws else "ap_grouped_gemm"

    @property
    def q_fit(self) -> bool:
        """Stages sized per bitwidth (`-DQFIT`): each holds the block's own planes, as many as fit the ring, up to
        `stages`. 128 x 256 blocks (64 KB of activations per stage) hold three stages up to 4-bit planes; 256 x 128
        blocks at four stages hold four up to 4-bit planes and three above (four stages of an 8-bit parent's planes
        would not fit)."""
        return self.wn == 4 or (self.rows == 256 and self.wn == 2 and self.stages == 4)

    def ring_bytes(self, bits_max: int) -> int:
        """Shared memory of the pipeline's stages: `stages` stages of bits_max planes (each rounded up to 1 KB); with
        q_fit at most what one block can hold (narrower bitwidths then fit more stages), and at least two stages; with
        red_v4 at least w2's staged results."""
        stage = -(-(self.block_m * 256 + bits_max * self.rows * 16 + self.block_m * 4) // 1024) * 1024
        ring = self.stages * stage
        if self.q_fit:  # what is left of one block's shared memory beside the alignment and the slot arrays
            budget = (SHARED_LIMIT - 1024 - 2 * 4 * self.block_m) // 1024 * 1024
            ring = max(min(ring, budget), 2 * stage)
        if self.red_v4:  # w2's results are staged in the ring's memory: [pairs][rows + 4] float32
            ring = max(ring, -(-self.block_m * (self.rows + 4) * 4 // 1024) * 1024)
        return ring

    def shared_bytes(self, bits_max: int) -> int:
        """Dynamic shared memory: the ring of stages, the warp-specialized kernel's two decoded weight tiles, plus
        1 KB to align the first stage."""
        tiles = 2 * WEIGHT_TILE_BYTES if self.ws else 0
        return self.ring_bytes(bits_max) + tiles + 1024


def grouped_unsupported(w: APMoEWeights) -> str | None:
    """Why the grouped kernel cannot read `w` (None when it can)."""
    if w.table_kind != "ubcq":
        return (f"table kind {w.table_kind!r} (the grouped kernel reads ubcq tables, whose weights are affine in the "
                "code)")
    if w.group_size % CHUNK and w.group_size != TAIL_GROUP:
        return f"ubcq group size {w.group_size} is neither {TAIL_GROUP} nor a multiple of {CHUNK}"
    if w.K % w.group_size:
        return f"K={w.K} is not a multiple of the group size {w.group_size}"
    if w.K // w.group_size > MAX_GROUPS:
        return f"K={w.K} holds more than {MAX_GROUPS} groups"
    if not w.page_table.is_cuda:
        return "the page table is not on a CUDA device"
    return None


def grouped_moe_unsupported(w13: APMoEWeights, w2: APMoEWeights) -> str | None:
    why = grouped_unsupported(w13) or grouped_unsupported(w2)
    if why is None and w2.N % ROWS_PER_BLOCK:
        return f"the hidden size {w2.N} is not a multiple of {ROWS_PER_BLOCK}"
    if why is None and w2.K % TAIL_GROUP:
        return f"the intermediate size {w2.K} is not a multiple of {TAIL_GROUP}"
    return why


def grouped_call_unsupported(m: int, topk: int, w13: APMoEWeights, w2: APMoEWeights, block_m: int,
                             apply_router_weight_on_input: bool) -> str | None:
    """Why one call of m tokens is past the grouped kernel's 32-bit activation offsets or its 65535 token blocks of
    block_m pairs (None when it fits): ap_fused_moe_grouped refuses such a call, and kernel="auto" does not pick it."""
    num_pairs = m * topk
    inter_row = -(-w2.K // CHUNK) * CHUNK  # w2's input rows, padded to whole chunks (-DTAIL64)
    units = num_pairs if apply_router_weight_on_input else m
    too_many_blocks = num_pairs + w13.num_experts * block_m >= 65535 * block_m
    if max(units * w13.K, num_pairs * inter_row) >= 2**31 or too_many_blocks:
        return (f"{m} tokens x top-{topk} exceed the grouped kernel's 32-bit activation offsets or its 65535 blocks "
                f"of {block_m} pairs at hidden {w13.K} / intermediate {w2.K}")
    return None


def grouped_layer_config(cfg: GroupedConfig, w13: APMoEWeights, w2: APMoEWeights, explicit: bool) -> GroupedConfig:
    """`cfg` for this layer: groups of 64 inputs (w13's or w2's) need the offset in the weights on the plain launch
    (the fp32 offset pass sums whole chunks). A default config takes it on; an explicit one without it is refused."""
    group = min(w13.group_size, w2.group_size)
    if group >= CHUNK or (cfg.offset_in_weights and not cfg.persistent and not cfg.ws):
        return cfg
    if explicit:
        raise ValueError(f"moe: the grouped kernel reads groups of {group} inputs only with the offset in the weights "
                         f"on the plain launch: pass a GroupedConfig with offset_in_weights=True, persistent=False, "
                         f"ws=False (got {cfg})")
    return dataclasses.replace(cfg, offset_in_weights=True)


def require_grouped(why: str | None) -> None:
    if why is not None:
        raise ValueError(f"moe: the grouped kernel cannot run: {why}")


def gemm_defines(mode: int, cfg: GroupedConfig, bits_max: int, group_size: int, compute: int,
                 tail64: bool = False) -> list[str]:
    if tail64 and (cfg.ws or cfg.persistent):
        raise ValueError("an intermediate size that is an odd multiple of 64 runs on the plain single-role launch: pass "
                         "ws=False, persistent=False")
    if cfg.ws:
        return [f"-DMODE={mode}", f"-DBN={cfg.block_m}", f"-DPMAX={bits_max}", f"-DG={group_size}",
                f"-DCT={compute}", f"-DSTAGES={cfg.stages}", f"-DL2PF={cfg.l2_prefetch}"]
    return [f"-DMODE={mode}", f"-DWN={cfg.wn}", f"-DPMAX={bits_max}", f"-DG={group_size}", f"-DCT={compute}",
            f"-DSTAGES={cfg.stages}", f"-DWGMMA={int(cfg.wgmma)}", f"-DL2PF={cfg.l2_prefetch}",
            f"-DWGR={cfg.row_warpgroups}", f"-DTPW={1 if cfg.wn == 4 or cfg.split_rows else 2}",
            f"-DRING={cfg.ring_bytes(bits_max)}", f"-DQFIT={int(cfg.q_fit)}",
            f"-DREDV={int(cfg.red_v4 and mode == MODE_W2)}", f"-DOFFW={int(cfg.offset_in_weights)}",
            f"-DLAG={cfg.refill_lag}", f"-DPERSIST={int(cfg.persistent)}", f"-DCOPY_STEP={cfg.copy_step}",
            f"-DMMA_DEPTH={cfg.mma_depth}", *(["-DTAIL64=1"] if tail64 else [])]


def gemm_arch(cfg: GroupedConfig, compute_capability: str) -> str:
    """The NVRTC target: wgmma needs the architecture-specific sm_90a."""
    if cfg.wgmma:
        if compute_capability != "90":
            raise ValueError(f"the grouped kernel's wgmma variant needs an sm_90 (Hopper) GPU, got "
                             f"sm_{compute_capability}: pass GroupedConfig(wgmma=False)")
        return "90a"
    return compute_capability


def prep_defines(group_size: int, compute: int, x_dtype: torch.dtype) -> list[str]:
    # groups of 64: the GEMM that compiles alongside the prep in the same file needs the offset in the weights
    return ["-DMODE=0", f"-DG={group_size}", f"-DCT={compute}", f"-DXT={_DTYPE_CODE[x_dtype]}",
            *(["-DOFFW=1"] if group_size < CHUNK else [])]


def compile_to_cubin(defines: list[str], compute_capability: str, name: str = "ap_grouped_gemm",
                     source: Path = _SOURCE) -> bytes:
    return compile_cubin(source, name, compute_capability, defines)


def gemm_kernel(cfg: GroupedConfig, mode: int, w: APMoEWeights, activation: str, compute: int, device: torch.device):
    """The (cached) w13 or w2 kernel of `cfg` for `w`, and its dynamic shared memory."""
    major, minor = torch.cuda.get_device_capability(device)
    smem = cfg.shared_bytes(w.bits_max)
    inter = w.N // 2 if mode == MODE_W13 else w.K
    defines = gemm_defines(mode, cfg, w.bits_max, w.group_size, compute, tail64=inter % CHUNK != 0)
    defines = tuple(defines + act_defines(activation) if mode == MODE_W13 else defines)
    return cached_kernel(cfg.source, cfg.kernel_name, defines, device.index or 0, smem,
                         gemm_arch(cfg, f"{major}{minor}")), smem


def prebuild_grouped(configs: list[GroupedConfig], w13: APMoEWeights, w2: APMoEWeights, dtype: torch.dtype,
                     activation: str = "silu") -> list[str]:
    """Build the w13 and w2 kernels of every config on all cores at once (NVRTC releases the GIL), so that a sweep's
    first calls do not compile one after another. Configs whose stages do not fit one block's shared memory are
    skipped (their calls refuse); returns a line per skipped config."""
    device = w13.page_table.device
    compute = compute_code(dtype)
    jobs, skipped = [], []
    for cfg in dict.fromkeys(configs):
        if cfg.shared_bytes(max(w13.bits_max, w2.bits_max)) > SHARED_LIMIT:
            skipped.append(f"{cfg}: its stages do not fit one block's shared memory")
            continue
        try:
            grouped_layer_config(cfg, w13, w2, explicit=True)
        except ValueError as e:
            skipped.append(str(e))
            continue
        jobs += [(cfg, MODE_W13, w13), (cfg, MODE_W2, w2)]
    if jobs:
        build_in_parallel([functools.partial(gemm_kernel, *job, activation, compute, device) for job in jobs],
                          device.index or 0)
    return skipped


# Pairs per expert from which the default block is 256 weight rows x 128 pairs in four warpgroups (each weight
# decoded once per block) instead of 128 rows x 64 pairs in two: the four-warpgroup block measured ahead from 64
# pairs per expert, the two-warpgroup block up to 34 (benchmark/grouped_sweep.py, docs/results/kernel.md session 35).
ROWS256_MIN_PAIRS_PER_EXPERT = 48


def default_block_m(m: int, topk: int, num_experts: int) -> int:
    """Pairs per token block of default_grouped_config, without building it (kernel="auto" sizes every prefill call
    against the kernel's limits with it)."""
    return 128 if m * topk / max(1, num_experts) >= ROWS256_MIN_PAIRS_PER_EXPERT else 64


def default_grouped_config(m: int, topk: int, num_experts: int) -> GroupedConfig:
    """The block shape by pairs per expert. 256 x 128 runs as four warpgroups of 64 rows (512 threads: more warps to
    hide each other's latencies), adds w2's results by 16-byte vector reductions (red_v4), builds each weight whole
    with its centred group offset (offset_in_weights: no fp32 offset pass, so no drain of the MMAs at a group's end),
    refills the stage read two chunks ago (refill_lag=2: no drain before a refill), issues those copies after a
    chunk's third k16 step (copy_step=2) and runs four stages up to 4-bit blocks (three above), keeping two chunks of
    copies in flight (docs/results/kernel.md, sessions 31-33). 128 x 64 runs as two warpgroups of 64 rows (256
    threads, two blocks per SM; session 34)."""
    if default_block_m(m, topk, num_experts) == 128:
        return GroupedConfig(wn=2, stages=4, rows=256, row_warpgroups=4, red_v4=True, offset_in_weights=True,
                             refill_lag=2, copy_step=2)
    return GroupedConfig(wn=1, stages=3, row_warpgroups=2)


def ap_fused_moe_grouped(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: APMoEWeights, w2: APMoEWeights,
    *, activation: str = "silu", apply_router_weight_on_input: bool = False, config: GroupedConfig | None = None,
) -> torch.Tensor:
    """gate/up -> act(gate) * up -> down with routing weights (act: activation.py); [M, H] in hidden's dtype."""
    require_grouped(grouped_moe_unsupported(w13, w2))
    m, topk = topk_ids.shape
    num_pairs = m * topk
    dev = hidden.device
    cfg = grouped_layer_config(config or default_grouped_config(m, topk, w13.num_experts), w13, w2, config is not None)
    x = hidden.contiguous()
    tw = topk_weights.contiguous().float()
    compute = compute_code(x.dtype)
    inter, H = w2.K, w2.N
    inter_row = -(-inter // CHUNK) * CHUNK  # w2's input rows, padded to whole chunks (-DTAIL64)
    units, src = (num_pairs, SRC_PAIR) if apply_router_weight_on_input else (m, SRC_TOKEN)
    too_big = grouped_call_unsupported(m, topk, w13, w2, cfg.block_m, apply_router_weight_on_input)
    if too_big is not None:
        raise ValueError(f"moe: {too_big}: split the batch")
    bits_max = max(w13.bits_max, w2.bits_max)
    if cfg.shared_bytes(bits_max) > SHARED_LIMIT:
        raise ValueError(f"moe: grouped kernel {cfg} needs {cfg.shared_bytes(bits_max)} bytes of shared memory at "
                         f"{bits_max} bits, over the {SHARED_LIMIT} of one block: use fewer stages or wn=1")
    align = moe_align_block_size(topk_ids, cfg.block_m, w13.num_experts)
    ng2 = inter // w2.group_size
    zero = torch.empty(m * H + num_pairs * ng2, dtype=torch.float32, device=dev)  # zeroed by the prep kernel
    acc, xs2 = zero[: m * H], zero[m * H :]
    xp = torch.empty(units, w13.K, dtype=torch.int16, device=dev)
    xs13 = torch.empty(units, w13.K // w13.group_size, dtype=torch.float32, device=dev)
    prep = cached_kernel(_SOURCE, "ap_grouped_prep", tuple(prep_defines(w13.group_size, compute, x.dtype)),
                         dev.index or 0)
    prep(grid=(units, 1, 1), block=(256, 1, 1),
         args=[x, x.stride(0), tw, xp, xs13, topk, w13.K, src, zero, zero.numel()])
    act = torch.empty(num_pairs, inter_row, dtype=torch.int16, device=dev)
    common = [tw, align.sorted_ids, align.expert_ids, align.num_tokens_post_padded]
    for mode, w, xin, xsin, n_out in ((MODE_W13, w13, xp, xs13, inter), (MODE_W2, w2, act, xs2, H)):
        kernel, smem = gemm_kernel(cfg, mode, w, activation, compute, dev)
        rows = cfg.rows // 2 if mode == MODE_W13 else cfg.rows  # outputs per block
        grid = (-(-n_out // rows), align.max_blocks, 1)
        if cfg.persistent:  # one block per SM, at most one per tile
            grid = (min(grid[0] * grid[1], torch.cuda.get_device_properties(dev).multi_processor_count), 1, 1)
        kernel(grid=grid, block=(cfg.threads, 1, 1), shared_mem=smem,
               args=[xin, xsin, w.page_table, *common, act, xs2, acc, num_pairs, topk, n_out, w.N, w.K,
                     int(apply_router_weight_on_input), w.num_experts, w.page_table.stride(0), w2.group_size,
                     int(apply_router_weight_on_input)])
    return acc.view(m, H).to(hidden.dtype)
