"""Plane memory: a fragmentation-free arena whose freed memory really goes back to the driver.

One size class per distinct plane/table byte size. A class owns one contiguous virtual address range
(reserved once, never moved) cut into fixed slots. Invariants per class:
  - live items are dense in slots [0, n_live);
  - freeing the item in slot s moves the item of the last live slot into s (one device copy) and
    returns a `Relocation`, so its page-table row can be rewritten;
  - the moved item's old slot stays *quarantined* (mapped, not reusable) until the caller proves with a
    fence that no forward still reads the old address, then calls `release(relocation)`;
  - physical memory is mapped per granule and whole granules past the highest used slot (live or
    quarantined) are unmapped at once, so `torch.cuda.mem_get_info` sees the bytes come back.
Handles are stable ids; `addr(handle)` follows relocations.

Two backends with the same bookkeeping (`PlaneArena`): `HostPlaneArena` (host tensors, CI; it tracks the
mapped granules but cannot return memory to the OS) and `CudaVmmPlaneArena` (cuda-python driver VMM, the
way sglang/srt/mem_cache/kv_vmm_backing.py backs the KV pool).

Data operations (relocation copies, poison fills) run on the current stream; the pager calls into the
arena at scheduler boundaries with the forward stream current, so they are ordered with the forwards.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

POISON_BYTE = 0xFF  # 0xFFFF as float16 is NaN, so stale reads of freed tables show up as NaN
SLOT_ALIGN = 256  # bytes; keeps every plane/table address aligned for vectorized kernel loads


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Relocation:
    """The item `handle` moved from `old_slot` to `new_slot` of size class `nbytes`."""

    handle: int
    nbytes: int
    old_slot: int
    new_slot: int
    old_addr: int
    new_addr: int


@dataclass
class SizeClass:
    nbytes: int  # item size
    slot_bytes: int  # nbytes rounded up to SLOT_ALIGN
    capacity: int  # slots the address range holds
    base: int  # address of slot 0
    reserved_bytes: int  # granule-aligned size of the address range
    slots: list[int] = field(default_factory=list)  # slot -> handle, len == n_live
    quarantine: set[int] = field(default_factory=set)  # slots >= n_live still holding a moved item's old copy
    mapped_granules: int = 0

    @property
    def n_live(self) -> int:
        return len(self.slots)

    def used_slots(self) -> int:
        return max(self.n_live, max(self.quarantine) + 1 if self.quarantine else 0)

    def slot_addr(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes


@dataclass(frozen=True)
class ArenaStats:
    live_bytes: int  # sum of item sizes
    mapped_bytes: int  # physical memory mapped (granules)
    reserved_bytes: int  # address space
    live_items: int
    quarantined_slots: int
    relocations: int
    maps: int
    unmaps: int


class PlaneArena(abc.ABC):
    """Bookkeeping shared by both backends; subclasses provide address space, mapping and data access."""

    def __init__(self, size_classes: Mapping[int, int], granularity: int, poison: bool = False) -> None:
        """`size_classes`: item byte size -> maximum live items (see page_table.arena_size_classes)."""
        if granularity <= 0 or granularity % SLOT_ALIGN:
            raise ValueError(f"granularity must be a positive multiple of {SLOT_ALIGN}, got {granularity}")
        self.granularity = granularity
        self.poison = poison
        self._classes: dict[int, SizeClass] = {}
        self._where: dict[int, tuple[int, int]] = {}  # handle -> (nbytes, slot)
        self._next_handle = 0
        self._relocations = 0
        self._maps = 0
        self._unmaps = 0
        self._closed = False
        for nbytes, capacity in sorted(size_classes.items()):
            if nbytes <= 0 or capacity <= 0:
                raise ValueError(f"size class {nbytes} B x {capacity}: both must be positive")
            slot_bytes = align_up(nbytes, SLOT_ALIGN)
            reserved = align_up(slot_bytes * capacity, granularity)
            base = self._reserve(reserved)
            if base % granularity:
                raise RuntimeError(f"reserved address {base:#x} is not aligned to the granularity {granularity}")
            self._classes[nbytes] = SizeClass(nbytes, slot_bytes, capacity, base, reserved)

    # -- backend ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def _reserve(self, nbytes: int) -> int:
        """Reserve `nbytes` (granule multiple) of address space; returns its granule-aligned base."""

    @abc.abstractmethod
    def _map(self, addr: int) -> None:
        """Back the granule at `addr` with physical memory."""

    @abc.abstractmethod
    def _unmap(self, addr: int) -> None:
        """Return the physical memory of the granule at `addr` to the driver."""

    @abc.abstractmethod
    def _view(self, addr: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over mapped memory [addr, addr + nbytes)."""

    def _drain_fills(self) -> None:
        """Wait until the poison fills enqueued so far have run (they are asynchronous on a GPU)."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Unmap everything and free the address space."""

    # -- public API ---------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> Optional[int]:
        """A handle to `nbytes` of mapped memory, or None while the next slot is quarantined (retry
        after releasing relocations). Raises when the class is full: the reservation was too small."""
        cls = self._class(nbytes)
        slot = cls.n_live
        if slot in cls.quarantine:
            return None
        if slot >= cls.capacity:
            raise RuntimeError(
                f"arena size class {nbytes} B is full ({cls.capacity} slots); size the arena with "
                "page_table.arena_size_classes()"
            )
        self._map_to(cls, slot + 1)
        handle = self._next_handle
        self._next_handle += 1
        cls.slots.append(handle)
        self._where[handle] = (nbytes, slot)
        return handle

    def free(self, handle: int) -> Optional[Relocation]:
        """Free an item nothing reads any more. When it was not in the last live slot, the last item
        moves into its slot (copy on the current stream) and the Relocation is returned; the caller
        rewrites that item's page-table row and calls `release(relocation)` once no forward can still
        read the old address."""
        nbytes, slot = self._lookup(handle)
        cls = self._classes[nbytes]
        del self._where[handle]
        last = cls.n_live - 1
        if slot == last:
            cls.slots.pop()
            self._retire(cls, slot)
            return None
        moved = cls.slots.pop()
        old_addr, new_addr = cls.slot_addr(last), cls.slot_addr(slot)
        self._view(new_addr, nbytes).copy_(self._view(old_addr, nbytes))
        cls.slots[slot] = moved
        self._where[moved] = (nbytes, slot)
        cls.quarantine.add(last)
        self._relocations += 1
        return Relocation(moved, nbytes, last, slot, old_addr, new_addr)

    def release(self, relocation: Relocation) -> None:
        """The old slot of a relocated item is no longer read: poison it and unmap granules past the tail."""
        cls = self._class(relocation.nbytes)
        if relocation.old_slot not in cls.quarantine:
            raise RuntimeError(f"{relocation} was already released or is not a relocation of this arena")
        cls.quarantine.remove(relocation.old_slot)
        self._retire(cls, relocation.old_slot)

    def addr(self, handle: int) -> int:
        nbytes, slot = self._lookup(handle)
        return self._classes[nbytes].slot_addr(slot)

    def nbytes(self, handle: int) -> int:
        return self._lookup(handle)[0]

    def tensor(self, handle: int) -> torch.Tensor:
        """uint8 view of the item's bytes (valid until the item is freed or relocated)."""
        nbytes, _ = self._lookup(handle)
        return self._view(self.addr(handle), nbytes)

    def __contains__(self, handle: int) -> bool:
        return handle in self._where

    def handles(self) -> list[int]:
        return list(self._where)

    def last_live(self, nbytes: int) -> Optional[int]:
        """The handle in the last live slot of a size class: the one a free in that class would move."""
        slots = self._class(nbytes).slots
        return slots[-1] if slots else None

    def size_class(self, nbytes: int) -> SizeClass:
        return self._class(nbytes)

    def stats(self) -> ArenaStats:
        classes = self._classes.values()
        return ArenaStats(
            live_bytes=sum(c.nbytes * c.n_live for c in classes),
            mapped_bytes=sum(c.mapped_granules for c in classes) * self.granularity,
            reserved_bytes=sum(c.reserved_bytes for c in classes),
            live_items=sum(c.n_live for c in classes),
            quarantined_slots=sum(len(c.quarantine) for c in classes),
            relocations=self._relocations,
            maps=self._maps,
            unmaps=self._unmaps,
        )

    def check(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests, debug mode)."""
        for cls in self._classes.values():
            for slot, handle in enumerate(cls.slots):
                assert self._where.get(handle) == (cls.nbytes, slot), f"handle {handle} slot mismatch"
            assert all(s >= cls.n_live for s in cls.quarantine), "quarantined slot inside the live range"
            need = self._granules_for(cls, cls.used_slots())
            assert cls.mapped_granules == need, f"class {cls.nbytes}: {cls.mapped_granules} granules mapped, need {need}"
        assert sum(c.n_live for c in self._classes.values()) == len(self._where)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    # -- internals ----------------------------------------------------------------------------------

    def _class(self, nbytes: int) -> SizeClass:
        try:
            return self._classes[nbytes]
        except KeyError:
            raise ValueError(
                f"no arena size class of {nbytes} B (have {sorted(self._classes)}); build the arena from "
                "page_table.arena_size_classes() of the same page table"
            ) from None

    def _lookup(self, handle: int) -> tuple[int, int]:
        try:
            return self._where[handle]
        except KeyError:
            raise KeyError(f"arena handle {handle} is not live (freed twice, or never allocated)") from None

    def _granules_for(self, cls: SizeClass, used_slots: int) -> int:
        return -(-used_slots * cls.slot_bytes // self.granularity)

    def _map_to(self, cls: SizeClass, used_slots: int) -> None:
        need = self._granules_for(cls, used_slots)
        while cls.mapped_granules < need:
            addr = cls.base + cls.mapped_granules * self.granularity
            self._map(addr)
            self._maps += 1
            cls.mapped_granules += 1
            if self.poison:  # fresh memory holds garbage; make a read of never-loaded data visible
                self._view(addr, self.granularity).fill_(POISON_BYTE)

    def _retire(self, cls: SizeClass, slot: int) -> None:
        """`slot` holds nothing anyone reads: poison what stays mapped of it, unmap granules past the tail."""
        need = self._granules_for(cls, cls.used_slots())
        if self.poison:
            start = cls.slot_addr(slot)
            end = min(start + cls.slot_bytes, cls.base + need * self.granularity)
            if end > start:
                self._view(start, end - start).fill_(POISON_BYTE)
        if self.poison and cls.mapped_granules > need:
            # A fill enqueued at an earlier boundary (behind a forward still in flight) may target a granule
            # about to be unmapped; it must run first. Poison mode is a debug mode: it may block here.
            self._drain_fills()
        while cls.mapped_granules > need:
            cls.mapped_granules -= 1
            self._unmap(cls.base + cls.mapped_granules * self.granularity)
            self._unmaps += 1


class HostPlaneArena(PlaneArena):
    """Host-memory backend for CPU serving and CI: one lazily-touched host buffer per size class.

    Mapping is bookkeeping only (the OS keeps the pages), but every view checks that its range is
    mapped, so a CPU test catches any access past the tail the CUDA backend would fault on.
    """

    def __init__(self, size_classes: Mapping[int, int], granularity: int = 2 << 20, poison: bool = False) -> None:
        self._buffers: list[tuple[int, torch.Tensor]] = []  # (base, buffer)
        self._mapped: set[int] = set()
        super().__init__(size_classes, granularity, poison)

    def _reserve(self, nbytes: int) -> int:
        # over-allocate by one granule so the base can be aligned like a VA reservation
        buf = torch.empty(nbytes + self.granularity, dtype=torch.uint8)
        base = align_up(buf.data_ptr(), self.granularity)
        self._buffers.append((base, buf[base - buf.data_ptr() : base - buf.data_ptr() + nbytes]))
        return base

    def _map(self, addr: int) -> None:
        assert addr not in self._mapped, f"granule {addr:#x} mapped twice"
        self._mapped.add(addr)

    def _unmap(self, addr: int) -> None:
        self._mapped.remove(addr)

    def _view(self, addr: int, nbytes: int) -> torch.Tensor:
        g = self.granularity
        for granule in range(addr // g * g, addr + nbytes, g):
            if granule not in self._mapped:
                raise RuntimeError(f"host arena access to unmapped granule {granule:#x} ({addr:#x}+{nbytes})")
        for base, buf in self._buffers:
            if base <= addr and addr + nbytes <= base + buf.numel():
                return buf[addr - base : addr - base + nbytes]
        raise RuntimeError(f"address {addr:#x}+{nbytes} is outside every reservation of this arena")

    def _close(self) -> None:
        self._mapped.clear()
        self._buffers.clear()


class _CudaBuffer:
    """Exposes raw device memory to torch.as_tensor through __cuda_array_interface__ (v3, no stream sync)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "strides": None,
            "version": 3,
        }


def _check(result: Any, label: str, driver: Any) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{label} failed: {err}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


class CudaVmmPlaneArena(PlaneArena):
    """CUDA virtual-memory backend: one VA range per size class, one physical allocation per granule.

    Per-granule allocations (cuMemCreate of exactly one granule) are what make tail unmapping exact:
    cuMemUnmap + cuMemRelease of a granule returns it to the driver at once, which PyTorch's caching
    allocator would not. `driver` and `wrap` are injectable so the granule arithmetic is testable without
    a GPU.
    """

    def __init__(
        self,
        size_classes: Mapping[int, int],
        device_id: int = 0,
        poison: bool = False,
        driver: Any = None,
        wrap: Optional[Callable[[int, int], torch.Tensor]] = None,
    ) -> None:
        self._real_driver = driver is None
        if driver is None:
            from cuda.bindings import driver as driver  # noqa: PLC0415 (only on CUDA machines)

            torch.cuda.init()  # the driver calls below need torch's primary context current
        self._drv = driver
        self.device_id = int(device_id)
        self._wrap = wrap or self._wrap_cuda
        self._physical: dict[int, Any] = {}  # granule addr -> cuMemCreate handle
        self._ranges: list[tuple[int, int]] = []  # (base, nbytes) reservations
        drv = driver
        _check(drv.cuInit(0), "cuInit", drv)
        self._prop = drv.CUmemAllocationProp()
        self._prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self.device_id
        self._access = drv.CUmemAccessDesc()
        self._access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = self.device_id
        self._access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        granularity = int(
            _check(
                drv.cuMemGetAllocationGranularity(
                    self._prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
                "cuMemGetAllocationGranularity",
                drv,
            )
        )
        super().__init__(size_classes, granularity, poison)

    def _ctx(self) -> contextlib.AbstractContextManager:
        return torch.cuda.device(self.device_id) if self._real_driver else contextlib.nullcontext()

    def _wrap_cuda(self, addr: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_CudaBuffer(addr, nbytes), device=torch.device("cuda", self.device_id))

    def _reserve(self, nbytes: int) -> int:
        with self._ctx():
            reserved = self._drv.cuMemAddressReserve(nbytes, self.granularity, 0, 0)
        base = int(_check(reserved, "cuMemAddressReserve", self._drv))
        self._ranges.append((base, nbytes))
        return base

    def _map(self, addr: int) -> None:
        with self._ctx():
            self._map_granule(addr)

    def _map_granule(self, addr: int) -> None:
        drv = self._drv
        handle = _check(drv.cuMemCreate(self.granularity, self._prop, 0), "cuMemCreate", drv)
        try:
            _check(drv.cuMemMap(addr, self.granularity, 0, handle, 0), "cuMemMap", drv)
            try:
                _check(drv.cuMemSetAccess(addr, self.granularity, [self._access], 1), "cuMemSetAccess", drv)
            except Exception:
                drv.cuMemUnmap(addr, self.granularity)
                raise
        except Exception:
            drv.cuMemRelease(handle)
            raise
        self._physical[addr] = handle

    def _unmap(self, addr: int) -> None:
        handle = self._physical.pop(addr)
        with self._ctx():
            _check(self._drv.cuMemUnmap(addr, self.granularity), "cuMemUnmap", self._drv)
            _check(self._drv.cuMemRelease(handle), "cuMemRelease", self._drv)

    def _view(self, addr: int, nbytes: int) -> torch.Tensor:
        return self._wrap(addr, nbytes)

    def _drain_fills(self) -> None:
        if self._real_driver:
            torch.cuda.current_stream(self.device_id).synchronize()

    @property
    def physical_granules(self) -> int:
        return len(self._physical)

    def _close(self) -> None:
        if self._real_driver:
            torch.cuda.synchronize(self.device_id)  # nothing may still read memory we unmap
        for addr in sorted(self._physical):
            self._unmap(addr)
        for base, nbytes in self._ranges:
            with self._ctx():
                _check(self._drv.cuMemAddressFree(base, nbytes), "cuMemAddressFree", self._drv)
        self._ranges.clear()
