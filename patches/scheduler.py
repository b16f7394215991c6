"""Scheduler integration: the per-iteration PagedWeight step and its state in /get_server_info.

- after Scheduler.__init__: attach a PagedWeightScheduler (pressure signal, policy, pager) when the model
  runner started a PagedWeight runtime;
- before Scheduler.get_next_batch_to_run: one step (the safe boundary, see python/pagedweight/serving_loop.py);
- after Scheduler.get_internal_state: add the runtime's state under "paged_weight", so SGLang's
  `/get_server_info` reports committed bitwidths, bytes in weights/KV/free and transitions.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("pagedweight")

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
ATTR = "_paged_weight"


def init_after(result, scheduler, *args, **kwargs):
    from pagedweight.paged_runtime import find_runtime
    from pagedweight.serving_loop import PagedWeightScheduler

    runtime = find_runtime(scheduler.tp_worker.model_runner)
    if runtime is not None:
        kv = getattr(scheduler, "_paged_weight_kv", None)  # set by the elastic KV hooks when present
        setattr(scheduler, ATTR, PagedWeightScheduler.attach(scheduler, runtime, kv))
    return result


def get_next_batch_before(scheduler, *args, **kwargs):
    state = getattr(scheduler, ATTR, None)
    if state is not None:
        state.step(scheduler)
    return None


def get_internal_state_after(result, scheduler, *args, **kwargs):
    state = getattr(scheduler, ATTR, None)
    if state is not None:
        result.internal_state["paged_weight"] = state.state()
    return result


def register(registry, hook_type) -> None:
    registry.register(f"{SCHEDULER}.__init__", init_after, hook_type.AFTER)
    registry.register(f"{SCHEDULER}.get_next_batch_to_run", get_next_batch_before, hook_type.BEFORE)
    registry.register(f"{SCHEDULER}.get_internal_state", get_internal_state_after, hook_type.AFTER)
