"""A moefy *recipe*: rebuild a MoEfied checkpoint bit for bit from the GGUF plus what moefy fitted.

`pagedweight moefy-recipe --model MOE_DIR --gguf GGUF --out RECIPE` records, for every tensor of
MOE_DIR/model.safetensors, how to get its exact bytes back:

- "dense": a tensor of the dequantized GGUF (embedding, lm_head = embedding, norms, attention), cast to
  the checkpoint dtype;
- "rows": an expert's w1/w3 = rows `expert_groups[layer][expert]` of the dense gate/up projection;
- "stored": everything else, kept verbatim in the recipe's payload: the routers and w2. With the default
  `refit_down` build, w2 is a ridge refit and not a function of the GGUF alone, so it must be stored
  (about 53 MB of bf16 before compression); a build without refit would store only the routers.

A rule is used only when it reproduces the original bytes exactly when the recipe is written; otherwise
the tensor is stored. The safetensors header is kept verbatim and the file is rewritten at the same byte
offsets, so the result does not depend on the safetensors version. Side files (config.json, tokenizer,
moefy.json, ...) are kept verbatim too (transformers writes its version into config.json).

`pagedweight moefy --recipe RECIPE --gguf GGUF --out OUT` rebuilds the directory. It refuses a GGUF whose
sha256 differs from the one recorded, and checks the sha256 of model.safetensors and of every side file
against the recipe before renaming OUT.partial to OUT.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import struct
from pathlib import Path

import numpy as np

from pagedweight.format.checkpoint import sha256_file
from pagedweight.moefy.checkpoint import METADATA_FILE, WEIGHTS_FILE
from pagedweight.moefy.gguf_source import DenseLlamaWeights

RECIPE_FILE = "recipe.json"
PAYLOAD_FILE = "payload.bin.xz"
RECIPE_FORMAT = "pagedweight-moefy-recipe"
RECIPE_VERSION = 1
_EXPERT_ROW_SOURCES = {"w1": "gate_proj", "w3": "up_proj"}
_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


class RecipeError(ValueError):
    """A recipe that does not fit its inputs; the message names the mismatch."""


def read_safetensors_header(path: Path) -> tuple[bytes, dict]:
    """The raw header bytes (without the 8-byte length) and the parsed header of a safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = f.read(length)
    return raw, json.loads(raw)


def _tensor_bytes(array: np.ndarray, dtype: str) -> bytes:
    import torch

    if dtype not in _DTYPE_NAMES:
        raise RecipeError(f"unsupported checkpoint dtype {dtype!r}")
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(getattr(torch, _DTYPE_NAMES[dtype]))
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _candidate_rule(name: str, dense: DenseLlamaWeights, groups: list) -> dict | None:
    """How tensor `name` might follow from the dense GGUF weights (checked against the bytes by the caller)."""
    if name == "lm_head.weight" and name not in dense.tensors:
        return {"kind": "dense", "source": "model.embed_tokens.weight"}
    if name in dense.tensors:
        return {"kind": "dense", "source": name}
    parts = name.split(".")
    # model.layers.L.block_sparse_moe.experts.E.w1.weight
    if len(parts) == 8 and parts[3] == "block_sparse_moe" and parts[4] == "experts" and parts[6] in _EXPERT_ROW_SOURCES:
        layer, expert = int(parts[2]), int(parts[5])
        if layer < len(groups) and expert < len(groups[layer]):
            return {"kind": "rows", "source": f"model.layers.{layer}.mlp.{_EXPERT_ROW_SOURCES[parts[6]]}.weight",
                    "layer": layer, "expert": expert}
    return None


def _derive(rule: dict, dense: DenseLlamaWeights, groups: list, dtype: str) -> bytes:
    source = dense.tensors.get(rule["source"])
    if source is None:
        raise RecipeError(f"the GGUF lacks {rule['source']!r}, which the recipe derives a tensor from")
    if rule["kind"] == "dense":
        return _tensor_bytes(source, dtype)
    if rule["kind"] == "rows":
        return _tensor_bytes(source[np.asarray(groups[rule["layer"]][rule["expert"]])], dtype)
    raise RecipeError(f"unknown recipe rule {rule['kind']!r}")


def _side_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir() if p.is_file() and p.name != WEIGHTS_FILE and not p.name.startswith("."))


def write_recipe(model_dir: Path, dense: DenseLlamaWeights, gguf_sha256: str, out_dir: Path,
                 preset: int = 6) -> dict:
    """Write RECIPE_FILE and PAYLOAD_FILE into out_dir for the checkpoint in model_dir; return the recipe."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    weights_path = model_dir / WEIGHTS_FILE
    if not weights_path.is_file():
        raise RecipeError(f"{model_dir} has no {WEIGHTS_FILE}")
    metadata_path = model_dir / METADATA_FILE
    if not metadata_path.is_file():
        raise RecipeError(f"{model_dir} has no {METADATA_FILE} (the expert groups); is it a `pagedweight moefy` build?")
    groups = json.loads(metadata_path.read_text())["expert_groups"]
    raw_header, header = read_safetensors_header(weights_path)
    data_start = 8 + len(raw_header)
    rules: dict[str, dict] = {}
    payload = bytearray()
    with open(weights_path, "rb") as f:
        tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
        for name, entry in sorted(tensors.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            f.seek(data_start + begin)
            original = f.read(end - begin)
            rule = _candidate_rule(name, dense, groups)
            if rule is not None:
                try:
                    if _derive(rule, dense, groups, entry["dtype"]) == original:
                        rules[name] = rule
                        continue
                except (RecipeError, IndexError, ValueError):
                    pass
            rules[name] = {"kind": "stored", "offset": len(payload), "nbytes": len(original)}
            payload += original
    side: dict[str, dict] = {}
    for path in _side_files(model_dir):
        data = path.read_bytes()
        side[path.name] = {"offset": len(payload), "nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        payload += data
    out_dir.mkdir(parents=True, exist_ok=True)
    compressed = lzma.compress(bytes(payload), preset=preset)
    (out_dir / PAYLOAD_FILE).write_bytes(compressed)
    recipe = {
        "format": RECIPE_FORMAT,
        "version": RECIPE_VERSION,
        "gguf": {"name": dense.gguf_path.name, "sha256": gguf_sha256},
        "weights": {"file": WEIGHTS_FILE, "sha256": sha256_file(weights_path), "size": weights_path.stat().st_size},
        "header": raw_header.decode("utf-8"),
        "expert_groups": groups,
        "tensors": rules,
        "side_files": side,
        "payload": {"file": PAYLOAD_FILE, "sha256": hashlib.sha256(compressed).hexdigest(), "size": len(payload)},
        "counts": {kind: sum(r["kind"] == kind for r in rules.values()) for kind in ("dense", "rows", "stored")},
    }
    (out_dir / RECIPE_FILE).write_text(json.dumps(recipe) + "\n")
    return recipe


def load_recipe(recipe_dir: Path) -> dict:
    path = Path(recipe_dir) / RECIPE_FILE
    if not path.is_file():
        raise RecipeError(f"{recipe_dir} has no {RECIPE_FILE}; write one with `pagedweight moefy-recipe`")
    recipe = json.loads(path.read_text())
    if recipe.get("format") != RECIPE_FORMAT or recipe.get("version") != RECIPE_VERSION:
        raise RecipeError(f"{path} is not a {RECIPE_FORMAT} v{RECIPE_VERSION} file")
    return recipe


def check_gguf(recipe: dict, gguf_sha256: str, gguf_path: Path) -> None:
    expected = recipe["gguf"]["sha256"]
    if gguf_sha256 != expected:
        raise RecipeError(
            f"GGUF {gguf_path} has sha256 {gguf_sha256}, but the recipe was made from {recipe['gguf']['name']} "
            f"with sha256 {expected}; use that exact file"
        )


def rebuild_from_recipe(recipe_dir: Path, dense: DenseLlamaWeights, gguf_sha256: str, out_dir: Path) -> Path:
    """Rebuild the checkpoint directory at out_dir (atomically, via out_dir.partial-PID); return out_dir."""
    recipe_dir, out_dir = Path(recipe_dir), Path(out_dir)
    recipe = load_recipe(recipe_dir)
    check_gguf(recipe, gguf_sha256, dense.gguf_path)
    payload_path = recipe_dir / PAYLOAD_FILE
    if not payload_path.is_file() or sha256_file(payload_path) != recipe["payload"]["sha256"]:
        raise RecipeError(f"{payload_path} is missing or its sha256 differs from {recipe_dir / RECIPE_FILE}")
    payload = lzma.decompress(payload_path.read_bytes())
    if len(payload) != recipe["payload"]["size"]:
        raise RecipeError(f"{payload_path} decompresses to {len(payload)} bytes, the recipe says {recipe['payload']['size']}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise RecipeError(f"--out {out_dir} exists and is not empty")
    partial = out_dir.parent / f"{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _write_weights(recipe, dense, payload, partial / recipe["weights"]["file"])
        for name, entry in recipe["side_files"].items():
            data = payload[entry["offset"]: entry["offset"] + entry["nbytes"]]
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise RecipeError(f"side file {name} in the payload does not match its sha256")
            (partial / name).write_bytes(data)
        digest = sha256_file(partial / recipe["weights"]["file"])
        if digest != recipe["weights"]["sha256"]:
            raise RecipeError(
                f"rebuilt {recipe['weights']['file']} has sha256 {digest}, expected {recipe['weights']['sha256']} "
                "(the GGUF dequantization differs on this machine: check the gguf/numpy/torch versions)"
            )
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(partial, out_dir)
    return out_dir


def _write_weights(recipe: dict, dense: DenseLlamaWeights, payload: bytes, path: Path) -> None:
    raw_header = recipe["header"].encode("utf-8")
    header = json.loads(raw_header)
    groups = recipe["expert_groups"]
    data_start = 8 + len(raw_header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw_header)))
        f.write(raw_header)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            rule = recipe["tensors"].get(name)
            if rule is None:
                raise RecipeError(f"the recipe has no rule for tensor {name!r}")
            if rule["kind"] == "stored":
                data = payload[rule["offset"]: rule["offset"] + rule["nbytes"]]
            else:
                data = _derive(rule, dense, groups, entry["dtype"])
            begin, end = entry["data_offsets"]
            if len(data) != end - begin:
                raise RecipeError(f"{name}: {len(data)} bytes, the header wants {end - begin}")
            f.seek(data_start + begin)
            f.write(data)
        f.truncate(recipe["weights"]["size"])
