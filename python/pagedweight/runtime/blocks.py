"""Identity of a linear block: one expert projection of one MoE layer.

The runtime concatenates an expert's gate and up projections along N into one block (`w13`, as SGLang's
FusedMoE stores them) and keeps the down projection as another (`w2`). Shared experts are blocks too.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Proj = Literal["w13", "w2"]
PROJS: tuple[Proj, ...] = ("w13", "w2")


class BlockKey(NamedTuple):
    """(layer, expert, proj) of one linear block; sorts by layer, then expert, then w13 before w2."""

    layer: int
    expert: int
    proj: Proj

    def sort_key(self) -> tuple[int, int, int]:
        return (self.layer, self.expert, PROJS.index(self.proj))

    def __str__(self) -> str:
        return f"layer{self.layer}.expert{self.expert}.{self.proj}"


def check_key(key: BlockKey) -> None:
    """Raise a ValueError naming the field when `key` is not a valid block key."""
    if key.proj not in PROJS:
        raise ValueError(f"block proj must be one of {PROJS}, got {key.proj!r}")
    if key.layer < 0 or key.expert < 0:
        raise ValueError(f"block layer and expert must be >= 0, got {key}")
