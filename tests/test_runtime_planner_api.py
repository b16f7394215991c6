"""Plan validation and the deterministic ScriptedPolicy (planner/scripted_policy.py), against a minimal
PageTableView."""

from __future__ import annotations


import pytest
from hypothesis import given, settings, strategies as st

from pagedweight.format.layout import BlockSpec
from pagedweight.runtime.blocks import BlockKey
from tests.support.fake_page_table import Row, Table
from pagedweight.planner.scripted_policy import ScriptedPolicy
from pagedweight.runtime.planner_api import (
    BlockView,
    Observation,
    Plan,
    plan_bytes_delta,
    validate_plan,
)

SPEC = BlockSpec(out_features=16, in_features=128, bits_min=2, bits_max=8, group_size=64)

def make_table(desired: list[int], floor: int = 2, ceiling: int = 8) -> Table:
    # block ids deliberately not in key order, so the policy's ordering is tested
    n = len(desired)
    rows = [
        Row(i, BlockKey(layer=(n - 1 - i) // 2, expert=(n - 1 - i) % 2, proj="w13"), SPEC, d, d, floor, ceiling)
        for i, d in enumerate(desired)
    ]
    return Table(rows)


def test_runtime_row_answers_what_a_policy_reads() -> None:
    """The runtime's BlockRow is what a policy sees: every BlockView field holds the row's own values and
    bytes_at is the spec's M^b (a policy's damage-per-byte ranking divides by it)."""
    assert list(BlockView.__annotations__) == ["block_id", "key", "spec", "committed_bits", "desired_bits",
                                               "floor_bits", "ceiling_bits"]
    row = make_table([5, 6], floor=3, ceiling=7).row(1)
    assert (row.block_id, row.key, row.spec) == (1, BlockKey(layer=0, expert=0, proj="w13"), SPEC)
    assert (row.committed_bits, row.desired_bits, row.floor_bits, row.ceiling_bits) == (6, 6, 3, 7)
    assert [row.bytes_at(b) for b in (2, 5, 8)] == [SPEC.bytes_at(b) for b in (2, 5, 8)]
    assert row.bytes_at(4) - row.bytes_at(3) == SPEC.plane_bytes() + SPEC.table_bytes(4) - SPEC.table_bytes(3)


def test_validate_rejects_bad_steps() -> None:
    t = make_table([6, 6])
    with pytest.raises(ValueError, match="appears twice"):
        validate_plan(t, Plan.of([(0, 5), (0, 4)]), "offload")
    with pytest.raises(ValueError, match="does not lower"):
        validate_plan(t, Plan.of([(0, 7)]), "offload")
    with pytest.raises(ValueError, match="does not raise"):
        validate_plan(t, Plan.of([(0, 5)]), "reload")
    with pytest.raises(ValueError, match="floor..ceiling"):
        validate_plan(t, Plan.of([(1, 1)]), "offload")
    with pytest.raises(ValueError, match="block_id outside"):
        validate_plan(t, Plan.of([(2, 5)]), "offload")
    validate_plan(t, Plan.of([(0, 5), (1, 2)]), "offload")


def test_scripted_offload_order_is_lowest_layer_expert_first() -> None:
    t = make_table([8, 8, 8, 8])
    one_bit = SPEC.bytes_at(8) - SPEC.bytes_at(7)
    plan = ScriptedPolicy().plan(t, one_bit + 1, Observation())
    # block 3 has key (0, 0), block 2 has key (0, 1)
    assert [(s.block_id, s.target_bits) for s in plan.steps] == [(3, 7), (2, 7)]


@settings(max_examples=60, deadline=None)
@given(
    desired=st.lists(st.integers(2, 8), min_size=1, max_size=6),
    target=st.integers(0, 40_000),
    floor=st.integers(2, 5),
)
def test_scripted_offload_meets_target_or_hits_floors(desired: list[int], target: int, floor: int) -> None:
    desired = [max(d, floor) for d in desired]
    t = make_table(desired, floor=floor)
    plan = ScriptedPolicy().plan(t, target, Observation())
    validate_plan(t, plan, "offload")
    freed = plan_bytes_delta(t, plan)
    planned = {s.block_id: s.target_bits for s in plan.steps}
    if freed < target:
        assert all(planned.get(r.block_id, r.desired_bits) == floor for r in t)
    else:  # no more than one step's worth past the target
        assert freed - target < SPEC.bytes_at(8) - SPEC.bytes_at(7)


@settings(max_examples=60, deadline=None)
@given(desired=st.lists(st.integers(2, 8), min_size=1, max_size=6), budget=st.integers(0, 40_000))
def test_scripted_reload_stays_within_budget(desired: list[int], budget: int) -> None:
    t = make_table(desired)
    plan = ScriptedPolicy().plan_reload(t, budget, Observation())
    validate_plan(t, plan, "reload")
    assert 0 <= -plan_bytes_delta(t, plan) <= budget
    planned = {s.block_id: s.target_bits for s in plan.steps}
    # maximal: no block below its ceiling could take one more bit
    left = budget + plan_bytes_delta(t, plan)
    for r in t:
        bits = planned.get(r.block_id, r.desired_bits)
        if bits < r.ceiling_bits:
            assert SPEC.bytes_at(bits + 1) - SPEC.bytes_at(bits) > left
