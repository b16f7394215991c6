"""Prefill dequantization of bcq planes into a dense scratch with a CUDA kernel (cuda_bcq_dequant.cu, NVRTC).

The prefill path (triton_dequant_moe.py) costs "rebuild every expert once + dense GEMM"; the rebuild is a
stream (q planes read, 2 bytes per weight written) that the Triton tile dequantization ran at ~1.4 TB/s.
This kernel is a flat stream: one thread per 32-bit plane word (warps read 128 contiguous bytes of every
plane), each warp's output staged through shared memory so every store writes 512 contiguous bytes. It
writes exactly what the Triton dequantization writes (same column order, same packed adds), so either can
fill the scratch; `dequantize_chunk(kernel="auto")` takes this one where it can run (CUDA, bcq, K and the
group a multiple of 32; bcq or ubcq tables) and the Triton one otherwise (k-means tables, the interpreter, CPU).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from pagedweight.kernels.nvrtc import compile_cubin, load_kernel
from pagedweight.kernels.weights import APMoEWeights

NTHREADS = 256
_SOURCE = Path(__file__).with_name("cuda_bcq_dequant.cu")
_CD = {torch.bfloat16: 0, torch.float16: 1}


def cuda_dequant_unsupported(w: APMoEWeights, scratch: torch.Tensor) -> str | None:
    """Why the CUDA dequantization cannot fill `scratch` from `w` (None when it can)."""
    if not w.grouped:
        return f"table kind {w.table_kind!r} (the CUDA dequantization reads binary-coded planes only)"
    if w.K % 32 or w.group_size % 32:
        return f"K={w.K} and the {w.table_kind} group size {w.group_size} must be multiples of 32"
    if w.N * (w.K // 32) * 16 >= 2**31:  # the kernel's 32-bit index math (16 output words per plane word)
        return f"an expert of N={w.N} x K={w.K} is too large for the kernel's 32-bit indexing"
    if scratch.dtype not in _CD:
        return f"scratch dtype {scratch.dtype} (bf16 or fp16 only)"
    if not (w.page_table.is_cuda and scratch.is_cuda):
        return "the page table and the scratch must be on a CUDA device"
    if not scratch.is_contiguous() or tuple(scratch.shape[1:]) != (w.N, w.K) or scratch.data_ptr() % 16:
        return f"scratch must be a contiguous, 16-byte aligned [chunk, {w.N}, {w.K}] tensor"
    return None


def kernel_defines(scratch_dtype: torch.dtype, bits_max: int, uniform: bool = False) -> list[str]:
    """uniform: ubcq tables (one scale and the offset per group)."""
    return [f"-DCD={_CD[scratch_dtype]}", f"-DPMAX={bits_max}", f"-DUNIFORM={int(uniform)}"]


def compile_to_cubin(defines: list[str], compute_capability: str) -> bytes:
    return compile_cubin(_SOURCE, "ap_bcq_dequant", compute_capability, defines)


@functools.lru_cache(maxsize=None)
def _kernel(scratch_dtype: torch.dtype, bits_max: int, uniform: bool, device_index: int):
    """The compiled kernel for one variant on one device (compiled once per process)."""
    return load_kernel(_SOURCE, "ap_bcq_dequant", kernel_defines(scratch_dtype, bits_max, uniform), device_index)


def dequantize_chunk_cuda(w: APMoEWeights, scratch: torch.Tensor, e0: int) -> None:
    """scratch[i] = dense W of expert e0 + i in tile column order (experts past the last are skipped)."""
    why = cuda_dequant_unsupported(w, scratch)
    if why is not None:
        raise ValueError(f"the CUDA dequantization cannot run: {why}")
    launch_checked(w, scratch, e0)


def launch_checked(w: APMoEWeights, scratch: torch.Tensor, e0: int) -> None:
    """The launch alone, for callers that already got None from `cuda_dequant_unsupported`."""
    words = w.N * (w.K // 32)
    kernel = _kernel(scratch.dtype, w.bits_max, w.table_kind == "ubcq", scratch.device.index or 0)
    kernel(
        grid=(-(-words // NTHREADS), scratch.shape[0], 1), block=(NTHREADS, 1, 1),
        args=[w.page_table, scratch, e0, w.num_experts, w.N, w.K, w.group_size, w.page_table.stride(0)],
    )
