"""Per-block initial bitwidths from a file (`--paged-weight-bits-map`).

The file is what the state endpoint reports: a JSON object whose "blocks" list holds one
[layer, expert, proj, committed, desired] row per block. The whole `/get_server_info` answer, or its
"paged_weight" part, is accepted as it is, so a plan a running server reached can be saved with one curl
and served again (with `--paged-weight-policy static` it stays). Every block of the model must be listed
once, at a bitwidth inside its stored range and the floor: a partial or foreign map is refused, naming the
first offending block, rather than filled in.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from pagedweight.runtime.blocks import PROJS, BlockKey


class BitsMapError(ValueError):
    """The bits map file cannot be used for this model; the message says which block and why."""


def _blocks_list(doc: Any, path: str) -> list:
    if isinstance(doc, dict) and "internal_states" in doc:  # the whole /get_server_info answer
        states = doc["internal_states"] or [{}]
        doc = states[0]
    if isinstance(doc, dict) and "paged_weight" in doc:
        doc = doc["paged_weight"]
    if not isinstance(doc, dict) or not isinstance(doc.get("blocks"), list):
        raise BitsMapError(
            f"{path}: no 'blocks' list; save one with curl <server>/get_server_info (a PagedWeight server's "
            "internal_states[0].paged_weight.blocks)"
        )
    return doc["blocks"]


def load_bits_map(path: str) -> dict[BlockKey, int]:
    """(layer, expert, proj) -> committed bits, from the file at `path`."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise BitsMapError(f"{path}: cannot read the bits map ({e})") from None
    out: dict[BlockKey, int] = {}
    for i, row in enumerate(_blocks_list(doc, path)):
        if not isinstance(row, (list, tuple)) or len(row) < 4:
            raise BitsMapError(f"{path}: blocks[{i}] is {row!r}, expected [layer, expert, proj, committed, ...]")
        layer, expert, proj, bits = row[0], row[1], row[2], row[3]
        if proj not in PROJS or not all(isinstance(v, int) for v in (layer, expert, bits)):
            raise BitsMapError(f"{path}: blocks[{i}] = {row!r} is not [int layer, int expert, {PROJS}, int bits]")
        key = BlockKey(layer, expert, proj)
        if key in out:
            raise BitsMapError(f"{path}: block {key} is listed twice")
        out[key] = bits
    return out


def check_bits_map(
    bits_map: Mapping[BlockKey, int], limits: Sequence[tuple[BlockKey, int, int]], path: str = "bits map"
) -> None:
    """Every block in `limits` ((key, floor, ceiling) per block of the model) is in the map, within its
    limits, and the map names no other block."""
    known = set()
    for key, floor, ceiling in limits:
        known.add(key)
        if key not in bits_map:
            raise BitsMapError(f"{path}: block {key} is missing (the map must list every expert block of this model)")
        bits = bits_map[key]
        if not floor <= bits <= ceiling:
            raise BitsMapError(
                f"{path}: block {key} at {bits} bits is outside [{floor}, {ceiling}] (the checkpoint's stored range "
                "and --paged-weight-min-bits)"
            )
    extra = [k for k in bits_map if k not in known]
    if extra:
        raise BitsMapError(
            f"{path}: block {extra[0]} (and {len(extra) - 1} more) is not in this model: the map is for another "
            "model or TP layout"
        )
