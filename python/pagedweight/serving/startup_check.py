"""Checks run in the launching process before any SGLang scheduler starts.

Every refusal raises PagedWeightStartupError with one message that names the problem and the fix, so a bad
checkpoint or flag never leaves a half-started server behind.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from pagedweight.config import PagedWeightConfig

# HF config keys that carry the number of routed experts, by family.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


logger = logging.getLogger(__name__)


class PagedWeightStartupError(RuntimeError):
    pass


def read_model_config(model_path: str) -> dict[str, Any]:
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise PagedWeightStartupError(
            f"--enable-paged-weight: no config.json in --model-path {model_path!r}; give a local model directory "
            f"(an AP checkpoint made by `pagedweight convert`, or the HF checkpoint it was made from)"
        )
    with open(path) as f:
        return json.load(f)


def num_routed_experts(hf_config: dict[str, Any]) -> int:
    text_cfg = hf_config.get("text_config") or {}
    for key in _EXPERT_COUNT_KEYS:
        for c in (hf_config, text_cfg):
            if isinstance(c.get(key), int) and c[key] > 0:
                return c[key]
    return 0


def check_paged_weight_launch(server_args: Any, cfg: PagedWeightConfig) -> None:
    model_path = server_args.model_path
    hf_config = read_model_config(model_path)
    if num_routed_experts(hf_config) == 0:
        raise PagedWeightStartupError(
            f"--enable-paged-weight needs a Mixture-of-Experts model, but {model_path!r} "
            f"(model_type {hf_config.get('model_type')!r}) has no MoE layers; drop the flag to serve it as is"
        )
    if str(getattr(server_args, "load_format", "auto")) == "dummy":
        from pagedweight.serving.layer_sources import DUMMY_BITS_MAX, DUMMY_BITS_MIN

        _check_bits(cfg, DUMMY_BITS_MIN, DUMMY_BITS_MAX, "the dummy AP planes")
        _check_dense_bits(cfg, DUMMY_BITS_MIN, DUMMY_BITS_MAX, "the dummy AP planes")
        _check_bits_map(cfg, DUMMY_BITS_MIN, DUMMY_BITS_MAX, hf_config)
        return
    from pagedweight.format.checkpoint import APCheckpoint, APCheckpointError

    ap_dir = cfg.resolve_ap_dir(model_path)
    try:
        ckpt = APCheckpoint.open(ap_dir)
        ckpt.check_model_config(hf_config)
        ckpt.verify(deep=cfg.verify)
        started = time.monotonic()
        tables = ckpt.check_tables_finite()
        logger.info("PagedWeight: %d AP tables of %s are finite (checked in %.2f s)", tables, ap_dir,
                    time.monotonic() - started)
    except APCheckpointError as e:
        raise PagedWeightStartupError(f"--enable-paged-weight: {e}") from None
    _check_bits(cfg, ckpt.bits_min, ckpt.bits_max, f"the AP checkpoint {ap_dir!r}")
    _check_dense_bits(cfg, ckpt.bits_min, ckpt.bits_max, f"the AP checkpoint {ap_dir!r}")
    if cfg.scope == "all" and not ckpt.dense_names():
        raise PagedWeightStartupError(
            f"--paged-weight-scope all: the AP checkpoint {ap_dir!r} has no dense blocks (it holds expert blocks "
            "only); re-convert with `pagedweight convert --dense-linears`, or serve with --paged-weight-scope experts"
        )
    if cfg.scope == "all":
        _check_row_parallel_shards(ckpt, int(getattr(server_args, "tp_size", 1) or 1))
    _check_bits_map(cfg, ckpt.bits_min, ckpt.bits_max, hf_config)


def _check_bits(cfg: PagedWeightConfig, lo: int, hi: int, what: str) -> None:
    if cfg.bits is not None and not lo <= cfg.bits <= hi:
        raise PagedWeightStartupError(
            f"--paged-weight-bits {cfg.bits} is outside the range {lo}..{hi} stored in {what}; pick a bitwidth "
            f"in {lo}..{hi} (or re-convert with `pagedweight convert --bits-min/--bits-max`)"
        )


# Dense linears SGLang splits by input columns over TP ranks (RowParallelLinear): attention's output projection and
# the down projection of a shared expert (Qwen, GLM, DeepSeek) or of the dense MLP kept as one (Gemma-4's `mlp`).
_ROW_PARALLEL_SUFFIXES = (".self_attn.o_proj", ".shared_expert.down_proj", ".shared_experts.down_proj",
                          ".mlp.down_proj")


def _check_row_parallel_shards(ckpt: Any, tp: int) -> None:
    """Under --tp N each rank of a row-parallel dense linear keeps K / N input columns: whole plane bytes and,
    for bcq/ubcq, whole groups. Refused here rather than in every scheduler process while it loads."""
    if tp <= 1:
        return
    from pagedweight.format.layout import is_grouped

    for name in ckpt.dense_names() + ckpt.names():
        if not name.endswith(_ROW_PARALLEL_SUFFIXES):
            continue
        spec = ckpt.spec(name)
        part = spec.in_features // tp
        if spec.in_features % tp or part % 8 or (is_grouped(spec.table_kind) and part % spec.group_size):
            raise PagedWeightStartupError(
                f"--paged-weight-scope all with --tp {tp}: {name} has {spec.in_features} inputs, so each rank would "
                f"keep {spec.in_features / tp:g}, not a multiple of 8 and of the group size {spec.group_size}; "
                "re-convert with a smaller --group-size, use a smaller --tp, or serve with --paged-weight-scope experts"
            )


def _check_dense_bits(cfg: PagedWeightConfig, lo: int, hi: int, what: str) -> None:
    if cfg.dense_bits is not None and not lo <= cfg.dense_bits <= hi:
        raise PagedWeightStartupError(
            f"--paged-weight-dense-bits {cfg.dense_bits} is outside the range {lo}..{hi} stored in {what}; pick a "
            f"bitwidth in {lo}..{hi}"
        )


def _check_bits_map(cfg: PagedWeightConfig, lo: int, hi: int, hf_config: dict[str, Any]) -> None:
    """What can be checked of --paged-weight-bits-map before the model exists: the file's shape, bitwidths
    inside the stored range and the floor, layers and experts inside the model. That every MoE layer is
    listed is checked when the page table is built (runtime/bits_map.check_bits_map)."""
    if cfg.bits_map is None:
        return
    from pagedweight.runtime.bits_map import BitsMapError, load_bits_map

    try:
        bits_map = load_bits_map(cfg.bits_map)
    except BitsMapError as e:
        raise PagedWeightStartupError(f"--paged-weight-bits-map: {e}") from None
    floor = max(lo, cfg.floor_bits or lo)
    layers = hf_config.get("num_hidden_layers") or (hf_config.get("text_config") or {}).get("num_hidden_layers")
    experts = num_routed_experts(hf_config)
    for key, bits in bits_map.items():
        if not floor <= bits <= hi:
            raise PagedWeightStartupError(
                f"--paged-weight-bits-map {cfg.bits_map}: block {key} at {bits} bits is outside {floor}..{hi} (the "
                "stored range and --paged-weight-min-bits); edit the map or lower --paged-weight-min-bits"
            )
        if (layers and key.layer >= layers) or key.expert >= experts:
            raise PagedWeightStartupError(
                f"--paged-weight-bits-map {cfg.bits_map}: block {key} is not in this model ({layers} layers, "
                f"{experts} experts): the map was saved from another model"
            )
