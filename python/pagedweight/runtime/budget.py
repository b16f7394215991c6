"""One GPU memory budget shared by the fixed part, the KV cache and the expert weights.

`M_total = M_fixed + M_kv + M_weights + free`. Every transition reserves before it allocates
(DynaExq's try_reserve): a reservation holds bytes out of `free` until it is committed (the allocation
happened; the bytes become `used[kind]`) or cancelled. A refusal is a returned None, never an exception:
the caller defers and retries at a later boundary. The sum of used and reserved bytes never exceeds
the total.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

Kind = Literal["fixed", "kv", "weights"]
KINDS: tuple[Kind, ...] = ("fixed", "kv", "weights")


class ReservationState(enum.Enum):
    RESERVED = "reserved"
    COMMITTED = "committed"
    CANCELLED = "cancelled"


@dataclass
class Reservation:
    kind: Kind
    nbytes: int
    state: ReservationState = ReservationState.RESERVED


@dataclass(frozen=True)
class BudgetSnapshot:
    total: int
    used: dict[str, int]
    reserved: dict[str, int]
    free: int
    refusals: int


class MemoryBudget:
    def __init__(self, total_bytes: int, fixed_bytes: int = 0) -> None:
        if total_bytes <= 0:
            raise ValueError(f"total_bytes must be positive, got {total_bytes}")
        if not 0 <= fixed_bytes <= total_bytes:
            raise ValueError(f"fixed_bytes {fixed_bytes} must be within 0..total_bytes {total_bytes}")
        self.total = total_bytes
        self._used: dict[str, int] = {k: 0 for k in KINDS}
        self._reserved: dict[str, int] = {k: 0 for k in KINDS}
        self._used["fixed"] = fixed_bytes
        self.refusals = 0

    @property
    def free(self) -> int:
        return self.total - sum(self._used.values()) - sum(self._reserved.values())

    def used(self, kind: Kind) -> int:
        return self._used[self._kind(kind)]

    def reserved(self, kind: Kind) -> int:
        return self._reserved[self._kind(kind)]

    def try_reserve(self, kind: Kind, nbytes: int) -> Reservation | None:
        """Hold `nbytes` for `kind`, or None (counted in `refusals`) when they are not free."""
        kind = self._kind(kind)
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative byte count ({nbytes})")
        if nbytes > self.free:
            self.refusals += 1
            return None
        self._reserved[kind] += nbytes
        return Reservation(kind, nbytes)

    def commit(self, reservation: Reservation) -> None:
        """The reserved bytes are now allocated memory of their kind."""
        self._expect(reservation, ReservationState.RESERVED, "commit")
        self._reserved[reservation.kind] -= reservation.nbytes
        self._used[reservation.kind] += reservation.nbytes
        reservation.state = ReservationState.COMMITTED

    def cancel(self, reservation: Reservation) -> None:
        """Give back a reservation that was never allocated."""
        self._expect(reservation, ReservationState.RESERVED, "cancel")
        self._reserved[reservation.kind] -= reservation.nbytes
        reservation.state = ReservationState.CANCELLED

    def release(self, kind: Kind, nbytes: int) -> None:
        """`nbytes` of allocated `kind` memory were freed."""
        kind = self._kind(kind)
        if not 0 <= nbytes <= self._used[kind]:
            raise ValueError(f"cannot release {nbytes} B of {kind}: only {self._used[kind]} B are in use")
        self._used[kind] -= nbytes

    def add_capacity(self, kind: Kind, nbytes: int) -> None:
        """Grow the total by memory that already exists and belongs to `kind` (e.g. the KV pool SGLang
        allocated after the weights were budgeted): total and used(kind) both rise, free is unchanged."""
        kind = self._kind(kind)
        if nbytes < 0:
            raise ValueError(f"cannot add a negative byte count ({nbytes})")
        self.total += nbytes
        self._used[kind] += nbytes

    def set_fixed(self, nbytes: int) -> bool:
        """Re-measure the fixed part (e.g. after CUDA graph capture); False when it no longer fits."""
        if nbytes < 0:
            raise ValueError(f"fixed bytes must be >= 0, got {nbytes}")
        if nbytes - self._used["fixed"] > self.free:
            self.refusals += 1
            return False
        self._used["fixed"] = nbytes
        return True

    def snapshot(self) -> BudgetSnapshot:
        return BudgetSnapshot(self.total, dict(self._used), dict(self._reserved), self.free, self.refusals)

    @staticmethod
    def _kind(kind: str) -> Kind:
        if kind not in KINDS:
            raise ValueError(f"budget kind must be one of {KINDS}, got {kind!r}")
        return kind  # type: ignore[return-value]

    @staticmethod
    def _expect(reservation: Reservation, state: ReservationState, action: str) -> None:
        if reservation.state is not state:
            raise RuntimeError(f"cannot {action} a reservation in state {reservation.state.value}: {reservation}")
