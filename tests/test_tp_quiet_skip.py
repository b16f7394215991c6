"""Quiet windows of the TP agreement (issue #20): two gloo ranks skip the same iterations, and only safe ones.

Each rank builds the real runtime (as tests/test_tp_sync.py: fences that complete at different iterations on each
rank, routing sampled differently per rank) and runs the real PagedWeightScheduler.step with
`blocks_per_iteration` set, so an exchange on a quiet system covers K = QUIET_WINDOW iterations. The schedules:

- quiet: free KV, nothing to do: both ranks exchange on the same few iterations and skip the rest;
- ramp: from iteration 20 the free KV falls by exactly the most one iteration may allocate; the margin ends the
  windows in time: no skipped iteration sees the available blocks at the low watermark, and the offload fires at
  the very iteration it would without windows;
- waiting: a request that needs more KV than is free arrives in the middle of a window; it is acted on at the
  window's end (the next exchange), not earlier and not later;
- busy: pressure dips put fences in flight: every iteration where a rank's pager is not idle (or a fence is
  pending, or blocks wait for a reload) exchanges (a drop beyond the per-iteration bound may wait for the
  window's end);
- quality: the quality policy with each rank's own observer traffic: identical plans and routing statistics on
  both ranks (the source rank's traffic, accumulated over the windows, wins).

Gloo's timeout turns a rank that entered a collective alone into a failure instead of a hang.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.test_tp_sync import (_Clock, _quality_policy, _Scheduler, _SkewedCopier, _SkewedFences, _stores,
                                 record_rank_traffic)

LOW, PER_ITER = 100, 10  # the low watermark and the most blocks one iteration may allocate (both in blocks)
STEPS = 96


class _FakeKV:
    """The elastic KV cache as the controller reads it: room to grow (so a waiting request counts), at its minimum."""

    max_tokens, capacity_tokens, min_tokens = 5000, 1000, 1000

    def shrink(self, nbytes: int) -> int:
        return 0


def _available(mode: str, i: int) -> int:
    if mode == "ramp":
        return 650 if i < 20 else max(0, 650 - PER_ITER * (i - 19))
    if mode in ("busy", "quality"):
        # a dip at the first exchange, and one (a drop beyond what an iteration may allocate, so it may land in a
        # window) held for one window's length
        return 95 if i == 0 or 40 <= i < 56 else 900
    return 900


def _worker(rank: int, init_file: str, mode: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from pagedweight.config import PagedWeightConfig
        from pagedweight.planner.factory import make_policy
        from pagedweight.runtime.controller import PagingController
        from pagedweight.runtime.copier import TorchCopier
        from pagedweight.runtime.fence_ledger import FenceLedger
        from pagedweight.runtime.paged_runtime import PagedRuntime
        from pagedweight.runtime.pressure import KVPressureSignal
        from pagedweight.runtime.tp_sync import QUIET_WINDOW, make_tp_sync
        from pagedweight.serving.serving_loop import PagedWeightScheduler

        clock = _Clock()
        fences, copier = _SkewedFences(clock, rank), _SkewedCopier(TorchCopier(None), clock, rank)
        ledger = FenceLedger(started=False)
        device = torch.device("cpu")
        runtime = PagedRuntime.build(PagedWeightConfig(enable=True, bits=8), _stores(rank, device), device,
                                     ledger=ledger, fences=fences, copier=copier)
        high = 700 if mode == "ramp" else 400
        signal = KVPressureSignal(threshold_blocks=LOW, bytes_per_block=512, relax_blocks=high, relax_checks=2)
        quality = mode == "quality"
        policy = _quality_policy() if quality else make_policy("hotness", options={"interval_s": 0.001})
        kv = _FakeKV() if mode == "waiting" else None
        controller = PagingController(runtime.pager, policy, signal, kv=kv,
                                      reload_headroom_bytes=runtime.reload_headroom_bytes)
        tp = make_tp_sync(runtime.pager, None, ledger, dist.group.WORLD, 0, rank == 0)
        state = PagedWeightScheduler(runtime, controller, page_size=1, capacity_blocks=1000, tp_sync=tp,
                                     blocks_per_iteration=PER_ITER)
        traffic_rng = torch.Generator().manual_seed(100 + rank)
        sched = _Scheduler()
        sched.waiting_queue = []
        steps = []
        for i in range(STEPS):
            clock.now = i
            available = _available(mode, i)
            sched.token_to_kv_pool_allocator.free = available
            # a request needing 1700 blocks while 900 are free waits from iteration 5 to 40 (it lacks 800)
            waiting = mode == "waiting" and 5 <= i < 40
            sched.waiting_queue = ([SimpleNamespace(origin_input_ids=[0] * 1700,
                                                    sampling_params=SimpleNamespace(max_new_tokens=0))]
                                   if waiting else [])
            state._routing_at = -1.0  # sample at every exchange
            if quality:
                state._traffic_at = -1.0
                record_rank_traffic(policy.observer, i, rank, traffic_rng)
            idle = runtime.pager.idle() and ledger.pending == 0
            at_top = all(r.committed_bits == r.ceiling_bits for r in runtime.table)
            before = tp.exchanges
            state.step(sched)
            steps.append({"available": available, "exchanged": tp.exchanges > before, "idle": idle,
                          "top": at_top, "offload_signals": signal.offload_signals,
                          "bits": [r.committed_bits for r in runtime.table],
                          "bytes_to_kv": runtime.pager.counters.bytes_to_kv})
        mass = policy.stats.normalized_mass().tolist() if quality else None
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"steps": steps, "tp": tp.state(), "window": QUIET_WINDOW, "mass": mass}))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, mode: str) -> tuple[dict, dict]:
    out = tmp_path / mode
    out.mkdir()
    mp.start_processes(_worker, args=(str(tmp_path / f"init-{mode}"), mode, str(out)), nprocs=2,
                       start_method="spawn", join=True)
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    # the one thing that must never happen: ranks taking different paths. Same iterations exchanged, same plans.
    assert [s["exchanged"] for s in r0["steps"]] == [s["exchanged"] for s in r1["steps"]]
    assert [(s["bits"], s["bytes_to_kv"]) for s in r0["steps"]] == [(s["bits"], s["bytes_to_kv"]) for s in r1["steps"]]
    for r in (r0, r1):
        tp = r["tp"]
        assert tp["digest_mismatches"] == 0
        assert tp["exchanges"] + tp["skipped"] == STEPS == len(r["steps"])
        assert tp["exchanges"] == sum(s["exchanged"] for s in r["steps"])
    return r0, r1


@pytest.mark.timeout(300)
def test_quiet_ranks_skip_the_same_iterations(tmp_path):
    r0, r1 = _run(tmp_path, "quiet")
    k = r0["window"]
    assert r0["tp"]["exchanges"] == r1["tp"]["exchanges"] == -(-STEPS // k) < STEPS
    assert [i for i, s in enumerate(r0["steps"]) if s["exchanged"]] == list(range(0, STEPS, k))
    assert r0["tp"]["skipped"] == r1["tp"]["skipped"] == STEPS - -(-STEPS // k)


@pytest.mark.timeout(300)
def test_margin_ends_windows_before_the_low_watermark(tmp_path):
    r0, _ = _run(tmp_path, "ramp")
    steps = r0["steps"]
    k = r0["window"]
    assert r0["tp"]["skipped"] > 0
    # a window opens only with a margin of k iterations at the most allocation each, so neither a skipped
    # iteration nor the exchange that ends the window sees the available blocks at the low watermark
    ramp_windows = 0
    for i, s in enumerate(steps):
        if s["exchanged"] and i + 1 < STEPS and not steps[i + 1]["exchanged"]:  # this exchange opened a window
            assert s["available"] - k * PER_ITER > LOW, (i, s["available"])
            ramp_windows += i >= 20
            end = steps[i + k] if i + k < STEPS else None
            assert end is None or (end["exchanged"] and end["available"] > LOW), (i, end)
        if not s["exchanged"]:
            assert s["available"] > LOW, (i, s["available"])
    assert ramp_windows > 0, "windows should have opened while the free KV was falling"
    # and the offload fires at the first iteration whose free KV reaches the low watermark, as without windows
    first_low = next(i for i, s in enumerate(steps) if s["available"] <= LOW)
    first_signal = next(i for i, s in enumerate(steps) if s["offload_signals"] > 0)
    assert first_signal == first_low
    assert any(b < 8 for b in steps[-1]["bits"])


@pytest.mark.timeout(300)
def test_pressure_arriving_mid_window_is_acted_on_at_its_end(tmp_path):
    r0, _ = _run(tmp_path, "waiting")
    steps = r0["steps"]
    k = r0["window"]
    assert steps[0]["exchanged"] and not any(s["exchanged"] for s in steps[1:k])  # the window the request lands in
    first_signal = next(i for i, s in enumerate(steps) if s["offload_signals"] > 0)
    assert first_signal == k  # arrived at iteration 5, inside [1, k): acted on at the next exchange, the window's end
    assert any(b < 8 for b in steps[k]["bits"] + steps[-1]["bits"]) or steps[-1]["bytes_to_kv"] > 0
    # while it waits (queued KV demand), every iteration after that exchange exchanges
    assert all(s["exchanged"] for s in steps[k:40])


@pytest.mark.timeout(300)
def test_fences_in_flight_and_wanted_reloads_force_an_exchange_every_iteration(tmp_path):
    r0, _ = _run(tmp_path, "busy")
    steps = r0["steps"]
    assert any(not s["idle"] for s in steps), "the dips should have put operations and fences in flight"
    assert r0["tp"]["skipped"] > 0, "and the quiet stretches between them should skip"
    for i, s in enumerate(steps):
        if not s["idle"]:
            assert s["exchanged"], (i, "a non-idle pager or a pending fence must exchange")
        if not s["top"] and s["available"] > 400:
            assert s["exchanged"], (i, "blocks below their ceiling with free KV: a reload is wanted")
    assert steps[0]["offload_signals"] == 1  # the first dip is acted on at once
    assert steps[55]["offload_signals"] > 1  # the held one by the end of the window it landed in


@pytest.mark.timeout(300)
def test_quality_policy_plans_agree_with_windows_and_different_traffic(tmp_path):
    r0, r1 = _run(tmp_path, "quality")
    assert r0["tp"]["skipped"] > 0
    assert any(any(b < 8 for b in s["bits"]) for s in r0["steps"])
    assert r0["mass"] == r1["mass"]  # the source rank's traffic, folded on both ranks


def test_quiet_window_rule():
    from pagedweight.runtime.tp_sync import StepInputs, quiet_window

    def win(available=900, evictable=0, waiting=0, held=False, idle=True, top=True, changed=False, per=10, k=16):
        return quiet_window(StepInputs(available, evictable, 0.0, None, waiting, held), idle, top, changed,
                            LOW, 400, per, k)

    assert win() == 15
    assert win(available=LOW + 16 * 10 + 1) == 15 and win(available=LOW + 16 * 10) == 0  # the margin, exactly
    assert win(idle=False) == 0 and win(waiting=1) == 0 and win(changed=True) == 0
    assert win(per=0) == 0 and win(k=1) == 0  # unknown demand per iteration / no window configured
    assert win(top=False) == 0  # free above the high watermark with something to reload
    assert win(top=False, held=True) == 15  # reloads held: the relax would do nothing
    assert win(available=350, top=False) == 15  # free at most the high watermark: no reload wanted


def test_iteration_blocks():
    from pagedweight.serving.serving_loop import iteration_blocks

    assert iteration_blocks(8192, 32, 1) == 8192 + 32 * 2
    assert iteration_blocks(8192, 32, 16) == 512 + 32 * 2
    assert iteration_blocks(100, 4, 16, tokens_per_request=20) == 7 + 4 * 3
    assert iteration_blocks(None, 32, 1) == 0 and iteration_blocks(-1, 32, 1) == 0 and iteration_blocks(8192, 0, 1) == 0


def test_the_scheduler_view_bounds_an_iterations_kv_demand_and_the_builder_passes_it_on():
    from patches.scheduler import scheduler_view
    from pagedweight.serving.builder import build_serving
    from tests.test_serving_builder import _runtime, _view

    buffers = SimpleNamespace(k_buffer=[torch.zeros(4, 2)], v_buffer=[torch.zeros(4, 2)])
    pool = SimpleNamespace(get_kvcache=lambda: buffers)
    args = SimpleNamespace(load_format="dummy", model_path="m", speculative_algorithm=None)
    sched = SimpleNamespace(page_size=16, max_total_num_tokens=1000, token_to_kv_pool_allocator=pool, server_args=args,
                            chunked_prefill_size=8192, max_running_requests=32)
    assert scheduler_view(sched).blocks_per_iteration == 512 + 32 * 2
    sched.chunked_prefill_size = -1  # unchunked prefill: one iteration's demand is unbounded, no quiet window
    assert scheduler_view(sched).blocks_per_iteration == 0
    assert build_serving(_view(blocks_per_iteration=7), _runtime()).blocks_per_iteration == 7
