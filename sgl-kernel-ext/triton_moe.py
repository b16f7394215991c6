"""Fused mixed-precision AP MoE in Triton over the aligned (token, slot) pairs.

  w13 (decode default, `_ap_moe_w13_split_kernel`): per (M-block of one expert, BN of the 2I gate||up
        rows, K split): one tile rebuilt from the expert's planes at its committed bitwidth, tl.dot,
        h [pairs, 2I]; then `_gate_mul_kernel` writes act = act(gate) * up in w2's column order (ACT: 0 silu,
        1 gelu; activation.py).
  w13 (`_ap_moe_w13_kernel`, fuse_gate_up): gate and up tiles in one program, the activation fused.
  w2:   per (M-block, BN hidden columns, K split): down tiles, times the routing weight, atomically
        added into a float32 [M, H] output (which also sums the top-k slots of each token).
  prefill (dequant_chunk > 0): triton_dequant_moe.py.

Every launch reads the bitwidth and addresses of its expert from the page table at run time, so one
compiled kernel serves any per-expert bitwidth mix and CUDA graphs stay valid when rows change.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedweight.kernels.activation import act_code
from pagedweight.kernels.align import MoEAlignment
from pagedweight.kernels.config import APKernelConfig, largest_block_k
from pagedweight.kernels.triton_tiles import (
    act_tile,
    load_row,
    permuted_position,
    plane_pointer,
    tile_dot,
    tile_from_words,
    tile_words,
    weight_tile,
)
from pagedweight.kernels.weights import APMoEWeights

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _gate_act(g, ACT: tl.constexpr):
    """The expert's gate activation (activation.py): 0 SiLU, 1 GELU (erf form)."""
    if ACT == 1:
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _ap_moe_w13_kernel(
    x_ptr, act_ptr, pt_ptr, tw_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
    num_pairs, topk, I, K, G: tl.constexpr, stride_xm, stride_am, PT_STRIDE,
    KIND: tl.constexpr, KIND2: tl.constexpr, APPLY_W_IN: tl.constexpr, P_MAX: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CD: tl.constexpr, USE_ASM: tl.constexpr, DOT_F32: tl.constexpr,
    PREFETCH: tl.constexpr, ACT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(post_pad_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m)
    if e < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = pairs < num_pairs
    tok = (pairs // topk).to(tl.int64)
    row, q, table = load_row(pt_ptr, e, PT_STRIDE)
    p0 = plane_pointer(row, 0, q)  # plane addresses are loop invariant: read the row once
    p1 = plane_pointer(row, 1, q) if P_MAX > 1 else p0
    p2 = plane_pointer(row, 2, q) if P_MAX > 2 else p0
    p3 = plane_pointer(row, 3, q) if P_MAX > 3 else p0
    p4 = plane_pointer(row, 4, q) if P_MAX > 4 else p0
    p5 = plane_pointer(row, 5, q) if P_MAX > 5 else p0
    p6 = plane_pointer(row, 6, q) if P_MAX > 6 else p0
    p7 = plane_pointer(row, 7, q) if P_MAX > 7 else p0
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < I
    if APPLY_W_IN:
        rw = tl.load(tw_ptr + pairs, mask=valid, other=0.0)
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    if PREFETCH:
        # registers double-buffer the plane words: step k+1's loads are in flight while step k computes
        g0, g1, g2, g3, g4, g5, g6, g7 = tile_words(p0, p1, p2, p3, p4, p5, p6, p7, q, offs_n, mask_n, 0, K, True, BK, P_MAX)
        u0, u1, u2, u3, u4, u5, u6, u7 = tile_words(p0, p1, p2, p3, p4, p5, p6, p7, q, offs_n + I, mask_n, 0, K, True, BK, P_MAX)
        for k0 in range(0, K, BK):
            more = k0 + BK < K
            h0, h1, h2, h3, h4, h5, h6, h7 = tile_words(p0, p1, p2, p3, p4, p5, p6, p7, q, offs_n, mask_n, k0 + BK, K,
                                                        more, BK, P_MAX)
            v0, v1, v2, v3, v4, v5, v6, v7 = tile_words(p0, p1, p2, p3, p4, p5, p6, p7, q, offs_n + I, mask_n, k0 + BK, K,
                                                        more, BK, P_MAX)
            xt = act_tile(x_ptr, tok, stride_xm, k0, valid, BK)
            if APPLY_W_IN:
                xt = (xt.to(tl.float32) * rw[None, :]).to(CD)
            wg = tile_from_words(g0, g1, g2, g3, g4, g5, g6, g7, q, table, offs_n, mask_n, k0, 2 * I, K, G,
                                 KIND, BN, BK, P_MAX, CD, USE_ASM)
            acc_g = tile_dot(wg, xt, acc_g, DOT_F32)
            wu = tile_from_words(u0, u1, u2, u3, u4, u5, u6, u7, q, table, offs_n + I, mask_n, k0, 2 * I, K, G,
                                 KIND, BN, BK, P_MAX, CD, USE_ASM)
            acc_u = tile_dot(wu, xt, acc_u, DOT_F32)
            g0, g1, g2, g3, g4, g5, g6, g7 = h0, h1, h2, h3, h4, h5, h6, h7
            u0, u1, u2, u3, u4, u5, u6, u7 = v0, v1, v2, v3, v4, v5, v6, v7
    else:
        for k0 in range(0, K, BK):
            # x is stored permuted and in CD by the launcher: a contiguous tile
            xt = act_tile(x_ptr, tok, stride_xm, k0, valid, BK)
            if APPLY_W_IN:
                xt = (xt.to(tl.float32) * rw[None, :]).to(CD)
            wg = weight_tile(p0, p1, p2, p3, p4, p5, p6, p7, q, table, offs_n, mask_n, k0, 2 * I, K, G,
                             KIND, BN, BK, P_MAX, CD, USE_ASM)
            acc_g = tile_dot(wg, xt, acc_g, DOT_F32)
            wu = weight_tile(p0, p1, p2, p3, p4, p5, p6, p7, q, table, offs_n + I, mask_n, k0, 2 * I, K, G,
                             KIND, BN, BK, P_MAX, CD, USE_ASM)
            acc_u = tile_dot(wu, xt, acc_u, DOT_F32)
    act = _gate_act(acc_g, ACT) * acc_u
    # written in the column order the w2 tiles expect (KIND2), so w2 loads contiguous tiles too
    ptrs = act_ptr + pairs[None, :].to(tl.int64) * stride_am + permuted_position(offs_n, KIND2)[:, None]
    tl.store(ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[None, :] & mask_n[:, None])


@triton.jit
def _ap_moe_w13_split_kernel(
    x_ptr, h_ptr, pt_ptr, tw_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
    num_pairs, topk, N, K, G: tl.constexpr, stride_xm, stride_hm, PT_STRIDE,
    KIND: tl.constexpr, APPLY_W_IN: tl.constexpr, P_MAX: tl.constexpr, SPLIT_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CD: tl.constexpr, USE_ASM: tl.constexpr, DOT_F32: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """h[pair, n] = x[token] . W13_e[n] for BN of the 2I gate||up rows: one tile per program, half the
    registers of the fused kernel, so more warps per SM hide the plane loads (decode). With SPLIT_K > 1
    the K slices are summed with float32 atomics into a zeroed h (few experts hit: more programs)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if pid_m * BM >= tl.load(post_pad_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m)
    if e < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = pairs < num_pairs
    tok = (pairs // topk).to(tl.int64)
    row, q, table = load_row(pt_ptr, e, PT_STRIDE)
    p0 = plane_pointer(row, 0, q)
    p1 = plane_pointer(row, 1, q) if P_MAX > 1 else p0
    p2 = plane_pointer(row, 2, q) if P_MAX > 2 else p0
    p3 = plane_pointer(row, 3, q) if P_MAX > 3 else p0
    p4 = plane_pointer(row, 4, q) if P_MAX > 4 else p0
    p5 = plane_pointer(row, 5, q) if P_MAX > 5 else p0
    p6 = plane_pointer(row, 6, q) if P_MAX > 6 else p0
    p7 = plane_pointer(row, 7, q) if P_MAX > 7 else p0
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    if APPLY_W_IN:
        rw = tl.load(tw_ptr + pairs, mask=valid, other=0.0)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    if PREFETCH:
        w0, w1, w2, w3, w4, w5, w6, w7 = tile_words(p0, p1, p2, p3, p4, p5, p6, p7, q, offs_n, mask_n, pid_k * BK, K,
                                                    True, BK, P_MAX)
        for kt in range(pid_k, K // BK, SPLIT_K):
            k0 = kt * BK
            k1 = k0 + SPLIT_K * BK
            h0, h1, h2, h3, h4, h5, h6, h7 = tile_words(p0, p1, p2, p3, p4, p5, p6, p7, q, offs_n, mask_n, k1, K,
                                                        k1 < K, BK, P_MAX)
            xt = act_tile(x_ptr, tok, stride_xm, k0, valid, BK)
            if APPLY_W_IN:
                xt = (xt.to(tl.float32) * rw[None, :]).to(CD)
            w = tile_from_words(w0, w1, w2, w3, w4, w5, w6, w7, q, table, offs_n, mask_n, k0, N, K, G,
                                KIND, BN, BK, P_MAX, CD, USE_ASM)
            acc = tile_dot(w, xt, acc, DOT_F32)
            w0, w1, w2, w3, w4, w5, w6, w7 = h0, h1, h2, h3, h4, h5, h6, h7
    else:
        for kt in range(pid_k, K // BK, SPLIT_K):
            k0 = kt * BK
            xt = act_tile(x_ptr, tok, stride_xm, k0, valid, BK)
            if APPLY_W_IN:
                xt = (xt.to(tl.float32) * rw[None, :]).to(CD)
            w = weight_tile(p0, p1, p2, p3, p4, p5, p6, p7, q, table, offs_n, mask_n, k0, N, K, G,
                            KIND, BN, BK, P_MAX, CD, USE_ASM)
            acc = tile_dot(w, xt, acc, DOT_F32)
    ptrs = h_ptr + pairs[None, :].to(tl.int64) * stride_hm + offs_n[:, None]
    if SPLIT_K > 1:
        tl.atomic_add(ptrs, acc, mask=valid[None, :] & mask_n[:, None], sem="relaxed")
    else:
        tl.store(ptrs, acc.to(h_ptr.dtype.element_ty), mask=valid[None, :] & mask_n[:, None])


@triton.jit
def _gate_mul_kernel(h_ptr, act_ptr, I, stride_hm, stride_am, KIND2: tl.constexpr, BLOCK: tl.constexpr,
                     ACT: tl.constexpr):
    """act[pair, permuted(j)] = act(h[pair, j]) * h[pair, I + j], in the column order w2's tiles read."""
    pair = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < I
    g = tl.load(h_ptr + pair * stride_hm + j, mask=m, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + pair * stride_hm + I + j, mask=m, other=0.0).to(tl.float32)
    a = _gate_act(g, ACT) * u
    tl.store(act_ptr + pair * stride_am + permuted_position(j, KIND2), a.to(act_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ap_moe_w2_kernel(
    act_ptr, out_ptr, pt_ptr, tw_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
    num_pairs, topk, N, K, G: tl.constexpr, stride_am, stride_om, PT_STRIDE,
    KIND: tl.constexpr, APPLY_W_IN: tl.constexpr, P_MAX: tl.constexpr, SPLIT_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CD: tl.constexpr, USE_ASM: tl.constexpr, DOT_F32: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if pid_m * BM >= tl.load(post_pad_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m)
    if e < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = pairs < num_pairs
    row, q, table = load_row(pt_ptr, e, PT_STRIDE)
    p0 = plane_pointer(row, 0, q)  # plane addresses are loop invariant: read the row once
    p1 = plane_pointer(row, 1, q) if P_MAX > 1 else p0
    p2 = plane_pointer(row, 2, q) if P_MAX > 2 else p0
    p3 = plane_pointer(row, 3, q) if P_MAX > 3 else p0
    p4 = plane_pointer(row, 4, q) if P_MAX > 4 else p0
    p5 = plane_pointer(row, 5, q) if P_MAX > 5 else p0
    p6 = plane_pointer(row, 6, q) if P_MAX > 6 else p0
    p7 = plane_pointer(row, 7, q) if P_MAX > 7 else p0
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    if PREFETCH:
        w0, w1, w2, w3, w4, w5, w6, w7 = tile_words(p0, p1, p2, p3, p4, p5, p6, p7, q, offs_n, mask_n, pid_k * BK, K,
                                                    True, BK, P_MAX)
        for kt in range(pid_k, K // BK, SPLIT_K):
            k0 = kt * BK
            k1 = k0 + SPLIT_K * BK
            h0, h1, h2, h3, h4, h5, h6, h7 = tile_words(p0, p1, p2, p3, p4, p5, p6, p7, q, offs_n, mask_n, k1, K,
                                                        k1 < K, BK, P_MAX)
            at = act_tile(act_ptr, pairs, stride_am, k0, valid, BK)
            w = tile_from_words(w0, w1, w2, w3, w4, w5, w6, w7, q, table, offs_n, mask_n, k0, N, K, G,
                                KIND, BN, BK, P_MAX, CD, USE_ASM)
            acc = tile_dot(w, at, acc, DOT_F32)
            w0, w1, w2, w3, w4, w5, w6, w7 = h0, h1, h2, h3, h4, h5, h6, h7
    else:
        for kt in range(pid_k, K // BK, SPLIT_K):
            k0 = kt * BK
            at = act_tile(act_ptr, pairs, stride_am, k0, valid, BK)
            w = weight_tile(p0, p1, p2, p3, p4, p5, p6, p7, q, table, offs_n, mask_n, k0, N, K, G,
                            KIND, BN, BK, P_MAX, CD, USE_ASM)
            acc = tile_dot(w, at, acc, DOT_F32)
    if not APPLY_W_IN:
        acc = acc * tl.load(tw_ptr + pairs, mask=valid, other=0.0)[None, :]
    tok = (pairs // topk).to(tl.int64)
    tl.atomic_add(out_ptr + tok[None, :] * stride_om + offs_n[:, None], acc,
                  mask=valid[None, :] & mask_n[:, None], sem="relaxed")


def input_permutation(k: int, table_kind: str, device: torch.device) -> torch.Tensor:
    """perm[j] = the input index held by tile column j (see triton_tiles.permuted_position)."""
    j = torch.arange(k, device=device)
    c, r = j // 32, j % 32
    if table_kind == "kmeans":
        return c * 32 + (r % 4) * 8 + r // 4
    return c * 32 + (r % 2) * 16 + r // 2


class _PermutationCache:
    """The constant permutations per (K, kind, device), so a decode step does not rebuild them (5 tiny
    kernels). Filled only outside CUDA-graph capture: a tensor made during capture is only written when
    the graph replays, so a cached copy would be garbage for eager calls."""

    def __init__(self) -> None:
        self._perms: dict[tuple[int, str, str], torch.Tensor] = {}

    def get(self, k: int, table_kind: str, device: torch.device) -> torch.Tensor:
        key = (k, table_kind, str(device))
        perm = self._perms.get(key)
        if perm is None:
            perm = input_permutation(k, table_kind, device)
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._perms[key] = perm
        return perm


_PERMUTATIONS = _PermutationCache()


def permute_inputs(x: torch.Tensor, table_kind: str, cd: torch.dtype) -> torch.Tensor:
    """x[:, perm] in the compute dtype (one small gather kernel): the kernels then read contiguous tiles."""
    return x.index_select(1, _PERMUTATIONS.get(x.shape[1], table_kind, x.device)).to(cd)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dot-operand dtype: fp16 activations stay fp16, bf16 and fp32 run in bf16 (fp16's range is too small)."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def _check_bk(w: APMoEWeights, bk: int, name: str) -> None:
    w.check_triton_supported(name)
    if w.K % bk or (w.grouped and w.group_size % bk):
        raise ValueError(f"{name}: BK={bk} must divide K={w.K}" + (f" and group_size={w.group_size}" if w.grouped else ""))


class _ScratchPipeline:
    """Rebuild chunk after chunk of experts into a scratch, each chunk consumed by GEMMs on the current stream.

    Without overlap: one scratch, rebuild and GEMMs alternate on the current stream. With overlap (CUDA, more
    than one chunk): two scratch buffers; chunk c + 1 is rebuilt on a side stream while chunk c's GEMMs run.
    Events order every rebuild after the GEMMs that last read its buffer and every GEMM after its rebuild.
    Measured on the H200 it is no faster (the GEMM grid fills every SM, so the rebuild waits for it), hence
    off by default (APKernelConfig.dequant_overlap; docs/kernels.md)."""

    def __init__(self, w: APMoEWeights, chunk: int, cd: torch.dtype, device: torch.device, overlap: bool) -> None:
        self.w, self.chunk = w, chunk
        self.overlap = overlap and device.type == "cuda" and w.num_experts > chunk
        self.buffers = [torch.empty(chunk, w.N, w.K, dtype=cd, device=device) for _ in range(2 if self.overlap else 1)]

    def run(self, rebuild, consume) -> None:
        """rebuild(scratch, e0) fills a buffer with experts e0.. ; consume(scratch, e0) launches its GEMMs."""
        starts = list(range(0, self.w.num_experts, self.chunk))
        if not self.overlap:
            for e0 in starts:
                rebuild(self.buffers[0], e0)
                consume(self.buffers[0], e0)
            return
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=main.device)
        side.wait_stream(main)  # page-table rewrites and inputs enqueued before this call
        ready = [torch.cuda.Event() for _ in starts]
        freed = [torch.cuda.Event() for _ in starts]
        for buf in self.buffers:
            buf.record_stream(side)

        def launch_rebuild(i: int) -> None:
            with torch.cuda.stream(side):
                if i >= 2:
                    side.wait_event(freed[i - 2])  # the GEMMs of chunk i - 2 read this buffer
                rebuild(self.buffers[i % 2], starts[i])
                ready[i].record(side)

        launch_rebuild(0)
        for i, e0 in enumerate(starts):
            if i + 1 < len(starts):
                launch_rebuild(i + 1)
            main.wait_event(ready[i])
            consume(self.buffers[i % 2], e0)
            freed[i].record(main)
        main.wait_stream(side)


def _dequantized_moe(x, act, out, w13, w2, tw, topk_ids, align, cfg13, cfg2, num_pairs, topk, kind2, *,
                     apply_router_weight_on_input, use_asm, cd, sglang_configs, act_kind: int) -> None:
    """Prefill path (triton_dequant_moe.py): experts dequantized once per call in chunks, dense GEMMs
    (SGLang's fused-MoE kernel, sglang_dense_moe.py, or ours, per cfg13.dense_gemm)."""
    from pagedweight.kernels.triton_dequant_moe import dense_moe_chunk, dequantize_chunk

    chunk = min(cfg13.dequant_chunk, w13.num_experts)
    inter = w2.K
    dot_f32 = not x.is_cuda
    cd_tl = _TL_DTYPE[cd]
    use_sglang = cfg13.dense_gemm == "sglang"
    # The scratch's column order does not depend on the block width, so the Triton dequantization takes its
    # own: the widest that divides K and the group (H200, Mixtral w13 at 4 bits: 412 us per 2 experts at 128
    # wide vs 633 us at 64; benchmark/dequant_sweep.py, docs/results/kernel.md)
    bk13 = largest_block_k(w13.K, w13.bcq_group)
    bk2 = largest_block_k(w2.K, w2.bcq_group)
    if use_sglang:
        from pagedweight.kernels.sglang_dense_moe import sglang_moe_chunk

        if sglang_configs is None:  # the alignment must already follow their BLOCK_SIZE_M
            raise ValueError("dense_gemm='sglang' needs sglang_configs; ap_fused_moe looks them up and aligns to them")
        tw2d = tw.view(-1, topk)
    h13 = torch.empty(num_pairs, 2 * inter, dtype=cd, device=x.device)

    def gemm13(s13, e0):
        # router weight on the input: W13 (w x) = w (W13 x), so it scales h before the activation
        if use_sglang:
            sglang_moe_chunk(x, h13, s13, tw2d, topk_ids, align, e0, w13.num_experts, rows_per_a=topk,
                             mul_routed_weight=apply_router_weight_on_input, config=sglang_configs.up)
        else:
            dense_moe_chunk(x, h13, s13, tw, align, e0, num_pairs, topk, by_token=True,
                            route_w=apply_router_weight_on_input, atomic_out=False, cfg=cfg13, cd_tl=cd_tl,
                            dot_f32=dot_f32)

    _ScratchPipeline(w13, chunk, cd, x.device, cfg13.dequant_overlap).run(
        lambda s, e0: dequantize_chunk(w13, s, e0, cd_tl, 64, bk13, use_asm, kernel=cfg13.dequant_kernel), gemm13)
    _gate_mul_kernel[(num_pairs, triton.cdiv(inter, 1024))](
        h13, act, inter, h13.stride(0), act.stride(0), KIND2=kind2, BLOCK=1024, ACT=act_kind, num_warps=4,
    )
    # SGLang's kernel stores one row per (token, slot) pair; the top-k slots are summed afterwards
    h2 = torch.empty(num_pairs, w2.N, dtype=cd, device=x.device) if use_sglang else None

    def gemm2(s2, e0):
        if use_sglang:
            sglang_moe_chunk(act, h2, s2, tw2d, topk_ids, align, e0, w2.num_experts, rows_per_a=1,
                             mul_routed_weight=not apply_router_weight_on_input, config=sglang_configs.down)
        else:
            dense_moe_chunk(act, out, s2, tw, align, e0, num_pairs, topk, by_token=False,
                            route_w=not apply_router_weight_on_input, atomic_out=True, cfg=cfg2, cd_tl=cd_tl,
                            dot_f32=dot_f32)

    _ScratchPipeline(w2, chunk, cd, x.device, cfg13.dequant_overlap).run(
        lambda s, e0: dequantize_chunk(w2, s, e0, cd_tl, 64, bk2, use_asm, kernel=cfg13.dequant_kernel), gemm2)
    if use_sglang:
        out += h2.view(-1, topk, w2.N).sum(dim=1, dtype=torch.float32)


def ap_fused_moe_triton(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: APMoEWeights,
    w2: APMoEWeights,
    align: MoEAlignment,
    cfg13: APKernelConfig,
    cfg2: APKernelConfig,
    *,
    apply_router_weight_on_input: bool,
    use_asm: bool,
    sglang_configs=None,
    activation: str = "silu",
) -> torch.Tensor:
    """Launches both kernels; `align` must have been built with cfg13.block_m == cfg2.block_m.
    `sglang_configs` (sglang_dense_moe.SGLangMoEConfigs): the prefill path's SGLang GEMM configs, required
    when cfg13.dense_gemm == "sglang" (`align` then uses their BLOCK_SIZE_M)."""
    if cfg13.fuse_gate_up and cfg13.split_k > 1:
        raise ValueError("w13 split_k > 1 needs fuse_gate_up=False (the activation needs the whole K sum)")
    if cfg13.block_m != align.block_size or cfg2.block_m != align.block_size:
        raise ValueError(f"alignment block {align.block_size} != kernel BM {cfg13.block_m}/{cfg2.block_m}")
    _check_bk(w13, cfg13.block_k, "w13")
    _check_bk(w2, cfg2.block_k, "w2")
    m, h = hidden.shape
    topk = topk_ids.shape[1]
    inter = w2.K
    num_pairs = m * topk
    cd = compute_dtype(hidden.dtype)
    tw = topk_weights.reshape(-1).to(torch.float32)
    x = permute_inputs(hidden, w13.table_kind, cd)
    act = torch.empty(num_pairs, inter, dtype=cd, device=hidden.device)
    out = torch.zeros(m, h, dtype=torch.float32, device=hidden.device)
    max_blocks = align.max_blocks
    kind13 = w13.kernel_kind
    kind2 = w2.kernel_kind
    act_kind = act_code(activation)
    if cfg13.dequant_chunk > 0:
        _dequantized_moe(x, act, out, w13, w2, tw, topk_ids, align, cfg13, cfg2, num_pairs, topk, kind2,
                         apply_router_weight_on_input=apply_router_weight_on_input, use_asm=use_asm, cd=cd,
                         sglang_configs=sglang_configs, act_kind=act_kind)
        return out.to(hidden.dtype)
    if cfg13.fuse_gate_up:
        _ap_moe_w13_kernel[(max_blocks, triton.cdiv(inter, cfg13.block_n))](
            x, act, w13.page_table, tw, align.sorted_ids, align.expert_ids, align.num_tokens_post_padded,
            num_pairs, topk, inter, w13.K, w13.group_size, x.stride(0), act.stride(0), w13.page_table.stride(0),
            KIND=kind13, KIND2=kind2, APPLY_W_IN=apply_router_weight_on_input, P_MAX=w13.bits_max,
            BM=cfg13.block_m, BN=cfg13.block_n, BK=cfg13.block_k, CD=_TL_DTYPE[cd], USE_ASM=use_asm,
            DOT_F32=not hidden.is_cuda, PREFETCH=cfg13.prefetch, ACT=act_kind,
            **cfg13.launch_options(hidden.is_cuda),
        )
    else:
        if cfg13.split_k > 1:
            h13 = torch.zeros(num_pairs, 2 * inter, dtype=torch.float32, device=hidden.device)
        else:
            h13 = torch.empty(num_pairs, 2 * inter, dtype=cd, device=hidden.device)
        _ap_moe_w13_split_kernel[(max_blocks, triton.cdiv(2 * inter, cfg13.block_n), cfg13.split_k)](
            x, h13, w13.page_table, tw, align.sorted_ids, align.expert_ids, align.num_tokens_post_padded,
            num_pairs, topk, 2 * inter, w13.K, w13.group_size, x.stride(0), h13.stride(0), w13.page_table.stride(0),
            KIND=kind13, APPLY_W_IN=apply_router_weight_on_input, P_MAX=w13.bits_max, SPLIT_K=cfg13.split_k,
            BM=cfg13.block_m, BN=cfg13.block_n, BK=cfg13.block_k, CD=_TL_DTYPE[cd], USE_ASM=use_asm,
            DOT_F32=not hidden.is_cuda, PREFETCH=cfg13.prefetch, **cfg13.launch_options(hidden.is_cuda),
        )
        _gate_mul_kernel[(num_pairs, triton.cdiv(inter, 1024))](
            h13, act, inter, h13.stride(0), act.stride(0), KIND2=kind2, BLOCK=1024, ACT=act_kind,
            num_warps=4,
        )
    _ap_moe_w2_kernel[(max_blocks, triton.cdiv(h, cfg2.block_n), cfg2.split_k)](
        act, out, w2.page_table, tw, align.sorted_ids, align.expert_ids, align.num_tokens_post_padded,
        num_pairs, topk, h, inter, w2.group_size, act.stride(0), out.stride(0), w2.page_table.stride(0),
        KIND=kind2, APPLY_W_IN=apply_router_weight_on_input, P_MAX=w2.bits_max, SPLIT_K=cfg2.split_k,
        BM=cfg2.block_m, BN=cfg2.block_n, BK=cfg2.block_k, CD=_TL_DTYPE[cd], USE_ASM=use_asm, DOT_F32=not hidden.is_cuda,
        PREFETCH=cfg2.prefetch,
        **cfg2.launch_options(hidden.is_cuda),
    )
    return out.to(hidden.dtype)
