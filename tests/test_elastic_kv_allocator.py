"""ElasticKVCache bookkeeping against SGLang's real KV pool, allocators, radix cache and invariant checker.

Importing SGLang's mem_cache needs the CPU-engine environment at process start (fake libcuda on
LD_LIBRARY_PATH), so in a plain pytest run this module holds one test that re-runs the module in a
subprocess with that environment; there the real tests below are collected.
"""

from __future__ import annotations

import os
import random
from array import array
from types import SimpleNamespace

import pytest

from tests.support.engine_suite import run_suite_in_cpu_engine

IN_ENGINE_ENV = os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"

if not IN_ENGINE_ENV:

    @pytest.mark.skipif(
        __import__("torch").cuda.is_available(),
        reason="CPU-engine suite (fake libcuda on LD_LIBRARY_PATH); on a GPU machine the real driver path runs in "
        "benchmark/pressure_bench.py",
    )
    def test_elastic_kv_allocator_suite_in_cpu_engine_env(server_env):
        run_suite_in_cpu_engine(__file__, server_env)

else:
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    from pagedweight.kvcache.elastic_kv import ElasticKVCache
    from pagedweight.kvcache.elastic_kv_backing import HostKVBacking, host_bytes_per_token
    from pagedweight.runtime.budget import MemoryBudget

    LAYERS, HEADS, DIM = 2, 2, 8
    BPT = LAYERS * 2 * HEADS * DIM * 2  # K and V, bf16

    def make(max_tokens=64, capacity=32, page_size=1, min_tokens=None, radix=True):
        pool = MHATokenToKVPool(
            max_tokens, page_size=page_size, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
            layer_num=LAYERS, device="cpu", enable_memory_saver=False,
        )
        if page_size == 1:
            alloc = TokenToKVPoolAllocator(max_tokens, torch.bfloat16, "cpu", pool, False)
        else:
            alloc = PagedTokenToKVPoolAllocator(max_tokens, page_size, torch.bfloat16, "cpu", pool, False)
        kv = ElasticKVCache(
            pool, alloc, capacity_tokens=capacity, max_tokens=max_tokens, min_tokens=min_tokens,
            backing=HostKVBacking(host_bytes_per_token(pool), capacity),
        )
        # An empty tree when the test is not about the radix cache: SGLang's stats read it either way.
        tree = RadixCache.create_simulated(mock_allocator=alloc, page_size=page_size)
        sched = fake_scheduler(alloc, tree, capacity)
        kv.bind_scheduler(sched)
        return kv, alloc, tree, sched

    def fake_scheduler(alloc, tree, capacity):
        """Just the scheduler attributes that hold a copy of the capacity, with SGLang's real checker."""
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
        from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver

        server_args = SimpleNamespace(dcp_size=1)
        no_batch = lambda: None  # noqa: E731
        obs = SchedulerPoolStatsObserver(
            tree_cache=tree, token_to_kv_pool_allocator=alloc, req_to_token_pool=None,
            session_controller=SimpleNamespace(sessions={}), hisparse_coordinator=None, is_hybrid_swa=False,
            is_hybrid_ssm=False, enable_hisparse=False, full_tokens_per_layer=None, swa_tokens_per_layer=None,
            max_total_num_tokens=capacity, get_last_batch=no_batch, get_running_batch=no_batch,
        )
        checker = SchedulerInvariantChecker(
            is_hybrid_swa=False, is_hybrid_ssm=False, disaggregation_mode=DisaggregationMode.NULL, page_size=alloc.page_size,
            full_tokens_per_layer=None, swa_tokens_per_layer=None, max_total_num_tokens=capacity,
            server_args=server_args, tree_cache=tree, token_to_kv_pool_allocator=alloc,
            req_to_token_pool=None, pool_stats_observer=obs, get_last_batch=no_batch, get_running_batch=no_batch,
        )
        return SimpleNamespace(
            server_args=server_args, token_to_kv_pool_allocator=alloc, tree_cache=tree,
            max_total_num_tokens=capacity, pool_stats_observer=obs, invariant_checker=checker,
        )

    def sglang_leak_check(kv, sched, held_by_requests=0):
        """SGLang's own idle check: available + evictable + protected (+ what requests hold) == total."""
        assert sched.max_total_num_tokens == kv.capacity_tokens
        assert sched.invariant_checker.max_total_num_tokens == kv.capacity_tokens
        assert sched.pool_stats_observer.max_total_num_tokens == kv.capacity_tokens
        ps = sched.pool_stats_observer.get_pool_stats()
        leak, msg = sched.invariant_checker._check_full_pool(ps, uncached=held_by_requests)
        assert not leak, msg

    def ids_of(alloc):
        return torch.cat((alloc.free_pages, alloc.release_pages)).tolist()

    def insert(tree, tokens, values):
        return tree.insert(InsertParams(key=RadixKey(array("q", tokens), None), value=torch.tensor(values, dtype=torch.int64)))

    # -- tests --------------------------------------------------------------------------------------------

    def test_start_parks_everything_past_capacity():
        kv, alloc, _, sched = make(max_tokens=64, capacity=32)
        assert (kv.capacity_tokens, kv.max_tokens, kv.parked_tokens) == (32, 64, 32)
        assert kv.bytes_per_token == BPT
        assert alloc.available_size() == 32 and alloc.size == 32
        assert sorted(ids_of(alloc)) == list(range(1, 33))
        sglang_leak_check(kv, sched)

    def test_grow_adds_the_lowest_parked_slots_and_keeps_partial_bytes_as_credit():
        kv, alloc, _, sched = make()
        assert kv.grow(10 * BPT) == 10
        assert sorted(ids_of(alloc)) == list(range(1, 43))
        assert kv.grow(BPT // 2) == 0 and kv.capacity_tokens == 42
        assert kv.grow(BPT // 2) == 1 and kv.capacity_tokens == 43
        assert kv.grow(10**9) == 64 - 43 and kv.capacity_tokens == 64
        assert kv.grow(10 * BPT) == 0  # nothing left to unpark
        sglang_leak_check(kv, sched)

    def test_shrink_never_parks_a_slot_in_use_and_resumes_once_it_is_freed():
        kv, alloc, _, sched = make(max_tokens=64, capacity=32, min_tokens=8, radix=False)
        kv.grow(32 * BPT)
        held = alloc.alloc(40)  # ids 1..40: the low ones first, then the grown ones
        assert sorted(held.tolist()) == list(range(1, 41))
        released = kv.shrink(60 * BPT)
        assert kv.capacity_tokens == 40, "must stop right above the highest slot a request holds"
        assert released == 24 * BPT
        assert kv.counters.deferred_shrinks == 1
        assert set(held.tolist()).isdisjoint(ids_of(alloc))
        sglang_leak_check(kv, sched, held_by_requests=40)
        alloc.free(held[20:])
        assert kv.shrink(60 * BPT) == 20 * BPT and kv.capacity_tokens == 20
        assert max(ids_of(alloc), default=0) <= 20
        sglang_leak_check(kv, sched, held_by_requests=20)

    def test_shrink_is_tail_only_bounded_by_bytes_and_min_tokens():
        kv, alloc, _, sched = make(max_tokens=64, capacity=64, min_tokens=16, radix=False)
        a = alloc.alloc(4)  # ids 1..4
        assert kv.shrink(10 * BPT) == 10 * BPT and kv.capacity_tokens == 54
        assert kv.shrink(BPT - 1) == 0 and kv.capacity_tokens == 54  # less than a token: nothing
        assert kv.shrink(10**9) == (54 - 16) * BPT and kv.capacity_tokens == 16
        assert sorted(ids_of(alloc)) == list(range(5, 17))
        assert kv.shrink(10**9) == 0 and kv.capacity_tokens == 16  # idempotent at the floor
        alloc.free(a)
        sglang_leak_check(kv, sched)

    def test_shrink_evicts_only_unlocked_radix_leaves_that_hold_tail_slots():
        kv, alloc, tree, sched = make(max_tokens=64, capacity=64, min_tokens=8)
        low = alloc.alloc(8).tolist()  # 1..8
        mid = alloc.alloc(8).tolist()  # 9..16
        high = alloc.alloc(8).tolist()  # 17..24
        insert(tree, [1, 2, 3, 4, 5, 6, 7, 8], low)
        insert(tree, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 9, 9, 9, 9], low + mid)  # child node holds 9..16
        locked = insert(tree, [7] * 8, high).last_device_node
        tree.inc_lock_ref(locked)  # a running request holds 17..24
        assert tree.evictable_size() == 16
        kv.shrink(10**9)
        assert kv.capacity_tokens == 24, "the locked node's slots stay; everything above goes"
        assert tree.evictable_size() == 8 and kv.counters.evicted_tokens == 8  # 9..16 went, 1..8 stayed
        tree.dec_lock_ref(locked)
        assert tree.evictable_size() == 16
        kv.shrink(10**9)
        # 17..24 and 9..16 evicted (tail), the root child 1..8 stays: it holds no tail slot
        assert kv.capacity_tokens == 8
        assert tree.evictable_size() == 8 and kv.counters.evicted_tokens == 16
        sglang_leak_check(kv, sched)

    def test_shrink_evicts_an_unlocked_inner_node_on_the_tail_with_its_subtree():
        kv, alloc, tree, sched = make(max_tokens=64, capacity=64, min_tokens=8)
        alloc.alloc(64)
        low, tail = list(range(1, 9)), [61, 62, 63, 64]
        alloc.free(torch.arange(9, 61))  # the tree below holds exactly `low` and `tail`
        insert(tree, [1, 2, 3, 4], tail)  # inner node on the tail ...
        insert(tree, [1, 2, 3, 4, 5, 6, 7, 8], tail + low[:4])  # ... its leaf child holds low slots only
        other = insert(tree, [9, 9, 9, 9], low[4:8]).last_device_node  # an unrelated low node
        assert tree.evictable_size() == 12
        kv.shrink(10**9)
        assert kv.capacity_tokens == 8, "the inner node and its subtree went; the unrelated node stayed"
        assert kv.counters.evicted_tokens == 8 and tree.evictable_size() == 4
        assert other.parent is tree.root_node
        sglang_leak_check(kv, sched)

    def test_random_sequences_keep_every_invariant():
        rng = random.Random(0)
        for trial in range(6):
            kv, alloc, _, sched = make(max_tokens=96, capacity=48, min_tokens=8, radix=False)
            live: list[torch.Tensor] = []
            for _ in range(150):
                op = rng.random()
                if op < 0.35:
                    got = alloc.alloc(rng.randint(1, 12))
                    if got is not None:
                        assert int(got.max()) <= kv.capacity_tokens
                        live.append(got)
                elif op < 0.6 and live:
                    alloc.free(live.pop(rng.randrange(len(live))))
                elif op < 0.8:
                    kv.grow(rng.randint(0, 20) * BPT + rng.randint(0, BPT - 1))
                else:
                    kv.shrink(rng.randint(0, 30) * BPT)
                held = torch.cat(live).tolist() if live else []
                free = ids_of(alloc)
                assert len(free) == len(set(free)), "duplicate free slot"
                assert set(held).isdisjoint(free), "a slot in use is on the free list"
                assert max(held + free, default=0) <= kv.capacity_tokens, "a parked slot is in use or free"
                assert len(free) + len(held) == kv.capacity_tokens == alloc.size
                assert kv.min_tokens <= kv.capacity_tokens <= kv.max_tokens
                sglang_leak_check(kv, sched, held_by_requests=len(held))

    def test_paged_allocator_grows_and_shrinks_in_whole_pages():
        kv, alloc, _, sched = make(max_tokens=64, capacity=32, page_size=4, min_tokens=8, radix=False)
        assert alloc.available_size() == 32 and sorted(ids_of(alloc)) == list(range(1, 9))
        assert kv.grow(7 * BPT) == 4  # one page of 4; 3 tokens of bytes stay as credit
        assert kv.grow(BPT) == 4 and kv.capacity_tokens == 40
        held = alloc.alloc(24)  # pages 1..6
        assert kv.shrink(10**9) == (40 - 24) * BPT and kv.capacity_tokens == 24
        assert alloc.num_pages == 6 and alloc.available_size() == 0
        alloc.free(held)
        sglang_leak_check(kv, sched)

    def test_budget_is_reserved_before_growing_and_released_on_shrink():
        kv, alloc, _, sched = make(max_tokens=64, capacity=32, min_tokens=8, radix=False)
        budget = MemoryBudget(total_bytes=100 * BPT, fixed_bytes=0)
        budget.commit(budget.try_reserve("weights", 90 * BPT))
        kv.attach_budget(budget)
        assert budget.free == 10 * BPT
        assert kv.grow(20 * BPT) == 10, "only what the budget has free"
        assert budget.used("kv") == 10 * BPT and budget.free == 0
        assert kv.grow(5 * BPT) == 0 and kv.counters.refused_grows == 0  # credit clipped to budget.free
        assert kv.grow_tokens(5) == 0 and kv.counters.refused_grows == 1
        assert kv.shrink(4 * BPT) == 4 * BPT and budget.used("kv") == 6 * BPT and budget.free == 4 * BPT
        sglang_leak_check(kv, sched)

    def test_resize_to_is_clamped_and_idempotent():
        kv, alloc, _, sched = make(max_tokens=64, capacity=32, min_tokens=16, radix=False)
        assert kv.resize_to(50) == 50 and kv.resize_to(50) == 50
        assert kv.resize_to(1000) == 64
        assert kv.resize_to(0) == 16 and kv.resize_to(16) == 16
        assert kv.counters.grows == 2 and kv.counters.shrinks == 1
        sglang_leak_check(kv, sched)

    @pytest.mark.parametrize("page_size", [1, 4])
    def test_mla_latent_pool_grows_and_shrinks(page_size):
        """An MLA pool (DeepSeek-V2/V3: one latent buffer of kv_lora_rank + rope dims per layer) under the same
        allocator: bytes per token from its latent buffers, grows, shrinks around held slots, SGLang's checks."""
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

        pool = MLATokenToKVPool(64, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8,
                                layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        if page_size == 1:
            alloc = TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", pool, False)
        else:
            alloc = PagedTokenToKVPoolAllocator(64, page_size, torch.bfloat16, "cpu", pool, False)
        bpt = LAYERS * (16 + 8) * 2
        assert host_bytes_per_token(pool) == bpt
        kv = ElasticKVCache(pool, alloc, capacity_tokens=32, max_tokens=64, min_tokens=8,
                            backing=HostKVBacking(bpt, 32))
        tree = RadixCache.create_simulated(mock_allocator=alloc, page_size=page_size)
        sched = fake_scheduler(alloc, tree, 32)
        kv.bind_scheduler(sched)
        assert kv.bytes_per_token == bpt and alloc.available_size() == 32
        assert kv.grow(16 * bpt) == 16 and kv.capacity_tokens == 48
        held = alloc.alloc(40)
        assert kv.shrink(10**9) == 8 * bpt and kv.capacity_tokens == 40  # stops above the held slots
        sglang_leak_check(kv, sched, held_by_requests=40)
        alloc.free(held)
        assert kv.shrink(10**9) == 32 * bpt and kv.capacity_tokens == 8
        sglang_leak_check(kv, sched)

    def test_refuses_an_allocator_that_is_not_empty_or_not_elastic():
        pool = MHATokenToKVPool(16, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
                                layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        alloc = TokenToKVPoolAllocator(16, torch.bfloat16, "cpu", pool, False)
        alloc.alloc(1)
        with pytest.raises(RuntimeError, match="empty allocator"):
            ElasticKVCache(pool, alloc, capacity_tokens=8, max_tokens=16, backing=HostKVBacking(BPT, 8))
        with pytest.raises(TypeError, match="not elastic"):
            ElasticKVCache(pool, SimpleNamespace(page_size=1), capacity_tokens=8, max_tokens=16,
                           backing=HostKVBacking(BPT, 8))
