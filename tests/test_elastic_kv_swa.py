"""ElasticKVCache on a hybrid sliding-window pool (SWAKVPool + SWATokenToKVPoolAllocator: Gemma-4), against SGLang's
real pool, allocator, radix caches (UnifiedRadixCache with full and SWA components, what SGLang 0.5.17 builds for a
hybrid sliding-window model; SWARadixCache, its older tree) and invariant checker: the full-attention part grows and
shrinks, the sliding-window part keeps its size, and SGLang's own full and SWA leak checks balance after every step.

Importing SGLang's mem_cache needs the CPU-engine environment at process start (fake libcuda on LD_LIBRARY_PATH),
so in a plain pytest run this module holds one test that re-runs it in a subprocess with that environment.
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
        reason="CPU-engine suite (fake libcuda on LD_LIBRARY_PATH)",
    )
    def test_elastic_kv_swa_suite_in_cpu_engine_env(server_env):
        run_suite_in_cpu_engine(__file__, server_env)

else:
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from pagedweight.kvcache.elastic_kv import ElasticKVCache
    from pagedweight.kvcache.elastic_kv_backing import HostKVBacking, host_bytes_per_token
    from pagedweight.patches.kv_cache import elastic_part
    from pagedweight.serving.serving_loop import full_available_tokens, full_evictable_tokens

    HEADS, DIM = 2, 8
    FULL_LAYERS, SWA_LAYERS = [1, 3], [0, 2, 4, 5]
    FULL_BPT = len(FULL_LAYERS) * 2 * HEADS * DIM * 2  # K and V, bf16, full-attention layers only
    WINDOW = 4

    def make(max_tokens=64, capacity=32, swa_tokens=24, min_tokens=None, page_size=1, tree_kind="swa"):
        pool = SWAKVPool(
            size=max_tokens, size_swa=swa_tokens, page_size=page_size, dtype=torch.bfloat16, head_num=HEADS,
            head_dim=DIM, swa_attention_layer_ids=SWA_LAYERS, full_attention_layer_ids=FULL_LAYERS, device="cpu",
            token_to_kv_pool_class=MHATokenToKVPool,
        )
        alloc = SWATokenToKVPoolAllocator(max_tokens, swa_tokens, page_size, torch.bfloat16, "cpu", pool, False)
        full = elastic_part(pool)
        kv = ElasticKVCache(
            full, alloc, capacity_tokens=capacity, max_tokens=max_tokens, min_tokens=min_tokens,
            backing=HostKVBacking(host_bytes_per_token(full), capacity),
        )
        params = CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page_size,
            sliding_window_size=WINDOW,
        )
        if tree_kind == "unified":
            params.tree_components = (ComponentType.FULL, ComponentType.SWA)
            tree = UnifiedRadixCache(params)
        else:
            tree = SWARadixCache(params)
        sched = fake_scheduler(alloc, tree, capacity, swa_tokens)
        kv.bind_scheduler(sched)
        return kv, alloc, tree, sched

    def fake_scheduler(alloc, tree, capacity, swa_tokens):
        """The scheduler attributes that hold a copy of the full capacity, with SGLang's real hybrid checker."""
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
        from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver

        server_args = SimpleNamespace(dcp_size=1)
        no_batch = lambda: None  # noqa: E731
        obs = SchedulerPoolStatsObserver(
            tree_cache=tree, token_to_kv_pool_allocator=alloc, req_to_token_pool=None,
            session_controller=SimpleNamespace(sessions={}), hisparse_coordinator=None, is_hybrid_swa=True,
            is_hybrid_ssm=False, enable_hisparse=False, full_tokens_per_layer=capacity,
            swa_tokens_per_layer=swa_tokens, max_total_num_tokens=capacity, get_last_batch=no_batch,
            get_running_batch=no_batch,
        )
        checker = SchedulerInvariantChecker(
            is_hybrid_swa=True, is_hybrid_ssm=False, disaggregation_mode=DisaggregationMode.NULL,
            page_size=alloc.page_size, full_tokens_per_layer=capacity, swa_tokens_per_layer=swa_tokens,
            max_total_num_tokens=capacity, server_args=server_args, tree_cache=tree,
            token_to_kv_pool_allocator=alloc, req_to_token_pool=None, pool_stats_observer=obs,
            get_last_batch=no_batch, get_running_batch=no_batch,
        )
        return SimpleNamespace(
            server_args=server_args, token_to_kv_pool_allocator=alloc, tree_cache=tree,
            max_total_num_tokens=capacity, full_tokens_per_layer=capacity, swa_tokens_per_layer=swa_tokens,
            pool_stats_observer=obs, invariant_checker=checker,
        )

    def sglang_leak_check(kv, sched, held_full=0, held_swa=0):
        """SGLang's own checks of both pools: available + evictable + protected (+ what requests hold) == total."""
        cap = kv.capacity_tokens
        assert sched.max_total_num_tokens == sched.full_tokens_per_layer == cap
        assert sched.invariant_checker.full_tokens_per_layer == cap
        assert sched.pool_stats_observer.full_tokens_per_layer == cap
        assert kv.allocator.size_full == cap and kv.units.size == cap
        ps = sched.pool_stats_observer.get_pool_stats()
        leak, msg = sched.invariant_checker._check_full_pool(ps, uncached=held_full)
        assert not leak, msg
        leak, msg = sched.invariant_checker._check_swa_pool(ps, uncached=held_swa)
        assert not leak, msg

    def full_ids(alloc):
        a = alloc.full_attn_allocator
        return torch.cat((a.free_pages, a.release_pages)).tolist()

    def check_step(kv, alloc, sched, held):
        """After a random step: every held slot and every free slot lies inside the capacity, and SGLang's leak checks
        balance with `held` (the running requests' slots, full and SWA alike) counted as theirs."""
        in_use = sum(len(h) for h in held)
        assert all(int(h.max()) <= kv.capacity_tokens for h in held)
        assert all(v <= kv.capacity_tokens for v in full_ids(alloc))
        sglang_leak_check(kv, sched, held_full=in_use, held_swa=in_use)

    def insert(tree, tokens, values, cached=0):
        """Insert as a finished request does: its first `cached` tokens came from the tree (SGLang's insert frees
        the duplicates of any matched prefix past that point)."""
        return tree.insert(InsertParams(key=RadixKey(array("q", tokens), None),
                                        value=torch.tensor(values, dtype=torch.int64), prev_prefix_len=cached))

    # -- tests --------------------------------------------------------------------------------------------

    def test_only_the_full_attention_pool_is_elastic():
        kv, alloc, tree, sched = make(max_tokens=64, capacity=32, swa_tokens=24)
        assert kv.pool is alloc.get_kvcache().full_kv_pool and kv.units is alloc.full_attn_allocator
        assert (kv.capacity_tokens, kv.max_tokens, kv.parked_tokens) == (32, 64, 32)
        assert kv.bytes_per_token == FULL_BPT
        assert sorted(full_ids(alloc)) == list(range(1, 33))
        assert alloc.swa_available_size() == 24 and alloc.size_swa == 24  # untouched
        assert full_available_tokens(alloc) == 32 and full_evictable_tokens(tree) == 0
        sglang_leak_check(kv, sched)
        assert kv.grow(10 * FULL_BPT) == 10 and kv.capacity_tokens == 42
        assert alloc.swa_available_size() == 24 and alloc.size_swa == 24
        sglang_leak_check(kv, sched)

    def test_grown_full_slots_are_allocated_with_their_sliding_window_slots():
        kv, alloc, _, sched = make(max_tokens=64, capacity=8, swa_tokens=24)
        kv.grow(16 * FULL_BPT)
        held = alloc.alloc(20)  # past the start capacity: grown ids, each mapped to an SWA slot
        assert held is not None and sorted(held.tolist()) == list(range(1, 21))
        swa = alloc.full_to_swa_index_mapping[held]
        assert bool((swa > 0).all()) and len(set(swa.tolist())) == 20
        assert alloc.swa_available_size() == 4
        sglang_leak_check(kv, sched, held_full=20, held_swa=20)
        alloc.free_swa(held[:12])  # the window slid past the first 12 tokens: their SWA slots go back
        sglang_leak_check(kv, sched, held_full=20, held_swa=8)
        alloc.free(held)
        assert alloc.swa_available_size() == 24
        sglang_leak_check(kv, sched)

    def test_shrink_stops_above_slots_in_use_and_keeps_the_swa_pool():
        kv, alloc, _, sched = make(max_tokens=64, capacity=64, swa_tokens=48, min_tokens=8)
        held = alloc.alloc(40)
        released = kv.shrink(60 * FULL_BPT)
        assert kv.capacity_tokens == 40 and released == 24 * FULL_BPT
        assert kv.counters.deferred_shrinks == 1
        assert set(held.tolist()).isdisjoint(full_ids(alloc))
        assert alloc.size_swa == 48
        sglang_leak_check(kv, sched, held_full=40, held_swa=40)
        alloc.free(held[20:])
        assert kv.shrink(60 * FULL_BPT) == 20 * FULL_BPT and kv.capacity_tokens == 20
        assert max(full_ids(alloc), default=0) <= 20
        sglang_leak_check(kv, sched, held_full=20, held_swa=20)

    def test_shrink_defers_while_a_free_group_is_open():
        kv, alloc, _, sched = make(max_tokens=64, capacity=64, swa_tokens=48, min_tokens=8)
        held = alloc.alloc(16)
        alloc.free_group_begin()
        alloc.free(held)
        kv.shrink(10**9)
        assert kv.capacity_tokens == 64 and kv.counters.deferred_shrinks == 1
        alloc.free_group_end()
        kv.shrink(10**9)
        assert kv.capacity_tokens == 8
        sglang_leak_check(kv, sched)

    def test_shrink_evicts_unlocked_radix_nodes_on_the_tail_and_keeps_locked_ones():
        kv, alloc, tree, sched = make(max_tokens=64, capacity=64, swa_tokens=64, min_tokens=8)
        low = alloc.alloc(8).tolist()  # 1..8
        mid = alloc.alloc(8).tolist()  # 9..16
        high = alloc.alloc(8).tolist()  # 17..24
        insert(tree, list(range(100, 108)), low)
        insert(tree, list(range(100, 108)) + [9] * 8, low + mid, cached=8)  # a child node holds 9..16
        insert(tree, [7] * 8, high)
        locked_node = next(n for n in tree.root_node.children.values() if n.value.tolist() == high)
        tree.inc_lock_ref(locked_node)  # a running request holds 17..24
        assert tree.full_evictable_size() == 16 and full_evictable_tokens(tree) == 16
        kv.shrink(10**9)
        assert kv.capacity_tokens == 24, "the locked node's slots stay; everything above goes"
        assert max(full_ids(alloc)) <= 24
        sglang_leak_check(kv, sched)
        tree.dec_lock_ref(locked_node)
        kv.shrink(10**9)
        assert kv.capacity_tokens <= 16 and kv.counters.evicted_tokens >= 16
        assert all(v <= kv.capacity_tokens for v in full_ids(alloc))
        assert alloc.swa_available_size() + tree.swa_evictable_size() == 64
        sglang_leak_check(kv, sched)

    def test_random_sequences_keep_both_pools_balanced():
        rng = random.Random(0)
        for _trial in range(5):
            kv, alloc, tree, sched = make(max_tokens=96, capacity=48, swa_tokens=64, min_tokens=8)
            held = []
            for _ in range(60):
                op = rng.random()
                if op < 0.35:
                    n = rng.randint(1, 12)
                    if n <= min(alloc.full_available_size(), alloc.swa_available_size()):
                        held.append(alloc.alloc(n))
                elif op < 0.55 and held:
                    alloc.free(held.pop(rng.randrange(len(held))))
                elif op < 0.8:
                    kv.grow(rng.randint(0, 20) * FULL_BPT)
                else:
                    kv.shrink(rng.randint(0, 30) * FULL_BPT)
                check_step(kv, alloc, sched, held)
            for h in held:
                alloc.free(h)
            kv.shrink(10**9)
            assert kv.capacity_tokens == 8
            sglang_leak_check(kv, sched)

    def test_unified_tree_shrink_evicts_unlocked_tail_nodes_and_keeps_locked_ones():
        kv, alloc, tree, sched = make(max_tokens=64, capacity=64, swa_tokens=64, min_tokens=8, tree_kind="unified")
        low, mid, high = (alloc.alloc(8).tolist() for _ in range(3))  # 1..8, 9..16, 17..24
        insert(tree, list(range(100, 108)), low)
        insert(tree, list(range(100, 108)) + [9] * 8, low + mid, cached=8)
        locked = insert(tree, [7] * 8, high).last_device_node
        tree.inc_lock_ref(locked)  # a running request holds 17..24
        assert full_evictable_tokens(tree) == 16 and tree.full_protected_size() == 8
        kv.shrink(10**9)
        assert kv.capacity_tokens == 24, "the locked node's slots stay; everything above goes"
        assert max(full_ids(alloc)) <= 24 and kv.counters.evicted_tokens == 16
        sglang_leak_check(kv, sched)
        tree.dec_lock_ref(locked)
        kv.shrink(10**9)
        assert kv.capacity_tokens == 8 and kv.counters.evicted_tokens == 24
        assert alloc.swa_available_size() + tree.swa_evictable_size() == 64
        sglang_leak_check(kv, sched)

    def test_unified_tree_stops_after_one_round_that_frees_no_tail_slot():
        """The tail is held by a running request: one LRU round of that many tokens, then the shrink defers
        instead of draining the whole prefix cache."""
        kv, alloc, tree, sched = make(max_tokens=64, capacity=64, swa_tokens=64, min_tokens=16, tree_kind="unified")
        a, b, c = (alloc.alloc(8).tolist() for _ in range(3))
        insert(tree, [1] * 8, a)
        insert(tree, [2] * 8, b)
        locked = insert(tree, [3] * 8, c).last_device_node
        tree.inc_lock_ref(locked)
        kv.shrink(10**9)
        assert kv.capacity_tokens == 24 and kv.counters.deferred_shrinks == 1
        assert kv.counters.evicted_tokens == 8 and full_evictable_tokens(tree) == 8
        sglang_leak_check(kv, sched)

    def test_unified_tree_random_sequences_keep_both_pools_balanced():
        """Requests allocate, finish into the tree (some prefixes shared), lock and unlock; the cache grows and
        shrinks between them, evicting tail nodes; SGLang's leak checks of both pools balance after every step."""
        rng = random.Random(1)
        for _trial in range(4):
            kv, alloc, tree, sched = make(max_tokens=96, capacity=48, swa_tokens=96, min_tokens=8, tree_kind="unified")
            running, locks, next_tok = [], [], 1000
            for _ in range(80):
                op = rng.random()
                if op < 0.3:
                    n = rng.randint(1, 10)
                    if n <= min(alloc.full_available_size(), alloc.swa_available_size()):
                        running.append(alloc.alloc(n))
                elif op < 0.5 and running:  # a request finishes: its slots go to the tree under fresh tokens
                    v = running.pop(rng.randrange(len(running)))
                    res = insert(tree, list(range(next_tok, next_tok + len(v))), v.tolist())
                    next_tok += len(v)
                    if rng.random() < 0.4:
                        tree.inc_lock_ref(res.last_device_node)
                        locks.append(res.last_device_node)
                elif op < 0.6 and locks:
                    tree.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
                elif op < 0.8:
                    kv.grow(rng.randint(0, 20) * FULL_BPT)
                else:
                    kv.shrink(rng.randint(0, 40) * FULL_BPT)
                check_step(kv, alloc, sched, running)
            for node in locks:
                tree.dec_lock_ref(node)
            for h in running:
                alloc.free(h)
            kv.shrink(10**9)
            assert kv.capacity_tokens == 8 and full_evictable_tokens(tree) == 0
            sglang_leak_check(kv, sched)

    def test_an_all_sliding_window_allocator_is_refused():
        from sglang.srt.mem_cache.allocator.swa import PureSWATokenToKVPoolAllocator

        pool = SWAKVPool(
            size=0, size_swa=32, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
            swa_attention_layer_ids=[0, 1], full_attention_layer_ids=[], device="cpu",
            token_to_kv_pool_class=MHATokenToKVPool,
        )
        alloc = PureSWATokenToKVPoolAllocator(32, 1, torch.bfloat16, "cpu", pool, False)
        with pytest.raises(TypeError, match="not elastic|no full-attention"):
            ElasticKVCache(pool.swa_kv_pool, alloc, capacity_tokens=16, max_tokens=32,
                           backing=HostKVBacking(FULL_BPT, 16))
