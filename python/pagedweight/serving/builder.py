"""The one builder of PagedWeight's runtime; the hooks only gather the views it reads and call `step`.

Two moments of SGLang's start-up, one builder:

- `build_weights` (patches/model_runner.py, after load_model, before SGLang sizes its KV cache): the page table,
  plane arena, budget (the weights' share) and pager with its final fences and copier; under TP > 1 both go
  through the FenceLedger every rank agrees on, which the KV backing's fences share (patches/kv_cache.py).
  The committed planes are loaded here, so their bytes are taken when SGLang measures free memory.
- `build_serving` (patches/scheduler.py, after Scheduler.__init__), from a `SchedulerView`: the KV side of the
  budget (`PagedRuntime.link_kv`, the budget's one owner), the pressure signal, the policy, the controller, the
  metrics and the TP agreement, returned as the PagedWeightScheduler whose `step` runs every iteration.

Nothing here imports SGLang: the views are plain values the hooks read off SGLang's objects.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedweight.config import PagedWeightConfig
from pagedweight.planner import registry as policy_registry
from pagedweight.planner.choice import PolicyChoice, choose_policy
from pagedweight.planner.registry import PolicyInputs
from pagedweight.runtime.controller import PagingController
from pagedweight.runtime.expert_store import MoELayerStore
from pagedweight.runtime.fence_ledger import FenceLedger
from pagedweight.runtime.paged_runtime import PagedRuntime
from pagedweight.runtime.planner_api import Policy
from pagedweight.runtime.pressure import KVPressureSignal
from pagedweight.runtime.tp_sync import make_tp_sync
from pagedweight.serving.serving_loop import PagedWeightScheduler

logger = logging.getLogger("pagedweight")


@dataclass(frozen=True)
class TpView:
    """The TP group's facts (SGLang's GroupCoordinator)."""

    world_size: int
    rank_in_group: int
    first_rank: int  # the global rank of the group's first member: the source rank of every agreement
    cpu_group: Any


@dataclass(frozen=True)
class SchedulerView:
    """What the serving side reads off SGLang's scheduler, once, after its __init__."""

    page_size: int
    max_total_num_tokens: int
    kv_bytes_per_token: int  # across every layer's K and V buffers (kv_bytes_per_token below)
    load_format: Any
    model_path: str
    enable_metrics: bool = False
    tp_rank: int = 0
    tp: Optional[TpView] = None
    forward_stream: Any = None  # where step() enqueues its device work (None without CUDA)
    # The most KV blocks one iteration may allocate (serving_loop.iteration_blocks); 0: unknown, TP exchanges
    # every iteration (no quiet windows)
    blocks_per_iteration: int = 0


def build_weights(cfg: PagedWeightConfig, stores: list[MoELayerStore], device: torch.device,
                  tp_world_size: int = 1) -> PagedRuntime:
    """The weights side, built and loaded (drained) at load time. Under TP the ledger numbers nothing until
    `build_serving` starts it: the load-time drain waits on the device blockingly, which needs no agreement."""
    ledger = FenceLedger(started=False) if tp_world_size > 1 else None
    return PagedRuntime.build(cfg, stores, device, ledger=ledger)


def build_serving(view: SchedulerView, runtime: PagedRuntime, kv: Any = None) -> PagedWeightScheduler:
    """Everything the per-iteration step needs, wired once. `kv` is the elastic KV cache (None: SGLang's pool is
    fixed, patches/kv_cache.py)."""
    cfg = runtime.cfg
    page = view.page_size
    capacity_blocks = view.max_total_num_tokens // page
    low = max(1, math.ceil(cfg.kv_low_watermark * capacity_blocks))
    high = max(low + 1, math.ceil(cfg.kv_high_watermark * capacity_blocks))
    signal = KVPressureSignal(low, view.kv_bytes_per_token * page, high)
    runtime.link_kv(kv, view.max_total_num_tokens * view.kv_bytes_per_token)
    ap_dir = None if view.load_format == "dummy" else cfg.resolve_ap_dir(view.model_path)
    policy, line = serving_policy(cfg, ap_dir, runtime, fixed_kv=kv is None)
    logger.info(line)
    controller = PagingController(
        runtime.pager, policy, signal, kv=kv, reload_headroom_bytes=runtime.reload_headroom_bytes
    )
    logger.info(
        "PagedWeight: policy %s, KV %d tokens x %d B/token, offload below %d free blocks, reload above %d",
        type(policy).__name__, view.max_total_num_tokens, view.kv_bytes_per_token, low, high,
    )
    metrics = None
    if view.enable_metrics:
        from pagedweight.serving.metrics import PagedWeightMetrics

        metrics = PagedWeightMetrics(tp_rank=view.tp_rank)
    tp_sync = None
    tp = view.tp
    if tp is not None and tp.world_size > 1:
        if runtime.ledger is None:
            raise RuntimeError(f"TP {tp.world_size}: the runtime was built without a fence ledger (build_weights "
                               "needs the model runner's TP size); its ranks' fences could not be agreed")
        tp_sync = make_tp_sync(runtime.pager, kv, runtime.ledger, tp.cpu_group, tp.first_rank, tp.rank_in_group == 0)
        logger.info("PagedWeight: TP %d, decisions and fence completions agreed on the TP CPU group", tp.world_size)
    return PagedWeightScheduler(runtime, controller, page, capacity_blocks, view.forward_stream, metrics, tp_sync,
                                queue_aware=cfg.queue_aware, blocks_per_iteration=view.blocks_per_iteration)


def make_runtime_policy_choice(cfg: PagedWeightConfig, ap_dir: Optional[str],
                               runtime: Optional[PagedRuntime] = None) -> tuple[Policy, PolicyChoice]:
    """The policy named by --paged-weight-policy ('auto': planner/choice.py), built by the registry
    (planner/registry.py), and which floor it plans above, and why; for 'quality' also a RoutingObserver that
    every MoE layer's forward feeds (routing weights and routed-input norms, on the device)."""
    choice = choose_policy(cfg.policy, ap_dir)
    inputs = PolicyInputs(ap_dir=ap_dir, runtime=runtime, calibration=choice.calibration, floor_bits=cfg.floor_bits)
    policy, floor = policy_registry.POLICY_REGISTRY.build(choice.name, inputs)
    return policy, choice.with_floor(floor)


def serving_policy(cfg: PagedWeightConfig, ap_dir, runtime: PagedRuntime, *, fixed_kv: bool) -> tuple[Policy, str]:
    """The policy a server runs and its startup line. A fixed KV pool (patches/kv_cache.py: a pool kind the
    elastic cache does not take) gets the static policy: bytes a lower bitwidth frees could not reach it, so no
    plan may lower one."""
    if fixed_kv:
        from pagedweight.planner.static_policy import StaticPolicy

        return StaticPolicy(), "PagedWeight: policy static (the KV pool is fixed: freed weight bytes could not reach it)"
    policy, choice = make_runtime_policy_choice(cfg, ap_dir, runtime)
    return policy, choice.log_line()


def kv_bytes_per_token(kv_cache: Any) -> int:
    """Bytes one token occupies across every layer's K and V buffers of SGLang's KV pool. A hybrid sliding-window
    pool (SWAKVPool: Gemma-4) writes every new token into both its full-attention and its sliding-window pools, so
    its token costs the sum of theirs."""
    parts = [getattr(kv_cache, name, None) for name in ("full_kv_pool", "swa_kv_pool")]
    if all(part is not None for part in parts):
        return sum(kv_bytes_per_token(part) for part in parts)
    from pagedweight.kvcache.elastic_kv_backing import kv_buffers

    try:
        bufs = kv_buffers(kv_cache)
    except TypeError as e:
        raise RuntimeError(f"cannot measure bytes per token of KV pool {type(kv_cache).__name__}: {e}") from None
    return sum(b[0].numel() * b.element_size() for b in bufs)
