"""ModelRunner integration: after the model is loaded, collect every paged-weight MoE layer and report.

The startup log states what the experts cost in device memory at their committed bitwidths, next to what
bf16 experts would have cost, so a user can see the saving before serving starts.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("pagedweight")

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"


def collect_layer_stores(model: torch.nn.Module) -> list:
    stores = [m._paged_weight_store for m in model.modules() if getattr(m, "_paged_weight_store", None) is not None]
    return sorted(stores, key=lambda s: s.layer_id)


def load_model_after(result, model_runner, *args, **kwargs):
    from pagedweight.patches.server_args import get_config

    cfg = get_config(model_runner.server_args)
    if not cfg.enable:
        return result
    stores = collect_layer_stores(model_runner.model)
    if not stores:
        raise RuntimeError(
            "--enable-paged-weight: the model was loaded but no FusedMoE layer uses the paged-weight method; "
            "this model's MoE layers are not built on SGLang's FusedMoE"
        )
    model_runner._paged_weight_stores = stores
    logger.info(summary_line(stores))
    return result


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def summary_line(stores: list) -> str:
    resident = sum(s.resident_bytes() for s in stores)
    bf16 = sum(s.bf16_bytes() for s in stores)
    blocks = sum(s.w13.num_experts + s.w2.num_experts for s in stores)
    bits = sorted({b for s in stores for p in (s.w13, s.w2) for b in p.committed})
    host = sum(s.w13.host_bytes() + s.w2.host_bytes() for s in stores)
    return (
        f"PagedWeight: {len(stores)} MoE layers, {blocks} expert blocks at {'/'.join(map(str, bits))} bits; "
        f"expert weights on device {format_bytes(resident)} (bf16 would be {format_bytes(bf16)}, "
        f"{resident / max(bf16, 1):.1%}); parent planes in host memory {format_bytes(host)}"
    )


def register(registry, hook_type) -> None:
    registry.register(TARGET, load_model_after, hook_type.AFTER)
