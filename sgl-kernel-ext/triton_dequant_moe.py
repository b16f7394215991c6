"""Prefill path of the AP MoE: dequantize each expert once, then plain bf16/fp16 grouped GEMMs.

At prefill sizes the tile-rebuilding kernels redo the bit work once per block of tokens (16 times per
expert at M=2048 on Mixtral), which costs more than the GEMM itself. Here every expert's weight is
rebuilt exactly once per call into a scratch buffer (q planes read, 2 bytes written per weight), and
the MoE runs as an ordinary grouped GEMM over that scratch. The rebuild is cuda_dequant.py's kernel for bcq
planes on CUDA and `_dequant_kernel` below otherwise (k-means tables, the interpreter); both write the same
values. Experts go in chunks of `chunk` so the
scratch stays bounded (chunk x N x K x 2 bytes per projection):

    for each chunk: dequantize w13 -> dense w13 GEMM -> h        (all chunks)
    silu(gate) * up -> act                                        (once)
    for each chunk: dequantize w2 -> dense w2 GEMM -> out (+=)    (all chunks)

Columns stay in the tile order of triton_tiles (the activations are stored in the same order), so the
scratch is written and read with contiguous tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedweight.kernels.config import DEQUANT_KERNELS
from pagedweight.kernels.cuda_dequant import cuda_dequant_unsupported, dequantize_chunk_cuda, launch_checked
from pagedweight.kernels.triton_tiles import act_tile, load_row, plane_pointer, tile_dot, weight_tile


@triton.jit
def _dequant_kernel(
    pt_ptr, scratch_ptr, e0, num_experts, N, K, G: tl.constexpr, PT_STRIDE,
    KIND: tl.constexpr, P_MAX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CD: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """scratch[e - e0, n, k'] = W_e[n, k'] (tile column order) for expert e = e0 + program_id(0)."""
    slot = tl.program_id(0)
    e = e0 + slot
    if e >= num_experts:
        return
    pid_n = tl.program_id(1)
    k0 = tl.program_id(2) * BK
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
    w = weight_tile(p0, p1, p2, p3, p4, p5, p6, p7, q, table, offs_n, mask_n, k0, N, K, G,
                    KIND, BN, BK, P_MAX, CD, USE_ASM)
    kk = tl.arange(0, BK)
    dst = scratch_ptr + slot.to(tl.int64) * N * K + offs_n[:, None].to(tl.int64) * K + (k0 + kk)[None, :]
    tl.store(dst, w, mask=mask_n[:, None])


@triton.jit
def _dense_moe_kernel(
    a_ptr, out_ptr, w_ptr, tw_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr, e0, chunk,
    num_pairs, topk, N, K, stride_am, stride_om,
    A_BY_TOKEN: tl.constexpr, ROUTE_W: tl.constexpr, ATOMIC_OUT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CD: tl.constexpr, DOT_F32: tl.constexpr,
):
    """out[row(pair), n] (+)= a[row_a(pair)] . W[e - e0, n] for the blocks of experts in [e0, e0 + chunk).
    A_BY_TOKEN: activation rows are tokens (w13) rather than pairs (w2); ROUTE_W: times the routing
    weight; ATOMIC_OUT: float32 atomics into out[token] (w2, sums the top-k slots) instead of stores
    into out[pair] (w13)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(post_pad_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m)
    if (e < e0) | (e >= e0 + chunk):
        return
    pairs = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = pairs < num_pairs
    tok = pairs // topk
    a_rows = tok if A_BY_TOKEN else pairs
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    kk = tl.arange(0, BK)
    w_base = w_ptr + (e - e0).to(tl.int64) * N * K + offs_n[:, None].to(tl.int64) * K
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        w = tl.load(w_base + (k0 + kk)[None, :], mask=mask_n[:, None], other=0.0)
        at = act_tile(a_ptr, a_rows, stride_am, k0, valid, BK)
        acc = tile_dot(w, at.to(CD), acc, DOT_F32)
    if ROUTE_W:
        acc = acc * tl.load(tw_ptr + pairs, mask=valid, other=0.0)[None, :]
    omask = valid[None, :] & mask_n[:, None]
    if ATOMIC_OUT:
        tl.atomic_add(out_ptr + tok[None, :].to(tl.int64) * stride_om + offs_n[:, None], acc, mask=omask, sem="relaxed")
    else:
        ptrs = out_ptr + pairs[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


def dequantize_chunk(w, scratch: torch.Tensor, e0: int, cd_tl, bn: int, bk: int, use_asm: bool,
                     num_warps: int = 4, kernel: str = "auto") -> None:
    """scratch[i] = dense W of expert e0 + i (tile column order) for the chunk's experts (benchmark/dequant_sweep.py
    times both kernels and the launch shapes). kernel: "cuda" (cuda_dequant.py: bcq planes on CUDA, whole
    plane words per thread), "triton" (every table kind, the interpreter), "auto" = "cuda" where it can run. Both
    write identical values; bn/bk/num_warps shape only the Triton launch."""
    if kernel not in DEQUANT_KERNELS:
        raise ValueError(f"kernel must be one of {DEQUANT_KERNELS}, got {kernel!r}")
    if kernel == "cuda":
        dequantize_chunk_cuda(w, scratch, e0)  # raises naming the reason where it cannot run
        return
    if kernel == "auto" and cuda_dequant_unsupported(w, scratch) is None:
        launch_checked(w, scratch, e0)
        return
    chunk = scratch.shape[0]
    grid = (chunk, triton.cdiv(w.N, bn), w.K // bk)
    _dequant_kernel[grid](
        w.page_table, scratch, e0, w.num_experts, w.N, w.K, w.group_size, w.page_table.stride(0),
        KIND=w.kernel_kind, P_MAX=w.bits_max, BN=bn, BK=bk, CD=cd_tl, USE_ASM=use_asm,
        num_warps=num_warps,
    )


def dense_moe_chunk(a, out, scratch, tw, align, e0, num_pairs, topk, *, by_token, route_w, atomic_out, cfg, cd_tl,
                    dot_f32) -> None:
    n, k = scratch.shape[1], scratch.shape[2]
    grid = (align.max_blocks, triton.cdiv(n, cfg.block_n))
    _dense_moe_kernel[grid](
        a, out, scratch, tw, align.sorted_ids, align.expert_ids, align.num_tokens_post_padded, e0, scratch.shape[0],
        num_pairs, topk, n, k, a.stride(0), out.stride(0),
        A_BY_TOKEN=by_token, ROUTE_W=route_w, ATOMIC_OUT=atomic_out,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, CD=cd_tl, DOT_F32=dot_f32,
        **cfg.launch_options(a.is_cuda),
    )
