"""Fused mixed-precision AP MoE in Triton: two launches over the aligned (token, slot) pairs.

  w13 kernel: per (M-block of one expert, BN intermediate columns): gate and up tiles rebuilt from the
              expert's planes at its committed bitwidth, two tl.dot's, act = silu(gate) * up -> [pairs, I].
  w2 kernel:  per (M-block, BN hidden columns, K split): down tiles, times the routing weight, atomically
              added into a float32 [M, H] output (which also sums the top-k slots of each token).

Every launch reads the bitwidth and addresses of its expert from the page table at run time, so one
compiled kernel serves any per-expert bitwidth mix and CUDA graphs stay valid when rows change.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedweight.kernels.align import MoEAlignment
from pagedweight.kernels.config import APKernelConfig
from pagedweight.kernels.triton_tiles import load_row, tile_dot, tile_k_order, weight_tile
from pagedweight.kernels.weights import APMoEWeights

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _ap_moe_w13_kernel(
    x_ptr, act_ptr, pt_ptr, tw_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
    num_pairs, topk, I, K, G, stride_xm, stride_am, PT_STRIDE,
    KIND: tl.constexpr, APPLY_W_IN: tl.constexpr, P_MAX: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CD: tl.constexpr, USE_ASM: tl.constexpr, DOT_F32: tl.constexpr,
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
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < I
    korder = tile_k_order(BK, KIND)
    if APPLY_W_IN:
        rw = tl.load(tw_ptr + pairs, mask=valid, other=0.0)
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        xt = tl.load(x_ptr + tok[None, :] * stride_xm + (k0 + korder)[:, None], mask=valid[None, :], other=0.0)
        if APPLY_W_IN:
            xt = xt * rw[None, :]
        xt = xt.to(CD)
        wg = weight_tile(row, q, table, offs_n, mask_n, k0, 2 * I, K, G, KIND, BN, BK, P_MAX, CD, USE_ASM)
        acc_g = tile_dot(wg, xt, acc_g, DOT_F32)
        wu = weight_tile(row, q, table, offs_n + I, mask_n, k0, 2 * I, K, G, KIND, BN, BK, P_MAX, CD, USE_ASM)
        acc_u = tile_dot(wu, xt, acc_u, DOT_F32)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    ptrs = act_ptr + pairs[None, :].to(tl.int64) * stride_am + offs_n[:, None]
    tl.store(ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[None, :] & mask_n[:, None])


@triton.jit
def _ap_moe_w2_kernel(
    act_ptr, out_ptr, pt_ptr, tw_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
    num_pairs, topk, N, K, G, stride_am, stride_om, PT_STRIDE,
    KIND: tl.constexpr, APPLY_W_IN: tl.constexpr, P_MAX: tl.constexpr, SPLIT_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CD: tl.constexpr, USE_ASM: tl.constexpr, DOT_F32: tl.constexpr,
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
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    korder = tile_k_order(BK, KIND)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for kt in range(pid_k, K // BK, SPLIT_K):
        k0 = kt * BK
        at = tl.load(act_ptr + pairs[None, :].to(tl.int64) * stride_am + (k0 + korder)[:, None],
                     mask=valid[None, :], other=0.0)
        w = weight_tile(row, q, table, offs_n, mask_n, k0, N, K, G, KIND, BN, BK, P_MAX, CD, USE_ASM)
        acc = tile_dot(w, at.to(CD), acc, DOT_F32)
    if not APPLY_W_IN:
        acc = acc * tl.load(tw_ptr + pairs, mask=valid, other=0.0)[None, :]
    tok = (pairs // topk).to(tl.int64)
    tl.atomic_add(out_ptr + tok[None, :] * stride_om + offs_n[:, None], acc,
                  mask=valid[None, :] & mask_n[:, None], sem="relaxed")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dot-operand dtype: fp16 activations stay fp16, bf16 and fp32 run in bf16 (fp16's range is too small)."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def _check_bk(w: APMoEWeights, bk: int, name: str) -> None:
    if w.K % bk or (w.table_kind == "bcq" and w.group_size % bk):
        raise ValueError(f"{name}: BK={bk} must divide K={w.K}" + (f" and group_size={w.group_size}" if w.table_kind == "bcq" else ""))


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
) -> torch.Tensor:
    """Launches both kernels; `align` must have been built with cfg13.block_m == cfg2.block_m."""
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
    act = torch.empty(num_pairs, inter, dtype=cd, device=hidden.device)
    out = torch.zeros(m, h, dtype=torch.float32, device=hidden.device)
    max_blocks = align.max_blocks
    kind13 = 0 if w13.table_kind == "bcq" else 1
    kind2 = 0 if w2.table_kind == "bcq" else 1
    _ap_moe_w13_kernel[(max_blocks, triton.cdiv(inter, cfg13.block_n))](
        hidden, act, w13.page_table, tw, align.sorted_ids, align.expert_ids, align.num_tokens_post_padded,
        num_pairs, topk, inter, w13.K, w13.group_size, hidden.stride(0), act.stride(0), w13.page_table.stride(0),
        KIND=kind13, APPLY_W_IN=apply_router_weight_on_input, P_MAX=w13.bits_max,
        BM=cfg13.block_m, BN=cfg13.block_n, BK=cfg13.block_k, CD=_TL_DTYPE[cd], USE_ASM=use_asm, DOT_F32=not hidden.is_cuda,
        num_warps=cfg13.num_warps, num_stages=cfg13.num_stages,
    )
    _ap_moe_w2_kernel[(max_blocks, triton.cdiv(h, cfg2.block_n), cfg2.split_k)](
        act, out, w2.page_table, tw, align.sorted_ids, align.expert_ids, align.num_tokens_post_padded,
        num_pairs, topk, h, inter, w2.group_size, act.stride(0), out.stride(0), w2.page_table.stride(0),
        KIND=kind2, APPLY_W_IN=apply_router_weight_on_input, P_MAX=w2.bits_max, SPLIT_K=cfg2.split_k,
        BM=cfg2.block_m, BN=cfg2.block_n, BK=cfg2.block_k, CD=_TL_DTYPE[cd], USE_ASM=use_asm, DOT_F32=not hidden.is_cuda,
        num_warps=cfg2.num_warps, num_stages=cfg2.num_stages,
    )
    return out.to(hidden.dtype)
