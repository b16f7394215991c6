"""GPU: an MLA latent pool (DeepSeek-V2/V3) in the elastic cache's chunk-mapped VMM reservation, on the real driver.

patches/kv_cache.py's hook on MLATokenToKVPool._create_buffers puts every layer's latent buffer in an
`ElasticKvVmmBufferOwner` while an elastic sizing is in progress. Here, on the GPU: only the usable prefix takes device
memory (the driver's free memory shows it), a grow maps chunks the latent buffers can then be written and read through,
and a shrink gives the chunks back once its fence is done. CI checks the same bookkeeping with a fake driver
(test_elastic_kv_vmm.py). Needs CUDA and SGLang (the devicekit on the GPU machine).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYERS, RANK, ROPE = 4, 512, 64  # DeepSeek-V2's latent: kv_lora_rank 512 + rope 64, bf16: 1152 B per token per layer
# The driver's free memory also drops by what is not the mapping: CUDA's lazily loaded kernel modules on first use and
# the pool's and allocator's own tensors (130 MB beyond the mapping on an H100, session 27). Far below the 4.8 GB the
# reservation would take if it were mapped whole, which is what the bounds below rule out.
SLACK = 256 << 20


def _elastic_mla_pool(max_tokens: int, capacity: int):
    pytest.importorskip("sglang")
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    from pagedweight.kvcache.elastic_kv import ElasticKVCache
    from pagedweight.kvcache.elastic_kv_backing import make_backing
    from pagedweight.patches import kv_cache

    sizing = kv_cache._Sizing(None, max_tokens - capacity, "cuda:0")
    token = kv_cache._SIZING.set(sizing)  # what alloc_memory_pool_around sets around SGLang's pool creation
    original = MLATokenToKVPool._create_buffers
    try:
        MLATokenToKVPool._create_buffers = lambda pool: kv_cache.mla_create_buffers_around(original, pool)
        pool = MLATokenToKVPool(max_tokens, page_size=1, dtype=torch.bfloat16, kv_lora_rank=RANK,
                                qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cuda", enable_memory_saver=False)
    finally:
        MLATokenToKVPool._create_buffers = original
        kv_cache._SIZING.reset(token)
    assert sizing.owner is not None, "the hook did not place the latent buffers in a VMM reservation"
    alloc = TokenToKVPoolAllocator(max_tokens, torch.bfloat16, "cuda", pool, False)
    backing = make_backing(pool, capacity, sizing.owner)
    kv = ElasticKVCache(pool, alloc, capacity_tokens=capacity, max_tokens=max_tokens, backing=backing)
    backing.grow_to(capacity)  # as _install does without post-capture sizing
    return kv, pool, alloc, sizing.owner


def test_mla_latent_buffers_grow_and_shrink_in_device_memory():
    max_tokens, capacity = 1 << 20, 1 << 16  # 4.8 GB reserved, 300 MB mapped at the start
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    kv, pool, alloc, owner = _elastic_mla_pool(max_tokens, capacity)
    bpt = LAYERS * (RANK + ROPE) * 2
    assert kv.bytes_per_token == bpt
    assert all(b.shape == (max_tokens + 1, 1, RANK + ROPE) for b in pool.kv_buffer)
    mapped = free_before - torch.cuda.mem_get_info()[0]
    assert capacity * bpt <= mapped < capacity * bpt + SLACK, "only the usable prefix (plus chunks) is mapped"

    grown = kv.grow_tokens(1 << 18)
    assert grown == 1 << 18 and kv.capacity_tokens == capacity + grown
    new = slice(capacity + 1, capacity + grown + 1)
    for layer, buf in enumerate(pool.kv_buffer):  # the new slots are real memory: write, read back
        buf[new].fill_(float(layer + 1))
    torch.cuda.synchronize()
    assert [float(buf[new].amin()) for buf in pool.kv_buffer] == [float(i + 1) for i in range(LAYERS)]
    assert [float(buf[new].amax()) for buf in pool.kv_buffer] == [float(i + 1) for i in range(LAYERS)]
    torch.cuda.empty_cache()
    assert free_before - torch.cuda.mem_get_info()[0] >= (capacity + grown) * bpt

    kv.shrink_tokens(grown)
    assert kv.capacity_tokens == capacity
    torch.cuda.synchronize()  # the shrink's fence is done
    kv.poll()
    assert kv.counters.bytes_released >= grown * bpt - (64 << 20)
    torch.cuda.empty_cache()
    assert free_before - torch.cuda.mem_get_info()[0] < capacity * bpt + SLACK, "the chunks went back"
    owner.close()
