"""Reading and writing AP checkpoints (docs/format.md).

Writer: tensors go to safetensors shards in <dir>/pagedweight/, each shard is hashed after it is complete,
and the manifest is written last (temp file + rename), so a directory without manifest.json is never
mistaken for a checkpoint.

Reader: `APCheckpoint.open` parses and validates the manifest and stats the data files (cheap: the server
calls it at start); tensors are read lazily through memory-mapped safetensors handles; hashing happens only
in `verify(deep=True)`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from pagedweight.format.arch import BlockKey
from pagedweight.format.block import QuantizedBlock
from pagedweight.format.layout import PLANE_DTYPE, TABLE_DTYPE, BlockSpec, table_key
from pagedweight.format.manifest import (
    AP_SUBDIR,
    MANIFEST_NAME,
    APCheckpointError,
    DenseEntry,
    FileEntry,
    Manifest,
    ModelInfo,
    TensorEntry,
    config_sha256,
    shape_config,
)

_HASH_CHUNK = 8 << 20


def sha256_file(path: Path, progress: tqdm | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


def planes_tensor_name(name: str) -> str:
    return f"{name}.planes"


def table_tensor_name(name: str, table_kind: str, bits: int) -> str:
    return f"{name}.{table_key(table_kind, bits)}"


def find_ap_dir(path: str | Path) -> Path:
    """The folder holding manifest.json: `path` itself or `path`/pagedweight."""
    path = Path(path)
    for candidate in (path, path / AP_SUBDIR):
        if (candidate / MANIFEST_NAME).is_file():
            return candidate
    if not path.exists():
        raise APCheckpointError(f"{path} does not exist; pass the AP checkpoint directory (created by `pagedweight convert`)")
    partial = path / AP_SUBDIR if (path / AP_SUBDIR).is_dir() else path
    if any(partial.glob("ap-*.safetensors")):
        raise APCheckpointError(
            f"{partial} has AP data files but no {MANIFEST_NAME}: the conversion did not finish; re-run `pagedweight convert`"
        )
    raise APCheckpointError(
        f"no {MANIFEST_NAME} in {path} or {path / AP_SUBDIR}; convert the model first: "
        f"`pagedweight convert --model HF_DIR --out {path}`"
    )


class APCheckpoint:
    """Lazy reader of one AP checkpoint. Use `APCheckpoint.open(path)`."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = directory
        self.manifest = manifest
        self._handles: dict[str, Any] = {}
        self._by_key = {entry.key: name for name, entry in manifest.tensors.items()}
        if len(self._by_key) != len(manifest.tensors):
            raise APCheckpointError(f"{self._manifest_path}: two tensors share one (layer, expert, proj) key")

    # ----------------------------------------------------------------------------------------- open
    @classmethod
    def open(cls, path: str | Path) -> APCheckpoint:
        """Open the checkpoint at `path` (the AP folder, or a model folder with pagedweight/ inside)."""
        directory = find_ap_dir(path)
        manifest_path = directory / MANIFEST_NAME
        try:
            data = json.loads(manifest_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise APCheckpointError(
                f"{manifest_path}: unreadable ({exc}); the file is corrupt, re-run `pagedweight convert`"
            ) from exc
        checkpoint = cls(directory, Manifest.from_json(data, str(manifest_path)))
        checkpoint._check_file_sizes()
        return checkpoint

    @property
    def _manifest_path(self) -> Path:
        return self.directory / MANIFEST_NAME

    def _check_file_sizes(self) -> None:
        for file, entry in self.manifest.files.items():
            path = self.directory / file
            if not path.is_file():
                raise APCheckpointError(f"{path} is missing (listed in {self._manifest_path}); re-run `pagedweight convert`")
            size = path.stat().st_size
            if size != entry.bytes:
                raise APCheckpointError(
                    f"{path} has {size} bytes, the manifest says {entry.bytes}: the file is truncated or was "
                    "modified; re-run `pagedweight convert`"
                )

    # ------------------------------------------------------------------------------------ properties
    @property
    def table_kind(self) -> str:
        return self.manifest.table_kind

    @property
    def bits_min(self) -> int:
        return self.manifest.bits_min

    @property
    def bits_max(self) -> int:
        return self.manifest.bits_max

    @property
    def bitwidths(self) -> range:
        return range(self.bits_min, self.bits_max + 1)

    @property
    def model(self) -> ModelInfo:
        return self.manifest.model

    def names(self) -> list[str]:
        """AP tensor names (HF weight names without '.weight'), ordered by (layer, expert, proj)."""
        return sorted(self.manifest.tensors, key=lambda n: self.manifest.tensors[n].key.sort_key())

    def dense_names(self) -> list[str]:
        """AP tensor names of dense linears (`convert --dense-linears`), sorted; empty for expert-only checkpoints."""
        return sorted(self.manifest.dense)

    def has_block(self, name: str) -> bool:
        """Whether `name` is an expert block or a dense block of this checkpoint."""
        return name in self.manifest.tensors or name in self.manifest.dense

    def blocks(self) -> dict[BlockKey, str]:
        """Every block key -> AP tensor name, ordered by (layer, expert, proj)."""
        return {self.manifest.tensors[n].key: n for n in self.names()}

    def layers(self) -> list[int]:
        return sorted({key.layer for key in self._by_key})

    def experts(self, layer: int) -> list[int | str]:
        """Routed expert indices of a layer, then "shared" if it has a shared expert."""
        experts = {key.expert for key in self._by_key if key.layer == layer}
        return sorted(experts, key=lambda e: BlockKey(layer, e, "gate").sort_key())

    def name_of(self, layer: int, expert: int | str, proj: str) -> str:
        """AP tensor name of (layer, expert, proj); proj is gate, up or down."""
        key = BlockKey(layer, expert, proj)
        if key not in self._by_key:
            raise APCheckpointError(
                f"{self._manifest_path}: no block for layer {layer}, expert {expert!r}, proj {proj!r} "
                f"(layers {self.layers()[:1]}..{self.layers()[-1:]}); is this the checkpoint of this model?"
            )
        return self._by_key[key]

    def spec(self, name: str) -> BlockSpec:
        entry = self._entry(name)
        n, k = entry.shape
        return BlockSpec(n, k, self.bits_min, self.bits_max, self.table_kind, entry.group_size)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------ tensor access
    def planes(self, name: str, bits: int | None = None) -> torch.Tensor:
        """The first `bits` planes (all bits_max if None) of block `name`: [bits, N, K // 8] uint8."""
        spec = self.spec(name)
        if bits is not None:
            self._check_bits(name, bits)
        count = spec.bits_max if bits is None else bits
        tensor = self._read(name, planes_tensor_name(name), spec.planes_shape(), PLANE_DTYPE, rows=count)
        return tensor

    def table(self, name: str, bits: int) -> torch.Tensor:
        """Table of block `name` for bitwidth `bits` (bcq [b + 1, N, K // G], kmeans [N, 2**b]) float16."""
        spec = self.spec(name)
        self._check_bits(name, bits)
        return self._read(name, table_tensor_name(name, self.table_kind, bits), spec.table_shape(bits), TABLE_DTYPE)

    def block(self, name: str) -> QuantizedBlock:
        """Planes and every table of one block."""
        return QuantizedBlock(self.spec(name), self.planes(name), {b: self.table(name, b) for b in self.bitwidths})

    def _check_bits(self, name: str, bits: int) -> None:
        if not self.bits_min <= bits <= self.bits_max:
            raise APCheckpointError(
                f"bitwidth {bits} requested for {name!r}, but {self.directory} stores {self.bits_min}..{self.bits_max}; "
                f"pick a bitwidth in that range or reconvert with --bits-min/--bits-max"
            )

    def _entry(self, name: str) -> TensorEntry | DenseEntry:
        try:
            return self.manifest.tensors[name] if name in self.manifest.tensors else self.manifest.dense[name]
        except KeyError:
            raise APCheckpointError(
                f"{self._manifest_path} has no tensor {name!r}; known blocks look like {self.names()[0]!r}"
            ) from None

    def _handle(self, file: str):
        if file not in self._handles:
            path = self.directory / file
            try:
                self._handles[file] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for bad headers
                raise APCheckpointError(
                    f"{path} is corrupt (safetensors header unreadable: {exc}); re-run `pagedweight convert`"
                ) from exc
        return self._handles[file]

    def _read(
        self, name: str, tensor_name: str, shape: tuple[int, ...], dtype: torch.dtype, rows: int | None = None
    ) -> torch.Tensor:
        file = self._entry(name).file
        handle = self._handle(file)
        if tensor_name not in handle.keys():
            raise APCheckpointError(
                f"{self.directory / file} lacks tensor {tensor_name!r} that the manifest promises; "
                "the checkpoint is incomplete, re-run `pagedweight convert`"
            )
        try:
            sliced = handle.get_slice(tensor_name)
            stored_shape = tuple(sliced.get_shape())
            if stored_shape != tuple(shape):
                raise APCheckpointError(
                    f"{self.directory / file}: {tensor_name!r} has shape {list(stored_shape)}, expected {list(shape)}; "
                    "re-run `pagedweight convert`"
                )
            tensor = sliced[:rows] if rows is not None else sliced[:]
        except APCheckpointError:
            raise
        except Exception as exc:
            raise APCheckpointError(
                f"{self.directory / file}: cannot read {tensor_name!r} ({exc}); the file is corrupt, "
                "re-run `pagedweight convert`"
            ) from exc
        if tensor.dtype != dtype:
            raise APCheckpointError(
                f"{self.directory / file}: {tensor_name!r} is {tensor.dtype}, expected {dtype}; re-run `pagedweight convert`"
            )
        return tensor

    # ------------------------------------------------------------------------------------ checks
    def verify(self, deep: bool = True, progress: bool = True) -> None:
        """Check sizes and that every promised tensor is present with the right shape and dtype;
        with deep=True also hash every file against the manifest."""
        self._check_file_sizes()
        if deep:
            total = sum(f.bytes for f in self.manifest.files.values())
            with tqdm(total=total, unit="B", unit_scale=True, desc="verify AP checkpoint", disable=not progress) as bar:
                for file, entry in self.manifest.files.items():
                    digest = sha256_file(self.directory / file, bar)
                    if digest != entry.sha256:
                        raise APCheckpointError(
                            f"{self.directory / file}: SHA-256 {digest[:16]}... does not match the manifest's "
                            f"{entry.sha256[:16]}...; the file is corrupt, re-run `pagedweight convert`"
                        )
        for name in self.names() + self.dense_names():
            spec = self.spec(name)
            handle = self._handle(self._entry(name).file)
            expected = {planes_tensor_name(name): (spec.planes_shape(), "U8")}
            for b in self.bitwidths:
                expected[table_tensor_name(name, self.table_kind, b)] = (spec.table_shape(b), "F16")
            for tensor_name, (shape, dtype) in expected.items():
                if tensor_name not in handle.keys():
                    raise APCheckpointError(
                        f"{self.directory / self._entry(name).file} lacks tensor {tensor_name!r}; re-run `pagedweight convert`"
                    )
                sliced = handle.get_slice(tensor_name)
                if tuple(sliced.get_shape()) != tuple(shape) or sliced.get_dtype() != dtype:
                    raise APCheckpointError(
                        f"{self.directory / self._entry(name).file}: {tensor_name!r} is {sliced.get_dtype()}"
                        f"{list(sliced.get_shape())}, expected {dtype}{list(shape)}; re-run `pagedweight convert`"
                    )

    def check_tables_finite(self, progress: bool = True) -> int:
        """Refuse a table that holds NaN or +-inf (every bitwidth of every expert and dense block).

        The hashes only prove that the files are what the converter wrote; a non-finite scale or offset written
        by it (or edited in with verification off) would be served as is and turn every output of its expert
        into NaN. Tables are a few percent of the bytes, so this runs whether or not `verify(deep=True)` does.
        Returns the number of tables checked.
        """
        names = self.names() + self.dense_names()
        checked = 0
        with tqdm(total=len(names), unit="block", desc="check AP tables", disable=not progress) as bar:
            for name in names:
                for bits in self.bitwidths:
                    table = self.table(name, bits)
                    finite = torch.isfinite(table)
                    if not bool(finite.all()):
                        bad = int((~finite).sum())
                        raise APCheckpointError(
                            f"{self.directory / self._entry(name).file}: block {name!r} holds {bad} non-finite "
                            f"value(s) (NaN or inf) in its {bits}-bit table; the checkpoint is corrupt, re-run "
                            "`pagedweight convert`"
                        )
                    checked += 1
                bar.update(1)
        return checked

    def check_model_config(self, hf_config: Any) -> None:
        """Refuse a model whose shape-fixing config differs from the one this checkpoint was made from.

        `hf_config`: a config dict (config.json) or an object with to_dict() (transformers PretrainedConfig).
        """
        config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        if config_sha256(config) == self.model.config_sha256:
            return
        given = shape_config(config)
        stored = self.model.shape_config
        diffs = [
            f"{k}: checkpoint {stored.get(k)!r} vs model {given.get(k)!r}"
            for k in sorted(set(stored) | set(given))
            if stored.get(k) != given.get(k)
        ]
        detail = "; ".join(diffs) if diffs and stored else "config hash differs"
        raise APCheckpointError(
            f"{self.directory} was converted from another model ({detail}); convert this model with "
            "`pagedweight convert --model MODEL_DIR --out OUT` or pass the matching --paged-weight-path"
        )

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> APCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class APCheckpointWriter:
    """Streams quantized blocks into shards of <= max_shard_bytes, then writes the manifest."""

    def __init__(
        self,
        ap_dir: str | Path,
        *,
        table_kind: str,
        bits_min: int,
        bits_max: int,
        group_size: int,
        model: ModelInfo,
        calibration: dict[str, Any] | None = None,
        seed: int = 0,
        max_shard_bytes: int = 1 << 30,
        bcq_init: str = "greedy",
        source_format: str = "plain",
    ) -> None:
        self.ap_dir = Path(ap_dir)
        if (self.ap_dir / MANIFEST_NAME).exists():
            raise APCheckpointError(f"{self.ap_dir} already holds an AP checkpoint; write into an empty directory")
        self.ap_dir.mkdir(parents=True, exist_ok=True)
        self._params = dict(table_kind=table_kind, bits_min=bits_min, bits_max=bits_max, group_size=group_size)
        self._model, self._calibration, self._seed, self._bcq_init = model, calibration, seed, bcq_init
        self._source_format = source_format
        self._max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_names: list[str] = []
        self._pending_bytes = 0
        self._parts: list[tuple[Path, list[str]]] = []
        self._entries: dict[str, tuple[tuple[int, int], int, BlockKey | None]] = {}
        self._finished = False

    def add(self, name: str, key: BlockKey, block: QuantizedBlock) -> None:
        """An expert block (routed or shared)."""
        self._stage(name, key, block)

    def add_dense(self, name: str, block: QuantizedBlock) -> None:
        """A dense linear's block (attention projection), listed under the manifest's "dense"."""
        self._stage(name, None, block)

    def _stage(self, name: str, key: BlockKey | None, block: QuantizedBlock) -> None:
        spec = block.spec
        if self._finished:
            raise RuntimeError("add() after finish()")
        if name in self._entries:
            raise ValueError(f"block {name!r} was added twice")
        if (spec.table_kind, spec.bits_min, spec.bits_max) != (
            self._params["table_kind"], self._params["bits_min"], self._params["bits_max"]
        ):
            raise ValueError(f"block {name!r} was quantized as {spec}, the checkpoint is {self._params}")
        tensors = {planes_tensor_name(name): block.planes.contiguous()}
        for b, table in block.tables.items():
            tensors[table_tensor_name(name, spec.table_kind, b)] = table.contiguous()
        self._pending.update(tensors)
        self._pending_names.append(name)
        self._pending_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self._entries[name] = ((spec.out_features, spec.in_features), spec.group_size, key)
        if self._pending_bytes >= self._max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        path = self.ap_dir / f"ap-part-{len(self._parts) + 1:05d}.safetensors.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._parts.append((path, self._pending_names))
        self._pending, self._pending_names, self._pending_bytes = {}, [], 0

    def finish(self, progress: bool = True) -> Manifest:
        """Close the last shard, name and hash the shards, write manifest.json atomically."""
        if not any(key is not None for _, _, key in self._entries.values()):
            raise ValueError("no expert blocks were added; an AP checkpoint needs at least one expert block")
        self._flush()
        self._finished = True
        count = len(self._parts)
        files: dict[str, FileEntry] = {}
        tensors: dict[str, TensorEntry] = {}
        dense: dict[str, DenseEntry] = {}
        for index, (tmp_path, names) in enumerate(tqdm(self._parts, desc="hash AP shards", disable=not progress)):
            final = f"ap-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(tmp_path, self.ap_dir / final)
            files[final] = FileEntry((self.ap_dir / final).stat().st_size, sha256_file(self.ap_dir / final))
            for name in names:
                shape, group_size, key = self._entries[name]
                if key is None:
                    dense[name] = DenseEntry(shape, group_size, final)
                else:
                    tensors[name] = TensorEntry(shape, group_size, final, key)
        ordered = dict(sorted(tensors.items(), key=lambda item: item[1].key.sort_key()))
        manifest = Manifest(
            **self._params, model=self._model, calibration=self._calibration, seed=self._seed,
            tensors=ordered, files=files, dense=dict(sorted(dense.items())), bcq_init=self._bcq_init,
            source_format=self._source_format,
        )
        write_manifest_atomically(self.ap_dir, manifest)
        return manifest


def write_manifest_atomically(ap_dir: Path, manifest: Manifest) -> None:
    tmp = ap_dir / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest.to_json(), f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ap_dir / MANIFEST_NAME)
