"""ModelRunner integration: after the model is loaded, build the PagedWeight runtime's weights side and report.

The builder (python/pagedweight/serving/builder.py, `build_weights`) loads every expert block's committed
planes into the plane arena before SGLang measures free memory for its KV cache. The startup log states what
the experts cost on the device at their committed bitwidths next to what bf16 experts would cost, so a user
sees the saving before serving starts.
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
    from pagedweight.serving.builder import build_weights

    cfg = get_config(model_runner.server_args)
    if not cfg.enable:
        return result
    stores = collect_layer_stores(model_runner.model)
    if not stores:
        raise RuntimeError(
            "--enable-paged-weight: the model was loaded but no FusedMoE layer uses the paged-weight method; "
            "this model's MoE layers are not built on SGLang's FusedMoE"
        )
    if str(model_runner.server_args.load_format) == "dummy":
        from pagedweight.serving.dummy_weights import unit_norm_weights

        n = unit_norm_weights(model_runner.model)
        logger.info(
            "PagedWeight: --load-format dummy: %d RMSNorm weights set to 1 (SGLang's +-1e-3 would hide the "
            "experts' bitwidths from the logits; python/pagedweight/serving/dummy_weights.py)", n
        )
    device = stores[0].w13.page_table.device
    group = getattr(model_runner, "tp_group", None)  # SGLang's TP GroupCoordinator (the scheduler's too)
    runtime = build_weights(cfg, stores, device, tp_world_size=group.world_size if group is not None else 1)
    model_runner._paged_weight_runtime = runtime
    logger.info(summary_line(runtime))
    if cfg.scope == "all":
        logger.info(dense_summary_line(model_runner.model))
    return result


def dense_summary_line(model: torch.nn.Module) -> str:
    """What --paged-weight-scope all serves from AP, and which linears stay bf16."""
    dense = [m._paged_weight_dense for m in model.modules() if getattr(m, "_paged_weight_dense", None) is not None]
    if not dense:
        raise RuntimeError(
            "--paged-weight-scope all: no dense linear of this model has AP blocks in the checkpoint; convert "
            "with `pagedweight convert --dense-linears` (or serve with --paged-weight-scope experts)"
        )
    from sglang.srt.layers.linear import LinearBase

    kept = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, LinearBase) and getattr(m, "_paged_weight_dense", None) is None})
    resident = sum(d.device_bytes for d in dense)
    bf16 = sum(d.bf16_bytes for d in dense)
    bits = sorted({d.bits for d in dense})
    lm_head = "lm_head from AP" if any(d.prefix.endswith("lm_head") for d in dense) else \
        "lm_head bf16 (tied to the embeddings, or not in the checkpoint)"
    return (
        f"PagedWeight: scope all: {len(dense)} dense linears at {'/'.join(map(str, bits))} bits (fixed) on device "
        f"{format_bytes(resident)} (bf16 would be {format_bytes(bf16)}, {resident / max(bf16, 1):.1%}); "
        f"linears kept in bf16: {', '.join(kept) or 'none'}; {lm_head}; embeddings stay bf16"
    )


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def summary_line(runtime) -> str:
    stores = runtime.stores
    resident = runtime.weight_bytes()
    bf16 = sum(s.bf16_bytes() for s in stores)
    hist = runtime.committed_bits_histogram()
    host = sum(s.host_bytes() for s in stores)
    return (
        f"PagedWeight: {len(stores)} MoE layers, {len(runtime.table)} expert blocks at "
        f"{'/'.join(map(str, hist))} bits; expert weights on device {format_bytes(resident)} (bf16 would be "
        f"{format_bytes(bf16)}, {resident / max(bf16, 1):.1%}); at the floor bitwidths "
        f"{format_bytes(runtime.bytes_at_floor())}; parent planes in host memory {format_bytes(host)}"
    )


def register(registry, hook_type) -> None:
    registry.register(TARGET, load_model_after, hook_type.AFTER)
