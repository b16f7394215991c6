"""serving/builder.py wires the whole runtime once, and the runtime is the one owner of the budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedweight.config import PagedWeightConfig
from pagedweight.serving.builder import SchedulerView, build_serving, build_weights, kv_bytes_per_token
from tests.support.random_stores import random_layer_stores


class _KV:
    """What the builder and the runtime's KV link use of an ElasticKVCache."""

    def __init__(self, mapped: int) -> None:
        self.mapped, self.budget, self.grown = mapped, None, []
        self.max_tokens = self.capacity_tokens = 64

    def state(self):
        from types import SimpleNamespace

        return SimpleNamespace(mapped_bytes=self.mapped)

    def attach_budget(self, budget) -> None:
        self.budget = budget

    def grow(self, nbytes: int) -> int:
        self.grown.append(nbytes)
        return 0


def _view(**kw) -> SchedulerView:
    return SchedulerView(**{"page_size": 1, "max_total_num_tokens": 1000, "kv_bytes_per_token": 64,
                            "load_format": "dummy", "model_path": "unused", **kw})


def _runtime(**cfg):
    return build_weights(PagedWeightConfig(enable=True, **cfg), random_layer_stores(2, 4), torch.device("cpu"))


def test_a_fixed_kv_pool_adds_its_bytes_and_gets_the_static_policy():
    runtime = _runtime()
    weights_total = runtime.budget.total
    pws = build_serving(_view(), runtime)
    assert runtime.budget.total == weights_total + 1000 * 64 and runtime.budget.used("kv") == 1000 * 64
    assert type(pws.controller.policy).__name__ == "StaticPolicy"
    assert pws.controller.pager is runtime.pager and pws.controller.kv is None and pws.tp_sync is None
    assert pws.capacity_blocks == 1000 and pws.controller.signal.bytes_per_block == 64
    runtime.kv_link(4096)  # bytes the pager frees reach no KV cache
    with pytest.raises(RuntimeError, match="already linked"):
        runtime.link_kv(None, 1)


def test_an_elastic_kv_cache_is_linked_to_the_budget_and_the_freed_bytes():
    runtime = _runtime(policy="hotness")
    weights_total = runtime.budget.total
    kv = _KV(mapped=12345)
    pws = build_serving(_view(), runtime, kv)
    assert runtime.budget.total == weights_total + 12345 and runtime.budget.used("kv") == 12345
    assert kv.budget is runtime.budget and pws.controller.kv is kv
    assert type(pws.controller.policy).__name__ == "HotnessPolicy"
    runtime.pager.on_bytes_freed(4096)  # the pager's callback, fixed at construction
    assert kv.grown == [4096]


def test_tp_needs_the_ledger_the_weights_were_built_with():
    from pagedweight.serving.builder import TpView

    runtime = _runtime()
    assert runtime.ledger is None
    with pytest.raises(RuntimeError, match="without a fence ledger"):
        build_serving(_view(tp=TpView(2, 0, 0, None)), runtime)
    tp_runtime = build_weights(PagedWeightConfig(enable=True), random_layer_stores(2, 4), torch.device("cpu"),
                               tp_world_size=2)
    assert tp_runtime.ledger is not None and not tp_runtime.ledger.started  # numbers nothing until serving
    assert tp_runtime.ledger.recorded == 0


def test_kv_bytes_per_token_of_each_pool_kind():
    """One token's bytes across an MHA pool's K and V buffers, an MLA pool's latent buffers, and both halves of a
    hybrid sliding-window pool; a pool with neither is refused in one line."""
    mha = SimpleNamespace(k_buffer=[torch.zeros(9, 2, 8, dtype=torch.bfloat16)] * 3,
                          v_buffer=[torch.zeros(9, 2, 8, dtype=torch.bfloat16)] * 3)
    mla = SimpleNamespace(kv_buffer=[torch.zeros(9, 1, 24, dtype=torch.bfloat16)] * 2)
    assert kv_bytes_per_token(mha) == 6 * 2 * 8 * 2
    assert kv_bytes_per_token(mla) == 2 * 24 * 2
    assert kv_bytes_per_token(SimpleNamespace(full_kv_pool=mha, swa_kv_pool=mla)) == 192 + 96
    with pytest.raises(RuntimeError, match="cannot measure bytes per token of KV pool SimpleNamespace"):
        kv_bytes_per_token(SimpleNamespace())
