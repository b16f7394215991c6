"""Static sizes and output buffers of one MoE alignment (align.py), shared by its torch, Triton and CUDA versions.

The sizes depend only on (pairs, experts, block size), never on the routing, which is what keeps every version
CUDA-graph capturable.
"""

from __future__ import annotations

import torch


def aligned_sizes(num_pairs: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """(max_padded, max_blocks): every expert may waste block_size - 1 slots."""
    max_padded = num_pairs + num_experts * (block_size - 1)
    max_blocks = -(-max_padded // block_size)
    return max_blocks * block_size, max_blocks


def alignment_buffers(num_pairs: int, num_experts: int, block_size: int, device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Uninitialised (sorted_ids, expert_ids, num_tokens_post_padded, max_padded, max_blocks) for one kernel's
    alignment (the Triton and CUDA versions fill them)."""
    max_padded, max_blocks = aligned_sizes(num_pairs, num_experts, block_size)
    return (torch.empty(max_padded, dtype=torch.int32, device=device),
            torch.empty(max_blocks, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device), max_padded, max_blocks)
