"""Keep PagedWeight's decisions identical on every tensor-parallel rank.

Each TP rank holds its shard of every expert block and runs its own pager, so all ranks must commit the
same bitwidths at the same scheduler iteration. The KV allocator and radix cache are identical on every
rank (they schedule the same batches), but a policy also reads the clock and the routing statistics,
which a rank samples at its own moments. So the first rank of the TP group samples the step's inputs and
broadcasts them over the TP CPU group; every rank then runs the same deterministic controller step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class StepInputs:
    available_blocks: int
    evictable_blocks: int
    now_s: float
    # (layer, expert) -> routing mass; None when unchanged since the last broadcast (saves bandwidth).
    routing: Optional[Mapping[tuple[int, int], float]]
    # KV blocks the first waiting request needs beyond what is free now (0 when it fits or nothing waits).
    waiting_blocks: int = 0


class StepInputBroadcast:
    """Broadcast the source rank's StepInputs to the group (one small pickled object per iteration)."""

    def __init__(self, group: Any, src_global_rank: int, is_src: bool):
        self.group = group
        self.src = src_global_rank
        self.is_src = is_src
        self.broadcasts = 0

    def __call__(self, local: StepInputs) -> StepInputs:
        box = [local if self.is_src else None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        self.broadcasts += 1
        return box[0]
