"""The sources a model load opens (the MoE layers' and the AP linears') belong to that server's ServerArgs: every
layer of one load shares them, another server's load opens its own, and nothing is kept in a module."""

from __future__ import annotations

from types import SimpleNamespace

from pagedweight.config import PagedWeightConfig
from pagedweight.patches.linear import dense_source_for
from pagedweight.serving.dense_linear import DummyDenseSource
from pagedweight.serving.layer_sources import DummyLayerSource, layer_source_for, sources_of


def _server_args(model_path: str) -> SimpleNamespace:
    return SimpleNamespace(load_format="dummy", model_path=model_path)


def test_one_load_shares_its_sources_and_another_opens_its_own(tmp_path):
    cfg = PagedWeightConfig(enable=True)
    first, second = _server_args(str(tmp_path / "m")), _server_args(str(tmp_path / "m"))
    moe = layer_source_for(first, cfg)
    assert isinstance(moe, DummyLayerSource) and layer_source_for(first, cfg) is moe  # every layer of the load
    dense = dense_source_for(first, cfg)
    assert isinstance(dense, DummyDenseSource) and dense_source_for(first, cfg) is dense
    assert layer_source_for(second, cfg) is not moe and dense_source_for(second, cfg) is not dense
    assert list(sources_of(first).moe.values()) == [moe] and list(sources_of(first).dense.values()) == [dense]
    # another AP directory of the same server is another source
    other = PagedWeightConfig(enable=True, path=str(tmp_path / "elsewhere"))
    assert layer_source_for(first, other) is not moe and len(sources_of(first).moe) == 2
