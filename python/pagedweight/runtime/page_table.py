"""The weight page table: one typed row per linear block (layer, expert, proj).

A row records what the kernel reads (`committed_bits`), what the plans asked for (`desired_bits`), the
allowed range (`floor_bits..ceiling_bits`), and where each plane and table lives: its arena handle and
state. Only the pager mutates rows; policies read them through planner_api.PageTableView.

State of a plane or table of a block:
  HOST       only in the pinned host copy of the parent model; no GPU memory.
  IN_FLIGHT  has GPU memory, but the kernel must not rely on it: being copied in (reload), or retired
             by a lower commit and waiting for a fence before it is freed (offload).
  GPU        resident with valid data.

Row invariants (checked by `check_row`):
  - planes [0, committed_bits) are GPU and table[committed_bits] is GPU (committed_bits = 0: not loaded);
  - a plane or table has an arena handle iff it is not HOST; every handle belongs to one row only.

Committing a bitwidth stages the row; `DevicePageTableMirror.flush` (device_mirror.py) writes all staged
rows at the next safe scheduler boundary.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Sequence

from pagedweight.format.layout import BlockSpec
from pagedweight.runtime.blocks import BlockKey, check_key


class PlaneState(enum.Enum):
    HOST = "host"
    IN_FLIGHT = "in_flight"
    GPU = "gpu"


@dataclass
class Resident:
    """A plane or table that holds GPU memory: its arena handle, size and state."""

    handle: int
    nbytes: int
    state: PlaneState


@dataclass
class BlockRow:
    block_id: int
    key: BlockKey
    spec: BlockSpec
    committed_bits: int
    desired_bits: int
    floor_bits: int
    ceiling_bits: int
    planes: list[Optional[Resident]] = field(default_factory=list)  # index p = plane p; None = HOST
    tables: dict[int, Resident] = field(default_factory=dict)  # bitwidth -> table; absent = HOST

    def bytes_at(self, bits: int) -> int:
        """M^b; 0 for bits == 0 (not loaded)."""
        return 0 if bits == 0 else self.spec.bytes_at(bits)

    @property
    def supported_bits(self) -> range:
        return self.spec.bitwidths

    def plane_state(self, p: int) -> PlaneState:
        r = self.planes[p]
        return PlaneState.HOST if r is None else r.state

    def table_state(self, bits: int) -> PlaneState:
        r = self.tables.get(bits)
        return PlaneState.HOST if r is None else r.state

    def resident_bytes(self) -> int:
        """GPU bytes held by this block now (resident and in-flight planes and tables)."""
        return sum(r.nbytes for r in self.planes if r is not None) + sum(r.nbytes for r in self.tables.values())


def bit_limits(spec: BlockSpec, floor_bits: Optional[int] = None, ceiling_bits: Optional[int] = None) -> tuple[int, int]:
    """(floor, ceiling) of a block: its stored range narrowed by the --paged-weight bit limits."""
    floor = spec.bits_min if floor_bits is None else max(spec.bits_min, floor_bits)
    ceiling = spec.bits_max if ceiling_bits is None else min(spec.bits_max, ceiling_bits)
    return floor, ceiling


class WeightPageTable:
    """All rows, indexed by block_id = position in the `blocks` sequence given at construction.

    Rows start not loaded (committed_bits = 0, every plane HOST) with desired_bits = `initial_bits`
    clamped to the row's range; the pager loads them.
    """

    def __init__(
        self,
        blocks: Sequence[tuple[BlockKey, BlockSpec]],
        initial_bits: "int | Mapping[BlockKey, int]",
        floor_bits: Optional[int] = None,
        ceiling_bits: Optional[int] = None,
    ) -> None:
        # An int starts every block there (clamped to its limits); a mapping (a checked bits map) gives each
        # block its own start.
        self._rows: list[BlockRow] = []
        self._by_key: dict[BlockKey, int] = {}
        self._owner: dict[int, tuple[int, str, int]] = {}  # handle -> (block_id, "plane"|"table", index)
        self._staged: set[int] = set()
        for block_id, (key, spec) in enumerate(blocks):
            key = BlockKey(*key)
            check_key(key)
            if key in self._by_key:
                raise ValueError(f"block {key} listed twice in the page table")
            floor, ceiling = bit_limits(spec, floor_bits, ceiling_bits)
            if floor > ceiling:
                raise ValueError(f"block {key}: floor {floor} above ceiling {ceiling}; check --paged-weight bit limits")
            row = BlockRow(
                block_id=block_id,
                key=key,
                spec=spec,
                committed_bits=0,
                desired_bits=min(max(initial_bits if isinstance(initial_bits, int) else initial_bits[key], floor), ceiling),
                floor_bits=floor,
                ceiling_bits=ceiling,
                planes=[None] * spec.bits_max,
            )
            self._rows.append(row)
            self._by_key[key] = block_id

    # -- PageTableView ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[BlockRow]:
        return iter(self._rows)

    def row(self, block_id: int) -> BlockRow:
        if not 0 <= block_id < len(self._rows):
            raise IndexError(f"block_id {block_id} outside 0..{len(self._rows) - 1}")
        return self._rows[block_id]

    def by_key(self, key: BlockKey) -> BlockRow:
        try:
            return self._rows[self._by_key[BlockKey(*key)]]
        except KeyError:
            raise KeyError(f"no block {key} in the page table") from None

    # -- desired / limits ---------------------------------------------------------------------------

    def set_desired(self, block_id: int, bits: int) -> None:
        row = self.row(block_id)
        if not row.floor_bits <= bits <= row.ceiling_bits:
            raise ValueError(f"{row.key}: desired {bits} outside {row.floor_bits}..{row.ceiling_bits} (floor..ceiling)")
        row.desired_bits = bits

    def set_limits(self, block_id: int, floor_bits: int, ceiling_bits: int) -> None:
        """Change a row's floor/ceiling (e.g. from a routing bucket); desired is clamped into it."""
        row = self.row(block_id)
        if not row.spec.bits_min <= floor_bits <= ceiling_bits <= row.spec.bits_max:
            raise ValueError(
                f"{row.key}: need {row.spec.bits_min} <= floor {floor_bits} <= ceiling {ceiling_bits} "
                f"<= {row.spec.bits_max}"
            )
        row.floor_bits, row.ceiling_bits = floor_bits, ceiling_bits
        row.desired_bits = min(max(row.desired_bits, floor_bits), ceiling_bits)

    # -- residency (pager only) ---------------------------------------------------------------------

    def attach_plane(self, block_id: int, p: int, handle: int, state: PlaneState) -> None:
        row = self.row(block_id)
        if row.planes[p] is not None:
            raise RuntimeError(f"{row.key}: plane {p} already holds handle {row.planes[p].handle}")
        self._claim(handle, block_id, "plane", p)
        row.planes[p] = Resident(handle, row.spec.plane_bytes(), state)

    def attach_table(self, block_id: int, bits: int, handle: int, state: PlaneState) -> None:
        row = self.row(block_id)
        row.spec.check_bits(bits)
        if bits in row.tables:
            raise RuntimeError(f"{row.key}: table {bits} already holds handle {row.tables[bits].handle}")
        self._claim(handle, block_id, "table", bits)
        row.tables[bits] = Resident(handle, row.spec.table_bytes(bits), state)

    def set_state(self, block_id: int, kind: str, index: int, state: PlaneState) -> None:
        res = self._resident(block_id, kind, index)
        if state is PlaneState.HOST:
            raise ValueError("use detach() to send a plane back to HOST")
        row = self.row(block_id)
        if state is not PlaneState.GPU and self._referenced(row, kind, index):
            raise RuntimeError(f"{row.key}: {kind} {index} is read by committed bits {row.committed_bits}")
        res.state = state

    def detach(self, block_id: int, kind: str, index: int) -> Resident:
        """Drop a plane/table from the row (it goes back to HOST); returns what it held."""
        row = self.row(block_id)
        res = self._resident(block_id, kind, index)
        if self._referenced(row, kind, index):
            raise RuntimeError(f"{row.key}: cannot free {kind} {index} while committed bits {row.committed_bits} read it")
        if kind == "plane":
            row.planes[index] = None
        else:
            del row.tables[index]
        del self._owner[res.handle]
        return res

    def commit(self, block_id: int, bits: int) -> None:
        """Make `bits` the bitwidth the kernel reads after the next flush; stages the row."""
        row = self.row(block_id)
        row.spec.check_bits(bits)
        missing = [p for p in range(bits) if row.plane_state(p) is not PlaneState.GPU]
        if missing or row.table_state(bits) is not PlaneState.GPU:
            raise RuntimeError(
                f"{row.key}: cannot commit {bits} bits: planes {missing} / table {bits} "
                f"({row.table_state(bits).value}) are not resident"
            )
        row.committed_bits = bits
        self._staged.add(block_id)

    def owner(self, handle: int) -> tuple[int, str, int]:
        """(block_id, 'plane'|'table', plane index or bitwidth) holding an arena handle."""
        try:
            return self._owner[handle]
        except KeyError:
            raise KeyError(f"arena handle {handle} belongs to no row") from None

    def on_relocated(self, handle: int) -> None:
        """An arena relocation moved `handle`: restage its row so the mirror gets the new address."""
        self._staged.add(self.owner(handle)[0])

    def take_staged(self) -> list[int]:
        """Block ids whose device row must be rewritten; clears the staging set."""
        staged = sorted(self._staged)
        self._staged.clear()
        return staged

    @property
    def staged(self) -> frozenset[int]:
        return frozenset(self._staged)

    # -- accounting ---------------------------------------------------------------------------------

    def committed_bytes(self) -> int:
        """sum_i M_i^{q_i}."""
        return sum(r.bytes_at(r.committed_bits) for r in self._rows)

    def desired_bytes(self) -> int:
        """sum_i M_i^{d_i}: what the weights will hold once every plan is applied."""
        return sum(r.bytes_at(r.desired_bits) for r in self._rows)

    def resident_bytes(self) -> int:
        return sum(r.resident_bytes() for r in self._rows)

    def handles(self) -> dict[int, tuple[int, str, int]]:
        return dict(self._owner)

    def check_row(self, block_id: int) -> None:
        """Raise AssertionError when a row breaks its invariants (used by tests and debug mode)."""
        row = self.row(block_id)
        q = row.committed_bits
        for p in range(q):
            assert row.plane_state(p) is PlaneState.GPU, f"{row.key}: plane {p} < q={q} is {row.plane_state(p)}"
        if q:
            assert row.table_state(q) is PlaneState.GPU, f"{row.key}: table {q} is {row.table_state(q)}"
        for kind, items in (("plane", enumerate(row.planes)), ("table", row.tables.items())):
            for index, res in items:
                if res is not None:
                    assert self._owner.get(res.handle) == (block_id, kind, index), f"{row.key}: {kind} {index} owner"

    # -- helpers ------------------------------------------------------------------------------------

    def _claim(self, handle: int, block_id: int, kind: str, index: int) -> None:
        if handle in self._owner:
            raise RuntimeError(f"arena handle {handle} already belongs to {self._owner[handle]}")
        self._owner[handle] = (block_id, kind, index)

    def _resident(self, block_id: int, kind: str, index: int) -> Resident:
        row = self.row(block_id)
        res = row.planes[index] if kind == "plane" else row.tables.get(index)
        if res is None:
            raise RuntimeError(f"{row.key}: {kind} {index} is not resident")
        return res

    @staticmethod
    def _referenced(row: BlockRow, kind: str, index: int) -> bool:
        q = row.committed_bits
        return (index < q) if kind == "plane" else (q > 0 and index == q)


def arena_size_classes(table: WeightPageTable) -> dict[int, int]:
    """Plane/table byte sizes -> how many arena slots of that size could ever be live at once.

    Upper bound for the arena's address-space reservation (address space is free; physical memory is
    mapped on demand): every plane of every block, and two tables per block per table size (the
    committed one and the one being loaded).
    """
    classes: dict[int, int] = {}
    for row in table:
        spec = row.spec
        classes[spec.plane_bytes()] = classes.get(spec.plane_bytes(), 0) + spec.bits_max
        sizes = {spec.table_bytes(b) for b in spec.bitwidths}
        for size in sizes:
            classes[size] = classes.get(size, 0) + 2
    return classes
