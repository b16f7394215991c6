"""Dense AP linear y = x @ W^T (+ bias) in Triton, W rebuilt from one page-table row per launch.

Same weight tiles as the MoE kernels (triton_tiles.py). With split_k > 1 the K slices are summed with
float32 atomics into a zeroed buffer (decode GEMVs need the extra parallelism); otherwise each program
writes its tile directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedweight.kernels.config import APKernelConfig
from pagedweight.kernels.triton_moe import _TL_DTYPE, _check_bk, compute_dtype, permute_inputs
from pagedweight.kernels.triton_tiles import act_tile, load_row, plane_pointer, tile_dot, weight_tile
from pagedweight.kernels.weights import APMoEWeights


@triton.jit(do_not_specialize=["row_index"])
def _ap_linear_kernel(
    x_ptr, out_ptr, bias_ptr, pt_ptr, row_index,
    M, N, K, G: tl.constexpr, stride_xm, stride_om, PT_STRIDE,
    KIND: tl.constexpr, HAS_BIAS: tl.constexpr, P_MAX: tl.constexpr, SPLIT_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CD: tl.constexpr, USE_ASM: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    valid = offs_m < M
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    row, q, table = load_row(pt_ptr, row_index, PT_STRIDE)
    p0 = plane_pointer(row, 0, q)  # plane addresses are loop invariant: read the row once
    p1 = plane_pointer(row, 1, q) if P_MAX > 1 else p0
    p2 = plane_pointer(row, 2, q) if P_MAX > 2 else p0
    p3 = plane_pointer(row, 3, q) if P_MAX > 3 else p0
    p4 = plane_pointer(row, 4, q) if P_MAX > 4 else p0
    p5 = plane_pointer(row, 5, q) if P_MAX > 5 else p0
    p6 = plane_pointer(row, 6, q) if P_MAX > 6 else p0
    p7 = plane_pointer(row, 7, q) if P_MAX > 7 else p0
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for kt in range(pid_k, K // BK, SPLIT_K):
        k0 = kt * BK
        xt = act_tile(x_ptr, offs_m, stride_xm, k0, valid, BK)
        w = weight_tile(p0, p1, p2, p3, p4, p5, p6, p7, q, table, offs_n, mask_n, k0, N, K, G,
                        KIND, BN, BK, P_MAX, CD, USE_ASM)
        acc = tile_dot(w, xt, acc, DOT_F32)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    omask = valid[None, :] & mask_n[:, None]
    if SPLIT_K > 1:
        tl.atomic_add(ptrs, acc, mask=omask, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


def ap_linear_triton(
    x: torch.Tensor, w: APMoEWeights, row: int, bias: torch.Tensor | None, cfg: APKernelConfig, *, use_asm: bool
) -> torch.Tensor:
    _check_bk(w, cfg.block_k, "linear")
    m = x.shape[0]
    cd = compute_dtype(x.dtype)
    if cfg.dequant_chunk > 0:
        return _dequantized_linear(x, w, row, bias, cfg, cd, use_asm)
    if cfg.split_k > 1:
        out = torch.zeros(m, w.N, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, w.N, dtype=x.dtype, device=x.device)
    xp = permute_inputs(x, w.table_kind, cd)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(w.N, cfg.block_n), cfg.split_k)
    _ap_linear_kernel[grid](
        xp, out, bias if bias is not None else out, w.page_table, row,
        m, w.N, w.K, w.group_size, xp.stride(0), out.stride(0), w.page_table.stride(0),
        KIND=w.kernel_kind, HAS_BIAS=bias is not None, P_MAX=w.bits_max, SPLIT_K=cfg.split_k,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, CD=_TL_DTYPE[cd], USE_ASM=use_asm, DOT_F32=not x.is_cuda,
        **cfg.launch_options(x.is_cuda),
    )
    return out.to(x.dtype) if cfg.split_k > 1 else out


def _dequantized_linear(x, w: APMoEWeights, row: int, bias, cfg: APKernelConfig, cd, use_asm: bool) -> torch.Tensor:
    """Prefill path: the weight is rebuilt once into an N x K scratch (tile column order, so x is permuted
    the same way), then one dense GEMM (cuBLAS on CUDA); the tile kernel would rebuild it per block of rows."""
    from pagedweight.kernels.triton_dequant_moe import dequantize_chunk

    scratch = torch.empty(1, w.N, w.K, dtype=cd, device=x.device)
    dequantize_chunk(w, scratch, row, _TL_DTYPE[cd], cfg.block_n, cfg.block_k, use_asm)
    xp = permute_inputs(x, w.table_kind, cd)
    y = torch.nn.functional.linear(xp, scratch[0], None if bias is None else bias.to(cd))
    return y.to(x.dtype)
