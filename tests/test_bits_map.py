"""--paged-weight-bits-map: a saved plan is served again block for block; bad maps are refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pagedweight.config import PagedWeightConfig, PagedWeightConfigError
from pagedweight.runtime.bits_map import BitsMapError, load_bits_map

LAYERS, EXPERTS = 2, 3


def _stores():
    from tests.support.random_stores import random_layer_stores

    return random_layer_stores(LAYERS, EXPERTS)


def _rows(bits_of=lambda layer, expert, proj: 2 + (layer * 5 + expert * 2 + (proj == "w2")) % 7):
    return [[layer, e, proj, bits_of(layer, e, proj), 8] for layer in range(LAYERS) for e in range(EXPERTS) for proj in ("w13", "w2")]


def _build(tmp_path, doc, **cfg):
    from pagedweight.runtime.paged_runtime import PagedRuntime

    path = tmp_path / "bits.json"
    path.write_text(json.dumps(doc))
    return PagedRuntime.build(PagedWeightConfig(enable=True, bits_map=str(path), **cfg), _stores(), torch.device("cpu"))


@pytest.mark.parametrize("wrap", ["blocks", "paged_weight", "server_info"])
def test_runtime_starts_at_the_saved_plan(tmp_path, wrap):
    rows = _rows()
    doc = {"blocks": rows}
    if wrap != "blocks":
        doc = {"paged_weight": doc}
    if wrap == "server_info":
        doc = {"internal_states": [doc], "version": "0.5.17"}
    runtime = _build(tmp_path, doc)
    got = sorted([r.key.layer, r.key.expert, r.key.proj, r.committed_bits] for r in runtime.table)
    assert got == sorted(row[:4] for row in rows)
    # Every committed plane and table is resident, nothing more: the pager really loaded the mixed plan.
    assert runtime.table.resident_bytes() == sum(r.bytes_at(r.committed_bits) for r in runtime.table)
    assert sorted(runtime.state()["blocks"]) == sorted(row[:4] + [row[3]] for row in rows)


def test_a_state_snapshot_round_trips(tmp_path):
    first = _build(tmp_path, {"blocks": _rows()})
    again = _build(tmp_path, {"paged_weight": first.state()})
    assert [r.committed_bits for r in again.table] == [r.committed_bits for r in first.table]


@pytest.mark.parametrize(
    "rows, message",
    [
        (_rows()[1:], "layer0.expert0.w13 is missing"),
        (_rows() + [[5, 0, "w13", 4, 4]], "layer5.expert0.w13 (and 0 more) is not in this model"),
        (_rows() + [_rows()[0]], "listed twice"),
        ([[0, 0, "w13", 9, 8]] + _rows()[1:], "at 9 bits is outside [2, 8]"),
        ([[0, 0, "gate", 4, 4]] + _rows()[1:], "is not [int layer"),
    ],
)
def test_bad_maps_are_refused_by_block(tmp_path, rows, message):
    with pytest.raises(BitsMapError, match=re.escape(message)):
        _build(tmp_path, {"blocks": rows})


def test_the_floor_applies_to_the_map(tmp_path):
    with pytest.raises(BitsMapError, match=r"outside \[4, 8\]"):
        _build(tmp_path, {"blocks": _rows()}, floor_bits=4)


def test_unreadable_or_shapeless_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(BitsMapError, match="cannot read the bits map"):
        load_bits_map(str(bad))
    bad.write_text(json.dumps({"paged_weight": {"committed_bits_histogram": {}}}))
    with pytest.raises(BitsMapError, match="no 'blocks' list"):
        load_bits_map(str(bad))


def test_flag_conflicts(tmp_path):
    path = tmp_path / "bits.json"
    path.write_text("{}")
    with pytest.raises(PagedWeightConfigError, match="give one"):
        PagedWeightConfig(enable=True, bits=4, bits_map=str(path))
    with pytest.raises(PagedWeightConfigError, match="without --enable-paged-weight"):
        PagedWeightConfig(bits_map=str(path))
    with pytest.raises(PagedWeightConfigError, match="no such file"):
        PagedWeightConfig(enable=True, bits_map=str(tmp_path / "missing.json"))
