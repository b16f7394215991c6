"""`moe_align_block_size` as one single-program Triton launch (see align.py for the output contract).

One program walks the pairs in chunks: a histogram per expert, padded prefix sums, the block -> expert
map, then a stable scatter (rank of a pair inside its expert = running count + exclusive prefix count in
the chunk). Work is O(pairs * (CHUNK + experts)), a few microseconds at decode sizes; it runs on CPU
tensors under TRITON_INTERPRET=1 too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedweight.kernels.align_sizes import alignment_buffers


@triton.jit
def _moe_align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    post_pad_ptr,
    num_pairs,
    num_experts,
    max_padded,
    max_blocks,
    BLOCK_SIZE: tl.constexpr,
    E_P2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    bins = tl.arange(0, E_P2)
    lane = tl.arange(0, CHUNK)

    counts = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + lane
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        ids = tl.where((ids >= 0) & (ids < num_experts), ids, -1)
        counts += tl.sum((ids[:, None] == bins[None, :]).to(tl.int32), axis=0)

    padded = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    cum = tl.cumsum(padded, axis=0)  # inclusive end of each expert's padded segment
    total = tl.sum(padded, axis=0)
    tl.store(post_pad_ptr, total)

    for f0 in range(0, max_padded, CHUNK):
        offs = f0 + lane
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs, mask=offs < max_padded)

    for b0 in range(0, max_blocks, CHUNK):
        blk = b0 + lane
        bstart = blk * BLOCK_SIZE
        # the block's expert = number of experts whose padded segment ends at or before its start
        e = tl.sum((cum[None, :] <= bstart[:, None]).to(tl.int32), axis=1)
        e = tl.where(bstart < total, e, -1)
        tl.store(expert_ids_ptr + blk, e, mask=blk < max_blocks)

    # the pad fill above and the scatter below may hit the same address from different threads
    tl.debug_barrier()

    nxt = cum - padded  # next free slot of each expert
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + lane
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        ids = tl.where((ids >= 0) & (ids < num_experts), ids, -1)
        onehot = (ids[:, None] == bins[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert in this chunk
        pos = tl.sum(onehot * (before + nxt[None, :]), axis=1)
        tl.store(sorted_ptr + pos, offs, mask=(offs < num_pairs) & (ids >= 0))
        nxt += tl.sum(onehot, axis=0)


def moe_align_block_size_triton(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:

    flat = topk_ids.reshape(-1).contiguous()
    num_pairs = flat.numel()
    sorted_ids, expert_ids, post_pad, max_padded, max_blocks = alignment_buffers(num_pairs, num_experts, block_size,
                                                                                 flat.device)
    e_p2 = triton.next_power_of_2(num_experts + 1)
    chunk = 64 if e_p2 <= 128 else 32
    _moe_align_kernel[(1,)](
        flat, sorted_ids, expert_ids, post_pad, num_pairs, num_experts, max_padded, max_blocks,
        BLOCK_SIZE=block_size, E_P2=e_p2, CHUNK=chunk, num_warps=4,
    )
    return sorted_ids, expert_ids, post_pad
