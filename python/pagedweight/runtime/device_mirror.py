"""Writes the device page table the MoE kernel reads from the rows of the WeightPageTable.

The row layout is the kernels' (pagedweight.kernels.weights, sgl-kernel-ext/weights.py: one int64 tensor per
MoE layer and projection, row e = [q_e, table_addr_e, plane_addr_e_0, ..., plane_addr_e_{P-1}] at the columns
PT_BITS, PT_TABLE, PT_PLANES + p, P = bits_max); here table_addr_e is the arena address of the table for
bitwidth q_e and plane_addr_e_p the address of plane p for p < q_e, 0 for planes the kernel must not read.
The tensors belong to the expert store and never move (CUDA graphs captured their addresses); this class
only rewrites their contents.

`flush()` is called at a safe scheduler boundary with the forward stream current: every staged row is
written there, in one batched copy per (layer, proj) tensor, so forward k reads the old rows and forward
k + 1 the new ones.
"""

from __future__ import annotations

from typing import Callable

import torch

from pagedweight.runtime.blocks import Proj
from pagedweight.runtime.page_table import WeightPageTable


def _row_layout():
    """pagedweight.kernels.weights, the one definition of the row's columns. Imported on first use, not with
    this module: the runtime imports without the kernel package (as expert_store does)."""
    from pagedweight.kernels import weights

    return weights


class DevicePageTableMirror:
    def __init__(self, table: WeightPageTable, addr: Callable[[int], int]) -> None:
        """`addr(handle)` gives the current device address of an arena handle (PlaneArena.addr)."""
        self._table = table
        self._addr = addr
        self._tensors: dict[tuple[int, Proj], torch.Tensor] = {}
        self.rows_written = 0
        self.flushes = 0

    def bind(self, layer: int, proj: Proj, tensor: torch.Tensor) -> None:
        """Register the device page table of one (layer, proj); every block of it must fit."""
        if tensor.dtype != torch.int64 or tensor.dim() != 2 or not tensor.is_contiguous():
            raise ValueError(
                f"page table of layer {layer} {proj} must be a contiguous 2-D int64 tensor, "
                f"got {tensor.dtype} {tuple(tensor.shape)}"
            )
        for row in self._table:
            if row.key.layer == layer and row.key.proj == proj:
                want = _row_layout().PT_PLANES + row.spec.bits_max
                if row.key.expert >= tensor.shape[0] or tensor.shape[1] != want:
                    raise ValueError(
                        f"page table of layer {layer} {proj} has shape {tuple(tensor.shape)}; block {row.key} "
                        f"needs at least {row.key.expert + 1} rows of {want} columns"
                    )
        self._tensors[(layer, proj)] = tensor

    def expected_row(self, block_id: int) -> list[int]:
        """The int64 row the kernel must see for a block, from its committed bits and handles."""
        layout = _row_layout()
        row = self._table.row(block_id)
        q = row.committed_bits
        out = [0] * (layout.PT_PLANES + row.spec.bits_max)
        out[layout.PT_BITS] = q
        out[layout.PT_TABLE] = self._addr(row.tables[q].handle) if q else 0
        for p in range(q):
            out[layout.PT_PLANES + p] = self._addr(row.planes[p].handle)
        return out

    def flush(self) -> int:
        """Write every staged row to its device tensor (current stream); returns rows written."""
        staged = self._table.take_staged()
        if not staged:
            return 0
        groups: dict[tuple[int, Proj], tuple[list[int], list[list[int]]]] = {}
        for block_id in staged:
            key = self._table.row(block_id).key
            idx, vals = groups.setdefault((key.layer, key.proj), ([], []))
            idx.append(key.expert)
            vals.append(self.expected_row(block_id))
        missing = [g for g in groups if g not in self._tensors]
        if missing:
            raise RuntimeError(f"no device page table bound for (layer, proj) {missing}; call bind() at load time")
        for group, (idx, vals) in groups.items():
            dst = self._tensors[group]
            src = _to_device(torch.tensor(vals, dtype=torch.int64), dst.device)
            dst.index_copy_(0, _to_device(torch.tensor(idx, dtype=torch.int64), dst.device), src)
        self.rows_written += len(staged)
        self.flushes += 1
        return len(staged)

    def bound(self, layer: int, proj: Proj) -> torch.Tensor:
        return self._tensors[(layer, proj)]


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to `device` without blocking the CPU on the forward stream.

    A pageable-to-device copy synchronizes the stream (the CPU would wait for the running forward);
    from pinned memory it is asynchronous, and PyTorch's caching host allocator keeps the pinned block
    alive until the copy's stream has consumed it.
    """
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
