"""MoEfication core: balanced k-means, exact expert split, router, output scales, GGUF name/permutation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedweight.moefy.clustering import balanced_assignment, balanced_kmeans, groups_from_labels, neuron_features
from pagedweight.moefy.gguf_source import hf_name_for_gguf_tensor, unpermute_qk_rows
from pagedweight.moefy.moe_ffn import dense_ffn, expert_outputs, mixtral_moe_forward, mixtral_routing, split_ffn
from pagedweight.moefy.moefier import MoefyLayerConfig, moefy_layer
from pagedweight.moefy.router import RouterFitConfig, fit_router, flatten_router, selection_recall

HIDDEN, INTERMEDIATE = 32, 96


def random_ffn(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    gate = torch.randn(INTERMEDIATE, HIDDEN, generator=generator) / HIDDEN**0.5
    up = torch.randn(INTERMEDIATE, HIDDEN, generator=generator) / HIDDEN**0.5
    down = torch.randn(HIDDEN, INTERMEDIATE, generator=generator) / INTERMEDIATE**0.5
    return gate, up, down


def test_balanced_kmeans_sizes_and_determinism():
    points = np.random.default_rng(1).standard_normal((48, 5))
    labels = balanced_kmeans(points, 4, seed=3)
    assert np.bincount(labels).tolist() == [12, 12, 12, 12]
    assert np.array_equal(labels, balanced_kmeans(points, 4, seed=3))
    assert groups_from_labels(labels, 4).shape == (4, 12)


def test_balanced_kmeans_recovers_planted_clusters():
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((3, 8)) * 10
    points = np.concatenate([center + rng.standard_normal((10, 8)) * 0.1 for center in centers])
    labels = balanced_kmeans(points, 3, seed=0)
    for block in range(3):
        assert len(set(labels[block * 10 : (block + 1) * 10])) == 1
    assert len(set(labels)) == 3


def test_balanced_assignment_is_optimal_on_hand_case():
    # Two points sit on centroid 0; balance forces one of them to centroid 1, at the cheapest cost.
    points = np.array([[0.0], [0.1], [5.0], [0.2]])
    centroids = np.array([[0.0], [5.0]])
    labels = balanced_assignment(points, centroids)
    assert np.bincount(labels).tolist() == [2, 2]
    assert labels[2] == 1 and labels[0] == 0 and labels[1] == 0 and labels[3] == 1


def test_kmeans_rejects_unbalanceable_input():
    with pytest.raises(ValueError, match="equal clusters"):
        balanced_kmeans(np.zeros((10, 2)), 3)


def test_neuron_features_are_unit_rows():
    gate, up, _ = random_ffn()
    features = neuron_features(gate.numpy(), up.numpy())
    assert features.shape == (INTERMEDIATE, 2 * HIDDEN)
    np.testing.assert_allclose(np.linalg.norm(features[:, :HIDDEN], axis=1), 1.0, rtol=1e-6)


def test_expert_split_sums_to_dense_ffn():
    gate, up, down = random_ffn()
    groups = torch.randperm(INTERMEDIATE, generator=torch.Generator().manual_seed(0)).view(4, -1)
    split = split_ffn(gate, up, down, groups)
    x = torch.randn(20, HIDDEN)
    torch.testing.assert_close(expert_outputs(x, split).sum(0), dense_ffn(x, gate, up, down), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="partition"):
        split_ffn(gate, up, down, torch.zeros(4, INTERMEDIATE // 4, dtype=torch.long))


def test_mixtral_routing_renormalizes():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, ids = mixtral_routing(logits, 2)
    assert ids.tolist() == [[3, 2]]
    expected = torch.softmax(torch.tensor([3.0, 2.0]), 0)
    torch.testing.assert_close(weights[0], expected)


def test_all_experts_with_scale_e_and_flat_router_reproduce_dense_ffn():
    gate, up, down = random_ffn()
    inputs = torch.randn(512, HIDDEN, generator=torch.Generator().manual_seed(2))
    layer = moefy_layer(gate, up, down, inputs, MoefyLayerConfig(num_experts=4, top_k_candidates=(2, 4), kmeans_iterations=3,
                                                               router=RouterFitConfig(steps=20)))
    assert layer.output_scales[4] == 4.0
    x = torch.randn(30, HIDDEN)
    moe = mixtral_moe_forward(x, layer.split, layer.router, top_k=4, output_scale=4.0)
    dense = dense_ffn(x, gate, up, down)
    assert ((moe - dense).norm() / dense.norm()).item() < 1e-2  # flattened logits: weights 1/4 within ~0.1%
    assert layer.diagnostics["relative_error"][4] < 1e-2
    torch.testing.assert_close(layer.down_by_top_k[4], layer.split.w2 * 4)


def test_moefy_layer_router_beats_chance_and_refit_helps():
    gate, up, down = random_ffn(5)
    inputs = torch.randn(4096, HIDDEN, generator=torch.Generator().manual_seed(6))
    base = MoefyLayerConfig(num_experts=4, top_k_candidates=(2,), kmeans_iterations=3, split="weights",
                            router=RouterFitConfig(steps=100), refit_down=False)
    scaled = moefy_layer(gate, up, down, inputs, base)
    refit = moefy_layer(gate, up, down, inputs, MoefyLayerConfig(**{**base.__dict__, "refit_down": True}))
    assert sorted(scaled.split.groups.flatten().tolist()) == list(range(INTERMEDIATE))
    assert scaled.diagnostics["router_recall"][2] > 0.6  # random choice of 2 of 4 recalls 0.5
    assert refit.diagnostics["relative_error"][2] < scaled.diagnostics["relative_error"][2]
    again = moefy_layer(gate, up, down, inputs, base)
    assert torch.equal(again.router, scaled.router) and torch.equal(again.split.groups, scaled.split.groups)


def test_router_fit_ranks_experts_and_flatten_keeps_order():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(400, 8, generator=generator)
    true_router = torch.randn(4, 8, generator=generator)
    norms = torch.exp(inputs @ true_router.T)  # a linearly rankable target
    router = fit_router(inputs, norms, RouterFitConfig(steps=200))
    assert selection_recall(inputs @ router.T, norms, 1) > 0.9
    flat = flatten_router(router, inputs, logit_std=1e-3)
    assert torch.equal((inputs @ flat.T).argsort(-1), (inputs @ router.T).argsort(-1))
    assert (inputs @ flat.T).std().item() < 2e-3


def test_unpermute_inverts_llama_cpp_permute():
    def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:  # convert_hf_to_gguf.py
        return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)

    weights = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    np.testing.assert_array_equal(unpermute_qk_rows(llama_cpp_permute(weights, 3), 3), weights)
    with pytest.raises(ValueError):
        unpermute_qk_rows(np.zeros((10, 2)), 3)


def test_gguf_names():
    assert hf_name_for_gguf_tensor("blk.7.ffn_gate.weight") == "model.layers.7.mlp.gate_proj.weight"
    assert hf_name_for_gguf_tensor("blk.0.attn_k.weight") == "model.layers.0.self_attn.k_proj.weight"
    assert hf_name_for_gguf_tensor("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="unexpected"):
        hf_name_for_gguf_tensor("blk.0.ffn_gate_exps.weight")
