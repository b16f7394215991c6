"""Two TP ranks (gloo, CPU) make identical PagedWeight decisions at every iteration.

Each rank builds the real runtime (page table, host arena, budget, pager) over the same expert blocks and
runs the real PagedWeightScheduler.step against the same KV-pressure sequence. The ranks differ as two
GPUs would: they sample routing statistics differently (rank 1 sees them reversed), and their fences (copy
completions, forward-stream fences) complete at different iterations. With the per-iteration exchange
(rank 0's inputs plus fences agreed by every rank) both ranks commit the same bitwidths and hand the same
bytes to the KV cache at every iteration, and their digests never differ; without the fence agreement, or
without any exchange, they diverge (control runs) and the digest check counts it. The same holds for the
quality policy, whose RoutingObserver each rank's forward feeds differently: the source rank's traffic is
agreed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS, EXPERTS, STEPS = 2, 6, 40


class _Allocator:
    def __init__(self) -> None:
        self.free = 0

    def available_size(self) -> int:
        return self.free


class _Tree:
    def evictable_size(self) -> int:
        return 0


class _Clock:
    now = None  # the iteration; None while the runtime loads (its drain is synchronous: fences done at once)


class _SkewedFence:
    def __init__(self, clock: _Clock, ready_at) -> None:
        self.clock, self.ready_at = clock, ready_at

    def done(self) -> bool:
        return self.ready_at is None or self.clock.now >= self.ready_at


class _SkewedFences:
    """FenceFactory whose fences complete 0-2 iterations after recording, differently on each rank."""

    def __init__(self, clock: _Clock, rank: int) -> None:
        self.clock, self.rank, self.n = clock, rank, 0

    def record(self) -> _SkewedFence:
        if self.clock.now is None:
            return _SkewedFence(self.clock, None)
        self.n += 1
        return _SkewedFence(self.clock, self.clock.now + (self.n + self.rank) % 3)


class _SkewedCopier:
    """Copies at once but reports completion 1-3 iterations later, differently on each rank."""

    def __init__(self, inner, clock: _Clock, rank: int) -> None:
        self.inner, self.clock, self.rank, self.n = inner, clock, rank, 0

    def copy(self, pairs) -> _SkewedFence:
        self.inner.copy(pairs)
        if self.clock.now is None:
            return _SkewedFence(self.clock, None)
        self.n += 1
        return _SkewedFence(self.clock, self.clock.now + 1 + (self.n * (self.rank + 1)) % 3)


class _Scheduler:
    def __init__(self) -> None:
        self.token_to_kv_pool_allocator = _Allocator()
        self.tree_cache = _Tree()
        self.max_total_num_tokens = 1000


def _stores(rank: int, device: torch.device):
    from tests.support.random_stores import random_layer_stores

    stores = random_layer_stores(LAYERS, EXPERTS, device=device)
    for store in stores:
        layer = store.layer_id
        mass = torch.arange(1, EXPERTS + 1, dtype=torch.float32) * (layer + 1)
        store.routing_mass.copy_(mass.flip(0) if rank == 1 else mass)  # each rank samples differently
    return stores


def _worker(rank: int, init_file: str, mode: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from pagedweight.config import PagedWeightConfig
        from pagedweight.runtime.paged_runtime import PagedRuntime
        from pagedweight.planner.factory import make_policy
        from pagedweight.runtime.controller import PagingController
        from pagedweight.runtime.pressure import KVPressureSignal
        from pagedweight.serving.serving_loop import PagedWeightScheduler
        from pagedweight.runtime.copier import TorchCopier
        from pagedweight.runtime.fence_ledger import FenceLedger
        from pagedweight.runtime.tp_sync import make_tp_sync

        cuda = mode == "cuda"
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        clock = _Clock()
        fences = copier = None
        if not cuda:  # on CUDA the fences are real events (VMM arena, copy stream)
            fences, copier = _SkewedFences(clock, rank), _SkewedCopier(TorchCopier(None), clock, rank)
        quality = mode.startswith("quality")
        agree = mode in ("full", "cuda") or quality
        ledger = FenceLedger(started=False) if agree else None  # as serving.builder.build_weights makes it
        runtime = PagedRuntime.build(PagedWeightConfig(enable=True, bits=8), _stores(rank, device), device,
                                     ledger=ledger, fences=fences, copier=copier)
        signal = KVPressureSignal(threshold_blocks=100, bytes_per_block=512, relax_blocks=400, relax_checks=2)
        policy = _quality_policy() if quality else make_policy("hotness", options={"interval_s": 0.001})
        controller = PagingController(runtime.pager, policy, signal, reload_headroom_bytes=runtime.reload_headroom_bytes)
        tp = None
        if mode != "none":
            tp = make_tp_sync(runtime.pager, None, ledger, dist.group.WORLD, 0, rank == 0)
        state = PagedWeightScheduler(runtime, controller, page_size=1, capacity_blocks=1000, tp_sync=tp)
        if mode == "quality_local":  # control: each rank folds its own observer's traffic, as before the fix
            state._fresh_traffic = lambda: None
        traffic_rng = torch.Generator().manual_seed(100 + rank)
        sched = _Scheduler()
        trace = []
        for i in range(STEPS):
            clock.now = i
            # The same KV pressure on both ranks: a short dip below the threshold every 10 iterations
            # (a few blocks must go down: which ones is the policy's choice), quiet in between.
            sched.token_to_kv_pool_allocator.free = 95 if i % 10 == 0 else 900
            state._routing_at = -1.0  # sample routing every step (rank 0's sample is what counts under sync)
            if quality:  # each rank's MoE forward routes differently (another hot expert, other inputs)
                state._traffic_at = -1.0
                record_rank_traffic(policy.observer, i, rank, traffic_rng)
            if cuda:
                # Rank 1's device runs behind (a busy kernel before each step's work), so its events complete
                # later than rank 0's, as on a slower or busier GPU.
                torch.cuda._sleep(2_000_000 * (1 + rank * (i % 3)))
            state.step(sched)
            trace.append([[r.committed_bits for r in runtime.table], runtime.pager.counters.bytes_to_kv])
        tp_state = tp.state() if tp is not None else None
        mass = policy.stats.normalized_mass().tolist() if quality else None
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"trace": trace, "tp": tp_state, "mass": mass}))
    finally:
        dist.destroy_process_group()


def record_rank_traffic(observer, i: int, rank: int, rng: torch.Generator) -> None:
    """One iteration of a rank's MoE forward as the quality policy's observer sees it: another hot expert per rank
    and layer, other inputs."""
    for layer in range(LAYERS):
        hot = (i // 5 + 3 * rank + layer) % EXPERTS
        ids = torch.tensor([[hot, (hot + 1) % EXPERTS]] * 32)
        observer.record(layer, torch.randn(32, 8, generator=rng), ids, torch.tensor([[0.9, 0.1]] * 32))


def _quality_policy():
    """The quality policy over a synthetic calibration of the random stores (bcq 2..8 bits), with its observer."""
    import numpy as np

    from pagedweight.planner.calibration import APIdentity, CalibrationData
    from pagedweight.planner.observer import RoutingObserver
    from pagedweight.planner.prompt_residual import PromptResidualModel
    from pagedweight.planner.quality_policy import QualityOptions, QualityPolicy
    from pagedweight.planner.routing_stats import BucketConfig, default_floor_stages
    from pagedweight.planner.sensitivity import SensitivityTable

    rng = np.random.default_rng(0)  # the same calibration on both ranks
    sens = {(l, e, p): SensitivityTable({b: float((9 - b) ** 2 * rng.uniform(0.5, 1.5)) for b in range(2, 9)})
            for l in range(LAYERS) for e in range(EXPERTS) for p in ("w13", "w2")}
    calib = CalibrationData(
        ap=APIdentity("bcq", 2, 8, "sha"), num_layers=LAYERS, num_experts=EXPERTS, sensitivity=sens,
        routing_mass=np.full((LAYERS, EXPERTS), 1.0 / EXPERTS),
        buckets=BucketConfig(1.5, 0.5, {"hot": 3.0, "warm": 1.0, "cold": 0.25}, default_floor_stages(2, 8)),
        residual=PromptResidualModel({}, np.ones((LAYERS, EXPERTS, 3))),
    )
    # a short memory, so the traffic of a few iterations decides the hot / cold buckets (and so the floors)
    options = QualityOptions(rebuild_interval_s=0.0, prior_tokens=8.0, horizon_tokens=64.0)
    return QualityPolicy(calib, options, observer=RoutingObserver(LAYERS, EXPERTS))


def _run(tmp_path: Path, mode: str) -> tuple[dict, dict]:
    out = tmp_path / mode
    out.mkdir()
    mp.start_processes(_worker, args=(str(tmp_path / f"init-{mode}"), mode, str(out)), nprocs=2,
                       start_method="spawn", join=True)
    return tuple(json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))


@pytest.mark.timeout(600)
def test_exchange_keeps_ranks_identical(tmp_path):
    r0, r1 = _run(tmp_path, "full")
    bits = [step[0] for step in r0["trace"]]
    assert any(any(b < 8 for b in step) for step in bits), "the bursts should have lowered some bitwidths"
    assert r0["trace"][-1][1] > 0, "offloads should have handed bytes to the KV side"
    assert r0["trace"] == r1["trace"]
    assert r0["tp"]["digest_mismatches"] == 0 and r1["tp"]["digest_mismatches"] == 0
    assert r0["tp"]["exchanges"] == STEPS and r0["tp"]["fences_agreed"] > 0
    # the agreement's own cost is measured: every exchange on this rank, every rank's as reported one late
    agree = r0["tp"]["agreement_us"]
    assert agree["count"] == STEPS and 0 < agree["p50_us"] <= agree["p99_us"] <= agree["max_us"]
    assert [h["count"] for h in r0["tp"]["rank_agreement_us"]] == [STEPS - 1, STEPS - 1]
    assert r1["tp"]["rank_agreement_us"] == r0["tp"]["rank_agreement_us"]  # the same reports reach both ranks
    assert 0 < r0["tp"]["report_bytes"]["last"] <= r0["tp"]["report_bytes"]["max"] < 64 * 1024
    # the pickled exchange runs on the iterations that carry routing statistics (here every one: the ranks
    # sample every step), on both ranks alike
    assert r0["tp"]["object_exchanges"] == r1["tp"]["object_exchanges"] == STEPS


@pytest.mark.timeout(600)
def test_quality_policy_agrees_on_the_source_ranks_traffic(tmp_path):
    """The quality policy's RoutingObserver is fed by each rank's own MoE forward; here the ranks' forwards
    route differently. The source rank's drain travels in the agreed inputs, so both ranks fold the same
    traffic and commit the same bitwidths at every iteration."""
    r0, r1 = _run(tmp_path, "quality")
    assert any(any(b < 8 for b in step[0]) for step in r0["trace"]), "the dips should have lowered some bitwidths"
    assert r0["trace"] == r1["trace"]
    assert r0["mass"] == r1["mass"] and r0["tp"]["digest_mismatches"] == 0


@pytest.mark.timeout(600)
def test_quality_policy_without_agreed_traffic_sees_different_routing(tmp_path):
    """Control: each rank folds its own observer's traffic: the routing statistics the plans rank by differ."""
    r0, r1 = _run(tmp_path, "quality_local")
    assert r0["mass"] != r1["mass"]
    assert [s[0] for s in r0["trace"]] != [s[0] for s in r1["trace"]], "and so do the committed bitwidths"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(600)
def test_exchange_keeps_cuda_ranks_identical(tmp_path):
    """Two processes on one GPU, each with the real CUDA runtime (VMM arena, copy stream, CUDA events); rank 1's
    device runs behind. With the exchange both commit the same bitwidths and free the same bytes at every
    iteration, whatever their events say locally."""
    r0, r1 = _run(tmp_path, "cuda")
    assert any(any(b < 8 for b in step[0]) for step in r0["trace"]), "the dips should have lowered some bitwidths"
    assert r0["trace"] == r1["trace"]
    assert r0["tp"]["digest_mismatches"] == 0 and r0["tp"]["fences_agreed"] > 0


@pytest.mark.timeout(600)
def test_without_fence_agreement_ranks_diverge(tmp_path):
    """Control: the same inputs on both ranks, but each rank polls its own fences: commits and KV hand-overs
    land at different iterations, and the digest check sees it."""
    r0, r1 = _run(tmp_path, "inputs")
    assert r0["trace"] != r1["trace"]
    assert r0["tp"]["digest_mismatches"] > 0


@pytest.mark.timeout(600)
def test_without_exchange_ranks_diverge(tmp_path):
    """Control: no exchange at all; the ranks' own routing samples make them commit different blocks."""
    r0, r1 = _run(tmp_path, "none")
    assert [s[0] for s in r0["trace"]] != [s[0] for s in r1["trace"]]


class _Event:
    def __init__(self, done: bool = False) -> None:
        self.is_done, self.waited = done, False

    def query(self) -> bool:
        return self.is_done

    def synchronize(self) -> None:
        self.waited = True


def test_fence_ledger_marks_only_fences_every_rank_completed():
    from pagedweight.runtime.fence_ledger import FenceLedger

    ledger = FenceLedger()
    record = ledger.wrap_event_fn(lambda stream: _Event())
    fences = [record(None) for _ in range(4)]
    assert [f.seq for f in fences] == [0, 1, 2, 3] and ledger.recorded == 4
    fences[0].inner.is_done = fences[2].inner.is_done = True
    assert ledger.local_done() == (0, 2)
    assert not any(f.query() for f in fences)  # local completion alone decides nothing
    assert ledger.agree([ledger.local_done(), (1, 2, 3)]) == 1  # only fence 2 is done on both ranks
    assert [f.done() for f in fences] == [False, False, True, False]
    assert ledger.pending == 3 and ledger.agreed == 1
    fences[1].synchronize()  # a blocking wait goes to the device fence (rank-symmetric by construction)
    assert fences[1].inner.waited and not fences[1].done()


def test_make_tp_sync_refuses_a_busy_pager():
    from pagedweight.runtime.fence_ledger import FenceLedger
    from pagedweight.runtime.tp_sync import make_tp_sync

    class _Busy:
        def idle(self) -> bool:
            return False

    with pytest.raises(RuntimeError, match="idle pager"):
        make_tp_sync(_Busy(), None, FenceLedger(started=False), None, 0, True)


class _EventFences:
    def record(self) -> _Event:
        return _Event()


class _EventCopier:
    def copy(self, pairs) -> _Event:
        return _Event()


class _IdlePager:
    def idle(self) -> bool:
        return True


class _ParkedKV:
    def __init__(self, backing) -> None:
        self.polls = 0
        self.backing = backing

    def poll(self) -> int:
        self.polls += 1
        return 0


def test_every_fence_source_is_built_over_the_ledger_make_tp_sync_starts(tmp_path, monkeypatch):
    """The pager's fences and copier (PagedRuntime.build) and the KV backing's fences (make_backing) are built over
    the runtime's ledger; it numbers nothing until make_tp_sync starts it (the load-time drain and SGLang's KV
    sizing wait blockingly), then every fence of the three sources is a ledger fence."""
    from pagedweight.kvcache import elastic_kv_backing
    from pagedweight.runtime.fence_ledger import FenceLedger
    from pagedweight.runtime.tp_sync import make_tp_sync

    ledger = FenceLedger(started=False)
    fences, copier = ledger.wrap_factory(_EventFences()), ledger.wrap_copier(_EventCopier())

    class _Owner:  # only what make_backing and the backing's constructor read (no CUDA here)
        device_id = 0

    monkeypatch.setattr(elastic_kv_backing, "_cuda_event_fence", lambda device_id: (lambda stream: _Event()))
    backing = elastic_kv_backing.make_backing(type("Pool", (), {"page_size": 1})(), 8, _Owner(), ledger)
    kv = _ParkedKV(backing)
    assert isinstance(fences.record(), _Event) and isinstance(backing._fence(None), _Event)  # before the start
    assert ledger.recorded == 0
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        sync = make_tp_sync(_IdlePager(), kv, ledger, dist.group.WORLD, 0, True)
    finally:
        dist.destroy_process_group()
    assert kv.polls == 1  # memory parked before the ledger started is released once, on every rank
    fence = backing._fence(None)
    assert fence.seq == 0 and not fence.query()  # a KV release fence is now a ledger fence
    assert fences.record().seq == 1 and copier.copy([]).seq == 2
    assert sync.ledger is ledger and ledger.recorded == 3


class _DoneEvent:
    def done(self) -> bool:
        return True


def test_report_row_round_trips_inputs_and_digest():
    from pagedweight.runtime.tp_sync import FLAG_FENCES, FLAG_PAYLOAD, FLAG_SRC, ROW, RankDigest, StepInputs, pack_report
    from pagedweight.runtime.tp_sync import unpack_digest, unpack_inputs

    local = StepInputs(available_blocks=7, evictable_blocks=3, now_s=12.345678901234, routing={(0, 1): 0.5},
                       waiting_blocks=9, reloads_held=True)
    digest = RankDigest(iteration=41, commits_crc=0xDEADBEEF, transitions=5, bytes_to_kv=1 << 40,
                        kv_capacity_tokens=123456, kv_available_tokens=789, fences_recorded=33)
    row = pack_report(local, True, tuple(range(20)), digest, 17.25)
    assert row.shape == (ROW,) and row.dtype == torch.int64
    values = row.tolist()
    assert values[0] == FLAG_PAYLOAD | FLAG_FENCES | FLAG_SRC
    assert unpack_digest(values) == digest
    back = unpack_inputs(values, None, None)
    assert back == StepInputs(7, 3, 12.345678901234, None, 9, True, None)  # the float's bits, exactly
    quiet = pack_report(StepInputs(1, 2, 0.5, None), False, (4, 5), digest, 0.0).tolist()
    assert quiet[0] == 0  # nothing to send beyond the row: no pickled exchange


def test_fences_beyond_the_row_are_agreed_through_the_pickled_exchange(tmp_path):
    """A rank that completed more fences than the row holds sends them all in the second exchange."""
    from pagedweight.runtime.fence_ledger import FenceLedger
    from pagedweight.runtime.tp_sync import FENCE_SLOTS, RankDigest, StepInputs, TpStepSync

    ledger = FenceLedger()
    fences = [ledger.track(_DoneEvent()) for _ in range(FENCE_SLOTS + 5)]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        sync = TpStepSync(dist.group.WORLD, 0, True, ledger)
        digest = RankDigest(1, 0, 0, 0, 100, 50, len(fences))
        out = sync(StepInputs(4, 0, 1.0, None), digest)
        assert out == StepInputs(4, 0, 1.0, None)
        assert all(f.done() for f in fences) and ledger.agreed == len(fences)
        assert sync.object_exchanges == 1
        sync(StepInputs(4, 0, 2.0, None), digest)  # nothing pending, no payload: the row alone
        assert sync.object_exchanges == 1 and sync.exchanges == 2
    finally:
        dist.destroy_process_group()
