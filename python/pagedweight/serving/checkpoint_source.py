"""Build a FusedMoE layer's plane store from an AP checkpoint.

Per routed expert e of layer l: w13 = gate || up concatenated along N (SGLang's w13 layout), w2 = down.
With tensor parallelism each rank keeps its shard: gate/up rows [r * I_p, (r + 1) * I_p) and down's input
columns [r * I_p, (r + 1) * I_p) (a byte range of every plane and a group range of every bcq table).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pagedweight.config import PagedWeightConfig
from pagedweight.format.checkpoint import APCheckpoint
from pagedweight.format.layout import BlockSpec, is_grouped
from pagedweight.serving.moe_method import LayerSource, layer_geometry
from pagedweight.runtime.expert_store import ExpertPlanes, MoELayerStore, ProjectionStore

logger = logging.getLogger(__name__)


class CheckpointLayerSource(LayerSource):
    def __init__(self, cfg: PagedWeightConfig, ap_dir: str, server_args: Any):
        self.cfg = cfg
        self.ckpt = APCheckpoint.open(ap_dir)

    def load_layer(self, layer: torch.nn.Module, device: torch.device) -> MoELayerStore:
        experts, hidden, inter_p = layer_geometry(layer)
        if getattr(layer, "moe_ep_size", 1) != 1:
            raise ValueError("PagedWeight does not support expert parallelism (--ep-size > 1) yet; use --tp")
        if getattr(layer, "num_fused_shared_experts", 0):
            raise ValueError("PagedWeight does not support fused shared experts; start with shared-expert fusion off")
        tp_rank, tp_size = getattr(layer, "moe_tp_rank", 0), getattr(layer, "moe_tp_size", 1)
        lid = layer.layer_id
        pin = device.type == "cuda"
        w13_host, w2_host = [], []
        w13_spec = w2_spec = None
        for e in range(experts):
            gate, up, down = (self.ckpt.name_of(lid, e, p) for p in ("gate", "up", "down"))
            g_spec, d_spec = self.ckpt.spec(gate), self.ckpt.spec(down)
            if g_spec.in_features != hidden or d_spec.out_features != hidden or g_spec.out_features != inter_p * tp_size:
                raise ValueError(
                    f"AP block {gate!r} has shape {g_spec.out_features}x{g_spec.in_features}, but SGLang's layer {lid} "
                    f"expects intermediate {inter_p * tp_size} x hidden {hidden}: the AP checkpoint is for another model"
                )
            rows = slice(tp_rank * inter_p, (tp_rank + 1) * inter_p)
            w13_host.append(self._w13(gate, up, rows, pin))
            w2_host.append(self._w2(down, d_spec, tp_rank, inter_p, pin))
            w13_spec = BlockSpec(2 * inter_p, hidden, g_spec.bits_min, g_spec.bits_max, g_spec.table_kind, g_spec.group_size)
            w2_spec = BlockSpec(hidden, inter_p, d_spec.bits_min, d_spec.bits_max, d_spec.table_kind, d_spec.group_size)
        return MoELayerStore(
            lid,
            ProjectionStore(f"layer{lid}.w13", "w13", w13_spec, w13_host, device),
            ProjectionStore(f"layer{lid}.w2", "w2", w2_spec, w2_host, device),
        )

    def _w13(self, gate: str, up: str, rows: slice, pin: bool) -> ExpertPlanes:
        kind = self.ckpt.table_kind
        planes = torch.cat([self.ckpt.planes(gate)[:, rows], self.ckpt.planes(up)[:, rows]], dim=1).contiguous()
        tables = {}
        for b in self.ckpt.bitwidths:
            g, u = self.ckpt.table(gate, b), self.ckpt.table(up, b)
            grouped = is_grouped(kind)  # bcq [b+1, N, G], ubcq [2, N, G], kmeans [N, 2^b]
            dim = 1 if grouped else 0
            g = g[:, rows] if grouped else g[rows]
            u = u[:, rows] if grouped else u[rows]
            tables[b] = _maybe_pin(torch.cat([g, u], dim=dim).contiguous(), pin)
        return ExpertPlanes(_maybe_pin(planes, pin), tables)

    def _w2(self, down: str, spec: BlockSpec, tp_rank: int, inter_p: int, pin: bool) -> ExpertPlanes:
        kind = self.ckpt.table_kind
        if spec.in_features == inter_p:
            planes = self.ckpt.planes(down)
            tables = {b: self.ckpt.table(down, b) for b in self.ckpt.bitwidths}
        else:
            if inter_p % 8 or (is_grouped(kind) and inter_p % spec.group_size):
                raise ValueError(
                    f"{down!r}: intermediate shard {inter_p} is not a multiple of 8 and of the group size "
                    f"{spec.group_size}; use a smaller --tp or reconvert with a smaller --group-size"
                )
            byte_cols = slice(tp_rank * inter_p // 8, (tp_rank + 1) * inter_p // 8)
            planes = self.ckpt.planes(down)[:, :, byte_cols]
            if is_grouped(kind):
                groups = slice(tp_rank * inter_p // spec.group_size, (tp_rank + 1) * inter_p // spec.group_size)
                tables = {b: self.ckpt.table(down, b)[:, :, groups] for b in self.ckpt.bitwidths}
            else:  # a k-means LUT is per output row: every input shard shares it
                tables = {b: self.ckpt.table(down, b) for b in self.ckpt.bitwidths}
        return ExpertPlanes(
            _maybe_pin(planes.contiguous(), pin), {b: _maybe_pin(t.contiguous(), pin) for b, t in tables.items()}
        )


def _maybe_pin(t: torch.Tensor, pin: bool) -> torch.Tensor:
    return t.pin_memory() if pin else t
