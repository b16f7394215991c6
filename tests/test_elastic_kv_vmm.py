"""The CUDA path of the elastic KV cache (chunk-mapped VMM owner + VmmKVBacking), on CPU with a fake driver.

`ElasticKvVmmBufferOwner` is SGLang's `KvVmmBufferOwner` mapping each K/V buffer in fixed chunks; here its
driver calls go to a fake that tracks every mapped range, so the tests check what would fault or leak on
the GPU: chunks mapped once and without overlap, only the usable prefix (plus the padded slot page)
mapped, tail chunks unmapped only after the fence of the shrink is done, chunks still waiting for their
fence reused by a grow instead of mapped twice, and the budget seeing physical (chunk-rounded) bytes.
The real driver path runs on the GPU machine (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING or not).

Like test_elastic_kv_allocator.py, the suite needs the CPU-engine environment and re-runs itself in a
subprocess from a plain pytest run.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
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
    def test_elastic_kv_vmm_suite_in_cpu_engine_env(server_env):
        run_suite_in_cpu_engine(__file__, server_env, allow_skips=True)

else:
    import torch
    from sglang.srt.mem_cache import kv_vmm_backing as vmm
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from pagedweight.kvcache.elastic_kv import ElasticKVCache
    from pagedweight.kvcache.elastic_kv_backing import VmmKVBacking, elastic_vmm_owner_class
    from pagedweight.runtime.budget import MemoryBudget

    GRAN = 4096
    BASE = 1 << 40
    LAYERS, HEADS, DIM = 2, 2, 8
    ROW = HEADS * DIM * 2  # bytes per token per buffer (bf16): 32, so one granule = 128 tokens
    OK = 0

    class FakeDriver:
        """The cuda.bindings.driver calls the owner makes, with every mapped range tracked."""

        class CUresult:
            CUDA_SUCCESS = OK

        def __init__(self) -> None:
            self.handles: dict[int, int] = {}  # handle -> size, created and not released
            self.mapped: dict[int, tuple[int, int]] = {}  # addr -> (size, handle)
            self.next_handle = 1
            self.maps = self.unmaps = 0

        def cuMemCreate(self, size, prop, flags):
            assert size > 0 and size % GRAN == 0, size
            h = self.next_handle
            self.next_handle += 1
            self.handles[h] = size
            return (OK, h)

        def cuMemMap(self, addr, size, offset, handle, flags):
            assert self.handles[handle] == size and (addr - BASE) % GRAN == 0
            for a, (s, _) in self.mapped.items():
                assert addr + size <= a or a + s <= addr, f"overlapping map at {addr:#x}"
            self.mapped[addr] = (size, handle)
            self.maps += 1
            return (OK,)

        def cuMemSetAccess(self, addr, size, descs, count):
            assert self.mapped[addr][0] == size
            return (OK,)

        def cuMemUnmap(self, addr, size):
            assert self.mapped.pop(addr)[0] == size, "unmap of a range that is not exactly one mapping"
            self.unmaps += 1
            return (OK,)

        def cuMemRelease(self, handle):
            assert not any(h == handle for _, h in self.mapped.values()), "release of a mapped handle"
            del self.handles[handle]
            return (OK,)

        def mapped_bytes(self) -> int:
            return sum(s for s, _ in self.mapped.values())

        def mapped_spans(self) -> list[tuple[int, int]]:
            """(start offset, end offset) of the mapped bytes, merged."""
            out: list[list[int]] = []
            for a in sorted(self.mapped):
                s = self.mapped[a][0]
                if out and out[-1][1] == a - BASE:
                    out[-1][1] += s
                else:
                    out.append([a - BASE, a - BASE + s])
            return [tuple(x) for x in out]

    class Fence:
        """A CUDA event stand-in the test completes by hand."""

        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True

    @pytest.fixture
    def driver(monkeypatch):
        fake = FakeDriver()
        monkeypatch.setattr(vmm, "_drv", fake)
        return fake

    def make_owner(pool, descs=None):
        """An ElasticKvVmmBufferOwner laid out like SGLang's (granule-aligned buffers with VA slack between),
        without the CUDA MemPool: its chunk mapping is what is under test. `descs`: the buffers (default the MHA
        pool's K and V buffers)."""
        cls = elastic_vmm_owner_class()
        owner = cls.__new__(cls)
        owner.device, owner.device_id, owner.page_size = "cuda:0", 0, pool.page_size
        owner._arena = SimpleNamespace(granularity=GRAN, base=BASE, _prop=None, _access=None, close=lambda: None)
        owner._device_ctx = nullcontext
        specs, offset = [], 0
        for desc in descs if descs is not None else pool._build_kv_buffer_descs():
            span = desc.reserved_span_bytes(pool.store_dtype.itemsize)
            aligned = vmm.align_up(span, GRAN)
            specs.append(vmm._BufferSpec(desc, offset, span, aligned))
            offset += aligned + 2 * GRAN
        owner._specs = specs
        owner.ensure_prefix(pool.page_size)  # as the real constructor does
        return owner

    def make(driver, max_tokens=2047, capacity=511, min_tokens=127):
        # 2047 tokens + the padded slot = 2048 rows = 16 granules per buffer.
        pool = MHATokenToKVPool(max_tokens, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
                                layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        return elastic_over(pool, make_owner(pool), max_tokens, capacity, min_tokens)

    def elastic_over(pool, owner, max_tokens, capacity, min_tokens):
        """The elastic cache over `pool`'s buffers in `owner`, with fences the test completes by hand."""
        alloc = TokenToKVPoolAllocator(max_tokens, torch.bfloat16, "cpu", pool, False)
        fences: list[Fence] = []

        def fence(stream):
            fences.append(Fence())
            return fences[-1]

        backing = VmmKVBacking(owner, 1, fence=fence)
        kv = ElasticKVCache(pool, alloc, capacity_tokens=capacity, max_tokens=max_tokens, min_tokens=min_tokens,
                            backing=backing)
        backing.grow_to(capacity)  # what patches/kv_cache.py does without post-capture sizing
        return kv, alloc, owner, fences

    def granules(tokens: int) -> int:
        """Granules one buffer maps to back `tokens` usable tokens plus the padded slot."""
        return -(-((tokens + 1) * ROW) // GRAN)

    def expect_mapped(driver, owner, tokens: int) -> None:
        want = granules(tokens) * GRAN
        assert [e - s for s, e in driver.mapped_spans()] == [want] * len(owner._specs)
        assert [s for s, _ in driver.mapped_spans()] == [sp.offset for sp in owner._specs]

    # -- tests --------------------------------------------------------------------------------------------

    def test_only_the_usable_prefix_is_mapped(driver):
        kv, alloc, owner, _ = make(driver)
        expect_mapped(driver, owner, 511)  # 512 rows = 4 granules per buffer
        assert kv.backing.mapped_bytes() == driver.mapped_bytes() == 4 * 4 * GRAN
        assert owner.backed_bytes == driver.mapped_bytes()
        assert kv.bytes_per_token == 4 * ROW and alloc.available_size() == 511

    def test_grow_maps_whole_chunks_and_uses_credit_for_partial_ones(driver):
        kv, alloc, owner, _ = make(driver)
        # One more granule per buffer backs 128 more tokens and costs 4 granules.
        assert kv.grow(4 * GRAN - 1) == 0 and driver.mapped_bytes() == 16 * GRAN
        assert kv.grow(1) == 128 and kv.capacity_tokens == 639
        expect_mapped(driver, owner, 639)
        assert kv.grow(10**9) == 2047 - 639
        expect_mapped(driver, owner, 2047)
        assert driver.mapped_bytes() == 4 * 16 * GRAN

    def test_shrink_parks_whole_chunks_and_unmaps_only_after_the_fence(driver):
        kv, alloc, owner, fences = make(driver, capacity=2047)
        held = alloc.alloc(300)  # slots 1..300 stay in use
        budget = MemoryBudget(total_bytes=10**9)
        budget.commit(budget.try_reserve("kv", driver.mapped_bytes()))
        kv.attach_budget(budget)
        before = driver.mapped_bytes()
        assert kv.shrink(10**9) == 0, "nothing is released before the fence"
        # Slot 300 is in use: keep its granule whole, i.e. every slot the mapped chunks back (383).
        assert kv.capacity_tokens == 383 and driver.mapped_bytes() == before
        assert kv.backing.mapped_bytes() == before
        assert max(torch.cat((alloc.free_pages, alloc.release_pages)).tolist()) == 383
        assert len(fences) == 1 and driver.unmaps == 0
        fences[0].done = True
        released = kv.poll()
        assert released == before - 4 * 3 * GRAN
        expect_mapped(driver, owner, 383)
        assert budget.used("kv") == driver.mapped_bytes() and kv.counters.bytes_released == released
        alloc.free(held)

    def test_grow_before_the_fence_reuses_the_parked_chunks(driver):
        kv, alloc, owner, fences = make(driver, capacity=2047)
        kv.shrink(10**9)
        assert kv.capacity_tokens == 127 and driver.unmaps == 0
        maps = driver.maps
        assert kv.grow_tokens(900) == 900, "the chunks are still mapped: no new memory needed"
        assert driver.maps == maps, "a parked chunk must not be mapped twice"
        assert owner.backed_bytes == 4 * granules(1027) * GRAN  # the rest still waits for the fence
        fences[0].done = True
        assert kv.poll() == 4 * (16 - granules(1027)) * GRAN
        expect_mapped(driver, owner, 1027)
        assert driver.mapped_bytes() == kv.backing.mapped_bytes() == owner.backed_bytes
        kv.shrink(10**9)
        fences[-1].done = True
        kv.poll()
        expect_mapped(driver, owner, 127)

    def test_close_unmaps_everything_including_chunks_waiting_for_a_fence(driver, monkeypatch):
        kv, alloc, owner, fences = make(driver, capacity=2047)
        kv.shrink(10**9)
        assert driver.unmaps == 0 and driver.mapped_bytes() == 4 * 16 * GRAN
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # no device here
        owner.close()
        assert driver.mapped == {} and driver.handles == {}
        assert fences[0].done, "close waited for the pending fence before unmapping"

    # -- MLA latent pools (DeepSeek-V2/V3): one buffer per layer -------------------------------------------

    MLA_RANK, MLA_ROPE = 24, 8  # kv_cache_dim 32, bf16: 64 B per token per layer, one granule = 64 tokens

    def make_mla(driver, max_tokens=2047, capacity=511, min_tokens=127):
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

        from pagedweight.patches import kv_cache

        pool = MLATokenToKVPool(max_tokens, page_size=1, dtype=torch.bfloat16, kv_lora_rank=MLA_RANK,
                                qk_rope_head_dim=MLA_ROPE, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        return elastic_over(pool, make_owner(pool, kv_cache._mla_buffer_descs(pool)), max_tokens, capacity, min_tokens)

    def test_mla_buffer_descs_are_the_latent_buffers_as_sglang_shapes_them():
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

        from pagedweight.patches import kv_cache

        pool = MLATokenToKVPool(100, page_size=4, dtype=torch.bfloat16, kv_lora_rank=MLA_RANK, qk_rope_head_dim=MLA_ROPE,
                                layer_num=3, device="cpu", enable_memory_saver=False)
        descs = kv_cache._mla_buffer_descs(pool)
        assert [d.name for d in descs] == ["kv0", "kv1", "kv2"]
        for d, buf in zip(descs, pool.kv_buffer):
            assert d.shape == tuple(buf.shape) == (104, 1, MLA_RANK + MLA_ROPE)
            assert d.row_bytes == (MLA_RANK + MLA_ROPE) * 2 and d.tokens_per_row == 1
            assert d.reserved_span_bytes(2) == buf.numel() * buf.element_size()

    def test_mla_pool_maps_the_usable_prefix_and_unmaps_a_shrink_after_its_fence(driver):
        kv, alloc, owner, fences = make_mla(driver)
        row = (MLA_RANK + MLA_ROPE) * 2
        assert kv.bytes_per_token == LAYERS * row and alloc.available_size() == 511
        per_buffer = -(-(511 + 1) * row // GRAN) * GRAN  # 512 rows of 64 B = 8 granules per layer buffer
        assert driver.mapped_bytes() == LAYERS * per_buffer == kv.backing.mapped_bytes()
        assert kv.grow(10**9) == 2047 - 511
        assert driver.mapped_bytes() == LAYERS * 32 * GRAN  # every latent buffer mapped in full
        held = alloc.alloc(100)
        assert kv.shrink(10**9) == 0 and kv.capacity_tokens == 127  # slots 1..100: the granule of 64..127 stays
        assert driver.unmaps == 0, "nothing is unmapped before the fence"
        fences[-1].done = True
        assert kv.poll() == LAYERS * (32 - 2) * GRAN
        assert driver.mapped_bytes() == LAYERS * 2 * GRAN
        alloc.free(held)

    def test_mla_create_buffers_hook_puts_the_latent_buffers_in_the_reservation(monkeypatch):
        """MLATokenToKVPool._create_buffers inside an elastic sizing on CUDA: the pool's kv_buffer are the owner's
        tensors (one per layer, as described); a subclass (FP4, DSA) and a fixed sizing keep SGLang's buffers."""
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, MLATokenToKVPoolFP4

        from pagedweight.patches import kv_cache

        seen = {}

        def fake_owner(pool, descs):
            seen["descs"] = descs
            return SimpleNamespace(tensors=[f"t{i}" for i in range(len(descs))])

        monkeypatch.setattr(kv_cache, "_vmm_owner", fake_owner)

        def bare(cls):
            pool = cls.__new__(cls)
            pool.size, pool.page_size, pool.kv_cache_dim, pool.layer_num = 1000, 1, 32, 3
            pool.store_dtype, pool.device, pool.custom_mem_pool = torch.bfloat16, "cuda:0", None
            return pool

        built = []
        original = lambda p: built.append(p)  # noqa: E731  (SGLang's own _create_buffers)
        token = kv_cache._SIZING.set(kv_cache._Sizing(None, 512, "cuda:0"))
        try:
            pool = bare(MLATokenToKVPool)
            kv_cache.mla_create_buffers_around(original, pool)
            assert pool.kv_buffer == ["t0", "t1", "t2"] and not built
            assert [d.shape for d in seen["descs"]] == [(1001, 1, 32)] * 3
            kv_cache.mla_create_buffers_around(original, bare(MLATokenToKVPoolFP4))
            assert len(built) == 1
            kv_cache._SIZING.get().fixed_reason = "a DSA model"
            kv_cache.mla_create_buffers_around(original, bare(MLATokenToKVPool))
            assert len(built) == 2
        finally:
            kv_cache._SIZING.reset(token)
