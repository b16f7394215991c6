"""A KV pool the elastic cache does not take (Mamba, the DSA / FP4 variants of the MLA pool, the MXFP8,
unified-memory and all-sliding-window variants of the hybrid sliding-window pool; issue #23): the hooks keep
SGLang's pool as it is and say so in one line, and the server runs the static policy, instead of dying after model
load. A plain MLA latent pool (DeepSeek-V2/V3) and the full-attention part of a plain hybrid sliding-window pool
(Gemma-4) are sized elastic. (Stock SGLang's CPU backend cannot run an MLA model, so this is checked on the hooks
themselves.)"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pagedweight.config import SERVER_ARGS_ATTR, PagedWeightConfig
from pagedweight.patches import kv_cache
from pagedweight.planner.static_policy import StaticPolicy
from pagedweight.serving.builder import serving_policy


def _configurator(**kind):
    base = dict(is_draft_worker=False, is_hybrid_swa=False, mambaish_config=None, use_mla_backend=False)
    return SimpleNamespace(**{**base, **kind})


def _model_runner():
    server_args = SimpleNamespace()
    object.__setattr__(server_args, SERVER_ARGS_ATTR, PagedWeightConfig(enable=True))
    return SimpleNamespace(server_args=server_args, is_draft_worker=False, device="cuda", max_total_num_tokens=4096)


DSA_CONFIG = SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=2048)
GEMMA4_CONFIG = SimpleNamespace(hf_config=SimpleNamespace(architectures=["Gemma4ForCausalLM"]),
                                full_attention_layer_ids=[5, 11])
ALL_SWA_CONFIG = SimpleNamespace(hf_config=SimpleNamespace(architectures=["Gemma4ForCausalLM"]),
                                 full_attention_layer_ids=[])


@pytest.fixture(autouse=True)
def memory_namespace(monkeypatch):
    """SGLang's runtime context publishes its `memory` namespace before the pools are built; unified memory off."""
    memory = SimpleNamespace(enable_unified_memory=False)
    monkeypatch.setattr("sglang.srt.runtime_context.get_memory", lambda: memory)
    return memory


@pytest.mark.parametrize("kind,word", [(dict(use_mla_backend=True, model_config=SimpleNamespace(hf_config=DSA_CONFIG)),
                                        "DSA (sparse-attention MLA)"),
                                       (dict(is_hybrid_swa=True, model_config=GEMMA4_CONFIG,
                                             kv_cache_dtype_str="mxfp8"), "MXFP8 hybrid sliding-window"),
                                       (dict(is_hybrid_swa=True, model_config=ALL_SWA_CONFIG), "all-sliding-window"),
                                       (dict(mambaish_config=object()), "Mamba")])
def test_a_pool_kind_the_cache_does_not_take_is_kept_fixed(kind, word, monkeypatch, caplog):
    monkeypatch.setenv(kv_cache.EXTRA_TOKENS_ENV, "512")
    runner = _model_runner()
    config = SimpleNamespace(max_total_num_tokens=4096)
    built = []

    def sglang_alloc(model_runner):  # SGLang's alloc_memory_pool: resolve the config, then build the pools
        got = kv_cache.resolve_memory_pool_config_around(lambda c: config, _configurator(**kind))
        pool = SimpleNamespace(device="cuda")
        kv_cache.create_buffers_normal_around(lambda p: built.append(p), pool)  # an MHA part of a hybrid pool
        return got

    with caplog.at_level(logging.INFO, logger="pagedweight"):
        assert kv_cache.alloc_memory_pool_around(sglang_alloc, runner) is config  # the size SGLang chose
    assert len(built) == 1  # SGLang's own buffers, not a VMM reservation nobody would map
    assert not hasattr(runner, kv_cache.KV_ATTR)
    lines = [r.getMessage() for r in caplog.records if "fixed KV pool" in r.getMessage()]
    assert len(lines) == 1 and word in lines[0] and "4096 tokens" in lines[0], lines
    assert kv_cache.sizing_in_progress() is None  # reset when the call returned


MLA_CONFIG = SimpleNamespace(architectures=["DeepseekV2ForCausalLM"])


@pytest.mark.parametrize("kind", [dict(), dict(use_mla_backend=True, model_config=SimpleNamespace(hf_config=MLA_CONFIG))],
                         ids=["mha", "mla"])
def test_a_plain_pool_is_still_sized_elastic(kind, monkeypatch):
    """The MHA case and a plain MLA latent pool (DeepSeek-V2) ask SGLang for capacity + extra tokens (what the fixed
    path must not change)."""
    monkeypatch.setenv(kv_cache.EXTRA_TOKENS_ENV, "512")
    sizing = kv_cache._Sizing(None, 512, "cpu")
    token = kv_cache._SIZING.set(sizing)  # inside an alloc_memory_pool call
    cfg = _configurator(**kind)
    cfg.pool_page_size = 16
    monkeypatch.setattr("sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator",
                        lambda c: SimpleNamespace(_cell_size=1024))
    import dataclasses

    @dataclasses.dataclass
    class Config:
        max_total_num_tokens: int

    out = kv_cache.resolve_memory_pool_config_around(lambda c: Config(4100), cfg)
    assert out.max_total_num_tokens == 4096 + 512 and not sizing.fixed_reason
    assert (sizing.capacity_tokens, sizing.max_tokens) == (4096, 4608)
    kv_cache._SIZING.reset(token)


def test_unified_memory_keeps_a_hybrid_sliding_window_pool_fixed(memory_namespace):
    memory_namespace.enable_unified_memory = True
    assert kv_cache._swa_variant(_configurator(is_hybrid_swa=True, model_config=GEMMA4_CONFIG)) == (
        "unified-memory hybrid sliding-window")
    memory_namespace.enable_unified_memory = False
    assert kv_cache._swa_variant(_configurator(is_hybrid_swa=True, model_config=GEMMA4_CONFIG)) == ""


def test_a_hybrid_sliding_window_pool_grows_its_full_attention_part_only(monkeypatch):
    """Gemma-4: the extra tokens are priced at the full-attention layers' bytes per token and go to the full pool's
    size (max_total_num_tokens follows it, as SGLang's hybrid configurator sets it); the SWA pool keeps its size."""
    import dataclasses

    monkeypatch.delenv(kv_cache.EXTRA_TOKENS_ENV, raising=False)
    sizing = kv_cache._Sizing(3 * 1000 * 1024, None, "cpu")  # bytes for 1000 full tokens of 3 KiB
    token = kv_cache._SIZING.set(sizing)
    cfg = _configurator(is_hybrid_swa=True, model_config=GEMMA4_CONFIG, is_hybrid_swa_compress=True)  # as Gemma-4
    cfg.pool_page_size = 16
    monkeypatch.setattr("sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator",
                        lambda c: SimpleNamespace(_full_per_token=1024, _full_layers_num=2, _draft_full_layers_num=1,
                                                  _cell_size=99))

    @dataclasses.dataclass
    class Config:
        max_total_num_tokens: int
        full_max_total_num_tokens: int
        swa_max_total_num_tokens: int

    out = kv_cache.resolve_memory_pool_config_around(lambda c: Config(2050, 2050, 8000), cfg)
    assert not sizing.fixed_reason
    assert (sizing.capacity_tokens, sizing.max_tokens) == (2048, 2048 + 992)  # 1000 tokens, whole pages of 16
    assert (out.max_total_num_tokens, out.full_max_total_num_tokens, out.swa_max_total_num_tokens) == (
        3040, 3040, 8000)
    kv_cache._SIZING.reset(token)


def test_a_fixed_pool_runs_the_static_policy():
    policy, line = serving_policy(PagedWeightConfig(enable=True), None, None, fixed_kv=True)
    assert isinstance(policy, StaticPolicy) and "KV pool is fixed" in line
    assert len(policy.plan_reload(None, 1 << 30, None)) == 0
