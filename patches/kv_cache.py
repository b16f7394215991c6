"""SGLang integration of the elastic KV cache (python/pagedweight/kvcache/elastic_kv.py).

Sizing (scheduler process, while the model runner allocates its pools):
- AROUND ModelRunner.alloc_memory_pool: with --enable-paged-weight (target worker only), learn how many
  bytes the expert weights could ever give to the KV cache (`max_extra_kv_bytes`), let SGLang create pool
  and allocator for `capacity + extra` tokens, then park everything past SGLang's own capacity in an
  `ElasticKVCache`, stored as `model_runner._paged_weight_kv`.
- AROUND KVCacheConfigurator._resolve_memory_pool_config: SGLang's computed capacity C stays the start
  capacity; the returned config asks for C + extra tokens (max_running_requests stays C's).
- AROUND MHATokenToKVPool._create_buffers_normal / _alloc_post_capture_buffers (CUDA only): the K/V
  buffers go into a CUDA VMM reservation mapped in fixed chunks (`ElasticKvVmmBufferOwner`), so only the
  usable prefix takes GPU memory, with or without SGLANG_ENABLE_POST_CAPTURE_KV_SIZING.
- AROUND MLATokenToKVPool._create_buffers (CUDA only): the same for an MLA pool's per-layer latent buffers
  (DeepSeek-V2/V3 and what reuses them; SGLang's own VMM path covers MHA pools only). The DSA, FP4 and
  hybrid variants of the MLA pool stay fixed.
- AROUND ModelRunner.post_capture_resize_kv_pool: SGLang's post-capture sizing resized the pool; rebase.

Serving:
- AFTER Scheduler.__init__: bind the cache to the scheduler (radix cache, capacity copies) and expose it as
  `scheduler._paged_weight_kv` (patches/scheduler.py picks it up; registered before it in plugin.py).
- BEFORE Scheduler.get_next_batch_to_run: `kv.poll()` releases parked CUDA chunks whose fence is done.
- set_internal_state (dispatched by patches/scheduler.py): `POST /set_internal_state {"server_args":
  {"paged_weight_kv_capacity_tokens": N}}` moves the capacity toward N (operators and tests; the answer
  `[true]` means exactly N, clamped to [min_tokens, max_tokens], was reached; a shrink stops above slots
  that running requests hold).
- AFTER Scheduler.get_internal_state: `/get_server_info` reports the cache under "paged_weight_kv".

`PAGEDWEIGHT_ELASTIC_KV_EXTRA_TOKENS=N` (tests, operators) overrides the extra room, in tokens.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger("pagedweight")

MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
MHA_POOL = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
MLA_POOL = "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"

EXTRA_TOKENS_ENV = "PAGEDWEIGHT_ELASTIC_KV_EXTRA_TOKENS"
MAX_EXTRA_ATTR = "_paged_weight_max_extra_kv_bytes"  # optional override the runtime may set on the model runner
KV_ATTR = "_paged_weight_kv"
STATE_KEY = "paged_weight_kv"
RESIZE_KEY = "paged_weight_kv_capacity_tokens"  # SetInternalStateReq takes numeric values only
SWA_SUBPOOL_LABEL = "SWA"  # SWAKVPool's allocation_label of its sliding-window sub-pool (the full one is "Full")


class ElasticKVSetupError(RuntimeError):
    """The elastic KV cache cannot be set up for this server configuration; the message says why."""


@dataclass
class _Sizing:
    """One alloc_memory_pool call of the target model runner, shared by the nested hooks."""

    extra_bytes: Optional[int]
    extra_tokens: Optional[int]
    device: str
    capacity_tokens: int = 0
    max_tokens: int = 0
    owner: Any = None
    fixed_reason: str = ""  # set when the pool kind is not elastic: SGLang's pool is kept as it is


# The sizing of the alloc_memory_pool call in progress, read by the hooks nested in it (pool config, buffers): a
# context variable set for that call and reset when it returns, so no sizing outlives its call.
_SIZING: contextvars.ContextVar[Optional[_Sizing]] = contextvars.ContextVar("pagedweight_kv_sizing", default=None)


def sizing_in_progress() -> Optional[_Sizing]:
    """The sizing of the alloc_memory_pool call in progress (None outside one)."""
    return _SIZING.get()


def _enabled(server_args: Any) -> bool:
    from pagedweight.patches.server_args import get_config

    return get_config(server_args).enable


def max_extra_kv_bytes(model_runner: Any) -> Optional[int]:
    """Bytes the expert weights can give up: between their initial and floor bitwidths (None: use the
    env override in tokens)."""
    if os.environ.get(EXTRA_TOKENS_ENV):
        return None
    explicit = getattr(model_runner, MAX_EXTRA_ATTR, None)
    if explicit is not None:
        return int(explicit)
    from pagedweight.runtime.paged_runtime import find_runtime

    runtime = find_runtime(model_runner)
    if runtime is None:
        raise ElasticKVSetupError(
            "--enable-paged-weight: the PagedWeight runtime was not started before SGLang allocated its KV "
            f"pool, so the elastic KV cache cannot be sized (set {EXTRA_TOKENS_ENV} to size it by hand)"
        )
    return max(0, int(runtime.weight_bytes()) - int(runtime.bytes_at_floor()))


def _extra_tokens_env() -> Optional[int]:
    raw = os.environ.get(EXTRA_TOKENS_ENV)
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ElasticKVSetupError(f"{EXTRA_TOKENS_ENV} must be a whole number of tokens, got {raw!r}") from None
    if n < 0:
        raise ElasticKVSetupError(f"{EXTRA_TOKENS_ENV} must be >= 0, got {n}")
    return n


# -- sizing ---------------------------------------------------------------------------------------------


def alloc_memory_pool_around(original, model_runner, *args, **kwargs):
    if not _enabled(model_runner.server_args) or model_runner.is_draft_worker:
        return original(model_runner, *args, **kwargs)
    sizing = _Sizing(max_extra_kv_bytes(model_runner), _extra_tokens_env(), str(model_runner.device))
    token = _SIZING.set(sizing)
    try:
        result = original(model_runner, *args, **kwargs)
    finally:
        _SIZING.reset(token)
    if sizing.fixed_reason:
        logger.info(
            "PagedWeight: fixed KV pool (%s): SGLang's %d tokens, no elastic KV; the experts serve at their start "
            "bits and keep that memory saving", sizing.fixed_reason, getattr(model_runner, "max_total_num_tokens", 0),
        )
        return result
    if not sizing.max_tokens:
        raise ElasticKVSetupError("SGLang allocated its KV pool without resolving a pool config; cannot size it")
    _install(model_runner, sizing)
    return result


def _install(model_runner: Any, sizing: _Sizing) -> None:
    from pagedweight.kvcache.elastic_kv import ElasticKVCache
    from pagedweight.kvcache.elastic_kv_backing import make_backing

    pool = elastic_part(model_runner.token_to_kv_pool)
    if sizing.device.startswith("cuda") and sizing.owner is None:
        raise ElasticKVSetupError(
            f"elastic KV on CUDA needs a VMM-backed MHA or MLA pool; {type(pool).__name__} was built without it"
        )
    from pagedweight.runtime.paged_runtime import find_runtime

    runtime = find_runtime(model_runner)
    ledger = runtime.ledger if runtime is not None else None  # TP > 1: the fences every rank agrees on
    backing = make_backing(pool, sizing.capacity_tokens, sizing.owner, ledger)
    kv = ElasticKVCache(
        pool,
        model_runner.token_to_kv_pool_allocator,
        capacity_tokens=sizing.capacity_tokens,
        max_tokens=sizing.max_tokens,
        backing=backing,
    )
    if sizing.owner is not None and not getattr(pool, "post_capture_active", False):
        backing.grow_to(sizing.capacity_tokens)  # no post-capture finalize will map it: map the capacity now
    kv.bind_model_runner(model_runner)
    setattr(model_runner, KV_ATTR, kv)
    swa = getattr(model_runner.token_to_kv_pool, "swa_kv_pool", None)
    logger.info(
        "PagedWeight elastic KV: %d tokens usable of %d (+%d parked), %d B/token, backing %s%s",
        kv.capacity_tokens, kv.max_tokens, kv.parked_tokens, kv.bytes_per_token, type(backing).__name__,
        f"; full-attention pool elastic, sliding-window pool fixed at {swa.size} tokens" if swa is not None else "",
    )


def elastic_part(pool: Any) -> Any:
    """The pool the elastic cache grows: the full-attention sub-pool of a hybrid sliding-window pool (SWAKVPool),
    else the pool itself. The full sub-pool must be SGLang's plain MHATokenToKVPool."""
    full = getattr(pool, "full_kv_pool", None)
    if full is None:
        return pool
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if type(full) is not MHATokenToKVPool:
        raise ElasticKVSetupError(
            f"elastic KV cache grows a hybrid pool's plain MHA full-attention pool; this one is {type(full).__name__}"
        )
    return full


def resolve_memory_pool_config_around(original, configurator, *args, **kwargs):
    config = original(configurator, *args, **kwargs)
    sizing = sizing_in_progress()
    if sizing is None or configurator.is_draft_worker:
        return config
    kind = (_swa_variant(configurator) if configurator.is_hybrid_swa
            else "Mamba" if configurator.mambaish_config is not None
            else _mla_variant(configurator) if configurator.use_mla_backend else "")
    if kind:  # the elastic cache grows MHA pools, MLA latent pools and the full part of hybrid SWA pools only
        sizing.fixed_reason = f"the elastic KV cache does not take this model's {kind} KV pool yet"
        return config
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    pool_configurator = create_memory_pool_configurator(configurator)
    if configurator.is_hybrid_swa:  # one more token costs its full-attention layers only
        cell = _full_token_bytes(pool_configurator)
    else:
        cell = getattr(pool_configurator, "_cell_size", None)
    if not cell:
        raise ElasticKVSetupError("cannot read SGLang's KV bytes per token (pool configurator has no cell size)")
    page = configurator.pool_page_size
    start = config.full_max_total_num_tokens if configurator.is_hybrid_swa else config.max_total_num_tokens
    cap = int(start) // page * page
    extra = sizing.extra_tokens if sizing.extra_tokens is not None else sizing.extra_bytes // cell
    extra = extra // page * page
    sizing.capacity_tokens, sizing.max_tokens = cap, cap + extra
    if configurator.is_hybrid_swa:  # the full-attention pool gets the room; the SWA pool keeps SGLang's size
        return dataclasses.replace(config, max_total_num_tokens=cap + extra, full_max_total_num_tokens=cap + extra)
    return dataclasses.replace(config, max_total_num_tokens=cap + extra)


def _full_token_bytes(pool_configurator: Any) -> int:
    """Bytes one full-attention token takes across the full-attention layers of a hybrid sliding-window model
    (HybridSWAPoolConfigurator's per-layer size times its full layers): what one more elastic token costs."""
    per_layer = getattr(pool_configurator, "_full_per_token", None)
    layers = getattr(pool_configurator, "_full_layers_num", None)
    if not per_layer or not layers:
        return 0
    return int(per_layer) * (int(layers) + int(getattr(pool_configurator, "_draft_full_layers_num", 0) or 0))


def _swa_variant(configurator: Any) -> str:
    """'' when SGLang builds a plain SWAKVPool (full-attention and sliding-window MHATokenToKVPool sub-pools) with
    SWATokenToKVPoolAllocator for this hybrid sliding-window model, else the kind of pool it builds instead.
    Gemma-4 sets SGLang's `is_hybrid_swa_compress`, which on CUDA only gives the SWA sub-pool its own head count and
    dims: still a plain SWAKVPool."""
    from sglang.srt.configs.model_config import is_deepseek_v4
    from sglang.srt.runtime_context import get_memory

    model_config = getattr(configurator, "model_config", None)
    if model_config is not None and is_deepseek_v4(model_config.hf_config):
        return "DeepSeek-V4 compressed sliding-window"
    if get_memory().enable_unified_memory:
        return "unified-memory hybrid sliding-window"
    if getattr(configurator, "kv_cache_dtype_str", None) == "mxfp8":
        return "MXFP8 hybrid sliding-window"
    if model_config is not None and not getattr(model_config, "full_attention_layer_ids", None):
        return "all-sliding-window"
    if getattr(configurator, "is_inkling_mtp_draft", False):
        return "draft hybrid sliding-window"
    return ""


def _mla_variant(configurator: Any) -> str:
    """'' when SGLang builds a plain MLATokenToKVPool for this model (KVCacheConfigurator's choice: not a DSA model,
    not an FP4 KV cache), else the kind of MLA pool it builds instead."""
    from sglang.srt.configs.model_config import is_deepseek_dsa
    from sglang.srt.utils.common import is_float4_e2m1fn_x2

    model_config = getattr(configurator, "model_config", None)
    if model_config is not None and is_deepseek_dsa(model_config.hf_config):
        return "DSA (sparse-attention MLA)"
    if is_float4_e2m1fn_x2(getattr(configurator, "kv_cache_dtype", None)):
        return "FP4 MLA latent"
    return ""


def _mla_buffer_descs(pool: Any) -> list:
    """One descriptor per layer's latent buffer [size + page, 1, kv_cache_dim], as MLATokenToKVPool._create_buffers
    shapes it (a row is one token slot)."""
    from sglang.srt.mem_cache.memory_pool import KvBufferDesc

    shape = (pool.size + pool.page_size, 1, pool.kv_cache_dim)
    row = pool.kv_cache_dim * pool.store_dtype.itemsize
    return [KvBufferDesc(f"kv{layer}", shape, row_bytes=row, tokens_per_row=1) for layer in range(pool.layer_num)]


def _vmm_owner(pool: Any, buffer_descs: list) -> Any:
    """A chunk-mapped CUDA VMM owner for `buffer_descs`, reserved for `pool.size` tokens; the sizing keeps it."""
    import torch

    from pagedweight.kvcache.elastic_kv_backing import elastic_vmm_owner_class

    dev = torch.device(pool.device)
    device_id = dev.index if dev.index is not None else torch.cuda.current_device()
    owner = elastic_vmm_owner_class()(
        device=pool.device,
        device_id=device_id,
        store_dtype=pool.store_dtype,
        page_size=pool.page_size,
        reserved_num_tokens=pool.size,
        buffer_descs=buffer_descs,
    )
    sizing_in_progress().owner = owner
    return owner


def _vmm_buffers(pool: Any) -> None:
    """Put the pool's K/V buffers into a chunk-mapped CUDA VMM reservation of `pool.size` tokens."""
    if getattr(pool, "kv_cache_layout", None) == "vectorized_5d":
        raise ElasticKVSetupError("elastic KV cache does not support the vectorized_5d KV layout")
    owner = _vmm_owner(pool, pool._build_kv_buffer_descs())
    pool._post_capture_owner = owner  # SGLang's _clear_buffers closes it, post_capture_backed_bytes reads it
    pool._assign_post_capture_tensors(owner.tensors)


def _vmm_wanted(pool: Any) -> bool:
    """The pool being built belongs to an elastic sizing on CUDA (not a fixed pool's MHA parts, nor the
    sliding-window sub-pool of a hybrid pool, which keeps its size)."""
    sizing = sizing_in_progress()
    return (sizing is not None and not sizing.fixed_reason and str(pool.device).startswith("cuda")
            and getattr(pool, "allocation_label", None) != SWA_SUBPOOL_LABEL)


def mla_create_buffers_around(original, pool, *args, **kwargs):
    """MLATokenToKVPool._create_buffers: the per-layer latent buffers in the chunk-mapped reservation. Subclasses
    (DSA, FP4, unified memory) override _create_buffers and never reach here; the sizing already left them fixed."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    if not _vmm_wanted(pool) or type(pool) is not MLATokenToKVPool:
        return original(pool, *args, **kwargs)
    if getattr(pool, "custom_mem_pool", None) is not None:
        raise ElasticKVSetupError("elastic KV cache does not take an MLA pool in a custom memory pool (PD transfer)")
    pool.kv_buffer = _vmm_owner(pool, _mla_buffer_descs(pool)).tensors


def create_buffers_normal_around(original, pool, *args, **kwargs):
    if not _vmm_wanted(pool):
        return original(pool, *args, **kwargs)
    _vmm_buffers(pool)


def alloc_post_capture_buffers_around(original, pool, *args, **kwargs):
    sizing = sizing_in_progress()
    if sizing is None or sizing.fixed_reason or getattr(pool, "allocation_label", None) == SWA_SUBPOOL_LABEL:
        return original(pool, *args, **kwargs)
    _vmm_buffers(pool)


def post_capture_resize_around(original, model_runner, *args, **kwargs):
    result = original(model_runner, *args, **kwargs)
    kv = getattr(model_runner, KV_ATTR, None)
    if kv is not None:
        kv.rebase(model_runner.max_total_num_tokens)
        logger.info("PagedWeight elastic KV: post-capture capacity %d of %d tokens", kv.capacity_tokens, kv.max_tokens)
    return result


# -- serving --------------------------------------------------------------------------------------------


def scheduler_init_after(result, scheduler, *args, **kwargs):
    kv = getattr(scheduler.tp_worker.model_runner, KV_ATTR, None)
    if kv is not None:
        kv.bind_scheduler(scheduler)
        setattr(scheduler, KV_ATTR, kv)
    return result


def get_next_batch_before(scheduler, *args, **kwargs):
    kv = getattr(scheduler, KV_ATTR, None)
    if kv is not None:
        kv.poll()  # CUDA: unmap parked tail chunks whose fence is done (O(1) when none are pending)
    return None


def handle_resize(scheduler, server_args: dict):
    """set_internal_state with RESIZE_KEY (dispatched by patches/scheduler.py's set_internal_state hook)."""
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    kv = getattr(scheduler, KV_ATTR, None)
    if kv is None or len(server_args) != 1:
        logger.warning(
            "set_internal_state %s: needs an elastic KV cache (--enable-paged-weight) and no other key, got %r",
            RESIZE_KEY, server_args,
        )
        return SetInternalStateReqOutput(updated=False)
    want = int(server_args[RESIZE_KEY])
    got = kv.resize_to(want)
    clamped = min(max(want, kv.min_tokens), kv.max_tokens)
    logger.info("PagedWeight elastic KV: capacity %d requested, now %d tokens", want, got)
    return SetInternalStateReqOutput(updated=got == clamped)


def get_internal_state_after(result, scheduler, *args, **kwargs):
    kv = getattr(scheduler, KV_ATTR, None)
    # The scheduler answers with GetInternalStateReqOutput(internal_state=dict) in 0.5.17.
    state = result if isinstance(result, dict) else getattr(result, "internal_state", None)
    if kv is not None and isinstance(state, dict):
        state[STATE_KEY] = kv.state_dict()
    return result


def register(registry, hook_type) -> None:
    registry.register(f"{MODEL_RUNNER}.alloc_memory_pool", alloc_memory_pool_around, hook_type.AROUND)
    registry.register(f"{MODEL_RUNNER}.post_capture_resize_kv_pool", post_capture_resize_around, hook_type.AROUND)
    registry.register(f"{CONFIGURATOR}._resolve_memory_pool_config", resolve_memory_pool_config_around, hook_type.AROUND)
    registry.register(f"{MHA_POOL}._create_buffers_normal", create_buffers_normal_around, hook_type.AROUND)
    registry.register(f"{MHA_POOL}._alloc_post_capture_buffers", alloc_post_capture_buffers_around, hook_type.AROUND)
    registry.register(f"{MLA_POOL}._create_buffers", mla_create_buffers_around, hook_type.AROUND)
    registry.register(f"{SCHEDULER}.__init__", scheduler_init_after, hook_type.AFTER)
    registry.register(f"{SCHEDULER}.get_next_batch_to_run", get_next_batch_before, hook_type.BEFORE)
    registry.register(f"{SCHEDULER}.get_internal_state", get_internal_state_after, hook_type.AFTER)
