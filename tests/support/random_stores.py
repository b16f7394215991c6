"""Small random expert stores (real ProjectionStore/MoELayerStore objects) for runtime tests without a model."""

from __future__ import annotations

import torch


def random_layer_stores(layers: int, experts: int, seed: int = 0, device: torch.device = torch.device("cpu")) -> list:
    """`layers` MoE layers of `experts` experts, w13 64x32 and w2 32x32, bcq planes 2..8 bits; host copies on
    the CPU (pinned when `device` is CUDA), page tables on `device`."""
    from pagedweight.format.layout import BlockSpec
    from pagedweight.runtime.expert_store import ExpertPlanes, MoELayerStore, ProjectionStore

    g = torch.Generator().manual_seed(seed)
    stores = []
    for layer in range(layers):
        projs = []
        for proj, (n, k) in (("w13", (64, 32)), ("w2", (32, 32))):
            spec = BlockSpec(n, k, 2, 8, "bcq", 32)
            host = [
                ExpertPlanes(
                    _pin(torch.randint(0, 256, spec.planes_shape(), dtype=torch.uint8, generator=g), device),
                    {b: _pin(torch.randn(spec.table_shape(b), generator=g).half(), device) for b in spec.bitwidths},
                )
                for _ in range(experts)
            ]
            projs.append(ProjectionStore(f"layer{layer}.{proj}", proj, spec, host, device))
        stores.append(MoELayerStore(layer, *projs))
    return stores


def _pin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory() if device.type == "cuda" else t
