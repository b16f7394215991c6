"""WeightPageTable rows and the device page-table mirror."""

from __future__ import annotations

import pytest
import torch

from pagedweight.format.layout import BlockSpec
from pagedweight.runtime.arena import HostPlaneArena
from pagedweight.runtime.blocks import BlockKey
from pagedweight.runtime.device_mirror import DevicePageTableMirror
from pagedweight.runtime.page_table import PlaneState, WeightPageTable, arena_size_classes
from pagedweight.runtime.planner_api import BlockView

SPEC = BlockSpec(out_features=16, in_features=64, bits_min=2, bits_max=4, group_size=32)


def make() -> tuple[WeightPageTable, HostPlaneArena, DevicePageTableMirror]:
    blocks = [(BlockKey(0, e, p), SPEC) for e in range(2) for p in ("w13", "w2")]
    table = WeightPageTable(blocks, initial_bits=3)
    arena = HostPlaneArena(arena_size_classes(table), granularity=1024)
    mirror = DevicePageTableMirror(table, arena.addr)
    for proj in ("w13", "w2"):
        mirror.bind(0, proj, torch.zeros(2, 2 + SPEC.bits_max, dtype=torch.int64))
    return table, arena, mirror


def load(table: WeightPageTable, arena: HostPlaneArena, block_id: int, bits: int) -> None:
    for p in range(bits):
        table.attach_plane(block_id, p, arena.alloc(SPEC.plane_bytes()), PlaneState.GPU)
    table.attach_table(block_id, bits, arena.alloc(SPEC.table_bytes(bits)), PlaneState.GPU)
    table.commit(block_id, bits)


def test_rows_start_unloaded_and_satisfy_the_view() -> None:
    table, _, _ = make()
    row = table.by_key(BlockKey(0, 1, "w2"))
    assert isinstance(row, BlockView)
    assert (row.block_id, row.committed_bits, row.desired_bits) == (3, 0, 3)
    assert all(row.plane_state(p) is PlaneState.HOST for p in range(SPEC.bits_max))
    assert list(row.supported_bits) == [2, 3, 4] and row.bytes_at(3) == SPEC.bytes_at(3)
    assert table.committed_bytes() == 0 and table.desired_bytes() == 4 * SPEC.bytes_at(3)


def test_commit_requires_resident_planes_and_mirror_matches() -> None:
    table, arena, mirror = make()
    with pytest.raises(RuntimeError, match="not resident"):
        table.commit(0, 2)
    load(table, arena, 0, 3)
    load(table, arena, 3, 2)
    assert mirror.flush() == 2 and mirror.flush() == 0
    row0 = table.row(0)
    expect = [3, arena.addr(row0.tables[3].handle)] + [arena.addr(row0.planes[p].handle) for p in range(3)] + [0]
    assert mirror.bound(0, "w13")[0].tolist() == expect
    assert mirror.bound(0, "w2")[1].tolist() == mirror.expected_row(3)
    assert mirror.bound(0, "w2")[0].tolist() == [0] * 6  # block 1 never committed
    for b in range(4):
        table.check_row(b)
    assert table.committed_bytes() == table.resident_bytes() == SPEC.bytes_at(3) + SPEC.bytes_at(2)


def test_referenced_items_cannot_be_freed_or_retired() -> None:
    table, arena, _ = make()
    load(table, arena, 0, 3)
    with pytest.raises(RuntimeError, match="committed bits 3"):
        table.detach(0, "plane", 2)
    with pytest.raises(RuntimeError, match="read by committed bits"):
        table.set_state(0, "table", 3, PlaneState.IN_FLIGHT)
    handle = table.row(0).planes[0].handle
    with pytest.raises(RuntimeError, match="already belongs"):
        table.attach_plane(1, 0, handle, PlaneState.GPU)


def test_relocation_restages_the_owner_row() -> None:
    table, arena, mirror = make()
    load(table, arena, 0, 2)
    load(table, arena, 1, 2)
    mirror.flush()
    # free block 0's planes (lower it to nothing by hand): block 1's plane moves into the hole
    table.row(0).committed_bits = 0
    res = table.detach(0, "plane", 0)
    reloc = arena.free(res.handle)
    assert reloc is not None and table.owner(reloc.handle)[0] == 1
    table.on_relocated(reloc.handle)
    assert table.staged == {1}
    mirror.flush()
    assert mirror.bound(0, "w2")[0].tolist() == mirror.expected_row(1)
    assert reloc.new_addr in mirror.bound(0, "w2")[0].tolist()


def test_bad_configuration_is_rejected() -> None:
    table, _, mirror = make()
    with pytest.raises(ValueError, match="listed twice"):
        WeightPageTable([(BlockKey(0, 0, "w13"), SPEC)] * 2, initial_bits=3)
    with pytest.raises(ValueError, match="proj"):
        WeightPageTable([(BlockKey(0, 0, "gate"), SPEC)], initial_bits=3)
    with pytest.raises(ValueError, match="floor..ceiling"):
        table.set_desired(0, 5)
    with pytest.raises(ValueError, match="int64"):
        mirror.bind(0, "w13", torch.zeros(2, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="columns"):
        mirror.bind(0, "w13", torch.zeros(2, 5, dtype=torch.int64))
    table.set_limits(0, 3, 3)
    assert table.row(0).desired_bits == 3 and table.row(0).floor_bits == 3
