"""Dense AP linears (--paged-weight-scope all): attention projections, shared experts and lm_head from AP planes.

SGLang's LinearBase asks for a quant method when it is built; patches/linear.py swaps in DenseAPLinearMethod
for every linear whose checkpoint names have AP blocks (`ap_names_for`). Its bf16 weight is a zero-size
placeholder that drops the streamed-in weights, so no bf16 copy is ever resident. After loading, this rank's
shard of the first q planes and the q-bit table are copied to the device once, one page-table row points at
them, and apply() runs `ap_linear`. The bitwidth is fixed (--paged-weight-dense-bits): the planner and the
pager move expert blocks only, so these bytes never change while serving.
"""

from __future__ import annotations

import logging
import re
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from sglang.srt.layers.quantization.base_config import LinearMethodBase
from sglang.srt.utils import set_weight_attrs

from pagedweight.format.arch import DENSE_LINEAR
from pagedweight.format.layout import DEFAULT_TABLE_KIND, is_grouped

logger = logging.getLogger(__name__)

# SGLang fuses these checkpoint linears into one module; the AP checkpoint keeps the unfused HF names.
FUSED_LINEARS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_SHARED_EXPERT_HINT = re.compile(r"\.shared_experts?\.")  # qwen2_moe: shared_expert, glm4_moe: shared_experts


def ap_names_for(prefix: str) -> tuple[str, ...]:
    """AP block names (HF weight names without '.weight') that make up the SGLang linear at `prefix`."""
    head, _, leaf = prefix.rpartition(".")
    return tuple(f"{head}.{part}" if head else part for part in FUSED_LINEARS.get(leaf, (leaf,)))


LM_HEAD = "lm_head"


def is_dense_ap_name(name: str) -> bool:
    """The names a dummy load serves from AP (what `convert --dense-linears` quantizes, plus shared experts)."""
    return bool(DENSE_LINEAR.fullmatch(f"{name}.weight")) or bool(_SHARED_EXPERT_HINT.search(f".{name}"))


@dataclass(frozen=True)
class RowShard:
    """Rows [start, stop) of one AP block that this rank keeps; shards concatenate along N in order."""

    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class ShardPlan:
    """What one rank serves of a linear: row ranges of its blocks, and for RowParallelLinear its input columns."""

    rows: tuple[RowShard, ...]
    cols: Optional[tuple[int, int]]  # [start, stop) of K, None: every input

    @property
    def out_features(self) -> int:
        return sum(r.stop - r.start for r in self.rows)


def shard_plan(layer: torch.nn.Module, names: tuple[str, ...], block_rows: dict[str, int], in_features: int) -> ShardPlan:
    """The rank's shard of `names`, following how SGLang's linear classes split their weight over TP ranks.

    block_rows[name] is the block's full out_features; in_features the full K of the blocks.
    """
    from sglang.srt.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if getattr(layer, "use_presharded_weights", False):
        raise ValueError(f"{names[0]}: PagedWeight cannot serve pre-sharded weights from AP blocks")
    rank, size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    full = lambda n: RowShard(n, 0, block_rows[n])  # noqa: E731
    if isinstance(layer, VocabParallelEmbedding):  # lm_head: this rank's rows of the original vocabulary
        idx = layer.shard_indices
        if layer.num_added_embeddings:
            raise ValueError(f"{names[0]}: PagedWeight cannot serve an lm_head with added (LoRA) vocabulary from AP")
        return ShardPlan((RowShard(names[0], idx.org_vocab_start_index, idx.org_vocab_end_index),), None)
    if isinstance(layer, QKVParallelLinear):
        if len(names) != 3:
            raise ValueError(f"{names}: a QKV linear needs q, k and v blocks")
        q_rows = layer.num_heads * layer.head_size
        kv_shard = rank // layer.num_kv_head_replicas
        k_rows, v_rows = layer.num_kv_heads * layer.head_size, layer.num_kv_heads * layer.v_head_size
        rows = (
            RowShard(names[0], rank * q_rows, (rank + 1) * q_rows),
            RowShard(names[1], kv_shard * k_rows, (kv_shard + 1) * k_rows),
            RowShard(names[2], kv_shard * v_rows, (kv_shard + 1) * v_rows),
        )
        return ShardPlan(rows, None)
    if isinstance(layer, MergedColumnParallelLinear):
        rows = []
        for name in names:
            part = block_rows[name] // size
            rows.append(RowShard(name, rank * part, (rank + 1) * part))
        return ShardPlan(tuple(rows), None)
    if isinstance(layer, ColumnParallelLinear):
        part = layer.output_size_per_partition
        return ShardPlan(tuple(RowShard(n, rank * part, (rank + 1) * part) for n in names), None)
    if isinstance(layer, RowParallelLinear):
        part = layer.input_size_per_partition
        cols = None if part == in_features else (rank * part, (rank + 1) * part)
        return ShardPlan(tuple(full(n) for n in names), cols)
    return ShardPlan(tuple(full(n) for n in names), None)  # ReplicatedLinear and the like


@dataclass
class DenseAPWeights:
    """One linear's device-resident AP weight at a fixed bitwidth, and the kernel's view of it."""

    prefix: str
    bits: int
    table_kind: str
    group_size: int
    planes: list[torch.Tensor]  # q planes, each [N, K/8] uint8
    table: torch.Tensor  # the q-bit table
    kernel: Any  # pagedweight.kernels.APMoEWeights with one page-table row

    @property
    def device_bytes(self) -> int:
        return sum(p.numel() for p in self.planes) + self.table.numel() * self.table.element_size()

    @property
    def bf16_bytes(self) -> int:
        return self.kernel.N * self.kernel.K * 2


class DenseSource(Protocol):
    """Where a dense linear's planes come from: the AP checkpoint, or random planes (--load-format dummy)."""

    def has_blocks(self, names: tuple[str, ...]) -> bool: ...

    def load(self, layer: torch.nn.Module, prefix: str, names: tuple[str, ...], bits: int,
             device: torch.device) -> DenseAPWeights: ...


def _slice_rows(tensor: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    return tensor.narrow(dim, start, stop - start)


def _to_device_weights(prefix: str, bits: int, kind: str, group: int, planes: torch.Tensor, table: torch.Tensor,
                       device: torch.device) -> DenseAPWeights:
    from pagedweight.kernels.weights import build_ap_moe_weights

    dev_planes = [planes[p].contiguous().to(device) for p in range(bits)]
    dev_table = table.contiguous().to(device)
    kernel = build_ap_moe_weights([dev_planes], [dev_table], [bits], table_kind=kind, group_size=group, bits_max=bits)
    return DenseAPWeights(prefix, bits, kind, group, dev_planes, dev_table, kernel)


def _local_shape(layer: torch.nn.Module) -> tuple[int, int]:
    """(rows this rank's AP weight must have, its in_features), as SGLang's layer was built."""
    if hasattr(layer, "shard_indices"):  # lm_head: the original vocabulary's rows; padding rows are zeros
        return layer.num_org_embeddings_per_partition, layer.embedding_dim
    return (sum(getattr(layer, "output_partition_sizes", None) or [layer.output_size]),
            getattr(layer, "input_size_per_partition", layer.input_size))


def _check_geometry(layer: torch.nn.Module, prefix: str, plan: ShardPlan, k_local: int) -> None:
    want_n, want_k = _local_shape(layer)
    if plan.out_features != want_n or k_local != want_k:
        raise ValueError(
            f"{prefix}: the AP blocks give this rank a {plan.out_features}x{k_local} weight, but SGLang's layer "
            f"expects {want_n}x{want_k}: the AP checkpoint is for another model"
        )


class CheckpointDenseSource:
    """Dense linears from the AP checkpoint. `k_eq_v` (the model's `attention_k_eq_v`, Gemma-4): a layer whose
    checkpoint has no v_proj shares K's weights for V (its full-attention layers ship k_proj only, and SGLang loads
    k into both the k and v shards of the fused QKV), so v reads the layer's k_proj block. Without the flag a
    missing v_proj is a broken checkpoint, refused as any missing block."""

    def __init__(self, ckpt: Any, k_eq_v: bool = False):
        self.ckpt = ckpt
        self.k_eq_v = k_eq_v

    def block_of(self, name: str) -> str:
        """The AP block that holds `name`'s weight."""
        if self.k_eq_v and name.endswith(".v_proj") and not self.ckpt.has_block(name):
            k = name[: -len("v_proj")] + "k_proj"
            if self.ckpt.has_block(k):
                return k
        return name

    def has_blocks(self, names: tuple[str, ...]) -> bool:
        present = [self.ckpt.has_block(self.block_of(n)) for n in names]
        if any(present) and not all(present):
            missing = [n for n, p in zip(names, present) if not p]
            raise ValueError(f"the AP checkpoint has only some blocks of a fused linear: {missing} are missing; "
                             "re-run `pagedweight convert --dense-linears`")
        return all(present)

    def load(self, layer: torch.nn.Module, prefix: str, names: tuple[str, ...], bits: int,
             device: torch.device) -> DenseAPWeights:
        ckpt = self.ckpt
        specs = {n: ckpt.spec(self.block_of(n)) for n in names}
        ks = {s.in_features for s in specs.values()}
        groups = {s.group_size for s in specs.values()}
        if len(ks) != 1 or len(groups) != 1:
            raise ValueError(f"{prefix}: its AP blocks {names} differ in in_features or group size")
        k, group = ks.pop(), groups.pop()
        plan = shard_plan(layer, names, {n: s.out_features for n, s in specs.items()}, k)
        kind = ckpt.table_kind
        k_local = k if plan.cols is None else plan.cols[1] - plan.cols[0]
        _check_geometry(layer, prefix, plan, k_local)
        planes, tables = [], []
        for shard in plan.rows:
            block = self.block_of(shard.name)
            p = _slice_rows(ckpt.planes(block, bits), 1, shard.start, shard.stop)
            t = ckpt.table(block, bits)
            t = _slice_rows(t, 1 if is_grouped(kind) else 0, shard.start, shard.stop)
            if plan.cols is not None:
                c0, c1 = plan.cols
                if c0 % 8 or c1 % 8 or (is_grouped(kind) and (c0 % group or c1 % group)):
                    raise ValueError(
                        f"{prefix}: this rank's input columns {c0}..{c1} do not fall on whole bytes and bcq/ubcq groups "
                        f"of {group}; use a smaller --tp or reconvert with a smaller --group-size"
                    )
                p = p[:, :, c0 // 8:c1 // 8]
                if is_grouped(kind):  # a k-means LUT is per output row: every input shard shares it
                    t = t[:, :, c0 // group:c1 // group]
            planes.append(p)
            tables.append(t)
        cat_planes = torch.cat(planes, dim=1)
        cat_table = torch.cat(tables, dim=1 if is_grouped(kind) else 0)
        return _to_device_weights(prefix, bits, kind, group, cat_planes, cat_table, device)


class DummyDenseSource:
    """Random binary-coded planes (the default table kind) at the rank's shard shape (like SGLang's
    --load-format dummy)."""

    def has_blocks(self, names: tuple[str, ...]) -> bool:
        return all(is_dense_ap_name(n) for n in names)

    def load(self, layer: torch.nn.Module, prefix: str, names: tuple[str, ...], bits: int,
             device: torch.device) -> DenseAPWeights:
        from pagedweight.serving.layer_sources import dummy_table, group_size_for

        n, k = _local_shape(layer)
        group = group_size_for(k)
        gen = torch.Generator().manual_seed(zlib.crc32(prefix.encode()))  # same planes on every run and rank
        planes = torch.randint(0, 256, (bits, n, k // 8), dtype=torch.uint8, generator=gen)
        table = dummy_table(DEFAULT_TABLE_KIND, bits, n, k // group)
        return _to_device_weights(prefix, bits, DEFAULT_TABLE_KIND, group, planes, table, device)


def _drop_weight(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """weight_loader of the placeholder bf16 weight: the AP blocks replace it."""
    return None


class DenseAPLinearMethod(LinearMethodBase):
    """SGLang linear method serving one linear from AP planes at a fixed bitwidth."""

    def __init__(self, source: DenseSource, prefix: str, names: tuple[str, ...], bits: int):
        self.source = source
        self.prefix = prefix
        self.names = names
        self.bits = bits
        self.weights: Optional[DenseAPWeights] = None

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        weight = torch.nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, {"weight_loader": _drop_weight})

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        device = layer.weight.device
        self.weights = self.source.load(layer, self.prefix, self.names, self.bits, device)
        layer._paged_weight_dense = self.weights  # the startup summary finds every dense AP linear through the model

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        from pagedweight.kernels import ap_linear

        if self.weights is None:
            raise RuntimeError(f"{self.prefix}: PagedWeight dense planes were not loaded")
        lead = x.shape[:-1]
        y = ap_linear(x.reshape(-1, x.shape[-1]), self.weights.kernel, bias=bias)
        return y.reshape(*lead, y.shape[-1])


class LMHeadAPMethod(DenseAPLinearMethod):
    """lm_head (SGLang's ParallelLMHead, called by the LogitsProcessor as quant_method.apply): logits over this
    rank's vocabulary shard; the padding rows SGLang adds to the vocabulary get zero logits, as with the
    zero rows of a bf16 lm_head (the LogitsProcessor cuts them off)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = super().apply(layer, x)
        pad = layer.num_embeddings_per_partition - logits.shape[-1]
        if pad:
            logits = torch.nn.functional.pad(logits, (0, pad))
        return logits if bias is None else logits + bias
