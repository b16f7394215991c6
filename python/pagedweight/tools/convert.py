"""`pagedweight convert`: Hugging Face MoE checkpoint -> AP checkpoint (docs/format.md, "Converter").

Every routed and shared expert linear (gate, up, down) is quantized to bit-planes + per-bitwidth tables,
and with --dense-linears the attention projections and an untied lm_head too (for --paged-weight-scope all); everything else is copied unchanged into the output's top-level safetensors, so the output directory is a
complete model SGLang can serve (`--model-path OUT`). The source is read one safetensors shard at a time.
The output is built in OUT.partial-<pid> and renamed to OUT only when complete.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from pagedweight.format.arch import (DENSE_LINEAR, EXPERT_NAME_HINTS, PROJS, SHARED, ArchAdapter, BlockKey, adapter_for,
                                     block_name, draft_layer_of, flat_config)
from pagedweight.format.fused_experts import FusedSlice, split_fused
from pagedweight.format.bcq import BCQ_INITS
from pagedweight.format.checkpoint import APCheckpointWriter
from pagedweight.format.layout import DEFAULT_TABLE_KIND, TABLE_KINDS, is_grouped
from pagedweight.format.manifest import AP_SUBDIR, ModelInfo
from pagedweight.format.quantize import effective_group_size, quantize_block
from pagedweight.format.weight_errors import TensorError, WeightErrors
from pagedweight.tools.source_format import (SCALE_SUFFIX, SourceFormat, SourceFormatError, dequantize_fp8_block,
                                             load_source_model)

logger = logging.getLogger(__name__)

# Top-level files of the source that are weights (never copied); every other top-level file
# (config, tokenizer, generation config, chat template, README, ...) is copied as is.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth",
                    ".gguf", ".h5", ".msgpack", ".ckpt")


class ConversionError(ValueError):
    """Bad converter input; the message names the problem and the fix."""


@dataclass(frozen=True)
class ConvertOptions:
    table_kind: str = DEFAULT_TABLE_KIND
    bits_min: int = 2
    bits_max: int = 8
    group_size: int = 128
    calib_text: Path | None = None
    calib_tokens: int = 512
    seed: int = 0  # picks the calibration windows when the text is longer than calib_tokens
    standalone_ap_dir: bool = False
    force: bool = False
    max_shard_bytes: int = 1 << 30
    progress: bool = True
    workers: int = 1  # >1: quantize blocks in a process pool (same bytes out, see _quantize_blocks)
    dense_linears: bool = False  # also quantize the attention projections and lm_head (manifest "dense")
    bcq_init: str = "greedy"  # bcq sign planes: greedy residual signs, or a uniform grid (format/bcq.py)

    def validate(self) -> None:
        if self.table_kind not in TABLE_KINDS:
            raise ConversionError(f"--table-kind must be one of {TABLE_KINDS}, got {self.table_kind!r}")
        if not 1 <= self.bits_min <= self.bits_max <= 8:
            raise ConversionError(
                f"need 1 <= --bits-min <= --bits-max <= 8, got --bits-min {self.bits_min} --bits-max {self.bits_max}"
            )
        if self.group_size <= 0 or self.group_size & (self.group_size - 1):
            raise ConversionError(f"--group-size must be a positive power of two, got {self.group_size}")
        if self.calib_tokens <= 0:
            raise ConversionError(f"--calib-tokens must be positive, got {self.calib_tokens}")
        if self.calib_text is not None and not Path(self.calib_text).is_file():
            raise ConversionError(f"--calib-text {self.calib_text} is not a file")
        if self.bcq_init not in BCQ_INITS:
            raise ConversionError(f"--bcq-init must be one of {BCQ_INITS}, got {self.bcq_init!r}")
        if self.bcq_init != "greedy" and self.table_kind != "bcq":
            raise ConversionError(
                f"--bcq-init {self.bcq_init} applies to --table-kind bcq only"
                + (" (ubcq planes are always the uniform grid)" if self.table_kind == "ubcq" else "")
            )
        if self.max_shard_bytes <= 0:
            raise ConversionError(f"max_shard_bytes must be positive, got {self.max_shard_bytes}")
        if self.workers < 1:
            raise ConversionError(f"--workers must be at least 1, got {self.workers}")


@dataclass
class SourceModel:
    """A scanned HF model directory: config, shards, and which tensors are expert blocks."""

    model_dir: Path
    config: dict[str, Any]
    adapter: ArchAdapter
    shards: list[Path]
    shard_of: dict[str, Path]  # tensor name -> shard file
    experts: dict[str, BlockKey]  # HF weight name -> block key
    dense: set[str] = field(default_factory=set)  # HF weight names of the dense linears (attention projections)
    fmt: SourceFormat = SourceFormat()
    scales: dict[str, str] = field(default_factory=dict)  # FP8 block sources: weight name -> its scale's name
    draft_layers: set[int] = field(default_factory=set)  # multi-token-prediction layers, copied as they are
    # per-expert names of the experts stored in fused 3-D tensors (Gemma-4) -> where each lies in its tensor
    fused: dict[str, FusedSlice] = field(default_factory=dict)
    fused_of: dict[str, list[str]] = field(default_factory=dict)  # fused tensor name -> its per-expert names, in order

    @classmethod
    def scan(cls, model_dir: str | Path) -> SourceModel:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ConversionError(f"--model {model_dir} is not a directory; pass a Hugging Face model folder")
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ConversionError(f"{model_dir} has no config.json; pass a Hugging Face model folder")
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConversionError(f"{config_path} is not valid JSON ({exc})") from exc
        try:
            adapter = adapter_for(config)
            adapter.num_experts(config)
            fmt = SourceFormat.of_config(config)
        except ValueError as exc:
            raise ConversionError(f"{config_path}: {exc}") from exc
        shards = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
        if not shards:
            other = [p.name for p in model_dir.iterdir() if p.name.endswith((".bin", ".pt", ".pth", ".gguf"))]
            hint = f" (found {other[:3]}: re-save the model with save_pretrained(safe_serialization=True))" if other else ""
            raise ConversionError(f"{model_dir} has no *.safetensors weight files{hint}")
        shard_of: dict[str, Path] = {}
        for shard in shards:
            try:
                with safe_open(str(shard), framework="pt") as f:
                    names = list(f.keys())
            except Exception as exc:
                raise ConversionError(f"{shard} is not a readable safetensors file ({exc})") from exc
            for name in names:
                if name in shard_of:
                    raise ConversionError(f"tensor {name!r} appears in both {shard_of[name].name} and {shard.name}")
                shard_of[name] = shard
        source = cls(model_dir, config, adapter, shards, shard_of, {}, fmt=fmt)
        source._classify()
        return source

    def _classify(self) -> None:
        unknown = []
        for name in list(self.shard_of):
            if name.endswith(SCALE_SUFFIX):
                weight = name.removesuffix(SCALE_SUFFIX)
                if self.fmt.kind != "fp8_block":
                    raise ConversionError(
                        f"{self.model_dir}: {name!r} is a block scale, but config.json has no FP8 quantization_config; "
                        "the checkpoint and its config.json do not belong together"
                    )
                if weight not in self.shard_of:
                    raise ConversionError(f"{self.model_dir}: {name!r} has no weight {weight!r}; the checkpoint is incomplete")
                self.scales[weight] = name
                continue
            draft = draft_layer_of(name, self.config)
            if draft is not None:  # SGLang's NextN draft reads these from the output model; nothing is paged
                self.draft_layers.add(draft)
                continue
            if self._split_fused(name):
                continue
            key = self.adapter.classify(name)
            if key is not None:
                self.experts[name] = key
            elif DENSE_LINEAR.fullmatch(name):
                self.dense.add(name)
            elif any(hint in name for hint in EXPERT_NAME_HINTS):
                unknown.append(name)
        if unknown:
            raise ConversionError(
                f"{self.model_dir}: expert tensors in an unsupported layout, e.g. {unknown[0]!r} "
                f"({len(unknown)} in all); the {self.adapter.model_type} adapter expects per-expert 2-D weights "
                "such as " + self.adapter.routed.pattern
            )
        if not self.experts:
            raise ConversionError(
                f"{self.model_dir}: no MoE expert weights found (model_type {self.adapter.model_type}); "
                "the AP converter only converts models with MoE layers"
            )
        self._check_complete()

    def _split_fused(self, name: str) -> bool:
        """Record the experts of a fused 3-D expert tensor under their per-expert names; False for any other tensor."""
        if self.adapter.fused is None or not self.adapter.fused.fullmatch(name):
            return False
        if name + SCALE_SUFFIX in self.shard_of:
            raise ConversionError(f"{name}: FP8 block scales on fused 3-D expert tensors are not supported; convert the bf16 checkpoint")
        with safe_open(str(self.shard_of[name]), framework="pt") as f:
            shape = list(f.get_slice(name).get_shape())
        try:
            parts = split_fused(self.adapter, name, shape, self.adapter.num_experts(self.config))
        except ValueError as exc:
            raise ConversionError(f"{self.model_dir}: {exc}") from exc
        for per_expert, (where, key) in parts.items():
            if per_expert in self.shard_of:
                raise ConversionError(f"{self.model_dir}: {per_expert!r} is stored both on its own and inside {name!r}")
            self.fused[per_expert] = where
            self.shard_of[per_expert] = self.shard_of[name]
            self.experts[per_expert] = key
        self.fused_of[name] = list(parts)
        return True

    def _check_complete(self) -> None:
        num_experts = self.adapter.num_experts(self.config)
        num_layers = int(flat_config(self.config).get("num_hidden_layers", 0))
        present = set(self.experts.values())
        for layer in sorted({k.layer for k in present}):
            if layer >= num_layers:
                raise ConversionError(f"expert tensors for layer {layer}, but config.json has {num_layers} layers")
            wanted = [BlockKey(layer, e, p) for e in range(num_experts) for p in PROJS]
            if any(k.layer == layer and k.expert == SHARED for k in present):
                wanted += [BlockKey(layer, SHARED, p) for p in PROJS]
            missing = [k for k in wanted if k not in present]
            if missing:
                raise ConversionError(
                    f"{self.model_dir}: layer {layer} lacks {len(missing)} expert weights, e.g. expert "
                    f"{missing[0].expert} {missing[0].proj}; the checkpoint is incomplete (config says {num_experts} experts)"
                )

    def experts_of_layer(self) -> dict[int, list[int | str]]:
        out: dict[int, set] = {}
        for key in self.experts.values():
            out.setdefault(key.layer, set()).add(key.expert)
        return {layer: sorted(e, key=lambda x: BlockKey(layer, x, "gate").sort_key()) for layer, e in out.items()}

    def read(self, name: str) -> torch.Tensor:
        with safe_open(str(self.shard_of[name]), framework="pt") as f:
            return f.get_tensor(name)

    def weight(self, name: str) -> torch.Tensor:
        """An expert weight in float32: one expert's slice of a fused tensor, an FP8 one dequantized."""
        with safe_open(str(self.shard_of[name]), framework="pt") as f:
            return _read_weight(f, name, self.scale_ref(name), self.fmt, self.fused.get(name))

    def scale_ref(self, name: str) -> tuple[Path, str] | None:
        """(shard, tensor name) of `name`'s FP8 block scale; None for a weight stored plainly."""
        scale = self.scales.get(name)
        return None if scale is None else (self.shard_of[scale], scale)

    def dense_tensor(self, f, name: str) -> torch.Tensor:
        """A tensor for the output's top-level model: as stored, or an FP8 weight dequantized to the model dtype."""
        ref = self.scale_ref(name)
        if ref is None:
            return f.get_tensor(name)
        return _read_weight(f, name, ref, self.fmt).to(_model_dtype(self.config))  # reads the weight once


def _model_dtype(config: dict[str, Any]) -> torch.dtype:
    name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2 else torch.bfloat16


def _read_weight(f, name: str, scale: tuple[Path, str] | None, fmt: SourceFormat,
                 fused: FusedSlice | None = None) -> torch.Tensor:
    """A weight in float32 from the open shard `f` (one expert's slice of a fused tensor when `fused` says where),
    dequantized with its FP8 block scale when it has one."""
    weight = fused.read(f) if fused is not None else f.get_tensor(name)
    if scale is None:
        return weight.float()
    shard, scale_name = scale
    with safe_open(str(shard), framework="pt") as g:
        scale_inv = g.get_tensor(scale_name)
    try:
        return dequantize_fp8_block(weight, scale_inv, fmt.block, name)
    except SourceFormatError as exc:
        raise ConversionError(str(exc)) from exc


def _calibrate(source: SourceModel, opts: ConvertOptions):
    from pagedweight.format.hessian import HessianStats, collect_moe_inputs, expert_hessians

    text = Path(opts.calib_text).read_text(encoding="utf-8", errors="replace")  # type: ignore[arg-type]
    experts_of_layer = source.experts_of_layer()
    inputs, used = collect_moe_inputs(source.model_dir, text, opts.calib_tokens, opts.seed, sorted(experts_of_layer),
                                      load_model=lambda path: load_source_model(path)[0])
    expert_names = {k: n for n, k in source.experts.items()}
    hessian, counts = expert_hessians(inputs, lambda key: source.weight(expert_names[key]), experts_of_layer)
    return HessianStats(Path(opts.calib_text).name, used, hessian, counts)  # type: ignore[arg-type]


def _prepare_output(model_dir: Path, out: Path, force: bool) -> Path:
    out = out.absolute()
    if out.exists() and not out.is_dir():
        raise ConversionError(f"--out {out} exists and is not a directory")
    src = model_dir.resolve()
    if out.exists() and (out.resolve() == src or out.resolve() in src.parents):
        raise ConversionError(f"--out {out} is (or contains) the source model; choose another output directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise ConversionError(f"--out {out} exists and is not empty; pass --force to replace it")
    partial = out.parent / f"{out.name}.partial-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def _write_dense(partial: Path, parts: list[dict[str, torch.Tensor]]) -> None:
    """Non-expert tensors: model.safetensors, or HF-style shards + index when there are several parts."""
    parts = [p for p in parts if p]
    if len(parts) == 1:
        save_file(parts[0], str(partial / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file(part, str(partial / file), metadata={"format": "pt"})
        for name, tensor in part.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _copy_side_files(model_dir: Path, partial: Path) -> None:
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and not path.name.startswith(".") and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(path, partial / path.name)


def _check_expert_shapes(source: SourceModel, opts: ConvertOptions) -> None:
    """Refuse before any work starts: every block's weight must be 2-D, K % 8 == 0, K divisible into groups."""
    if opts.dense_linears and not source.dense:
        raise ConversionError(
            f"--dense-linears: {source.model_dir} has no attention projections or lm_head named like "
            f"{DENSE_LINEAR.pattern!r}; convert without --dense-linears"
        )
    for shard in source.shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if f.get_slice(name).get_dtype().startswith("F8") and not name.endswith(SCALE_SUFFIX) \
                        and name not in source.scales:
                    raise ConversionError(
                        f"{name}: float8 weights without a {name}{SCALE_SUFFIX} block scale; the converter reads FP8 "
                        "only as block-quantized weights (quantization_config quant_method fp8 + weight_block_size)"
                    )
                if name in source.fused_of:  # a fused 3-D tensor: the shapes of the blocks it holds
                    for per_expert in source.fused_of[name]:
                        _check_block_shape(per_expert, list(source.fused[per_expert].shape), opts)
                    continue
                if name not in source.experts and not (opts.dense_linears and name in source.dense):
                    continue
                _check_block_shape(name, f.get_slice(name).get_shape(), opts)


def _check_block_shape(name: str, shape: list[int], opts: ConvertOptions) -> None:
    """One block's weight: 2-D, K % 8 == 0, K divisible into groups (bcq / ubcq)."""
    if len(shape) != 2 or shape[1] % 8:
        raise ConversionError(f"{name}: shape {shape}; AP blocks need 2-D weights with in_features % 8 == 0")
    if is_grouped(opts.table_kind):
        try:
            effective_group_size(shape[1], opts.group_size)
        except ValueError as exc:
            raise ConversionError(f"{name}: {exc}") from exc


def convert_checkpoint(model_dir: str | Path, out_dir: str | Path, **options: Any) -> Path:
    """Convert the HF MoE model in `model_dir` to an AP checkpoint at `out_dir`; return `out_dir`.

    Options are the fields of ConvertOptions (table_kind, bits_min, bits_max, group_size, calib_text,
    calib_tokens, seed, standalone_ap_dir, force, max_shard_bytes, progress, workers, dense_linears).
    """
    known = {f.name for f in fields(ConvertOptions)}
    if unknown := sorted(set(options) - known):
        raise ConversionError(f"unknown conversion option(s) {unknown}; valid: {sorted(known)}")
    opts = ConvertOptions(**options)
    opts.validate()
    model_dir, out = Path(model_dir), Path(out_dir)
    source = SourceModel.scan(model_dir)
    _check_expert_shapes(source, opts)

    partial = _prepare_output(model_dir, out, opts.force)
    try:
        _convert_into(source, partial, opts)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    # Swap in the finished output; an old one (--force) is moved aside first and deleted last, so at
    # every moment OUT is either the old complete conversion, absent, or the new complete one.
    previous = out.parent / f"{out.name}.replaced-{os.getpid()}"
    if out.exists():
        os.replace(out, previous)
    os.replace(partial, out)
    if previous.exists():
        shutil.rmtree(previous)
    return out


def _quantize_one(shard: Path, name: str, scale: tuple[Path, str] | None, fused: FusedSlice | None, fmt: SourceFormat,
                  hessian: torch.Tensor | None, kind: str, bits_min: int, bits_max: int, group_size: int, bcq_init: str):
    """Read one expert weight from its shard (one slice of a fused tensor; dequantizing an FP8 block source) and
    quantize it: (QuantizedBlock, sum of squared weights)."""
    with safe_open(str(shard), framework="pt") as f:
        weight = _read_weight(f, name, scale, fmt, fused)
    block = quantize_block(weight, kind, bits_min, bits_max, group_size, hessian, bcq_init)
    return block, float(weight.double().square().sum())


def _pool_worker_init() -> None:
    # One thread per process: N processes x 1 thread is what makes --workers N use N cores. The quantizer
    # works on small float64 batches whose results do not depend on the thread count (a test checks bytes).
    torch.set_num_threads(1)


@contextlib.contextmanager
def _block_quantizer(opts: ConvertOptions, source: SourceModel):
    """Yields quantize(shard, jobs) -> iterator of (block, energy) in job order; in-process or a process pool."""
    args = (opts.table_kind, opts.bits_min, opts.bits_max, opts.group_size, opts.bcq_init)
    fmt = source.fmt
    if opts.workers == 1:
        yield lambda shard, jobs: (_quantize_one(shard, name, source.scale_ref(name), source.fused.get(name), fmt, hessian, *args)
                                   for name, _, hessian in jobs)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent may already run OpenMP threads, which a forked child must not inherit.
    with ProcessPoolExecutor(opts.workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_pool_worker_init) as pool:
        def quantize(shard: Path, jobs: list):
            futures = [pool.submit(_quantize_one, shard, name, source.scale_ref(name), source.fused.get(name), fmt, hessian,
                                   *args)
                       for name, _, hessian in jobs]
            return (future.result() for future in futures)

        yield quantize


def _convert_into(source: SourceModel, partial: Path, opts: ConvertOptions) -> None:
    if source.draft_layers:
        logger.info("multi-token-prediction layer(s) %s (num_nextn_predict_layers) copied as they are: SGLang's NextN "
                    "draft reads them; the AP checkpoint holds the %d decoder layers' experts",
                    ", ".join(map(str, sorted(source.draft_layers))), int(source.config.get("num_hidden_layers", 0)))
    stats = _calibrate(source, opts) if opts.calib_text is not None else None
    if stats is not None:
        missing = stats.uncalibrated(list(source.experts.values()))
        if missing:
            logger.warning(
                "%d of %d expert blocks received no calibration tokens and use uniform weights", len(missing),
                len(source.experts),
            )
    calibration = None if stats is None else {"source": stats.source, "num_tokens": stats.num_tokens}
    writer = APCheckpointWriter(
        partial / AP_SUBDIR,
        table_kind=opts.table_kind,
        bits_min=opts.bits_min,
        bits_max=opts.bits_max,
        group_size=opts.group_size,
        model=ModelInfo.from_config(source.config),
        calibration=calibration,
        seed=opts.seed,
        max_shard_bytes=opts.max_shard_bytes,
        bcq_init=opts.bcq_init,
        source_format=source.fmt.label,
    )
    dense_parts: list[dict[str, torch.Tensor]] = []
    sse = {b: 0.0 for b in range(opts.bits_min, opts.bits_max + 1)}
    energy = 0.0
    tensor_errors: dict[tuple[int, int, str], TensorError] = {}  # routed experts: weight_errors.json
    dense_names = source.dense if opts.dense_linears else set()
    with tqdm(total=len(source.experts) + len(dense_names), desc=f"quantize blocks ({opts.table_kind})", unit="block",
              disable=not opts.progress) as bar, _block_quantizer(opts, source) as quantize:
        for shard in source.shards:
            dense: dict[str, torch.Tensor] = {}
            jobs: list[tuple[str, BlockKey, torch.Tensor | None]] = []
            with safe_open(str(shard), framework="pt") as f:
                for name in sorted(f.keys()):
                    if name.endswith(SCALE_SUFFIX):  # FP8 block scales: the output stores dequantized weights
                        continue
                    if name in source.fused_of:  # routed experts only: quantized per expert, not kept in the model
                        jobs += [(e, source.experts[e], None) for e in source.fused_of[name]]
                        continue
                    key = source.experts.get(name)
                    if name in dense_names:
                        # uniform column weights: calibration collects expert inputs only
                        if not opts.standalone_ap_dir:
                            dense[name] = source.dense_tensor(f, name)  # kept for --paged-weight-scope experts
                        jobs.append((name, None, None))
                        continue
                    if key is None or key.expert == SHARED:
                        # Shared experts are quantized too, but SGLang serves them as dense layers, so their
                        # bf16 weights also stay in the servable model.
                        if not opts.standalone_ap_dir:
                            dense[name] = source.dense_tensor(f, name)
                        if key is None:
                            continue
                    jobs.append((name, key, None if stats is None else stats.hessian.get(key)))
            # Blocks come back in job order, so shards, manifest and the error sums are the same for any pool size.
            for (name, key, _), (block, block_energy) in zip(jobs, quantize(shard, jobs), strict=True):
                if key is None:
                    writer.add_dense(block_name(name), block)
                else:
                    writer.add(block_name(name), key, block)
                    if key.expert != SHARED:
                        tensor_errors[(key.layer, key.expert, key.proj)] = TensorError(block_energy, dict(block.fit_sse))
                for b, value in block.fit_sse.items():
                    sse[b] += value
                energy += block_energy
                bar.update(1)
            dense_parts.append(dense)
    writer.finish(progress=opts.progress)
    # the uncalibrated policy's weight-only sensitivity and floor (format/weight_errors.py)
    WeightErrors(opts.table_kind, opts.bits_min, opts.bits_max, tensor_errors).save(partial / AP_SUBDIR)
    if not opts.standalone_ap_dir:
        _write_dense(partial, dense_parts)
        _copy_side_files(source.model_dir, partial)
        if source.fmt.kind != "plain":  # the output's weights are dequantized: its config says so
            plain = {k: v for k, v in source.config.items() if k != "quantization_config"}
            (partial / "config.json").write_text(json.dumps(plain, indent=2) + "\n")
    if energy > 0:
        logger.info(
            "relative squared error per bitwidth: %s",
            ", ".join(f"{b}: {value / energy:.2e}" for b, value in sse.items()),
        )


# ------------------------------------------------------------------------------------------------ CLI
def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("convert", help="convert a Hugging Face MoE checkpoint to an AP checkpoint")
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model directory (safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (must not exist or be empty)")
    parser.add_argument("--table-kind", choices=TABLE_KINDS, default=DEFAULT_TABLE_KIND,
                        help=f"ubcq: uniform-grid sign planes + one scale and offset per group (smallest tables); bcq: "
                        f"binary-coded planes + b+1 least-squares scales per group; kmeans: Any-Precision LLM LUTs "
                        f"(default {DEFAULT_TABLE_KIND})")
    parser.add_argument("--bits-min", type=int, default=2, help="seed bitwidth (lowest servable), default 2")
    parser.add_argument("--bits-max", type=int, default=8, help="parent bitwidth (planes stored), default 8")
    parser.add_argument("--group-size", type=int, default=128,
                        help="bcq/ubcq input group size (power of two; clipped to in_features), default 128")
    parser.add_argument("--bcq-init", choices=BCQ_INITS, default="greedy",
                        help="how bcq sign planes are chosen: greedy residual signs (default) or the codes of a "
                        "uniform grid anchored at 4 bits (lower error on the MoEfied SmolLM2, exact at 4 bits for "
                        "GGUF Q4 sources; docs/format.md)")
    parser.add_argument("--calib-text", type=Path, default=None,
                        help="UTF-8 text file for Hessian-weighted fitting (default: uniform weights)")
    parser.add_argument("--calib-tokens", type=int, default=512, help="calibration tokens, default 512")
    parser.add_argument("--seed", type=int, default=0, help="selects calibration windows; recorded in the manifest")
    parser.add_argument("--standalone-ap-dir", action="store_true",
                        help="write only OUT/pagedweight/ (serve with --model-path HF_DIR --paged-weight-path OUT)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    parser.add_argument("--dense-linears", action="store_true",
                        help="also quantize the attention projections (q/k/v/o) and an untied lm_head, for "
                        "--paged-weight-scope all")
    parser.add_argument("--workers", type=int, default=1,
                        help="quantize expert blocks in N processes of one thread each (output bytes do not depend on N)")
    parser.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = convert_checkpoint(
            args.model, args.out, table_kind=args.table_kind, bits_min=args.bits_min, bits_max=args.bits_max,
            group_size=args.group_size, calib_text=args.calib_text, calib_tokens=args.calib_tokens, seed=args.seed,
            standalone_ap_dir=args.standalone_ap_dir, force=args.force, workers=args.workers,
            dense_linears=args.dense_linears, bcq_init=args.bcq_init,
        )
    except ConversionError as exc:
        print(f"pagedweight convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote AP checkpoint to {out}")
    return 0
