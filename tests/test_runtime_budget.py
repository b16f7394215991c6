"""MemoryBudget: reserve before allocate, refusals returned, never negative, never over the total."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from pagedweight.runtime.budget import KINDS, MemoryBudget, ReservationState


@settings(max_examples=80, deadline=None)
@given(
    total=st.integers(1, 10_000),
    ops=st.lists(
        st.tuples(st.sampled_from(["reserve", "commit", "cancel", "release"]), st.sampled_from(KINDS), st.integers(0, 4_000)),
        max_size=60,
    ),
)
def test_random_operations_never_overcommit(total: int, ops) -> None:
    b = MemoryBudget(total, fixed_bytes=total // 4)
    open_res = []
    used = {k: b.used(k) for k in KINDS}
    for op, kind, n in ops:
        if op == "reserve":
            free = b.free
            r = b.try_reserve(kind, n)
            assert (r is None) == (n > free)
            if r is not None:
                open_res.append(r)
        elif op in ("commit", "cancel") and open_res:
            r = open_res.pop(n % len(open_res))
            if op == "commit":
                b.commit(r)
                used[r.kind] += r.nbytes
            else:
                b.cancel(r)
        elif op == "release":
            amount = min(n, used[kind])
            b.release(kind, amount)
            used[kind] -= amount
        assert b.free >= 0
        assert all(b.used(k) == used[k] >= 0 and b.reserved(k) >= 0 for k in KINDS)
        assert sum(b.used(k) + b.reserved(k) for k in KINDS) + b.free == total


def test_refusal_is_counted_and_state_errors_are_clear() -> None:
    b = MemoryBudget(100)
    assert b.try_reserve("kv", 101) is None and b.refusals == 1
    r = b.try_reserve("weights", 60)
    assert r is not None and b.free == 40
    b.commit(r)
    assert r.state is ReservationState.COMMITTED
    with pytest.raises(RuntimeError, match="state committed"):
        b.cancel(r)
    with pytest.raises(ValueError, match="only 60 B"):
        b.release("weights", 61)
    with pytest.raises(ValueError, match="budget kind"):
        b.try_reserve("planes", 1)
    assert not b.set_fixed(41) and b.set_fixed(40) and b.free == 0
