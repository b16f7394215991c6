"""The pager end to end on host memory, with fences and copies completed by the test.

Copies are deferred until their fence completes (like a copy stream) and every "forward" reads the device
page table as flushed at its boundary and is checked, right before the fence covering it completes, to
still find valid plane and table bytes at the addresses it read (so a free, relocation or poison before
the fence, or a commit before the copy, fails the test).
"""

from __future__ import annotations

import random
from typing import Callable, Optional

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedweight.format.layout import BlockSpec
from pagedweight.runtime.arena import HostPlaneArena
from pagedweight.runtime.blocks import PROJS, BlockKey
from pagedweight.runtime.budget import MemoryBudget
from pagedweight.runtime.controller import PagingController
from pagedweight.runtime.page_table import PlaneState, WeightPageTable, arena_size_classes
from pagedweight.runtime.pager import OpPhase, Pager, PagerConfig
from pagedweight.planner.scripted_policy import ScriptedPolicy
from pagedweight.runtime.planner_api import Observation, Plan
from pagedweight.runtime.pressure import KVPressureSignal

LAYERS, EXPERTS = 2, 2
SPECS = {
    "w13": BlockSpec(out_features=32, in_features=64, bits_min=2, bits_max=8, group_size=32),
    "w2": BlockSpec(out_features=16, in_features=64, bits_min=2, bits_max=8, group_size=32),
}
BLOCKS = [(BlockKey(l, e, p), SPECS[p]) for l in range(LAYERS) for e in range(EXPERTS) for p in PROJS]


class ManualFence:
    def __init__(self, on_done: Optional[Callable[[], None]] = None) -> None:
        self.completed = False
        self._on_done = on_done

    def done(self) -> bool:
        return self.completed

    def complete(self) -> None:
        if not self.completed:
            if self._on_done is not None:
                self._on_done()
            self.completed = True


class ManualFences:
    """Forward-stream fences, completed in order by the test."""

    def __init__(self) -> None:
        self.issued: list[ManualFence] = []

    def record(self) -> ManualFence:
        self.issued.append(ManualFence())
        return self.issued[-1]


class DeferredCopier:
    """The data lands only when the fence completes, like an async copy stream."""

    def __init__(self) -> None:
        self.pending: list[ManualFence] = []

    def copy(self, pairs):
        snapshot = [(dst, src.reshape(-1).view(torch.uint8).clone()) for dst, src in pairs]

        def land() -> None:
            for dst, src in snapshot:
                dst.copy_(src)

        fence = ManualFence(land)
        self.pending.append(fence)
        return fence


class HostModel:
    def __init__(self, table: WeightPageTable, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.planes, self.tables = {}, {}
        for row in table:
            spec = row.spec
            self.planes[row.block_id] = torch.randint(0, 255, spec.planes_shape(), dtype=torch.uint8, generator=g)
            for b in spec.bitwidths:
                self.tables[row.block_id, b] = torch.randn(spec.table_shape(b), generator=g).half()

    def host_planes(self, block_id: int) -> torch.Tensor:
        return self.planes[block_id]

    def host_table(self, block_id: int, bits: int) -> torch.Tensor:
        return self.tables[block_id, bits]

    def table_bytes(self, block_id: int, bits: int) -> torch.Tensor:
        return self.tables[block_id, bits].reshape(-1).view(torch.uint8)


class Harness:
    def __init__(
        self, poison: bool = True, cap: int = 1 << 30, staging: Optional[int] = None, slack: int = 4096, seed: int = 0
    ) -> None:
        self.table = WeightPageTable(BLOCKS, initial_bits=8)
        self.arena = HostPlaneArena(arena_size_classes(self.table), granularity=1024, poison=poison)
        staging_bytes = SPECS["w13"].table_bytes(8) if staging is None else staging
        total = sum(s.bytes_at(8) for _, s in BLOCKS) + staging_bytes + slack
        self.budget = MemoryBudget(total, fixed_bytes=0)
        self.host = HostModel(self.table, seed)
        self.fences = ManualFences()
        self.copier = DeferredCopier()
        self.kv_grants: list[int] = []
        self.kv_greedy = True  # the KV side takes every byte the weights free
        self.pager = Pager(
            self.table,
            self.arena,
            self.budget,
            self.host,
            self.copier,
            self.fences,
            on_bytes_freed=self._kv_take,
            config=PagerConfig(max_inflight_bytes=cap, staging_bytes=staging),
        )
        for l in range(LAYERS):
            for p in PROJS:
                self.pager.mirror.bind(l, p, torch.zeros(EXPERTS, 2 + 8, dtype=torch.int64))
        self.forwards: list[tuple[dict, Optional[ManualFence]]] = []
        self.settle()

    # -- the KV side --------------------------------------------------------------------------------
    def _kv_take(self, nbytes: int) -> None:
        self.kv_grants.append(nbytes)
        if not self.kv_greedy:
            return
        res = self.budget.try_reserve("kv", nbytes)
        assert res is not None, "bytes handed to the KV side must be free in the budget"
        self.budget.commit(res)

    def kv_grab_all(self) -> None:
        res = self.budget.try_reserve("kv", self.budget.free)
        self.budget.commit(res)

    def kv_release(self, frac: float) -> None:
        self.budget.release("kv", int(self.budget.used("kv") * frac))

    # -- driving ------------------------------------------------------------------------------------
    def boundary(self) -> None:
        before = len(self.fences.issued)
        self.pager.on_boundary()
        assert len(self.fences.issued) <= before + 1, "at most one forward-stream fence per boundary"
        if len(self.fences.issued) > before:
            # stream order: this fence completes after every forward enqueued before it
            fence = self.fences.issued[-1]
            self.forwards = [(s, fence if f is None else f) for s, f in self.forwards]
        snap = self.snapshot()
        self.verify(snap)  # what the next forward reads is valid now ...
        self.forwards.append((snap, None))
        self.check_invariants()

    def complete_copies(self, n: int) -> None:
        for fence in self.copier.pending[:n]:
            fence.complete()
        self.copier.pending = self.copier.pending[n:]

    def complete_fences(self, n: int) -> None:
        for fence in [f for f in self.fences.issued if not f.completed][:n]:
            for snap, f in self.forwards:
                if f is fence:
                    self.verify(snap)  # ... and still valid when the forward that read it finishes
            fence.complete()
        self.forwards = [(s, f) for s, f in self.forwards if f is None or not f.completed]

    def settle(self, max_rounds: int = 100) -> None:
        for _ in range(max_rounds):
            self.complete_copies(len(self.copier.pending))
            self.complete_fences(len(self.fences.issued))
            self.boundary()
            if self.pager.idle():
                self.complete_fences(len(self.fences.issued))
                return
        raise AssertionError(f"pager not idle: {self.pager.state()}")

    # -- checks -------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {(l, p): self.pager.mirror.bound(l, p).clone() for l in range(LAYERS) for p in PROJS}

    def verify(self, snap: dict) -> None:
        for row in self.table:
            k = row.key
            dev = snap[k.layer, k.proj][k.expert].tolist()
            q, spec = dev[0], row.spec
            if q == 0:
                assert dev == [0] * len(dev)
                continue
            table_bytes = self.arena._view(dev[1], spec.table_bytes(q))
            assert torch.equal(table_bytes, self.host.table_bytes(row.block_id, q)), f"{k}: table {q} corrupted"
            for p in range(spec.bits_max):
                if p >= q:
                    assert dev[2 + p] == 0, f"{k}: plane {p} >= q={q} has an address"
                    continue
                plane = self.arena._view(dev[2 + p], spec.plane_bytes())
                assert torch.equal(plane, self.host.planes[row.block_id][p].reshape(-1)), f"{k}: plane {p} corrupted"

    def check_invariants(self) -> None:
        t, b, a, pager = self.table, self.budget, self.arena, self.pager
        assert b.free >= 0
        assert b.used("weights") == t.resident_bytes() + pager.staging_free
        assert set(a.handles()) == set(t.handles()), "a plane is both free and referenced, or leaked"
        a.check()
        for row in t:
            t.check_row(row.block_id)
            k = row.key
            assert pager.mirror.bound(k.layer, k.proj)[k.expert].tolist() == pager.mirror.expected_row(row.block_id)
        loading = [op for op in pager._ops.values() if op.phase is OpPhase.LOADING]
        assert pager.inflight_bytes == sum(op.inflight_bytes for op in loading)
        assert len(loading) <= 1 or pager.inflight_bytes <= pager.config.max_inflight_bytes


# boundaries, copies and fences interleave far more often than new plans arrive
actions = st.lists(
    st.tuples(
        st.sampled_from(["plan"] * 2 + ["boundary"] * 5 + ["copies"] * 3 + ["fences"] * 2 + ["kv_grab", "kv_release"]),
        st.integers(1, 2**31),
    ),
    min_size=10,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(acts=actions, poison=st.booleans(), cap=st.sampled_from([1, 3000, 1 << 30]), staging=st.sampled_from([0, None]))
def test_random_transitions_keep_invariants(acts, poison: bool, cap: int, staging: Optional[int]) -> None:
    h = Harness(poison=poison, cap=cap, staging=staging)
    for act, arg in acts:
        if act == "plan":
            rng = random.Random(arg)
            ids = rng.sample(range(len(BLOCKS)), rng.randint(1, len(BLOCKS)))
            h.pager.submit(Plan.of([(i, rng.randint(2, 8)) for i in ids], reason="random"))
        elif act == "boundary":
            h.boundary()
        elif act == "copies":
            h.complete_copies(1 + arg % 4)
        elif act == "fences":
            h.complete_fences(1 + arg % 3)
        elif act == "kv_grab":
            h.kv_grab_all()
        else:
            h.kv_release(1 / (1 + arg % 4))
    h.kv_greedy = False  # the quiet end: freed bytes stay free, so every plan can finish
    h.kv_release(1.0)
    h.settle()
    for row in h.table:
        assert row.committed_bits == row.desired_bits
    assert h.table.resident_bytes() == h.table.committed_bytes()
    assert h.budget.used("weights") == h.table.committed_bytes() + h.pager.staging_free


def loaded_harness(**kw) -> Harness:
    h = Harness(**kw)
    assert all(r.committed_bits == 8 for r in h.table)
    return h


def test_offload_lowers_q_before_freeing_and_pays_the_kv_side() -> None:
    h = loaded_harness()
    row = h.table.row(0)
    spec = row.spec
    loads = h.pager.counters.transitions  # the initial load at 8 bits counts as reloads
    h.pager.submit(Plan.of([(0, 6)]), direction="offload")
    h.boundary()  # table_6 is being copied in
    assert row.committed_bits == 8 and h.copier.pending
    h.boundary()
    assert row.committed_bits == 8, "committed before the lower table arrived"
    h.complete_copies(1)
    h.boundary()  # commit: the flush of this boundary switches the kernel to 6 bits
    assert row.committed_bits == 6 and h.snapshot()[0, "w13"][0, 0] == 6
    assert [row.plane_state(p) for p in (6, 7)] == [PlaneState.IN_FLIGHT] * 2
    assert row.table_state(8) is PlaneState.IN_FLIGHT and h.kv_grants == []
    h.boundary()
    assert row.planes[6] is not None, "freed before the fence proved no forward reads it"
    h.complete_fences(len(h.fences.issued))
    h.boundary()
    assert row.planes[6] is None and row.planes[7] is None and 8 not in row.tables
    assert h.kv_grants == [2 * spec.plane_bytes() + spec.table_bytes(8)]
    assert h.pager.counters.offloads_committed == 1 and h.pager.counters.transitions == loads + 1


def test_reload_copies_before_raising_q() -> None:
    h = loaded_harness()
    h.pager.submit(Plan.of([(1, 4)]))
    h.settle()
    row = h.table.row(1)
    h.pager.submit(Plan.of([(1, 7)]), direction="reload")
    h.boundary()
    assert row.committed_bits == 4 and [row.plane_state(p) for p in (4, 5, 6)] == [PlaneState.IN_FLIGHT] * 3
    h.boundary()
    assert row.committed_bits == 4, "raised before the copy fence"
    h.complete_copies(1)
    h.boundary()
    assert row.committed_bits == 7 and row.table_state(4) is PlaneState.IN_FLIGHT
    h.complete_fences(len(h.fences.issued))
    h.boundary()
    assert 4 not in row.tables and h.pager.idle()


def test_back_pressure_caps_bytes_in_flight() -> None:
    h = loaded_harness()
    h.kv_greedy = False  # keep freed bytes for the reloads
    h.pager.submit(Plan.of([(i, 2) for i in range(len(BLOCKS))]))
    h.settle()
    one = SPECS["w13"].bytes_at(8) - SPECS["w13"].bytes_at(2) + SPECS["w13"].table_bytes(2)
    h.pager.config.max_inflight_bytes = one
    h.pager.submit(Plan.of([(i, 8) for i in range(len(BLOCKS))]), direction="reload")
    h.boundary()
    loading = [op for op in h.pager._ops.values() if op.phase is OpPhase.LOADING]
    assert len(loading) == 1 and h.pager.inflight_bytes <= one
    assert h.pager.counters.deferred_backpressure >= 1
    h.settle()
    assert all(r.committed_bits == 8 for r in h.table)


def test_budget_refusal_defers_and_staging_keeps_offload_possible() -> None:
    for staging in (0, None):
        h = loaded_harness(staging=staging)
        h.kv_grab_all()  # the KV cache holds every free byte
        h.pager.submit(Plan.of([(0, 5)]), direction="offload")
        for _ in range(3):
            h.complete_copies(9)
            h.complete_fences(99)
            h.boundary()
        if staging is None:  # the default staging reserve
            assert h.table.row(0).committed_bits == 5 and h.pager.counters.deferred_budget == 0
        else:
            assert h.table.row(0).committed_bits == 8 and h.pager.counters.deferred_budget >= 3
        # reload with no free memory: refused, not raised
        h.pager.submit(Plan.of([(1, 8), (2, 8)]))
        h.kv_release(1.0)
        h.settle()
        assert h.table.row(0).committed_bits == 5


def test_replanning_while_in_flight_aborts_unwanted_copies() -> None:
    h = loaded_harness()
    h.pager.submit(Plan.of([(3, 3)]))
    h.settle()
    used = h.budget.used("weights")
    reloads = h.pager.counters.reloads_committed
    h.pager.submit(Plan.of([(3, 8)]))
    h.boundary()
    assert h.budget.used("weights") > used
    h.pager.submit(Plan.of([(3, 3)]))  # changed our mind while the planes are in flight
    h.pager.submit(Plan.of([(3, 3)]))  # and again: idempotent
    h.complete_copies(9)
    h.boundary()
    assert h.pager.counters.ops_aborted == 1 and h.table.row(3).committed_bits == 3
    assert h.budget.used("weights") == used and h.pager.counters.reloads_committed == reloads
    h.settle()


def test_scripted_policy_drives_the_pager_to_its_target() -> None:
    h = loaded_harness()
    loads = h.pager.counters.transitions
    before = h.table.committed_bytes()
    target = 5000
    plan = ScriptedPolicy().plan(h.table, target, Observation())
    h.pager.submit(plan, direction="offload")
    h.settle()
    freed = before - h.table.committed_bytes()
    assert freed >= target and sum(h.kv_grants) >= target - 2 * SPECS["w13"].table_bytes(8)
    state = h.pager.state()
    assert state["counters"]["transitions"] == loads + len(plan) and state["queued_blocks"] == 0
    assert state["weights_committed_bytes"] == h.table.committed_bytes()


def test_submit_rejects_bad_plans() -> None:
    h = loaded_harness()
    with pytest.raises(ValueError, match="appears twice"):
        h.pager.submit(Plan.of([(0, 4), (0, 5)]))
    with pytest.raises(ValueError, match="floor..ceiling"):
        h.pager.submit(Plan.of([(0, 1)]))
    with pytest.raises(ValueError, match="does not raise"):
        h.pager.submit(Plan.of([(0, 4)]), direction="reload")


def test_free_never_relocates_a_plane_still_being_copied_in() -> None:
    h = loaded_harness()
    h.kv_greedy = False
    w13_a, w13_b = 0, 2  # two gate_up blocks: their planes share one arena size class
    h.pager.submit(Plan.of([(w13_b, 4)]))
    h.settle()
    h.pager.submit(Plan.of([(w13_b, 8), (w13_a, 6)]))
    h.boundary()  # b's planes 4..7 are being copied into the tail slots; a loads table_6
    tail = h.arena.last_live(SPECS["w13"].plane_bytes())
    assert h.table.owner(tail) == (w13_b, "plane", 7)
    h.complete_copies(1)  # only a's table arrives
    h.boundary()  # a commits 6 bits
    h.complete_fences(len(h.fences.issued))
    h.boundary()  # a's planes 6, 7 may go, but freeing them would move b's half-copied plane 7
    assert h.pager.counters.deferred_inbound >= 1
    assert h.table.row(w13_a).planes[6] is not None
    h.settle()  # every boundary re-verifies the planes the kernel reads
    assert h.table.row(w13_b).committed_bits == 8 and h.table.row(w13_a).planes[6] is None


class FakeElasticKV:
    """A KV cache of fixed-size blocks that grows with freed weight bytes and shrinks its free tail."""

    def __init__(self, budget: MemoryBudget, bytes_per_block: int) -> None:
        self.budget, self.bpb = budget, bytes_per_block
        self.capacity = 0  # blocks
        self.in_use = 0
        self.grow(budget.free)

    def grow(self, nbytes: int) -> None:
        blocks = nbytes // self.bpb
        res = self.budget.try_reserve("kv", blocks * self.bpb)
        assert res is not None
        self.budget.commit(res)
        self.capacity += blocks

    def shrink(self, nbytes: int) -> int:
        blocks = min(nbytes // self.bpb, self.capacity - self.in_use)
        self.capacity -= blocks
        self.budget.release("kv", blocks * self.bpb)
        return blocks * self.bpb


def test_controller_trades_weight_bytes_for_kv_blocks_and_back() -> None:
    h = loaded_harness(slack=4096)
    kv = FakeElasticKV(h.budget, bytes_per_block=256)
    h.pager.on_bytes_freed = kv.grow
    ctrl = PagingController(
        h.pager, ScriptedPolicy(), KVPressureSignal(threshold_blocks=4, bytes_per_block=256, relax_blocks=12, relax_checks=2), kv
    )
    start_blocks, full_weights = kv.capacity, h.table.committed_bytes()

    def run(demand: int, iterations: int) -> None:
        for _ in range(iterations):
            kv.in_use = min(demand, kv.capacity)
            ctrl.step(available_blocks=kv.capacity - kv.in_use)
            h.verify(h.snapshot())
            h.check_invariants()
            h.complete_copies(len(h.copier.pending))
            h.complete_fences(len(h.fences.issued))

    run(demand=40, iterations=40)  # burst: far more KV than the slack gives
    assert kv.capacity - 40 >= 5, "pressure not relieved: free blocks still at or below T_blk"
    assert h.table.committed_bytes() < full_weights and ctrl.pager.counters.offloads_committed > 0
    burst_weights = h.table.committed_bytes()
    run(demand=0, iterations=40)  # quiet: the KV cache gives memory back and the weights reload
    assert h.table.committed_bytes() == full_weights > burst_weights  # all blocks back at 8 bits
    assert kv.capacity == 12 < start_blocks  # T_hi free blocks kept, the rest went back to the weights


def test_an_operator_hold_keeps_the_plan_but_not_the_pressure() -> None:
    """allow_reload=False (set_internal_state paged_weight_hold_reloads=1): a quiet period neither shrinks the
    KV cache nor reloads; pressure still offloads; releasing the hold reloads."""
    h = loaded_harness(slack=4096)
    kv = FakeElasticKV(h.budget, bytes_per_block=256)
    h.pager.on_bytes_freed = kv.grow
    ctrl = PagingController(
        h.pager, ScriptedPolicy(), KVPressureSignal(threshold_blocks=4, bytes_per_block=256, relax_blocks=12, relax_checks=2), kv
    )
    full_weights = h.table.committed_bytes()

    def run(demand: int, iterations: int, allow_reload: bool) -> None:
        for _ in range(iterations):
            kv.in_use = min(demand, kv.capacity)
            ctrl.step(available_blocks=kv.capacity - kv.in_use, allow_reload=allow_reload)
            h.check_invariants()
            h.complete_copies(len(h.copier.pending))
            h.complete_fences(len(h.fences.issued))

    run(demand=40, iterations=40, allow_reload=False)  # the hold does not refuse offloads under pressure
    held_weights, held_capacity = h.table.committed_bytes(), kv.capacity
    assert held_weights < full_weights
    run(demand=0, iterations=40, allow_reload=False)  # quiet, but held
    assert (h.table.committed_bytes(), kv.capacity) == (held_weights, held_capacity)
    run(demand=0, iterations=40, allow_reload=True)  # released
    assert h.table.committed_bytes() == full_weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pager_with_vmm_arena_copy_stream_and_events() -> None:
    """The real thing on one GPU: VMM arena (poison on), copy stream, CUDA events; the device page table
    always points at valid bytes, and offloading to the floor gives memory back to the driver."""
    from pagedweight.runtime.arena import CudaVmmPlaneArena
    from pagedweight.runtime.copier import TorchCopier
    from pagedweight.runtime.fences import CudaEventFenceFactory

    dev = torch.device("cuda", torch.cuda.current_device())
    specs = {
        "w13": BlockSpec(out_features=512, in_features=1024, bits_min=2, bits_max=8, group_size=128),
        "w2": BlockSpec(out_features=1024, in_features=256, bits_min=2, bits_max=8, group_size=128),
    }
    layers, experts = 8, 16  # ~110 MB of planes and tables: well above the per-class granule rounding
    blocks = [(BlockKey(l, e, p), specs[p]) for l in range(layers) for e in range(experts) for p in PROJS]
    table = WeightPageTable(blocks, initial_bits=8)
    host = HostModel(table, seed=1)
    for d in (host.planes, host.tables):
        for k in d:
            d[k] = d[k].pin_memory()
    arena = CudaVmmPlaneArena(arena_size_classes(table), device_id=dev.index, poison=True)
    full = sum(s.bytes_at(8) for _, s in blocks)
    budget = MemoryBudget(full + (64 << 20))
    freed: list[int] = []
    pager = Pager(
        table, arena, budget, host, TorchCopier.for_device(dev), CudaEventFenceFactory(),
        on_bytes_freed=freed.append, config=PagerConfig(max_inflight_bytes=4 << 20),
    )
    tensors = {(l, p): torch.zeros(experts, 10, dtype=torch.int64, device=dev) for l in range(layers) for p in PROJS}
    for (l, p), t in tensors.items():
        pager.mirror.bind(l, p, t)

    def verify() -> None:
        torch.cuda.synchronize()
        for row in table:
            k, spec = row.key, row.spec
            dev_row = tensors[k.layer, k.proj][k.expert].tolist()
            assert dev_row == pager.mirror.expected_row(row.block_id)
            q = dev_row[0]
            got = arena._view(dev_row[1], spec.table_bytes(q)).cpu()
            assert torch.equal(got, host.table_bytes(row.block_id, q)), f"{k}: table {q}"
            for p in range(q):
                got = arena._view(dev_row[2 + p], spec.plane_bytes()).cpu()
                assert torch.equal(got, host.planes[row.block_id][p].reshape(-1)), f"{k}: plane {p}"

    try:
        pager.drain(wait=torch.cuda.synchronize)
        verify()
        free_full, _ = torch.cuda.mem_get_info(dev)
        pager.submit(Plan.of([(i, 2) for i in range(len(blocks))]), direction="offload")
        pager.drain(wait=torch.cuda.synchronize)
        verify()
        free_floor, _ = torch.cuda.mem_get_info(dev)
        expect = full - sum(s.bytes_at(2) for _, s in blocks)
        slack = len(arena_size_classes(table)) * arena.granularity
        assert sum(freed) >= expect - 2 * max(s.table_bytes(8) for s in specs.values())
        assert expect > 3 * slack  # so the check below is not vacuous
        # the caching allocator may grow by a few MiB meanwhile (page-table staging tensors)
        assert free_floor - free_full >= expect - slack - (8 << 20), "offloaded planes did not go back to the driver"
        rng = random.Random(0)
        x = torch.randn(1024, 1024, device=dev)
        for it in range(300):  # forwards keep the GPU busy while plans change underneath
            if it % 5 == 0:
                ids = rng.sample(range(len(blocks)), 32)
                pager.submit(Plan.of([(i, rng.randint(2, 8)) for i in ids]))
            x = torch.tanh(x @ x) * 0.5
            pager.on_boundary()
            if it % 50 == 49:
                verify()
        pager.drain(wait=torch.cuda.synchronize)
        verify()
        arena.check()
        assert budget.used("weights") == table.resident_bytes() + pager.staging_free
    finally:
        torch.cuda.synchronize()
        arena.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runtime_fences_follow_the_stream_current_at_the_boundary() -> None:
    """The runtime built at model load (default stream current) records each pager fence on the stream current when
    the boundary runs, which the serving loop makes the scheduler's forward stream: a forward still running there
    keeps its planes from being freed. (A fence on the load-time stream completes while that forward still reads.)"""
    from pagedweight.config import PagedWeightConfig
    from pagedweight.runtime.paged_runtime import PagedRuntime
    from tests.support.random_stores import random_layer_stores

    dev = torch.device("cuda", torch.cuda.current_device())
    runtime = PagedRuntime.build(PagedWeightConfig(enable=True, bits=8), random_layer_stores(2, 4, device=dev), dev)
    torch.cuda.synchronize()
    forward = torch.cuda.Stream(dev)
    with torch.cuda.stream(forward):
        torch.cuda._sleep(1 << 30)  # a forward that is still running (~0.5 s of spinning)
        fence = runtime.pager.fences.record()
    assert not fence.done()
    forward.synchronize()
    assert fence.done()


def test_resident_views_dequantize_like_the_host_copy() -> None:
    from pagedweight.format.layout import dequantize

    h = loaded_harness()
    spec = SPECS["w2"]
    h.pager.submit(Plan.of([(1, 5)]))
    h.settle()
    planes, table = h.pager.resident(1)
    assert len(planes) == 5 and planes[0].shape == (16, 8) and table.dtype == torch.float16
    got = dequantize(torch.stack(planes), table, 5, "bcq", spec.group_size)
    want = dequantize(h.host.planes[1][:5], h.host.tables[1, 5], 5, "bcq", spec.group_size)
    assert torch.equal(got, want)
