"""One TP rank of the per-step overhead measurement (benchmark/tp_overhead_bench.py spawns two of them).

A rank builds what a PagedWeight `--tp N` server builds for its shard, through the same code:

- the expert stores of every MoE layer at the model's shard shapes, from `DummyLayerSource` (what
  `--load-format dummy` loads: random AP planes, intermediate size divided by the TP size);
- routing statistics that differ between the ranks (each rank's MoE inputs are its own), so their plans agree only
  through the TP agreement;
- the weights side through `serving.builder.build_weights` (page table, plane arena, budget, pager, and the
  FenceLedger of TP > 1), which is what `patches/model_runner.py` calls after load_model;
- a real SGLang KV pool (MHATokenToKVPool at the shard's KV heads, every layer), its TokenToKVPoolAllocator and a
  simulated radix cache, made elastic by `ElasticKVCache` over `make_backing` (the host backing: the CUDA VMM
  backing needs SGLang's VMM pool owner, which only a real server's KV allocation creates), sized as
  `patches/kv_cache.py` sizes it (room for the bytes the weights can give up down to the floor);
- the serving side through the scheduler hooks themselves (`patches/kv_cache.scheduler_init_after`, then
  `patches/scheduler.init_after`, which calls `build_serving(scheduler_view(...))`), on a stand-in scheduler that
  carries exactly the attributes those hooks read, with the TP group's CPU (gloo) group.

Every iteration then runs what SGLang runs before `get_next_batch_to_run`: `patches/kv_cache.get_next_batch_before`
(the elastic cache's poll) and `patches/scheduler.get_next_batch_before` (PagedWeightScheduler.step: the TP
agreement `TpStepSync`, the controller, the pager boundary). Their host time is the step time; the agreement alone
is `TpStepSync.agreement`, both reset per regime.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.distributed as dist

from pagedweight.runtime.latency_histogram import LatencyHistogram


@dataclass(frozen=True)
class ShardShape:
    """One rank's share of a model's MoE and KV at `--tp tp`."""

    name: str
    layers: int
    experts: int
    topk: int
    hidden: int
    intermediate: int  # per rank
    kv_heads: int  # per rank
    head_dim: int
    renormalize: bool

    @staticmethod
    def from_hf_config(name: str, cfg: dict, tp: int, layers: Optional[int] = None) -> "ShardShape":
        inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts"))
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if inter % tp or kv_heads % tp:
            raise ValueError(f"{name}: intermediate {inter} / KV heads {kv_heads} do not split over --tp {tp}")
        return ShardShape(
            name=name, layers=int(layers or cfg["num_hidden_layers"]), experts=experts,
            topk=int(cfg["num_experts_per_tok"]), hidden=int(cfg["hidden_size"]), intermediate=inter // tp,
            kv_heads=kv_heads // tp, head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
        )

    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2  # K and V, bf16


@dataclass(frozen=True)
class RunSpec:
    shape: ShardShape
    tp: int
    bits: int
    floor_bits: int
    policy: str
    kv_tokens: int  # the KV capacity SGLang sized (tokens, page size 1)
    iters: int  # timed iterations per regime
    warmup: int
    phase_iters: int  # offload/reload regime: iterations under pressure, then as many released
    batches: tuple[int, ...]
    moe_reps: int
    out_dir: str
    # the server's chunked-prefill size and running-request cap: they bound what one iteration may allocate, so the TP
    # agreement's quiet windows open only while the free KV exceeds the low watermark by that much (tp_sync.py)
    chunked_prefill_size: int = 8192
    max_running_requests: int = 256


def _stores(shape: ShardShape, cfg: Any, device: torch.device) -> list:
    from pagedweight.serving.layer_sources import DummyLayerSource

    source = DummyLayerSource(cfg)
    return [source.load_layer(SimpleNamespace(num_local_experts=shape.experts, hidden_size=shape.hidden,
                                              intermediate_size_per_partition=shape.intermediate, layer_id=layer),
                              device) for layer in range(shape.layers)]


def _kv_cache(shape: ShardShape, capacity: int, extra_bytes: int, device: torch.device):
    """SGLang's KV pool and allocator at the shard's shapes, made elastic as patches/kv_cache.py does it."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from pagedweight.kvcache.elastic_kv import ElasticKVCache
    from pagedweight.kvcache.elastic_kv_backing import make_backing

    max_tokens = capacity + extra_bytes // shape.kv_bytes_per_token()
    pool = MHATokenToKVPool(max_tokens, page_size=1, dtype=torch.bfloat16, head_num=shape.kv_heads,
                            head_dim=shape.head_dim, layer_num=shape.layers, device=str(device),
                            enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(max_tokens, torch.bfloat16, str(device), pool, False)
    kv = ElasticKVCache(pool, alloc, capacity_tokens=capacity, max_tokens=max_tokens,
                        backing=make_backing(pool, capacity))
    tree = RadixCache.create_simulated(mock_allocator=alloc, page_size=1)
    return kv, alloc, tree


def _scheduler(rank: int, spec: RunSpec, runtime: Any, kv: Any, alloc: Any, tree: Any, stream: Any) -> Any:
    """The attributes of SGLang's Scheduler that the PagedWeight hooks read (patches/scheduler.py, kv_cache.py)."""
    from pagedweight.patches.kv_cache import KV_ATTR

    runner = SimpleNamespace(_paged_weight_runtime=runtime, max_total_num_tokens=spec.kv_tokens)
    setattr(runner, KV_ATTR, kv)
    return SimpleNamespace(
        tp_worker=SimpleNamespace(model_runner=runner),
        tp_group=SimpleNamespace(world_size=spec.tp, rank_in_group=rank, first_rank=0, cpu_group=dist.group.WORLD),
        tp_rank=rank, page_size=1, max_total_num_tokens=spec.kv_tokens, token_to_kv_pool_allocator=alloc,
        chunked_prefill_size=spec.chunked_prefill_size, max_running_requests=spec.max_running_requests,
        tree_cache=tree, forward_stream=stream, waiting_queue=[], new_token_ratio_tracker=None,
        server_args=SimpleNamespace(load_format="dummy", model_path=spec.shape.name, enable_metrics=False, dcp_size=1),
    )


class _Pressure:
    """KV demand of the offload/reload regime: `phase` iterations holding the free KV at half the offload watermark
    (taking every token the pager's offloads give the cache), then `phase` iterations with everything freed, so the
    pager reloads. It reads only the allocator, whose state every rank shares while they are in step."""

    def __init__(self, alloc: Any, low_blocks: int, phase: int) -> None:
        self.alloc, self.target, self.phase = alloc, max(1, low_blocks // 2), phase
        self.held: list[torch.Tensor] = []

    def before_step(self, i: int) -> None:
        if (i // self.phase) % 2 == 0:
            want = int(self.alloc.available_size()) - self.target
            if want > 0:
                got = self.alloc.alloc(want)
                if got is not None:
                    self.held.append(got)
        elif self.held:
            self.alloc.free(torch.cat(self.held))
            self.held = []


def _sample_routing(stores: list, rank: int) -> None:
    """Each rank's routing statistics, drawn differently (seeded by the rank), as two ranks whose MoE inputs are not
    bit-identical would record them: the ranks plan from the source rank's sample only while the agreement works."""
    g = torch.Generator().manual_seed(rank)
    for store in stores:
        store.routing_mass.copy_(torch.rand(store.routing_mass.shape, generator=g) * 100)


def _routing(m: int, shape: ShardShape, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(shape.experts, generator=g)[:shape.topk] for _ in range(m)]).to(torch.int32)
    w = torch.softmax(torch.randn(m, shape.experts, generator=g), dim=-1).gather(1, ids.long())
    if shape.renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w.float().to(device), ids.to(device)


def time_moe_step(stores: list, shape: ShardShape, m: int, reps: int, device: torch.device) -> dict:
    """One decode step's MoE work on this shard: `ap_fused_moe` over every layer at M = m tokens, the call
    serving/moe_method.py makes per layer. CUDA: the layers in one CUDA graph, timed by cuda_timing.graph_time
    (no L2 flush: the layers' planes are far larger than L2); CPU: wall time of each call (the reference path)."""
    from pagedweight.bench.cuda_timing import graph_time, summarize_us
    from pagedweight.kernels import ap_fused_moe

    x = torch.randn((m, shape.hidden), dtype=torch.bfloat16, generator=torch.Generator().manual_seed(m)).to(device)
    tw, ids = _routing(m, shape, 1000 + m, device)

    def call() -> None:
        for s in stores:
            ap_fused_moe(x, tw, ids, s.w13.kernel_weights(), s.w2.kernel_weights())

    if device.type == "cuda":
        call()
        torch.cuda.synchronize()
        return dict(graph_time(call, reps, None), timing="CUDA graph of every layer's ap_fused_moe, CUDA events")
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
    return dict(summarize_us(times), timing="wall time of every layer's ap_fused_moe (CPU reference path)")


def _hist(values: list[float]) -> dict:
    h = LatencyHistogram()
    for v in values:
        h.add(v)
    return h.state()


def _regime(name: str, sched: Any, spec: RunSpec, pressure: Optional[_Pressure], stream: Any) -> dict:
    from pagedweight.patches import kv_cache as kv_hooks
    from pagedweight.patches import scheduler as sched_hooks
    from pagedweight.patches.scheduler import ATTR

    pws = getattr(sched, ATTR)
    sync, ledger = pws.tp_sync, pws.tp_sync.ledger
    step_us: list[float] = []
    sent: list[int] = []  # bytes this rank sent in each iteration's agreement
    pending = 0
    before = dict(transitions=pws.runtime.pager.counters.transitions, bytes_to_kv=pws.runtime.pager.counters.bytes_to_kv,
                  object_exchanges=sync.object_exchanges, mismatches=sync.digest_mismatches)
    timed_from = {}  # the sync's exchange / skip counts when the timed iterations start
    for i in range(spec.warmup + spec.iters):
        if i == spec.warmup:
            sync.agreement = LatencyHistogram()
            pws.step_timing = LatencyHistogram()
            timed_from = dict(exchanges=sync.exchanges, skipped=sync.skipped)
        if pressure is not None:
            pressure.before_step(i)
        pending += i >= spec.warmup and ledger.pending > 0
        t0 = time.perf_counter()
        kv_hooks.get_next_batch_before(sched)
        sched_hooks.get_next_batch_before(sched)
        dt = (time.perf_counter() - t0) * 1e6
        if i >= spec.warmup:
            step_us.append(dt)
            sent.append(sync.report_bytes_last)
        if stream is not None:
            stream.synchronize()  # the iteration's forward would end here; the step's device writes are done
    counters = pws.runtime.pager.counters
    return {
        "regime": name,
        "iterations": spec.iters,
        "step_us": _hist(step_us),  # both hooks, host time
        "step_us_state_endpoint": pws.step_timing.state(),  # PagedWeightScheduler.step alone, as /get_server_info
        "agreement_us": sync.agreement.state(),
        "report_bytes": {"row": sync.state()["report_bytes"]["row"], "max": max(sent), "mean": sum(sent) / len(sent)},
        "object_exchanges": sync.object_exchanges - before["object_exchanges"],
        # timed iterations with an exchange, and those a quiet window skipped (no exchange, no PagedWeight step)
        "exchanges": sync.exchanges - timed_from["exchanges"],
        "skipped": sync.skipped - timed_from["skipped"],
        "iterations_with_fences_pending": pending,
        "transitions": counters.transitions - before["transitions"],
        "bytes_to_kv": counters.bytes_to_kv - before["bytes_to_kv"],
        "digest_mismatches": sync.digest_mismatches - before["mismatches"],
        "kv_capacity_tokens_end": int(sched.max_total_num_tokens),
    }


def run_rank(rank: int, spec: RunSpec, init_file: str) -> None:
    """One rank: build, time the regimes (both ranks together), then each rank's MoE step in turn; writes
    rank{rank}.json into spec.out_dir."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=spec.tp)
    try:
        _run(rank, spec)
    finally:
        dist.destroy_process_group()


def _run(rank: int, spec: RunSpec) -> None:
    from pagedweight.config import PagedWeightConfig
    from pagedweight.patches import kv_cache as kv_hooks
    from pagedweight.patches import scheduler as sched_hooks
    from pagedweight.patches.scheduler import ATTR
    from pagedweight.serving.builder import build_weights

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, torch.get_num_threads() // spec.tp))
    shape = spec.shape
    cfg = PagedWeightConfig(enable=True, bits=spec.bits, floor_bits=spec.floor_bits, policy=spec.policy)
    t0 = time.monotonic()
    stores = _stores(shape, cfg, device)
    _sample_routing(stores, rank)
    runtime = build_weights(cfg, stores, device, tp_world_size=spec.tp)
    extra = max(0, int(runtime.weight_bytes()) - int(runtime.bytes_at_floor()))  # patches/kv_cache.max_extra_kv_bytes
    kv, alloc, tree = _kv_cache(shape, spec.kv_tokens, extra, device)
    stream = torch.cuda.Stream(device) if cuda else None
    sched = _scheduler(rank, spec, runtime, kv, alloc, tree, stream)
    kv_hooks.scheduler_init_after(None, sched)
    sched_hooks.init_after(None, sched)
    pws = getattr(sched, ATTR)
    build_s = time.monotonic() - t0
    moe = {}
    # the MoE step first, at the starting bitwidths; one rank at a time so two processes never share the device
    for r in range(spec.tp):
        dist.barrier()
        if r == rank:
            moe = {str(m): time_moe_step(stores, shape, m, spec.moe_reps, device) for m in spec.batches}
    dist.barrier()
    regimes = [_regime("steady", sched, spec, None, stream)]
    low = pws.controller.signal.threshold_blocks
    regimes.append(_regime("offload_reload", sched, spec, _Pressure(alloc, low, spec.phase_iters), stream))
    sync = pws.tp_sync
    doc = {
        "rank": rank,
        "device": str(device),
        "build_s": round(build_s, 1),
        "weights_bytes": int(runtime.weight_bytes()),
        "kv": {"capacity_tokens_start": spec.kv_tokens, "max_tokens": kv.max_tokens,
               "bytes_per_token": kv.bytes_per_token, "offload_below_blocks": low,
               "reload_above_blocks": pws.controller.signal.relax_blocks},
        "policy": type(pws.controller.policy).__name__,
        "moe_step_us": moe,
        "regimes": regimes,
        "tp": {k: sync.state()[k] for k in ("exchanges", "object_exchanges", "digest_mismatches", "fences_agreed",
                                           "fences_pending", "ranks", "skipped", "quiet_windows", "quiet_window")},
        "commits_crc": pws.commits_crc,
        "transitions": runtime.pager.counters.transitions,
        "committed_bits": [r.committed_bits for r in runtime.table],
    }
    Path(spec.out_dir, f"rank{rank}.json").write_text(json.dumps(doc))
