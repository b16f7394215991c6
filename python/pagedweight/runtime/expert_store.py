"""Resident AP planes and tables of one MoE layer, and the device page table the kernel reads.

One `ProjectionStore` per MoE layer and projection (w13 = gate||up concatenated along N, w2 = down).
The parent planes of every expert stay in host memory (pinned on CUDA machines); the device holds only the
first q_e planes of expert e and its q_e-bit table, so device memory follows the committed bitwidths.

Device page table (contract with pagedweight.kernels): int64 [E, 2 + P], row e =
[q_e, table_addr_e, plane_addr_e_0, ..., plane_addr_e_{P-1}] (0 for planes not resident). The tensor is
allocated once and only its contents change, so CUDA graphs that captured its address stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedweight.format.layout import BlockSpec


@dataclass
class ExpertPlanes:
    """One expert's parent planes [P, N, K/8] and its table for every stored bitwidth (host side)."""

    planes: torch.Tensor
    tables: dict[int, torch.Tensor]


@dataclass
class ProjectionStore:
    name: str  # e.g. "layer3.w13"
    spec: BlockSpec  # per-expert block
    host: list[ExpertPlanes]
    device: torch.device
    page_table: torch.Tensor = field(init=False)
    committed: list[int] = field(init=False)
    _dev_planes: list[list[Optional[torch.Tensor]]] = field(init=False)
    _dev_tables: list[Optional[torch.Tensor]] = field(init=False)
    _kernel_weights: Optional[object] = field(init=False, default=None)

    def __post_init__(self) -> None:
        e, p = len(self.host), self.spec.bits_max
        for i, ex in enumerate(self.host):
            if tuple(ex.planes.shape) != self.spec.planes_shape():
                raise ValueError(
                    f"{self.name}: expert {i} planes have shape {tuple(ex.planes.shape)}, "
                    f"expected {self.spec.planes_shape()}"
                )
            missing = [b for b in self.spec.bitwidths if b not in ex.tables]
            if missing:
                raise ValueError(f"{self.name}: expert {i} has no table for bitwidths {missing}")
        self.page_table = torch.zeros((e, 2 + p), dtype=torch.int64, device=self.device)
        self.committed = [0] * e
        self._dev_planes = [[None] * p for _ in range(e)]
        self._dev_tables = [None] * e
        self._kernel_weights = None

    @property
    def num_experts(self) -> int:
        return len(self.host)

    def commit(self, expert: int, bits: int) -> None:
        """Make expert `expert` serve at `bits`: load missing planes and the table, free the rest.

        Synchronous version used at load time and on CPU; the run-time pager orders the same steps
        asynchronously (lower q before freeing, copy before raising q).
        """
        self.spec.check_bits(bits)
        host = self.host[expert]
        planes = self._dev_planes[expert]
        for p in range(self.spec.bits_max):
            if p < bits and planes[p] is None:
                planes[p] = host.planes[p].to(self.device, non_blocking=True).contiguous()
            elif p >= bits:
                planes[p] = None
        self._dev_tables[expert] = host.tables[bits].to(self.device, non_blocking=True).contiguous()
        self.committed[expert] = bits
        self._write_row(expert)

    def _write_row(self, expert: int) -> None:
        row = [self.committed[expert], self._dev_tables[expert].data_ptr()]
        row += [t.data_ptr() if t is not None else 0 for t in self._dev_planes[expert]]
        self.page_table[expert].copy_(torch.tensor(row, dtype=torch.int64), non_blocking=False)

    def kernel_weights(self):
        """The kernel's view: the fixed-address page table plus shape facts (built once, rows change)."""
        if self._kernel_weights is None:
            from pagedweight.kernels.weights import APMoEWeights

            self._kernel_weights = APMoEWeights(
                page_table=self.page_table,
                table_kind=self.spec.table_kind,
                group_size=self.spec.group_size,
                N=self.spec.out_features,
                K=self.spec.in_features,
                bits_max=self.spec.bits_max,
                num_experts=self.num_experts,
                resident=self.resident,
            )
        return self._kernel_weights

    def resident(self, expert: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The device planes (first q) and table of an expert, for the CPU reference path."""
        q = self.committed[expert]
        return [t for t in self._dev_planes[expert][:q]], self._dev_tables[expert]

    def resident_bytes(self) -> int:
        n = 0
        for planes, table in zip(self._dev_planes, self._dev_tables):
            n += sum(t.numel() for t in planes if t is not None)
            n += table.numel() * table.element_size() if table is not None else 0
        return n

    def host_bytes(self) -> int:
        return sum(
            ex.planes.numel() + sum(t.numel() * t.element_size() for t in ex.tables.values()) for ex in self.host
        )

    def bf16_bytes(self) -> int:
        return self.num_experts * self.spec.out_features * self.spec.in_features * 2


@dataclass
class MoELayerStore:
    """Both projections of one FusedMoE layer."""

    layer_id: int
    w13: ProjectionStore
    w2: ProjectionStore

    def commit_all(self, bits: int) -> None:
        for proj in (self.w13, self.w2):
            for e in range(proj.num_experts):
                proj.commit(e, bits)

    def resident_bytes(self) -> int:
        return self.w13.resident_bytes() + self.w2.resident_bytes()

    def bf16_bytes(self) -> int:
        return self.w13.bf16_bytes() + self.w2.bf16_bytes()
