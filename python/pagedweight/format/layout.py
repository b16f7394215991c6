"""Bit-plane layout of one AP linear block and its torch reference dequantization.

This module is the contract between the converter, the runtime and the kernels (docs/format.md).
Everything here is plain torch and runs on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

TableKind = Literal["bcq", "kmeans", "ubcq"]
TABLE_KINDS: tuple[str, ...] = ("bcq", "kmeans", "ubcq")
PLANE_DTYPE = torch.uint8
TABLE_DTYPE = torch.float16
# What `pagedweight convert` writes unless told otherwise, and what --load-format dummy serves: at equal bytes
# ubcq fits Gaussian, heavy-tailed and trained weights better than bcq at group 32 and 128, and its decode
# kernels read fewer table bytes (docs/results/quality.md, docs/results/kernel.md "Run 13").
DEFAULT_TABLE_KIND = "ubcq"
# Kinds whose tables are per (row, input group) and whose planes are +-1 signs: [rows, N, K // G] tables.
GROUPED_KINDS: tuple[str, ...] = ("bcq", "ubcq")


def is_grouped(table_kind: str) -> bool:
    """True for the binary-coded kinds (bcq, ubcq): grouped tables with N along dim 1, sign planes."""
    return table_kind in GROUPED_KINDS


def uniform_scale_ladder(bits: int) -> torch.Tensor:
    """ubcq's plane multipliers 2^(bits-1-p), p = 0..bits-1 (float32): alpha_p = scale * ladder[p]."""
    return torch.pow(2.0, torch.arange(bits - 1, -1, -1, dtype=torch.float32))


@dataclass(frozen=True)
class BlockSpec:
    """Shape and bit range of one AP linear block W[N, K]."""

    out_features: int  # N
    in_features: int  # K
    bits_min: int
    bits_max: int
    table_kind: TableKind = "bcq"
    group_size: int = 128  # grouped kinds (bcq, ubcq) only

    def __post_init__(self) -> None:
        if self.table_kind not in TABLE_KINDS:
            raise ValueError(f"table_kind must be one of {TABLE_KINDS}, got {self.table_kind!r}")
        if not 1 <= self.bits_min <= self.bits_max <= 8:
            raise ValueError(f"need 1 <= bits_min <= bits_max <= 8, got {self.bits_min}..{self.bits_max}")
        if self.in_features % 8:
            raise ValueError(f"in_features must be a multiple of 8, got {self.in_features}")
        if is_grouped(self.table_kind) and (
            self.group_size <= 0 or self.in_features % self.group_size or self.group_size & (self.group_size - 1)
        ):
            raise ValueError(
                f"group_size must be a power of two dividing in_features={self.in_features}, got {self.group_size}"
            )

    @property
    def bitwidths(self) -> range:
        return range(self.bits_min, self.bits_max + 1)

    @property
    def num_groups(self) -> int:
        return self.in_features // self.group_size

    def planes_shape(self, bits: int | None = None) -> tuple[int, int, int]:
        return (self.bits_max if bits is None else bits, self.out_features, self.in_features // 8)

    def table_shape(self, bits: int) -> tuple[int, ...]:
        self.check_bits(bits)
        if self.table_kind == "bcq":
            return (bits + 1, self.out_features, self.num_groups)
        if self.table_kind == "ubcq":
            return (2, self.out_features, self.num_groups)
        return (self.out_features, 2**bits)

    def plane_bytes(self) -> int:
        """Bytes of one bit-plane."""
        return self.out_features * self.in_features // 8

    def table_bytes(self, bits: int) -> int:
        n = 1
        for d in self.table_shape(bits):
            n *= d
        return n * 2  # float16

    def bytes_at(self, bits: int) -> int:
        """M^b: GPU bytes the block needs at bitwidth b (planes + that bitwidth's table)."""
        return bits * self.plane_bytes() + self.table_bytes(bits)

    def check_bits(self, bits: int) -> None:
        if not self.bits_min <= bits <= self.bits_max:
            raise ValueError(f"bitwidth {bits} outside the stored range {self.bits_min}..{self.bits_max}")


def table_key(table_kind: str, bits: int) -> str:
    """Suffix of the tensor that holds the table for `bits` (e.g. 'bcq.b4', 'ubcq.b4', 'lut.b4')."""
    return f"{'lut' if table_kind == 'kmeans' else table_kind}.b{bits}"


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[..., K] tensor of 0/1 -> [..., K // 8] uint8, k at bit k % 8 of byte k // 8."""
    k = bits.shape[-1]
    if k % 8:
        raise ValueError(f"last dim must be a multiple of 8, got {k}")
    b = bits.to(torch.uint8).reshape(*bits.shape[:-1], k // 8, 8)
    return (b << _SHIFTS.to(b.device)).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_bits: [..., K // 8] uint8 -> [..., K] uint8 of 0/1."""
    b = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 1
    return b.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def codes_from_planes(planes: torch.Tensor, bits: int) -> torch.Tensor:
    """Top `bits` planes [>=bits, N, K/8] -> integer codes [N, K] (plane 0 is the MSB)."""
    code = torch.zeros(planes.shape[1], planes.shape[2] * 8, dtype=torch.int32, device=planes.device)
    for p in range(bits):
        code = (code << 1) | unpack_bits(planes[p]).to(torch.int32)
    return code


def dequantize(
    planes: torch.Tensor, table: torch.Tensor, bits: int, table_kind: str, group_size: int = 128
) -> torch.Tensor:
    """Reference: the b-bit weight W_b [N, K] in float32 from the first `bits` planes and table_b."""
    if is_grouped(table_kind):
        k = planes.shape[2] * 8
        t = table.float()
        rows = bits + 1 if table_kind == "bcq" else 2
        if t.dim() != 3 or t.shape[-1] * group_size != k or t.shape[0] != rows:
            raise ValueError(
                f"{table_kind} table shape {tuple(t.shape)} does not fit planes {tuple(planes.shape)} at {bits} bits"
            )
        if table_kind == "bcq":
            alphas, offset = t[:bits], t[bits]
        else:  # ubcq: the scales are one per group times the power-of-two ladder
            alphas = t[0].unsqueeze(0) * uniform_scale_ladder(bits).to(t.device)[:, None, None]
            offset = t[1]
        w = offset.repeat_interleave(group_size, dim=-1).clone()
        for p in range(bits):
            sign = unpack_bits(planes[p]).float() * 2 - 1
            w += alphas[p].repeat_interleave(group_size, dim=-1) * sign
        return w
    if table_kind == "kmeans":
        code = codes_from_planes(planes, bits).long()
        if table.shape[-1] != 2**bits:
            raise ValueError(f"LUT width {table.shape[-1]} does not match {bits} bits")
        return torch.gather(table.float(), 1, code)
    raise ValueError(f"unknown table kind {table_kind!r}")
