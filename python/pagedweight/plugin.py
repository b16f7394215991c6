"""SGLang plugin entry point (group `sglang.srt.plugins`): registers PagedWeight's hooks.

SGLang calls `register()` once per process (launcher, every scheduler/TP process, the offline Engine),
then applies the hooks. Each hook is inert unless --enable-paged-weight is set.
"""

from __future__ import annotations


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from pagedweight.patches import fused_moe, kv_cache, linear, model_runner, scheduler, server_args

    server_args.register(HookRegistry, HookType)
    fused_moe.register(HookRegistry, HookType)
    linear.register(HookRegistry, HookType)
    model_runner.register(HookRegistry, HookType)
    kv_cache.register(HookRegistry, HookType)  # before scheduler: its __init__ hook reads _paged_weight_kv
    scheduler.register(HookRegistry, HookType)
