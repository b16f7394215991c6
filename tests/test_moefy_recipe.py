"""`pagedweight moefy --recipe`: a MoEfied checkpoint rebuilt bit for bit from the dense weights plus a recipe."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from pagedweight.moefy import recipe
from pagedweight.moefy.checkpoint import write_mixtral_checkpoint
from pagedweight.moefy.moefier import MoefyLayerConfig, moefy_layer
from pagedweight.moefy.router import RouterFitConfig
from tests.test_moefy_checkpoint import NUM_EXPERTS, SHAPE, TOP_K, tiny_dense

GGUF_SHA = "ab" * 32


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def built(request, tmp_path_factory):
    dense = tiny_dense()
    config = MoefyLayerConfig(num_experts=NUM_EXPERTS, top_k_candidates=(TOP_K, NUM_EXPERTS), kmeans_iterations=3,
                              router=RouterFitConfig(steps=20), refit_down=True)
    inputs = torch.randn(512, SHAPE.hidden_size, generator=torch.Generator().manual_seed(2))
    layers = []
    for index in range(SHAPE.num_hidden_layers):
        w = {n: torch.from_numpy(dense.tensors[f"model.layers.{index}.mlp.{n}.weight"])
             for n in ("gate_proj", "up_proj", "down_proj")}
        layers.append(moefy_layer(w["gate_proj"], w["up_proj"], w["down_proj"], inputs, config, layer_seed=index))
    root = tmp_path_factory.mktemp(f"recipe-{request.param}")
    model = write_mixtral_checkpoint(root / "moe", dense, layers, TOP_K, dtype=request.param)
    written = recipe.write_recipe(model, dense, GGUF_SHA, root / "recipe")
    return dense, model, root / "recipe", written


def test_rebuild_is_bitwise_identical(built, tmp_path):
    dense, model, recipe_dir, written = built
    out = recipe.rebuild_from_recipe(recipe_dir, dense, GGUF_SHA, tmp_path / "rebuilt")
    assert _digests(out) == _digests(model)
    # w1/w3 are GGUF rows, the refitted w2 and the routers must be stored, the rest is copied from the GGUF.
    layers, experts = SHAPE.num_hidden_layers, NUM_EXPERTS
    assert written["counts"] == {"rows": 2 * layers * experts, "stored": layers * (experts + 1), "dense": 3 + 6 * layers}
    assert not list(tmp_path.glob("rebuilt.partial-*"))


def test_wrong_gguf_is_named(built, tmp_path):
    dense, _, recipe_dir, _ = built
    with pytest.raises(recipe.RecipeError, match=f"sha256 {'cd' * 32}.*made from tiny.gguf with sha256 {GGUF_SHA}"):
        recipe.rebuild_from_recipe(recipe_dir, dense, "cd" * 32, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_other_weights_fail_the_final_hash(built, tmp_path):
    _, _, recipe_dir, _ = built
    with pytest.raises(recipe.RecipeError, match="rebuilt model.safetensors has sha256"):
        recipe.rebuild_from_recipe(recipe_dir, tiny_dense(seed=5), GGUF_SHA, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.partial-*"))


def test_corrupt_payload_and_busy_out_are_refused(built, tmp_path):
    dense, _, recipe_dir, _ = built
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(recipe.RecipeError, match="not empty"):
        recipe.rebuild_from_recipe(recipe_dir, dense, GGUF_SHA, busy)
    copy = tmp_path / "recipe"
    copy.mkdir()
    (copy / recipe.RECIPE_FILE).write_bytes((recipe_dir / recipe.RECIPE_FILE).read_bytes())
    payload = bytearray((recipe_dir / recipe.PAYLOAD_FILE).read_bytes())
    payload[-1] ^= 1
    (copy / recipe.PAYLOAD_FILE).write_bytes(bytes(payload))
    with pytest.raises(recipe.RecipeError, match="payload.bin.xz is missing or its sha256 differs"):
        recipe.rebuild_from_recipe(copy, dense, GGUF_SHA, tmp_path / "out")
