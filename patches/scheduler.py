"""Scheduler integration: the per-iteration PagedWeight step and its state in /get_server_info.

- after Scheduler.__init__: when the model runner started a PagedWeight runtime, gather a SchedulerView and
  let the builder (python/pagedweight/serving/builder.py) wire the PagedWeightScheduler (KV side of the
  budget, pressure signal, policy, controller, TP agreement);
- before Scheduler.get_next_batch_to_run: one step (the safe boundary, see python/pagedweight/serving/serving_loop.py);
- after Scheduler.get_internal_state: add the runtime's state under "paged_weight", so SGLang's
  `/get_server_info` reports committed bitwidths, bytes in weights/KV/free and transitions;
- around Scheduler.set_internal_state: the elastic KV resize (patches/kv_cache.py), and `POST
  /set_internal_state {"server_args": {"paged_weight_hold_reloads": 1}}` holds the current plan (no reloads, no KV shrink; offloads under
  pressure still run), `0` releases it. Every TP rank receives the request; rank 0's value is what the
  ranks act on (tp_sync.StepInputs).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("pagedweight")

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
ATTR = "_paged_weight"


def init_after(result, scheduler, *args, **kwargs):
    from pagedweight.runtime.paged_runtime import find_runtime
    from pagedweight.serving.builder import build_serving

    runtime = find_runtime(scheduler.tp_worker.model_runner)
    if runtime is not None:
        kv = getattr(scheduler, "_paged_weight_kv", None)  # set by the elastic KV hooks when present
        setattr(scheduler, ATTR, build_serving(scheduler_view(scheduler, kv), runtime, kv))
    return result


def scheduler_view(scheduler, kv=None):
    """The builder's view of SGLang's scheduler. With an elastic KV cache `kv`, a token costs what one more of its
    slots costs (for a hybrid sliding-window pool: its full-attention part, the part that grows)."""
    import torch

    from pagedweight.serving.builder import SchedulerView, TpView, kv_bytes_per_token
    from pagedweight.serving.serving_loop import iteration_blocks

    group = getattr(scheduler, "tp_group", None)
    tp = None if group is None else TpView(group.world_size, group.rank_in_group, group.first_rank, group.cpu_group)
    args = scheduler.server_args
    return SchedulerView(
        page_size=scheduler.page_size,
        max_total_num_tokens=scheduler.max_total_num_tokens,
        kv_bytes_per_token=(kv.bytes_per_token if kv is not None
                            else kv_bytes_per_token(scheduler.token_to_kv_pool_allocator.get_kvcache())),
        load_format=args.load_format,
        model_path=args.model_path,
        enable_metrics=bool(getattr(args, "enable_metrics", False)),
        tp_rank=getattr(scheduler, "tp_rank", 0),
        tp=tp,
        forward_stream=getattr(scheduler, "forward_stream", None) if torch.cuda.is_available() else None,
        blocks_per_iteration=iteration_blocks(
            getattr(scheduler, "chunked_prefill_size", None), getattr(scheduler, "max_running_requests", None),
            scheduler.page_size, _tokens_per_request(args)),
    )


def _tokens_per_request(args) -> int:
    """KV tokens one running request may take per iteration: 1, or with speculative decoding its draft tokens or
    draft tree (steps x top-k), doubled as a margin for the draft model's own KV writes."""
    if getattr(args, "speculative_algorithm", None):
        steps = int(getattr(args, "speculative_num_steps", None) or 0) + 1
        topk = int(getattr(args, "speculative_eagle_topk", None) or 1)
        return max(1, int(getattr(args, "speculative_num_draft_tokens", None) or 0), steps * topk) * 2
    return 1


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


HOLD_KEY = "paged_weight_hold_reloads"  # SetInternalStateReq takes numeric values only


def set_internal_state_around(original, scheduler, recv_req, *args, **kwargs):
    """PagedWeight's operator keys (the elastic KV resize and the reload hold); anything else is SGLang's."""
    from pagedweight.patches import kv_cache

    server_args = getattr(recv_req, "server_args", None) or {}
    if kv_cache.RESIZE_KEY in server_args:
        return kv_cache.handle_resize(scheduler, server_args)
    if HOLD_KEY not in server_args:
        return original(scheduler, recv_req, *args, **kwargs)
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    state = getattr(scheduler, ATTR, None)
    if state is None or len(server_args) != 1:
        logger.warning(
            "set_internal_state %s: needs --enable-paged-weight and no other key, got %r", HOLD_KEY, server_args
        )
        return SetInternalStateReqOutput(updated=False)
    state.reloads_held = bool(int(server_args[HOLD_KEY]))
    logger.info("PagedWeight: reloads %s by set_internal_state", "held" if state.reloads_held else "released")
    return SetInternalStateReqOutput(updated=True)


def register(registry, hook_type) -> None:
    registry.register(f"{SCHEDULER}.__init__", init_after, hook_type.AFTER)
    registry.register(f"{SCHEDULER}.get_next_batch_to_run", get_next_batch_before, hook_type.BEFORE)
    registry.register(f"{SCHEDULER}.get_internal_state", get_internal_state_after, hook_type.AFTER)
    registry.register(f"{SCHEDULER}.set_internal_state", set_internal_state_around, hook_type.AROUND)
