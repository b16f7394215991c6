"""Small random expert stores (real ProjectionStore/MoELayerStore objects) for runtime tests without a model."""

from __future__ import annotations

import torch


def random_layer_stores(layers: int, experts: int, seed: int = 0) -> list:
    """`layers` MoE layers of `experts` experts, w13 64x32 and w2 32x32, bcq planes 2..8 bits, on the CPU."""
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
                    torch.randint(0, 256, spec.planes_shape(), dtype=torch.uint8, generator=g),
                    {b: torch.randn(spec.table_shape(b), generator=g).half() for b in spec.bitwidths},
                )
                for _ in range(experts)
            ]
            projs.append(ProjectionStore(f"layer{layer}.{proj}", proj, spec, host, torch.device("cpu")))
        stores.append(MoELayerStore(layer, *projs))
    return stores
