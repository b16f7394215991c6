"""manifest.json of an AP checkpoint (docs/format.md): typed records, JSON (de)serialization, validation.

Besides the keys docs/format.md lists, this writer adds (readers must tolerate their absence):
  model.shape_config   the canonical shape-fixing config the config_sha256 was computed from, so a
                       mismatch error can say which key differs;
  tensors[*].layer / .expert / .proj   the block key (expert = index or "shared"); when absent, the
                       reader derives it from the HF name through the model_type's arch adapter.
  dense                AP blocks of dense linears (attention projections), written by `pagedweight convert
                       --dense-linears`; absent (= none) in checkpoints of expert blocks only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pagedweight.format.arch import SHARED, BlockKey, adapter_for, flat_config
from pagedweight.format.layout import TABLE_KINDS

FORMAT_NAME = "pagedweight-ap"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
AP_SUBDIR = "pagedweight"


class APCheckpointError(Exception):
    """Any problem with an AP checkpoint; the message names the file or tensor and the fix."""


# Config keys that fix the shapes of the expert tensors (aliases map to one canonical key).
SHAPE_CONFIG_KEYS: tuple[str, ...] = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_experts",
    "moe_intermediate_size",
    "intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
)
_ALIASES = {"num_local_experts": "num_experts", "n_routed_experts": "num_experts"}
# Values equal to the transformers default are dropped so a config.json that omits them and a
# config.to_dict() that spells them out hash the same.
_DEFAULTS = {"decoder_sparse_step": 1, "mlp_only_layers": []}


def shape_config(config: dict[str, Any]) -> dict[str, Any]:
    """The canonical shape-fixing subset of a HF config dict (a multimodal config's text_config read as its own)."""
    flat = dict(flat_config(config))
    for alias, key in _ALIASES.items():
        if flat.get(key) is None and flat.get(alias) is not None:
            flat[key] = flat[alias]
    out = {}
    for key in SHAPE_CONFIG_KEYS:
        value = flat.get(key)
        if value is None or (key in _DEFAULTS and value == _DEFAULTS[key]):
            continue
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def config_sha256(config: dict[str, Any]) -> str:
    canonical = json.dumps(shape_config(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class ModelInfo:
    architectures: list[str]
    model_type: str
    num_hidden_layers: int
    num_experts: int
    hidden_size: int
    config_sha256: str
    shape_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelInfo:
        adapter = adapter_for(config)
        flat = flat_config(config)
        return cls(
            architectures=list(config.get("architectures") or []),
            model_type=config["model_type"],
            num_hidden_layers=int(flat["num_hidden_layers"]),
            num_experts=adapter.num_experts(config),
            hidden_size=int(flat["hidden_size"]),
            config_sha256=config_sha256(config),
            shape_config=shape_config(config),
        )


@dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, int]  # [N, K] of the original weight
    group_size: int
    file: str
    key: BlockKey


@dataclass(frozen=True)
class DenseEntry:
    """A dense linear's AP block (served under --paged-weight-scope all); not a routed/shared expert."""

    shape: tuple[int, int]  # [N, K] of the original weight
    group_size: int
    file: str


@dataclass(frozen=True)
class FileEntry:
    bytes: int
    sha256: str


@dataclass
class Manifest:
    table_kind: str
    bits_min: int
    bits_max: int
    group_size: int
    model: ModelInfo
    calibration: dict[str, Any] | None
    seed: int
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    dense: dict[str, DenseEntry] = field(default_factory=dict)
    bcq_init: str = "greedy"  # how the converter chose the sign planes (provenance; readers need not care)
    source_format: str = "plain"  # how the source stored its weights, e.g. fp8_block128x128 (provenance)

    def to_json(self) -> dict[str, Any]:
        model = {
            "architectures": self.model.architectures,
            "model_type": self.model.model_type,
            "num_hidden_layers": self.model.num_hidden_layers,
            "num_experts": self.model.num_experts,
            "hidden_size": self.model.hidden_size,
            "config_sha256": self.model.config_sha256,
            "shape_config": self.model.shape_config,
        }
        tensors = {
            name: {
                "shape": list(e.shape),
                "group_size": e.group_size,
                "file": e.file,
                "layer": e.key.layer,
                "expert": e.key.expert,
                "proj": e.key.proj,
            }
            for name, e in self.tensors.items()
        }
        out = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "table_kind": self.table_kind,
            "bits_min": self.bits_min,
            "bits_max": self.bits_max,
            "group_size": self.group_size,
            "model": model,
            "calibration": self.calibration,
            "seed": self.seed,
            "tensors": tensors,
            "files": {name: {"bytes": f.bytes, "sha256": f.sha256} for name, f in self.files.items()},
        }
        if self.bcq_init != "greedy":  # absent for the default, so earlier checkpoints keep their exact bytes
            out["bcq_init"] = self.bcq_init
        if self.source_format != "plain":  # likewise
            out["source_format"] = self.source_format
        if self.dense:  # absent rather than empty, so expert-only checkpoints keep their exact bytes
            out["dense"] = {
                name: {"shape": list(e.shape), "group_size": e.group_size, "file": e.file}
                for name, e in self.dense.items()
            }
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> Manifest:
        """Parse and validate; `where` (the manifest path) goes into every error message."""

        def fail(problem: str) -> APCheckpointError:
            return APCheckpointError(f"{where}: {problem}")

        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise fail(f"not a PagedWeight AP manifest (missing \"format\": \"{FORMAT_NAME}\")")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise fail(
                f"format_version {version!r} is not supported (this pagedweight reads version {FORMAT_VERSION}); "
                "re-run `pagedweight convert` with this version, or install the pagedweight that wrote it"
            )
        try:
            table_kind = data["table_kind"]
            bits_min, bits_max, group_size = int(data["bits_min"]), int(data["bits_max"]), int(data["group_size"])
            model_json = data["model"]
            model = ModelInfo(
                architectures=list(model_json.get("architectures") or []),
                model_type=str(model_json["model_type"]),
                num_hidden_layers=int(model_json["num_hidden_layers"]),
                num_experts=int(model_json["num_experts"]),
                hidden_size=int(model_json["hidden_size"]),
                config_sha256=str(model_json["config_sha256"]),
                shape_config=dict(model_json.get("shape_config") or {}),
            )
            files = {
                name: FileEntry(int(f["bytes"]), str(f["sha256"])) for name, f in dict(data["files"]).items()
            }
            raw_tensors = dict(data["tensors"])
        except (KeyError, TypeError, ValueError) as exc:
            raise fail(f"malformed manifest ({type(exc).__name__}: {exc}); re-run `pagedweight convert`") from exc
        if table_kind not in TABLE_KINDS:
            raise fail(f"table_kind {table_kind!r} is not one of {TABLE_KINDS}")
        if not 1 <= bits_min <= bits_max <= 8:
            raise fail(f"bit range {bits_min}..{bits_max} is invalid (need 1 <= bits_min <= bits_max <= 8)")
        if not raw_tensors:
            raise fail("lists no tensors")

        adapter = None
        tensors: dict[str, TensorEntry] = {}
        for name, entry in raw_tensors.items():
            try:
                shape = tuple(int(d) for d in entry["shape"])
                file = str(entry["file"])
                tensor_group = int(entry.get("group_size", group_size))
                if "layer" in entry:
                    expert = entry["expert"]
                    key = BlockKey(int(entry["layer"]), expert if expert == SHARED else int(expert), str(entry["proj"]))
                else:
                    adapter = adapter or adapter_for({"model_type": model.model_type})
                    key = adapter.classify(f"{name}.weight")
                    if key is None:
                        raise ValueError(f"no block key and {model.model_type} adapter does not recognise the name")
            except (KeyError, TypeError, ValueError) as exc:
                raise fail(f"malformed entry for tensor {name!r} ({exc}); re-run `pagedweight convert`") from exc
            if len(shape) != 2:
                raise fail(f"tensor {name!r} has shape {list(shape)}, expected [out_features, in_features]")
            if file not in files:
                raise fail(f"tensor {name!r} points to {file!r}, which the manifest's \"files\" does not list")
            tensors[name] = TensorEntry(shape, tensor_group, file, key)  # type: ignore[arg-type]
        dense: dict[str, DenseEntry] = {}
        raw_dense = data.get("dense") or {}
        if not isinstance(raw_dense, dict):
            raise fail("\"dense\" must map tensor names to entries; re-run `pagedweight convert`")
        for name, entry in raw_dense.items():
            try:
                shape = tuple(int(d) for d in entry["shape"])
                dense[name] = DenseEntry(shape, int(entry.get("group_size", group_size)), str(entry["file"]))  # type: ignore[arg-type]
            except (KeyError, TypeError, ValueError) as exc:
                raise fail(f"malformed dense entry for tensor {name!r} ({exc}); re-run `pagedweight convert`") from exc
            if len(shape) != 2:
                raise fail(f"dense tensor {name!r} has shape {list(shape)}, expected [out_features, in_features]")
            if dense[name].file not in files:
                raise fail(f"dense tensor {name!r} points to {dense[name].file!r}, which \"files\" does not list")
            if name in tensors:
                raise fail(f"tensor {name!r} is listed both as an expert block and as a dense block")
        return cls(table_kind, bits_min, bits_max, group_size, model, data.get("calibration"),
                   int(data.get("seed", 0)), tensors, files, dense, str(data.get("bcq_init", "greedy")),
                   str(data.get("source_format", "plain")))
