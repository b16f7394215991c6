"""PlaneArena bookkeeping: dense slots, relocation, quarantine, granule mapping, poison.

The same random sequences run on the host backend and on the CUDA-VMM backend with a fake driver (whose
"device memory" is a host buffer), so both share one tested bookkeeping; a `gpu` test runs the real
driver and checks that torch.cuda.mem_get_info sees freed granules come back.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedweight.runtime.arena import POISON_BYTE, CudaVmmPlaneArena, HostPlaneArena, PlaneArena, Relocation

GRAN = 1024
CLASSES = {128: 24, 700: 12, 3000: 4}  # slot sizes 256, 768, 3072 (3072 spans granules)


class FakeDriver:
    """Just enough of cuda.bindings.driver: VA ranges and granule handles over one host buffer."""

    class CUresult:
        CUDA_SUCCESS = 0

    class _Struct(SimpleNamespace):
        def __init__(self) -> None:
            super().__init__(location=SimpleNamespace(type=None, id=None), type=None, flags=None)

    CUmemAllocationProp = _Struct
    CUmemAccessDesc = _Struct
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)

    def __init__(self, granularity: int, space: int = 1 << 20) -> None:
        self.granularity = granularity
        self.memory = torch.zeros(space + granularity, dtype=torch.uint8)
        self.base = (self.memory.data_ptr() + granularity - 1) // granularity * granularity
        self.cursor = 0
        self.reserved: dict[int, int] = {}
        self.created: dict[int, int] = {}  # physical handle -> size
        self.mapped: dict[int, int] = {}  # addr -> physical handle
        self.next_handle = 1
        self.calls: list[str] = []

    def cuInit(self, flags):
        return (0,)

    def cuMemGetAllocationGranularity(self, prop, flags):
        return (0, self.granularity)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        assert size % self.granularity == 0 and alignment == self.granularity
        base = self.base + self.cursor
        self.cursor += size
        assert self.cursor <= self.memory.numel() - self.granularity, "fake VA space exhausted"
        self.reserved[base] = size
        return (0, base)

    def cuMemCreate(self, size, prop, flags):
        assert size == self.granularity
        h = self.next_handle
        self.next_handle += 1
        self.created[h] = size
        self.calls.append("create")
        return (0, h)

    def cuMemMap(self, addr, size, offset, handle, flags):
        assert addr % self.granularity == 0 and size == self.granularity and handle in self.created
        assert any(b <= addr and addr + size <= b + n for b, n in self.reserved.items()), "map outside a reservation"
        assert addr not in self.mapped, "granule mapped twice"
        self.mapped[addr] = handle
        self.calls.append("map")
        return (0,)

    def cuMemSetAccess(self, addr, size, descs, count):
        assert addr in self.mapped
        return (0,)

    def cuMemUnmap(self, addr, size):
        assert size == self.granularity and addr in self.mapped, "unmap of an unmapped granule"
        del self.mapped[addr]
        self.calls.append("unmap")
        return (0,)

    def cuMemRelease(self, handle):
        assert handle in self.created and handle not in self.mapped.values(), "release of a mapped handle"
        del self.created[handle]
        self.calls.append("release")
        return (0,)

    def cuMemAddressFree(self, base, size):
        assert self.reserved.pop(base) == size
        return (0,)

    def view(self, addr: int, nbytes: int) -> torch.Tensor:
        g = self.granularity
        for granule in range(addr // g * g, addr + nbytes, g):
            assert granule in self.mapped, f"device access to unmapped granule {granule:#x}"
        off = addr - self.memory.data_ptr()
        return self.memory[off : off + nbytes]


def make_arena(backend: str, poison: bool) -> tuple[PlaneArena, FakeDriver | None]:
    if backend == "host":
        return HostPlaneArena(CLASSES, granularity=GRAN, poison=poison), None
    drv = FakeDriver(GRAN)
    return CudaVmmPlaneArena(CLASSES, poison=poison, driver=drv, wrap=drv.view), drv


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "release"]), st.sampled_from(sorted(CLASSES)), st.integers(0, 10**6)),
    max_size=120,
)


@pytest.mark.parametrize("backend", ["host", "fake-cuda"])
@settings(max_examples=40, deadline=None)
@given(ops=ops, poison=st.booleans())
def test_random_sequences_keep_data_and_bookkeeping(backend: str, ops, poison: bool) -> None:
    arena, drv = make_arena(backend, poison)
    content: dict[int, int] = {}  # handle -> fill byte
    pending: list[Relocation] = []
    counter = 0
    for op, nbytes, pick in ops:
        if op == "alloc":
            cls = arena.size_class(nbytes)
            blocked = cls.n_live in cls.quarantine
            if cls.n_live == cls.capacity and not blocked:
                with pytest.raises(RuntimeError, match="is full"):
                    arena.alloc(nbytes)
                continue
            h = arena.alloc(nbytes)
            assert (h is None) == blocked, "alloc must refuse exactly when the next slot is quarantined"
            if h is not None:
                counter = counter % 250 + 1  # never POISON_BYTE
                arena.tensor(h).fill_(counter)
                content[h] = counter
        elif op == "free" and content:
            h = sorted(content)[pick % len(content)]
            addr_before = {k: arena.addr(k) for k in content}
            reloc = arena.free(h)
            del content[h]
            if reloc is not None:
                pending.append(reloc)
                assert reloc.old_addr == addr_before[reloc.handle] and reloc.new_addr == arena.addr(reloc.handle)
            moved = {k for k in content if arena.addr(k) != addr_before[k]}
            assert moved == ({reloc.handle} if reloc else set()), "only the relocated item may move"
        elif op == "release" and pending:
            r = pending.pop(pick % len(pending))
            arena.release(r)
            if poison and arena.size_class(r.nbytes).mapped_granules * GRAN > r.old_addr - arena.size_class(r.nbytes).base:
                start = r.old_addr
                end = min(start + arena.size_class(r.nbytes).slot_bytes, arena.size_class(r.nbytes).base + arena.size_class(r.nbytes).mapped_granules * GRAN)
                assert bool((arena._view(start, end - start) == POISON_BYTE).all()), "released slot not poisoned"
        arena.check()
        for h, byte in content.items():
            assert bool((arena.tensor(h) == byte).all()), f"handle {h} lost its data"
        stats = arena.stats()
        assert stats.live_bytes == sum(arena.nbytes(h) for h in content)
        if drv is not None:
            assert len(drv.mapped) == len(drv.created) == stats.mapped_bytes // GRAN
    # with nothing quarantined and nothing live, every granule is back with the driver
    for r in pending:
        arena.release(r)
    for h in list(content):
        r = arena.free(h)
        if r is not None:
            arena.release(r)
    assert arena.stats().mapped_bytes == 0
    arena.close()
    if drv is not None:
        assert not drv.mapped and not drv.created and not drv.reserved


def test_relocation_moves_last_item_and_unmaps_after_release() -> None:
    arena, drv = make_arena("fake-cuda", poison=True)
    hs = [arena.alloc(700) for _ in range(4)]  # slots of 768 B: 4 slots = 3072 B = 3 granules
    assert arena.stats().mapped_bytes == 3 * GRAN
    reloc = arena.free(hs[0])
    assert reloc is not None and reloc.handle == hs[3] and (reloc.old_slot, reloc.new_slot) == (3, 0)
    # quarantined: slot 3 stays mapped and the next alloc must wait
    assert arena.stats().mapped_bytes == 3 * GRAN and arena.alloc(700) is None
    arena.release(reloc)
    assert arena.stats().mapped_bytes == 3 * GRAN  # 3 live slots = 2304 B still need 3 granules
    # live slots are now [hs3, hs1, hs2]; freeing the tail items needs no copy
    assert arena.free(hs[2]) is None and arena.free(hs[1]) is None
    assert arena.stats().mapped_bytes == 1 * GRAN and arena.addr(hs[3]) == reloc.new_addr
    assert drv.calls.count("unmap") == drv.calls.count("release") == 2


def test_bad_requests_name_the_problem() -> None:
    arena, _ = make_arena("host", poison=False)
    with pytest.raises(ValueError, match="no arena size class of 64 B"):
        arena.alloc(64)
    h = arena.alloc(128)
    arena.free(h)
    with pytest.raises(KeyError, match="not live"):
        arena.free(h)
    with pytest.raises(ValueError, match="granularity"):
        HostPlaneArena(CLASSES, granularity=1000)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_vmm_returns_memory_to_the_driver() -> None:
    mib = 1 << 20
    arena = CudaVmmPlaneArena({8 * mib: 64}, poison=True)
    try:
        torch.cuda.synchronize()
        free0, _ = torch.cuda.mem_get_info()
        hs = [arena.alloc(8 * mib) for _ in range(32)]  # 256 MiB
        for i, h in enumerate(hs):
            arena.tensor(h).fill_(i + 1)
        torch.cuda.synchronize()
        free1, _ = torch.cuda.mem_get_info()
        assert free0 - free1 >= 250 * mib
        relocs = [arena.free(h) for h in hs[:16]]  # frees the front: every one relocates a tail item
        assert all(r is not None for r in relocs)
        for r in relocs:
            arena.release(r)
        torch.cuda.synchronize()
        free2, _ = torch.cuda.mem_get_info()
        assert free2 - free1 >= 120 * mib, "unmapped granules did not go back to the driver"
        for i, h in enumerate(hs[16:]):
            assert bool((arena.tensor(h) == i + 17).all()), "relocated plane lost its data"
        arena.check()
    finally:
        arena.close()


class _EventLog(HostPlaneArena):
    """Records fills-drained and unmaps in order (the host backend's fills are synchronous; a GPU's are not)."""

    def __init__(self, *a, **k) -> None:
        self.events: list[str] = []
        super().__init__(*a, **k)

    def _drain_fills(self) -> None:
        self.events.append("drain")

    def _unmap(self, addr: int) -> None:
        self.events.append("unmap")
        super()._unmap(addr)


@pytest.mark.parametrize("poison", [False, True])
def test_poison_fills_are_drained_before_a_granule_is_unmapped(poison: bool) -> None:
    """On a GPU a poison fill is queued behind the forward in flight; unmapping its granule at once (found on
    the H200: an illegal-address fault in poison mode) must first wait for the fills."""
    gran = 4096
    arena = _EventLog({1024: 16}, granularity=gran, poison=poison)
    handles = [arena.alloc(1024) for _ in range(8)]  # 2 granules
    for h in reversed(handles[4:]):
        assert arena.free(h) is None  # the last slot each time: no relocation
    events = arena.events
    assert events.count("unmap") == 1
    if poison:
        assert events.index("drain") < events.index("unmap")
    else:
        assert "drain" not in events  # normal mode never blocks
