"""KVPressureSignal: D = max(0, T_blk + 1 - F_blk) * B_KV and the relax hysteresis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from pagedweight.runtime.pressure import KVPressureSignal


@settings(max_examples=80, deadline=None)
@given(t=st.integers(0, 64), b=st.integers(1, 1 << 20), avail=st.integers(0, 200), evict=st.integers(0, 200))
def test_target_formula(t: int, b: int, avail: int, evict: int) -> None:
    sig = KVPressureSignal(threshold_blocks=t, bytes_per_block=b, relax_blocks=t + 10, relax_checks=3)
    reading = sig.update(avail, evict)
    assert reading.free_blocks == avail + evict
    assert reading.target_bytes == max(0, t + 1 - avail - evict) * b


def test_relax_needs_consecutive_quiet_checks() -> None:
    sig = KVPressureSignal(threshold_blocks=4, bytes_per_block=100, relax_blocks=10, relax_checks=3)
    seq = [11, 12, 10, 11, 11, 11, 20, 20, 20, 3]
    relax = [sig.update(f).relax for f in seq]
    # 10 is not above T_hi and breaks the streak; the streak restarts after each relax
    assert relax == [False, False, False, False, False, True, False, False, True, False]
    assert sig.update(3).target_bytes == 200
    quiet = [sig.update(15) for _ in range(3)][-1]
    assert quiet.relax and quiet.relax_bytes == 500


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        KVPressureSignal(threshold_blocks=8, bytes_per_block=1, relax_blocks=8)
    with pytest.raises(ValueError, match="B_KV"):
        KVPressureSignal(threshold_blocks=8, bytes_per_block=0, relax_blocks=9)
    with pytest.raises(ValueError, match=">= 0"):
        KVPressureSignal(threshold_blocks=1, bytes_per_block=1, relax_blocks=2).update(-1)


def test_waiting_demand_counts_as_used_blocks():
    sig = KVPressureSignal(threshold_blocks=10, bytes_per_block=100, relax_blocks=50, relax_checks=1)
    r = sig.update(40, 0)  # 40 free: no pressure
    assert r.target_bytes == 0
    r = sig.update(40, 0, waiting_blocks=35)  # a waiting request lacks 35 blocks: 5 effectively free
    assert r.target_bytes == (10 + 1 - 5) * 100 and r.free_blocks == 5 and not r.relax
    r = sig.update(40, 2, waiting_blocks=60)  # free goes negative: the target covers the whole shortfall
    assert r.target_bytes == (10 + 1 + 18) * 100 and r.free_blocks == 0
    r = sig.update(120, 0, waiting_blocks=60)  # 60 effectively free: relax only counts what the queue leaves
    assert r.relax and r.relax_bytes == (60 - 50) * 100
