"""Two TP ranks (gloo, CPU) make identical PagedWeight decisions when rank 0's step inputs are broadcast.

Each rank builds the real runtime (page table, host arena, budget, pager) over the same expert blocks and
runs the real PagedWeightScheduler.step against the same KV-pressure sequence. The ranks sample routing
statistics differently (rank 1 sees them reversed), as two processes reading at different moments would.
With the broadcast every rank commits the same bitwidths at every iteration; without it they diverge.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS, EXPERTS, STEPS = 2, 6, 40


class _Allocator:
    def __init__(self) -> None:
        self.free = 0

    def available_size(self) -> int:
        return self.free


class _Tree:
    def evictable_size(self) -> int:
        return 0


class _Scheduler:
    def __init__(self) -> None:
        self.token_to_kv_pool_allocator = _Allocator()
        self.tree_cache = _Tree()
        self.max_total_num_tokens = 1000


def _stores(rank: int):
    from pagedweight.format.layout import BlockSpec
    from pagedweight.runtime.expert_store import ExpertPlanes, MoELayerStore, ProjectionStore

    g = torch.Generator().manual_seed(0)
    stores = []
    for layer in range(LAYERS):
        projs = []
        for proj, (n, k) in (("w13", (64, 32)), ("w2", (32, 32))):
            spec = BlockSpec(n, k, 2, 8, "bcq", 32)
            host = [
                ExpertPlanes(
                    torch.randint(0, 256, spec.planes_shape(), dtype=torch.uint8, generator=g),
                    {b: torch.randn(spec.table_shape(b), generator=g).half() for b in spec.bitwidths},
                )
                for _ in range(EXPERTS)
            ]
            projs.append(ProjectionStore(f"layer{layer}.{proj}", proj, spec, host, torch.device("cpu")))
        store = MoELayerStore(layer, *projs)
        mass = torch.arange(1, EXPERTS + 1, dtype=torch.float32) * (layer + 1)
        store.routing_mass.copy_(mass.flip(0) if rank == 1 else mass)  # each rank samples differently
        stores.append(store)
    return stores


def _worker(rank: int, init_file: str, sync: bool, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from pagedweight.config import PagedWeightConfig
        from pagedweight.paged_runtime import PagedRuntime
        from pagedweight.planner.factory import make_policy
        from pagedweight.runtime.controller import PagingController
        from pagedweight.runtime.pressure import KVPressureSignal
        from pagedweight.serving_loop import PagedWeightScheduler
        from pagedweight.tp_sync import StepInputBroadcast

        runtime = PagedRuntime.build(PagedWeightConfig(enable=True, bits=8), _stores(rank), torch.device("cpu"))
        signal = KVPressureSignal(threshold_blocks=100, bytes_per_block=512, relax_blocks=400, relax_checks=2)
        policy = make_policy("hotness", options={"interval_s": 0.001})
        controller = PagingController(runtime.pager, policy, signal, reload_headroom_bytes=runtime.reload_headroom_bytes)
        tp = StepInputBroadcast(dist.group.WORLD, 0, rank == 0) if sync else None
        state = PagedWeightScheduler(runtime, controller, page_size=1, capacity_blocks=1000, tp_sync=tp)
        sched = _Scheduler()
        trace = []
        for i in range(STEPS):
            # The same KV pressure on both ranks: a short dip below the threshold every 10 iterations
            # (a few blocks must go down: which ones is the policy's choice), quiet in between.
            sched.token_to_kv_pool_allocator.free = 95 if i % 10 == 0 else 900
            state._routing_at = -1.0  # sample routing every step (rank 0's sample is what counts under sync)
            state.step(sched)
            trace.append([r.committed_bits for r in runtime.table])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(trace))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, sync: bool) -> tuple[list, list]:
    out = tmp_path / ("sync" if sync else "nosync")
    out.mkdir()
    mp.start_processes(_worker, args=(str(tmp_path / f"init-{sync}"), sync, str(out)), nprocs=2,
                       start_method="spawn", join=True)
    return tuple(json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))


@pytest.mark.timeout(600)
def test_broadcast_keeps_ranks_identical(tmp_path):
    r0, r1 = _run(tmp_path, sync=True)
    assert any(any(b < 8 for b in step) for step in r0), "the burst should have lowered some bitwidths"
    assert r0 == r1


@pytest.mark.timeout(600)
def test_without_broadcast_ranks_diverge(tmp_path):
    """Control: the same run without the broadcast commits different blocks on the two ranks."""
    r0, r1 = _run(tmp_path, sync=False)
    assert r0 != r1
