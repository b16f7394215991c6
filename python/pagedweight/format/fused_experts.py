"""Per-expert blocks of fused 3-D expert tensors (Gemma-4's `experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]).

The AP format keeps one block per (layer, expert, proj), named like a per-expert weight; a fused source tensor
is split here into those blocks, each read on its own through a safetensors slice (one expert's rows, never the
whole [E, ...] tensor), so converting a 128-expert layer reads each byte of the source once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.format.arch import ArchAdapter, BlockKey

# fused tensor kind -> the projections it holds, in row order (transformers: gate, up = (x @ gate_up[e].T).chunk(2))
FUSED_PARTS: dict[str, tuple[str, ...]] = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
_HF_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class FusedSlice:
    """One expert's projection inside a fused tensor: `stored[expert]`, the gate or up half of its rows, or all of it."""

    stored: str  # the fused tensor's name in the source
    expert: int
    proj: str  # gate, up or down
    rows: int  # rows of this projection (I for gate / up, H for down)
    cols: int  # its in_features

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def read(self, f) -> torch.Tensor:
        """The [N, K] weight from an open safetensors file `f` (only this slice is read)."""
        part = FUSED_PARTS["down_proj" if self.proj == "down" else "gate_up_proj"].index(self.proj)
        return f.get_slice(self.stored)[self.expert, part * self.rows:(part + 1) * self.rows]


def split_fused(adapter: ArchAdapter, name: str, shape: list[int], num_experts: int) -> dict[str, tuple[FusedSlice, BlockKey]]:
    """{per-expert weight name: (slice, block key)} of the fused tensor `name`; {} when `name` is not a fused expert
    tensor of this family. ValueError (one line) when its shape does not hold `num_experts` experts."""
    m = adapter.fused.fullmatch(name) if adapter.fused is not None else None
    if m is None:
        return {}
    layer, kind = int(m[1]), m[2]
    parts = FUSED_PARTS[kind]
    if len(shape) != 3 or shape[0] != num_experts or shape[1] % len(parts):
        raise ValueError(
            f"{name}: shape {shape}, expected [{num_experts} experts, {'2 x intermediate' if len(parts) == 2 else 'hidden'}, "
            f"in_features] (config.json says {num_experts} experts)"
        )
    rows = shape[1] // len(parts)
    prefix = name.removesuffix(f".{kind}")
    out = {}
    for e in range(num_experts):
        for proj in parts:
            per_expert = f"{prefix}.{e}.{_HF_PROJ[proj]}.weight"
            key = adapter.classify(per_expert)
            if key != BlockKey(layer, e, proj):
                raise ValueError(f"{name}: its per-expert name {per_expert!r} is not one the {adapter.model_type} adapter reads")
            out[per_expert] = (FusedSlice(name, e, proj, rows, shape[2]), key)
    return out
