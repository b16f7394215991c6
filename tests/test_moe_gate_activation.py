"""The fused AP MoE's gate activation (pagedweight.kernels.activation; GELU for Gemma-4) on its CPU path: each expert's
page-table row read at its own bitwidth, the gate function the one SGLang's activation name asks for, against a
token-by-token dense computation. The GPU kernels are checked against the same reference in test_kernel_moe.py
(Triton) and test_kernel_gate_activation.py (CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedweight.kernels import ap_fused_moe, build_ap_moe_weights
from pagedweight.kernels.reference import dequantize_expert

EXPERTS, HIDDEN, INTER, GROUP = 4, 32, 16, 16
BITS = [8, 3, 5, 2]  # one bitwidth per expert: each row is read at its own


def _weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    planes = [[torch.randint(0, 256, (n, k // 8), dtype=torch.uint8, generator=g) for _ in range(8)] for _ in BITS]
    tables = [(0.05 * torch.randn(2, n, k // GROUP, generator=g)).half() for _ in BITS]  # ubcq: scale, offset
    w = build_ap_moe_weights(planes, tables, BITS, table_kind="ubcq", group_size=GROUP, bits_max=8)
    return w, (planes, tables)  # the caller keeps the tensors alive


@pytest.fixture(scope="module")
def layer():
    w13, keep13 = _weights(2 * INTER, HIDDEN, 0)
    w2, keep2 = _weights(HIDDEN, INTER, 1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, HIDDEN, generator=g)
    ids = torch.tensor([[0, 1], [1, 3], [2, 0], [3, 3], [1, 2], [EXPERTS + 1, 0]], dtype=torch.int32)  # one foreign id
    weights = torch.rand(6, 2, generator=g)
    return x, weights, ids, w13, w2, (keep13, keep2)


def _dense_gelu_moe(x, weights, ids, w13, w2, on_input: bool):
    out = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if e >= EXPERTS:
                continue
            xt = x[t] * weights[t, s] if on_input else x[t]
            h = dequantize_expert(w13, e) @ xt
            y = dequantize_expert(w2, e) @ (F.gelu(h[:INTER]) * h[INTER:])
            out[t] += y if on_input else weights[t, s] * y
    return out


@pytest.mark.parametrize("on_input", [False, True])
def test_gelu_experts_match_the_dense_computation(layer, on_input):
    x, weights, ids, w13, w2, _ = layer
    got = ap_fused_moe(x, weights, ids, w13, w2, activation="gelu", apply_router_weight_on_input=on_input)
    want = _dense_gelu_moe(x, weights, ids, w13, w2, on_input)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    silu = ap_fused_moe(x, weights, ids, w13, w2, activation="silu", apply_router_weight_on_input=on_input)
    assert (silu - got).abs().max() > 1e-3  # the gate function is the one asked for


def test_bf16_hidden_comes_back_in_bf16(layer):
    x, weights, ids, w13, w2, _ = layer
    got = ap_fused_moe(x.bfloat16(), weights, ids, w13, w2, activation="gelu")
    assert got.dtype == torch.bfloat16
    want = _dense_gelu_moe(x, weights, ids, w13, w2, False)
    assert float((got.float() - want).norm() / want.norm()) < 2e-2  # bf16 activations between the two linears


def test_unknown_activation_is_refused(layer):
    x, weights, ids, w13, w2, _ = layer
    with pytest.raises(ValueError, match="gate activations .*got 'relu2'"):
        ap_fused_moe(x, weights, ids, w13, w2, activation="relu2")
