"""Token/expert alignment for the fused MoE kernels (SGLang's `moe_align_block_size`, without its CUDA op).

Flatten the [M, topk] routing into M * topk (token, slot) pairs, group the pairs by expert (stable: token
order inside an expert) and pad every expert's group to a multiple of `block_size`, so each M-block of
the kernel holds pairs of exactly one expert:

    sorted_ids[max_padded]    pair index t * topk + s, or the pad value M * topk
    expert_ids[max_blocks]    expert of each block, -1 for blocks past the padded total
    num_tokens_post_padded[1] padded total (blocks at or past it are skipped)

Shapes depend only on (M * topk, num_experts, block_size), never on the routing, so both versions are
CUDA-graph capturable and need no host sync. Pairs whose expert id is outside [0, num_experts) are dropped
(SGLang marks non-local experts -1 under expert parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.kernels.align_sizes import aligned_sizes
from pagedweight.kernels.triton_align import moe_align_block_size_triton


@dataclass(frozen=True)
class MoEAlignment:
    sorted_ids: torch.Tensor  # int32 [max_padded]
    expert_ids: torch.Tensor  # int32 [max_blocks]
    num_tokens_post_padded: torch.Tensor  # int32 [1]
    block_size: int

    @property
    def max_blocks(self) -> int:
        return self.expert_ids.numel()


def moe_align_block_size_torch(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> MoEAlignment:
    """Reference / CPU version, plain torch ops with static shapes (also runs on CUDA)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    flat = topk_ids.reshape(-1).to(torch.int64)
    dev = flat.device
    num_pairs = flat.numel()
    max_padded, max_blocks = aligned_sizes(num_pairs, num_experts, block_size)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # invalid pairs sort last, dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    cum = torch.cumsum(padded, 0)
    start = cum - padded
    first_in_sorted = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    keep = sorted_key < num_experts
    e_clamped = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=dev) - first_in_sorted[e_clamped]
    pos = torch.where(keep, start[e_clamped] + rank, torch.full_like(rank, max_padded))  # dropped -> spare slot
    sorted_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    block_start = torch.arange(max_blocks, device=dev) * block_size
    total = cum[-1] if num_experts else torch.zeros((), dtype=torch.int64, device=dev)
    expert_ids = torch.searchsorted(cum, block_start, right=True)
    expert_ids = torch.where(block_start < total, expert_ids, torch.full_like(expert_ids, -1))
    return MoEAlignment(
        sorted_ids=sorted_ids[:max_padded],
        expert_ids=expert_ids.to(torch.int32),
        num_tokens_post_padded=total.reshape(1).to(torch.int32),
        block_size=block_size,
    )


# From this many (token, slot) pairs on, CUDA runs the one-block CUDA alignment (cuda_align.py) rather than the
# single-program Triton one, whose work grows with pairs x experts. H200 (benchmark/align_bench.py, kernel.md
# session 12): even up to 8 pairs (~10-15 us, launch-bound), CUDA ahead from 16 pairs over 128 experts (10.0 vs
# 15.3 us), at 512 pairs (9.9 vs 34.6) and at 16k pairs (25 vs 867 us); outputs identical everywhere.
CUDA_ALIGN_MIN_PAIRS = 8


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> MoEAlignment:
    """One launch on CUDA (graph capturable): Triton at decode sizes, CUDA from CUDA_ALIGN_MIN_PAIRS pairs; the
    torch version on CPU."""
    if topk_ids.is_cuda:
        if topk_ids.numel() >= CUDA_ALIGN_MIN_PAIRS:
            from pagedweight.kernels.cuda_align import moe_align_block_size_cuda

            return MoEAlignment(*moe_align_block_size_cuda(topk_ids, block_size, num_experts), block_size=block_size)
        return MoEAlignment(*moe_align_block_size_triton(topk_ids, block_size, num_experts), block_size=block_size)
    return moe_align_block_size_torch(topk_ids, block_size, num_experts)
