"""GPU: the elastic KV cache edits SGLang's free lists on the scheduler's stream, not the forward stream.

SGLang 0.5.17 prepares batch k+1 on its schedule stream (allocator slices, req_to_token writes) while forward
k runs on the forward stream, and the PagedWeight step runs in between with the forward stream current (the
pager's page-table writes and fences belong there). A grow whose new free list was computed on the forward
stream would be read by the scheduler before forward k let it be written: garbage slot ids, an illegal memory
access in the next forward (seen on the H200 in the GLM-4.5-Air KV-pressure burst, docs/results/models.md).
Needs CUDA and SGLang (the devicekit on the GPU machine); CI covers the bookkeeping in
test_elastic_kv_allocator.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BUSY_CYCLES = 1 << 30  # ~0.5 s of spinning on an H200: a forward still in flight


def make_kv(max_tokens: int = 4096, capacity: int = 1024):
    pytest.importorskip("sglang")
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from pagedweight.kvcache.elastic_kv import ElasticKVCache
    from pagedweight.kvcache.elastic_kv_backing import HostKVBacking, host_bytes_per_token

    pool = MHATokenToKVPool(
        max_tokens, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=2, device="cuda",
        enable_memory_saver=False,
    )
    alloc = TokenToKVPoolAllocator(max_tokens, torch.bfloat16, "cuda", pool, False)
    kv = ElasticKVCache(
        pool, alloc, capacity_tokens=capacity, max_tokens=max_tokens,
        backing=HostKVBacking(host_bytes_per_token(pool), capacity),
    )
    # Run every kernel a grow and a shrink launch once: CUDA loads modules lazily, and a module load synchronizes
    # the device, which would finish the "running forward" of the tests before the free list is read.
    kv.grow_tokens(max_tokens - capacity)
    kv.shrink_tokens(max_tokens - capacity)
    alloc.free_pages.cpu()
    torch.cuda.synchronize()
    return kv, alloc


def test_grow_under_a_running_forward_is_readable_on_the_scheduler_stream() -> None:
    schedule, forward = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(schedule):
        kv, alloc = make_kv()
        torch.cuda.synchronize()
        kv.allocator_stream = torch.cuda.current_stream()
        with torch.cuda.stream(forward):  # the PagedWeight step's context: the forward stream current
            torch.cuda._sleep(BUSY_CYCLES)
            assert kv.grow_tokens(2048) == 2048
        ids = alloc.free_pages.cpu()  # what the scheduler's next alloc reads, on its own stream
        still_running = not forward.query()
    forward.synchronize()
    assert still_running, "the forward finished before the check; raise BUSY_CYCLES"
    assert ids.tolist() == list(range(1, 1024 + 2048 + 1))


def test_shrink_under_a_running_forward_parks_on_the_scheduler_stream() -> None:
    schedule, forward = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(schedule):
        kv, alloc = make_kv()
        kv.grow_tokens(2048)  # 1024 -> 3072; the shrink below goes back to the minimum (the start)
        torch.cuda.synchronize()
        kv.allocator_stream = torch.cuda.current_stream()
        with torch.cuda.stream(forward):
            torch.cuda._sleep(BUSY_CYCLES)
            assert kv.shrink_tokens(2048) == 2048
        ids = alloc.free_pages.cpu()
        still_running = not forward.query()
    forward.synchronize()
    assert still_running, "the forward finished before the check; raise BUSY_CYCLES"
    assert ids.tolist() == list(range(1, 1024 + 1))


def test_serving_step_hands_the_scheduler_stream_to_the_elastic_cache() -> None:
    """PagedWeightScheduler.step: the elastic cache's allocator stream is the stream current when SGLang calls
    the step, while the controller (pager boundary) runs with the forward stream current."""
    from pagedweight.serving.serving_loop import PagedWeightScheduler

    seen = {}
    kv = SimpleNamespace(allocator_stream=None)

    def step(*args, **kwargs):
        seen["current"] = torch.cuda.current_stream()
        return SimpleNamespace(boundary=SimpleNamespace(committed=()))

    controller = SimpleNamespace(kv=kv, step=step, policy=SimpleNamespace(refresh=lambda *a: None),
                                 signal=None)
    runtime = SimpleNamespace(routing_mass=lambda: {}, table=None)
    schedule, forward = torch.cuda.Stream(), torch.cuda.Stream()
    sched = PagedWeightScheduler(runtime, controller, page_size=1, capacity_blocks=16, forward_stream=forward)
    scheduler = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 16),
        tree_cache=SimpleNamespace(evictable_size=lambda: 0), waiting_queue=[],
    )
    with torch.cuda.stream(schedule):
        sched.step(scheduler)
    assert kv.allocator_stream == schedule
    assert seen["current"] == forward
