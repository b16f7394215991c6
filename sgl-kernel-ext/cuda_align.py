"""`moe_align_block_size` as one CUDA block of 32 warps (cuda_align.cu, NVRTC), for prefill sizes.

The single-program Triton version (triton_align.py) does O(pairs * experts) work in one program: a few
microseconds at decode sizes, but ~1 ms at 16k pairs over 128 experts (Qwen3-30B-A3B, 2048 tokens), more than
the GEMMs it feeds. This one does O(pairs / 1024 + experts) per thread with the same output (align.py's
contract, stable order inside an expert), graph-capturable, no host sync. Each pair's expert is kept in shared memory
for the second pass: 48 KB where that fits, else all of a block's shared memory (up to ~100k pairs at 128 experts).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedweight.kernels.align_sizes import alignment_buffers
from pagedweight.kernels.nvrtc import cached_kernel, compile_cubin

_SOURCE = Path(__file__).with_name("cuda_align.cu")
WARPS = 32
MAX_EXPERTS = 1024


def table_bytes(num_experts: int) -> int:
    """The per-warp histogram, the segments and the scan scratch."""
    return (WARPS * num_experts + num_experts + 1 + 1024) * 4


SMALL_SHARED = 48 * 1024  # shared memory a block gets without opting in


def shared_bytes(num_experts: int, num_pairs: int, optin: int) -> int:
    """The tables, then a stash of each pair's expert (int16). Two sizes, so two cached kernels whatever the call's
    size: 48 KB where the stash fits it (decode and small prefills keep the default shared-memory carveout), else all
    a block of this device can take (`optin`, 227 KB on sm_90)."""
    small = max(SMALL_SHARED, table_bytes(num_experts))
    return small if table_bytes(num_experts) + 2 * num_pairs <= small else optin


def stash_capacity(num_experts: int, shared: int) -> int:
    """Pairs whose experts the stash holds (more pairs: pass 2 reads them from global memory again)."""
    return max(0, (shared - table_bytes(num_experts)) // 2)


def compile_to_cubin(compute_capability: str) -> bytes:
    return compile_cubin(_SOURCE, "ap_moe_align", compute_capability, [])


def moe_align_block_size_cuda(topk_ids: torch.Tensor, block_size: int, num_experts: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:

    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"the CUDA alignment takes 1..{MAX_EXPERTS} experts, got {num_experts}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    flat = topk_ids.reshape(-1).contiguous()
    num_pairs = flat.numel()
    sorted_ids, expert_ids, post_pad, max_padded, max_blocks = alignment_buffers(num_pairs, num_experts, block_size,
                                                                                 flat.device)
    optin = torch.cuda.get_device_properties(flat.device).shared_memory_per_block_optin
    if table_bytes(num_experts) > optin:
        raise ValueError(f"the CUDA alignment's tables for {num_experts} experts need {table_bytes(num_experts)} bytes "
                         f"of shared memory, over the {optin} of one block on this GPU")
    smem = shared_bytes(num_experts, num_pairs, optin)
    kernel = cached_kernel(_SOURCE, "ap_moe_align", (), flat.device.index or 0, smem)
    kernel(grid=(1, 1, 1), block=(1024, 1, 1), shared_mem=smem,
           args=[flat, int(flat.dtype == torch.int64), sorted_ids, expert_ids, post_pad, num_pairs, num_experts,
                 block_size, max_padded, max_blocks, stash_capacity(num_experts, smem)])
    return sorted_ids, expert_ids, post_pad
