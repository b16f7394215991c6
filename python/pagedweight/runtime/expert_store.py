"""One MoE layer's expert weights as the kernels and the pager see them.

One `ProjectionStore` per MoE layer and projection (w13 = gate||up concatenated along N, w2 = down) holds:
- the parent planes and every bitwidth's table of each expert in host memory (pinned on CUDA machines):
  the source of every reload;
- the device page table the kernel reads, int64 [E, 2 + P], row e = [q_e, table_addr_e,
  plane_addr_e_0, ..., plane_addr_e_{P-1}] (0 for planes not resident). It is allocated once and only its
  contents change (the pager's DevicePageTableMirror writes them at safe boundaries), so CUDA graphs that
  captured its address stay valid;
- a resident-view function (set by the runtime) that turns a row back into tensors for the CPU path.
Device planes themselves live in the pager's arena, never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from pagedweight.format.layout import BlockSpec

ResidentFn = Callable[[int], tuple[list[torch.Tensor], torch.Tensor]]


@dataclass
class ExpertPlanes:
    """One expert's parent planes [P, N, K/8] and its table for every stored bitwidth (host side)."""

    planes: torch.Tensor
    tables: dict[int, torch.Tensor]


@dataclass
class ProjectionStore:
    name: str  # e.g. "layer3.w13"
    proj: str  # "w13" or "w2"
    spec: BlockSpec  # per-expert block
    host: list[ExpertPlanes]
    device: torch.device
    page_table: torch.Tensor = field(init=False)
    _resident_fn: Optional[ResidentFn] = field(init=False, default=None)
    _kernel_weights: Optional[object] = field(init=False, default=None)

    def __post_init__(self) -> None:
        for i, ex in enumerate(self.host):
            if tuple(ex.planes.shape) != self.spec.planes_shape():
                raise ValueError(
                    f"{self.name}: expert {i} planes have shape {tuple(ex.planes.shape)}, "
                    f"expected {self.spec.planes_shape()}"
                )
            missing = [b for b in self.spec.bitwidths if b not in ex.tables]
            if missing:
                raise ValueError(f"{self.name}: expert {i} has no table for bitwidths {missing}")
        self.page_table = torch.zeros((len(self.host), 2 + self.spec.bits_max), dtype=torch.int64, device=self.device)

    @property
    def num_experts(self) -> int:
        return len(self.host)

    def set_resident_fn(self, fn: ResidentFn) -> None:
        self._resident_fn = fn

    def resident(self, expert: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Device planes (first q) and q-bit table of an expert, as its page-table row says."""
        if self._resident_fn is None:
            raise RuntimeError(f"{self.name}: planes are not loaded (the PagedWeight runtime was not started)")
        return self._resident_fn(expert)

    def kernel_weights(self):
        """The kernel's view: the fixed-address page table plus shape facts (built once; rows change)."""
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

    def host_bytes(self) -> int:
        seen: set[int] = set()  # dummy stores share one host copy between experts
        n = 0
        for ex in self.host:
            if ex.planes.data_ptr() in seen:
                continue
            seen.add(ex.planes.data_ptr())
            n += ex.planes.numel() + sum(t.numel() * t.element_size() for t in ex.tables.values())
        return n

    def bf16_bytes(self) -> int:
        return self.num_experts * self.spec.out_features * self.spec.in_features * 2


@dataclass
class MoELayerStore:
    """Both projections of one FusedMoE layer, plus its routing statistics."""

    layer_id: int
    w13: ProjectionStore
    w2: ProjectionStore
    # Routing-weight mass per expert since start (eq. 1's numerator), accumulated on the device by the
    # MoE forward; read by the runtime a few times a second, never on the forward path.
    routing_mass: torch.Tensor = field(init=False)
    # The quality policy's RoutingObserver (routed-input norms for the prompt residual), when that policy runs.
    observer: Optional[object] = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.routing_mass = torch.zeros(self.w13.num_experts, dtype=torch.float32, device=self.w13.device)

    @property
    def projections(self) -> tuple[ProjectionStore, ProjectionStore]:
        return (self.w13, self.w2)

    def bf16_bytes(self) -> int:
        return self.w13.bf16_bytes() + self.w2.bf16_bytes()

    def host_bytes(self) -> int:
        return self.w13.host_bytes() + self.w2.host_bytes()
