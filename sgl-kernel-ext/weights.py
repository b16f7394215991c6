"""What the AP kernels read: one device page table per projection, plus its static shape facts.

Page-table row e of a projection (w13 = gate||up along N, or w2 = down), int64 [2 + P] with P = bits_max:

    [q_e, table_addr_e, plane_addr_e_0, ..., plane_addr_e_{P-1}]

q_e is the committed bitwidth, table_addr_e the data_ptr() of expert e's q_e-bit table (docs/format.md:
bcq [q+1, N, K/G] fp16, ubcq [2, N, K/G] fp16, kmeans [N, 2**q] fp16) and plane_addr_e_p the data_ptr() of plane p [N, K/8] uint8.
Planes and tables may live anywhere; the runtime rewrites rows between calls (or CUDA-graph replays) while
the tensor's own address stays fixed, so a captured graph keeps reading the current rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from pagedweight.format.layout import PLANE_DTYPE, TABLE_DTYPE, TABLE_KINDS, is_grouped

# The kernels' KIND constexpr per table kind (triton_tiles.tile_from_words).
KERNEL_KIND = {"bcq": 0, "kmeans": 1, "ubcq": 2}

# Column indices of a page-table row.
PT_BITS = 0
PT_TABLE = 1
PT_PLANES = 2

# A callable that returns, for expert e, the resident planes (at least q_e of them, each [N, K/8] uint8)
# and the table the row points to. The CPU reference uses it to turn addresses back into tensors.
ResidentFn = Callable[[int], tuple[Sequence[torch.Tensor], torch.Tensor]]


@dataclass(frozen=True)
class APMoEWeights:
    """One AP projection of an MoE layer (or of a dense linear when num_experts == 1).

    `N`, `K` are one expert's out/in features (w13: N = 2 * intermediate). `resident` is optional on CUDA
    (the Triton kernel reads only the page table) and lets the CPU reference validate every address.
    """

    page_table: torch.Tensor  # int64 [num_experts, 2 + bits_max]
    table_kind: str
    group_size: int
    N: int
    K: int
    bits_max: int
    num_experts: int
    resident: Optional[ResidentFn] = None

    def __post_init__(self) -> None:
        if self.table_kind not in TABLE_KINDS:
            raise ValueError(f"table_kind must be one of {TABLE_KINDS}, got {self.table_kind!r}")
        if not 1 <= self.bits_max <= 8:
            raise ValueError(f"bits_max must be in 1..8, got {self.bits_max}")
        pt = self.page_table
        if pt.dtype != torch.int64 or pt.dim() != 2 or tuple(pt.shape) != (self.num_experts, 2 + self.bits_max):
            raise ValueError(
                f"page_table must be int64 [num_experts={self.num_experts}, 2 + bits_max={2 + self.bits_max}], "
                f"got {pt.dtype} {tuple(pt.shape)}"
            )
        if not pt.is_contiguous():
            raise ValueError("page_table must be contiguous (the kernel indexes rows as e * (2 + bits_max))")
        if self.K % 8:
            raise ValueError(f"K (in_features) must be a multiple of 8 (docs/format.md), got {self.K}")

    def check_triton_supported(self, name: str) -> None:
        """The Triton kernels' extra requirements (the torch reference needs only the format's)."""
        if self.K % 32:
            raise ValueError(
                f"{name}: the Triton AP kernels need K (in_features) % 32 == 0 (one plane word), got K={self.K}; "
                "use the torch reference (CPU) for this shape"
            )
        if self.grouped:
            g = self.group_size
            if g < 32 or g & (g - 1) or self.K % g:
                raise ValueError(
                    f"{name}: the Triton AP kernels need a {self.table_kind} group_size that is a power of two >= 32 dividing "
                    f"K={self.K}, got {g} (the kernel keeps one scale per 32-weight word); re-convert with "
                    "group_size >= 32"
                )

    @property
    def num_groups(self) -> int:
        return self.K // self.group_size

    @property
    def grouped(self) -> bool:
        """Binary-coded planes with per-group tables (bcq, ubcq)."""
        return is_grouped(self.table_kind)

    @property
    def kernel_kind(self) -> int:
        """The KIND constexpr of the Triton kernels (0 bcq, 1 kmeans, 2 ubcq)."""
        return KERNEL_KIND[self.table_kind]

    @property
    def bcq_group(self) -> int | None:
        """The group the kernels' K blocks must divide: the bcq/ubcq group size (k-means rows have none)."""
        return self.group_size if self.grouped else None

    def table_shape(self, bits: int) -> tuple[int, ...]:
        if self.table_kind == "bcq":
            return (bits + 1, self.N, self.num_groups)
        if self.table_kind == "ubcq":
            return (2, self.N, self.num_groups)
        return (self.N, 2**bits)


def page_table_row(bits: int, table: torch.Tensor, planes: Sequence[torch.Tensor], bits_max: int) -> list[int]:
    """The int64 values of one page-table row; planes beyond `bits` may be absent (address 0)."""
    if len(planes) < bits:
        raise ValueError(f"a {bits}-bit row needs {bits} resident planes, got {len(planes)}")
    addrs = [int(p.data_ptr()) for p in planes[:bits_max]]
    return [int(bits), int(table.data_ptr())] + addrs + [0] * (bits_max - len(addrs))


def build_ap_moe_weights(
    planes: Sequence[Sequence[torch.Tensor]],
    tables: Sequence[torch.Tensor],
    bits: Sequence[int],
    *,
    table_kind: str,
    group_size: int,
    bits_max: int,
) -> APMoEWeights:
    """Page table (on the planes' device) for experts given as lists of plane tensors and their tables.

    planes[e][p]: [N, K/8] uint8 (at least bits[e] of them, contiguous); tables[e]: the bits[e]-bit table.
    The caller keeps the tensors alive; the returned weights carry a `resident` view of them.
    """
    if not (len(planes) == len(tables) == len(bits)) or not planes:
        raise ValueError(f"need one entry per expert, got {len(planes)} planes, {len(tables)} tables, {len(bits)} bits")
    n, kb = planes[0][0].shape
    device = planes[0][0].device
    rows = []
    for e, (pl, tb, q) in enumerate(zip(planes, tables, bits)):
        for p in pl[:q]:
            if p.dtype != PLANE_DTYPE or tuple(p.shape) != (n, kb) or not p.is_contiguous() or p.device != device:
                raise ValueError(f"expert {e}: planes must be contiguous uint8 [{n}, {kb}] on {device}")
        if tb.dtype != TABLE_DTYPE or not tb.is_contiguous():
            raise ValueError(f"expert {e}: table must be contiguous float16, got {tb.dtype}")
        rows.append(page_table_row(q, tb, pl, bits_max))
    weights = APMoEWeights(
        page_table=torch.tensor(rows, dtype=torch.int64, device=device),
        table_kind=table_kind,
        group_size=group_size,
        N=n,
        K=kb * 8,
        bits_max=bits_max,
        num_experts=len(planes),
        resident=lambda e: (planes[e], tables[e]),
    )
    for e, q in enumerate(bits):
        shape = weights.table_shape(q)
        if tuple(tables[e].shape) != shape:
            raise ValueError(f"expert {e}: {q}-bit {table_kind} table must be {shape}, got {tuple(tables[e].shape)}")
    return weights
