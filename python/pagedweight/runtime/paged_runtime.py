"""PagedWeight's per-process runtime: the page table, plane arena, budget and pager over every MoE layer.

Built once the model is loaded (serving/builder.py, from patches/model_runner.py), before SGLang sizes its KV
cache, so the device bytes of the committed planes are already taken when SGLang measures free memory. The
pager gets its final fences and copier here (under TP, over the FenceLedger every rank agrees on). The
runtime is the one owner of the MemoryBudget: it registers the weights' share here and the KV side's share in
`link_kv` (the scheduler side of the builder); the pager and the elastic KV cache only reserve, commit and
release through it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagedweight.config import PagedWeightConfig
from pagedweight.runtime.arena import CudaVmmPlaneArena, HostPlaneArena, PlaneArena
from pagedweight.runtime.blocks import BlockKey
from pagedweight.runtime.budget import MemoryBudget
from pagedweight.runtime.copier import Copier, TorchCopier
from pagedweight.runtime.expert_store import MoELayerStore, ProjectionStore
from pagedweight.runtime.fence_ledger import FenceLedger
from pagedweight.runtime.fences import CudaEventFenceFactory, FenceFactory, ImmediateFenceFactory
from pagedweight.runtime.page_table import WeightPageTable, arena_size_classes
from pagedweight.runtime.pager import Pager, PagerConfig

logger = logging.getLogger("pagedweight")


class StoreHostWeights:
    """pager.HostWeights over the layer stores: block_id -> that expert's host planes and tables."""

    def __init__(self, index: list[tuple[ProjectionStore, int]]):
        self._index = index

    def host_planes(self, block_id: int) -> torch.Tensor:
        store, e = self._index[block_id]
        return store.host[e].planes

    def host_table(self, block_id: int, bits: int) -> torch.Tensor:
        store, e = self._index[block_id]
        return store.host[e].tables[bits]


class KVLink:
    """Where the bytes the pager frees go: the elastic KV cache's grow once `PagedRuntime.link_kv` linked it,
    nowhere before (a fixed KV pool never links one)."""

    def __init__(self) -> None:
        self.kv: Any = None

    def __call__(self, nbytes: int) -> None:
        if self.kv is not None:
            self.kv.grow(nbytes)


@dataclass
class PagedRuntime:
    cfg: PagedWeightConfig
    stores: list[MoELayerStore]
    table: WeightPageTable
    arena: PlaneArena
    budget: MemoryBudget
    pager: Pager
    block_index: list[tuple[ProjectionStore, int]]  # block_id -> (store, expert)
    initial_bits: int
    reload_headroom_bytes: int
    ledger: Optional[FenceLedger] = None  # TP > 1: the fences every rank agrees on (started by tp_sync.make_tp_sync)
    kv_link: KVLink = field(default_factory=KVLink)
    kv_linked: bool = False

    @classmethod
    def build(cls, cfg: PagedWeightConfig, stores: list[MoELayerStore], device: torch.device, *,
              ledger: Optional[FenceLedger] = None, fences: Optional[FenceFactory] = None,
              copier: Optional[Copier] = None) -> "PagedRuntime":
        """`fences` / `copier` replace the device's own (tests); with `ledger` (TP > 1) both go through it."""
        index: list[tuple[ProjectionStore, int]] = []
        blocks: list[tuple[BlockKey, object]] = []
        for layer in stores:
            for proj in layer.projections:
                for e in range(proj.num_experts):
                    index.append((proj, e))
                    blocks.append((BlockKey(layer.layer_id, e, proj.proj), proj.spec))
        spec0 = blocks[0][1]
        bits = cfg.bits if cfg.bits is not None else spec0.bits_max
        if cfg.bits_map is not None:
            table = _table_from_bits_map(cfg, blocks)
            bits = max(row.desired_bits for row in table)
        else:
            table = WeightPageTable(blocks, initial_bits=bits, floor_bits=cfg.floor_bits)
        classes = arena_size_classes(table)
        if device.type == "cuda":
            arena: PlaneArena = CudaVmmPlaneArena(classes, device_id=device.index or 0, poison=cfg.debug_poison)
            # on the stream current when a fence is recorded: Pager.on_boundary runs with the scheduler's forward
            # stream current, so a fence orders after every forward enqueued before its page-table flush (a stream
            # fixed here, at model load, is not the one SGLang's overlap scheduler runs its forwards on)
            fences = fences if fences is not None else CudaEventFenceFactory()
        else:
            arena = HostPlaneArena(classes, poison=cfg.debug_poison)
            fences = fences if fences is not None else ImmediateFenceFactory()
        copier = copier if copier is not None else TorchCopier.for_device(device)
        if ledger is not None:
            fences, copier = ledger.wrap_factory(fences), ledger.wrap_copier(copier)
        want = sum(row.bytes_at(row.desired_bits) for row in table)
        staging = max(row.spec.table_bytes(row.spec.bits_max) for row in table)
        # The weights' share of the budget: the committed blocks, the pager's staging reserve (an offload
        # loads its lower table before freeing), and the same again as headroom for a reload's transient
        # (the new table is copied in while the old one is still read). The KV side's bytes follow in
        # link_kv.
        budget = MemoryBudget(total_bytes=want + 2 * staging, fixed_bytes=0)
        kv_link = KVLink()
        pager = Pager(
            table,
            arena,
            budget,
            StoreHostWeights(index),
            copier,
            fences,
            on_bytes_freed=kv_link,
            config=PagerConfig(max_inflight_bytes=cfg.max_inflight_mib << 20, staging_bytes=staging),
        )
        for layer in stores:
            for proj in layer.projections:
                pager.mirror.bind(layer.layer_id, proj.proj, proj.page_table)
        runtime = cls(cfg, stores, table, arena, budget, pager, index, bits, staging, ledger, kv_link)
        for block_id, (proj, e) in enumerate(index):
            if e == 0:
                first = block_id
                proj.set_resident_fn(lambda expert, _first=first: pager.resident(_first + expert))
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        pager.drain(wait=sync)
        if sync:
            sync()
        return runtime

    def link_kv(self, kv: Any, fixed_kv_bytes: int) -> None:
        """Register the KV side's share of the budget, once. An elastic KV cache (`kv`) brings what its backing
        has mapped now (its bytes: whole chunks on CUDA); from then on its grows and shrinks reserve and release
        through the budget, and the bytes the pager frees go to its grow. A fixed pool (`kv` None) brings
        `fixed_kv_bytes`, and the freed bytes go nowhere."""
        if self.kv_linked:
            raise RuntimeError("the KV side of the budget is already linked")
        self.kv_linked = True
        if kv is None:
            self.budget.add_capacity("kv", fixed_kv_bytes)
            return
        self.budget.add_capacity("kv", kv.state().mapped_bytes)
        kv.attach_budget(self.budget)
        self.kv_link.kv = kv

    # -- accounting for the log line and the state endpoint -----------------------------------------

    def weight_bytes(self) -> int:
        return self.table.resident_bytes()

    def bytes_at_floor(self) -> int:
        return sum(row.bytes_at(row.floor_bits) for row in self.table)

    def committed_bits_histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for row in self.table:
            hist[row.committed_bits] = hist.get(row.committed_bits, 0) + 1
        return dict(sorted(hist.items()))

    def routing_mass(self) -> dict[tuple[int, int], float]:
        """(layer, expert) -> routing-weight mass since start (one device->host copy per layer)."""
        out: dict[tuple[int, int], float] = {}
        for layer in self.stores:
            for e, m in enumerate(layer.routing_mass.tolist()):
                out[(layer.layer_id, e)] = m
        return out

    def state(self, include_blocks: bool = True) -> dict:
        return {
            "initial_bits": self.initial_bits,
            "committed_bits_histogram": {str(k): v for k, v in self.committed_bits_histogram().items()},
            "weights_bytes_at_floor": self.bytes_at_floor(),
            **self.pager.state(include_blocks=include_blocks),
        }


def _table_from_bits_map(cfg: PagedWeightConfig, blocks: list) -> WeightPageTable:
    """The page table started at --paged-weight-bits-map's per-block bitwidths (checked, never clamped)."""
    from collections import Counter

    from pagedweight.runtime.bits_map import check_bits_map, load_bits_map
    from pagedweight.runtime.page_table import bit_limits

    bits_map = load_bits_map(cfg.bits_map)
    check_bits_map(bits_map, [(BlockKey(*key), *bit_limits(spec, cfg.floor_bits)) for key, spec in blocks], cfg.bits_map)
    logger.info("PagedWeight: initial bitwidths from %s: %s blocks per bitwidth", cfg.bits_map,
                dict(sorted(Counter(bits_map.values()).items())))
    return WeightPageTable(blocks, initial_bits=bits_map, floor_bits=cfg.floor_bits)


def find_runtime(model_runner) -> Optional[PagedRuntime]:
    return getattr(model_runner, "_paged_weight_runtime", None)
