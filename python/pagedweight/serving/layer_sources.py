"""Layer sources: build a FusedMoE layer's MoELayerStore from an AP checkpoint or from random planes.

`layer_source_for(server_args, cfg)` returns one source per process and AP directory: FusedMoE layers are
constructed one by one, and all of them must read the same opened checkpoint.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pagedweight.config import PagedWeightConfig
from pagedweight.format.layout import DEFAULT_TABLE_KIND, BlockSpec
from pagedweight.serving.moe_method import LayerSource, layer_geometry
from pagedweight.runtime.expert_store import ExpertPlanes, MoELayerStore, ProjectionStore

logger = logging.getLogger(__name__)

# Dummy (random) AP planes: the bit range and group size used when --load-format dummy.
DUMMY_BITS_MIN, DUMMY_BITS_MAX, DUMMY_GROUP = 2, 8, 128

_SOURCES: dict[tuple[str, str], LayerSource] = {}  # per process: (load_format, ap_dir) -> source


def layer_source_for(server_args: Any, cfg: PagedWeightConfig) -> LayerSource:
    load_format = str(getattr(server_args, "load_format", "auto"))
    ap_dir = cfg.resolve_ap_dir(server_args.model_path)
    key = (load_format, ap_dir)
    if key not in _SOURCES:
        if load_format == "dummy":
            _SOURCES[key] = DummyLayerSource(cfg)
        else:
            from pagedweight.serving.checkpoint_source import CheckpointLayerSource

            _SOURCES[key] = CheckpointLayerSource(cfg, ap_dir, server_args)
    return _SOURCES[key]


def dummy_table(table_kind: str, bits: int, n: int, groups: int) -> torch.Tensor:
    """A b-bit table like a fitted binary code of N(0, 0.02) weights (geometric plane scales, offset 0)."""
    if table_kind == "ubcq":  # plane p's scale is t[0] * 2^(b-1-p): the top plane gets 0.02
        t = torch.zeros(2, n, groups, dtype=torch.float16)
        t[0] = 0.02 * 0.5 ** (bits - 1)
        return t
    t = torch.zeros(bits + 1, n, groups, dtype=torch.float16)
    for p in range(bits):
        t[p] = 0.02 * 0.5**p
    return t


def group_size_for(k: int, preferred: int = DUMMY_GROUP) -> int:
    g = preferred
    while g > 8 and k % g:
        g //= 2
    return g


def _pin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host copies are pinned on CUDA machines so reloads can copy asynchronously."""
    return t.pin_memory() if device.type == "cuda" else t


class DummyLayerSource(LayerSource):
    """Random binary-coded planes (the default table kind) at the layer's real shapes (like SGLang's
    --load-format dummy).

    Speed does not depend on weight values, so one random expert per projection is generated and shared
    by every expert's host copy; device planes are allocated per expert, so device memory is real.
    """

    def __init__(self, cfg: PagedWeightConfig):
        self.cfg = cfg

    def _projection(self, name: str, n: int, k: int, experts: int, device: torch.device, seed: int) -> ProjectionStore:
        spec = BlockSpec(n, k, DUMMY_BITS_MIN, DUMMY_BITS_MAX, DEFAULT_TABLE_KIND, group_size_for(k))
        gen = torch.Generator().manual_seed(seed)
        planes = torch.randint(0, 256, spec.planes_shape(), dtype=torch.uint8, generator=gen)
        tables = {b: _pin(dummy_table(spec.table_kind, b, n, spec.num_groups), device) for b in spec.bitwidths}
        shared = ExpertPlanes(_pin(planes, device), tables)
        return ProjectionStore(name, name.rsplit(".", 1)[1], spec, [shared] * experts, device)

    def load_layer(self, layer: torch.nn.Module, device: torch.device) -> MoELayerStore:
        experts, hidden, inter = layer_geometry(layer)
        lid = layer.layer_id
        return MoELayerStore(
            lid,
            self._projection(f"layer{lid}.w13", 2 * inter, hidden, experts, device, seed=2 * lid),
            self._projection(f"layer{lid}.w2", hidden, inter, experts, device, seed=2 * lid + 1),
        )
