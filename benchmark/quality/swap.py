"""Put AP-decoded expert weights into a transformers MoE model in place, one block at a time.

The model's fused experts (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, see
pagedweight.planner.moe_capture) are overwritten with `W^b` decoded from an AP checkpoint. Each
(table kind, tensor, bitwidth) is decoded once and kept (float32); blocks already at the requested
bitwidth are not rewritten, so moving between nearby assignments is cheap.
"""

from __future__ import annotations

from typing import Mapping

import torch

from pagedweight.format.checkpoint import APCheckpoint
from pagedweight.format.layout import BlockSpec, dequantize
from pagedweight.planner.moe_capture import find_moe_layers
from pagedweight.runtime.blocks import BlockKey

FULL = 0  # bitwidth label of the unquantized (bf16 checkpoint) weights

Assignment = Mapping[BlockKey, int]  # block -> bits (FULL = original weights)


def runtime_blocks(ckpt: APCheckpoint) -> list[tuple[BlockKey, BlockSpec]]:
    """Page-table rows of a checkpoint's routed experts: w13 = gate || up along N, w2 = down."""
    out = []
    for layer in ckpt.layers():
        for e in ckpt.experts(layer):
            if not isinstance(e, int):
                continue  # shared experts run outside FusedMoE: not page-table rows
            g = ckpt.spec(ckpt.name_of(layer, e, "gate"))
            out.append((BlockKey(layer, e, "w13"),
                        BlockSpec(2 * g.out_features, g.in_features, g.bits_min, g.bits_max, g.table_kind, g.group_size)))
            out.append((BlockKey(layer, e, "w2"), ckpt.spec(ckpt.name_of(layer, e, "down"))))
    return out


class ExpertBank:
    """Decoded weights of one or more AP checkpoints of the same model, and the swap into the model."""

    def __init__(self, model: torch.nn.Module, checkpoints: Mapping[str, APCheckpoint]) -> None:
        self.model = model
        self.checkpoints = dict(checkpoints)
        self.layers = {ref.layer: ref for ref in find_moe_layers(model)}
        self._original = {l: (r.module.gate_up_proj.detach().clone(), r.module.down_proj.detach().clone())
                          for l, r in self.layers.items()}
        self._cache: dict[tuple[str, str, int], torch.Tensor] = {}
        self._current: dict[BlockKey, tuple[str, int]] = {}  # absent = original weights

    def decoded(self, kind: str, name: str, bits: int) -> torch.Tensor:
        key = (kind, name, bits)
        w = self._cache.get(key)
        if w is None:
            ckpt = self.checkpoints[kind]
            spec = ckpt.spec(name)
            w = dequantize(ckpt.planes(name, bits), ckpt.table(name, bits), bits, spec.table_kind,
                           spec.group_size).float()
            self._cache[key] = w
        return w

    def weight(self, kind: str, key: BlockKey, bits: int) -> torch.Tensor:
        ckpt = self.checkpoints[kind]
        if key.proj == "w13":
            return torch.cat([self.decoded(kind, ckpt.name_of(key.layer, key.expert, p), bits) for p in ("gate", "up")])
        return self.decoded(kind, ckpt.name_of(key.layer, key.expert, "down"), bits)

    @torch.no_grad()
    def apply(self, assignment: Assignment, kind: str = "bcq") -> None:
        """Set every listed block to its bitwidth (FULL: original weights); unlisted blocks go back to FULL."""
        wanted = {BlockKey(*k): (kind, int(b)) for k, b in assignment.items() if int(b) != FULL}
        for key in set(self._current) | set(wanted):
            target = wanted.get(key)
            if self._current.get(key) == target:
                continue
            ref = self.layers[key.layer]
            param = ref.module.gate_up_proj if key.proj == "w13" else ref.module.down_proj
            if target is None:
                orig = self._original[key.layer][0 if key.proj == "w13" else 1]
                param[key.expert].copy_(orig[key.expert])
                del self._current[key]
            else:
                param[key.expert].copy_(self.weight(target[0], key, target[1]).to(param.dtype))
                self._current[key] = target

    def restore(self) -> None:
        self.apply({})
