"""GELU-gated experts (Gemma-4) on the CUDA MoE kernels: fold, MMA, LUT and grouped compile `gate_act` with -DACT=1
where they form act(gate) * up, and match the torch reference with activation="gelu".

CPU (CI): every kernel that forms the activation builds its GELU variant for sm_90, and the SiLU variants keep their
defines (their compiled kernels and caches are unchanged), the grouped kernel's at 704 too. GPU: each kernel forced,
at a Gemma-4-like shape it takes (Gemma-4-26B-A4B's intermediate 704 needs the MMA kernel's half chunk and groups of
64, and the grouped kernel's -DTAIL64, where its prefill runs) and at a fold/LUT/grouped one, against the reference;
and a CUDA-graph replay across page-table rewrites with GELU.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pagedweight.kernels import ap_fused_moe
from pagedweight.kernels.activation import act_defines
from pagedweight.kernels.reference import ap_fused_moe_reference
from pagedweight.kernels.testing import random_ap_projection
from tests.support.cuda_kernel_cases import assert_cubins, check_graph_replay, compile_in_parallel
from tests.support.triton_kernels import rel_err

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="the CUDA MoE kernels need a GPU")
GELU = ["-DACT=1"]


def test_act_defines_leave_silu_variants_unchanged():
    assert act_defines("silu") == [] and act_defines("gelu") == GELU
    with pytest.raises(ValueError, match="gate activations .*got 'relu2'"):
        act_defines("relu2")


def test_gelu_variants_compile_for_sm90():
    from pagedweight.kernels import cuda_fold, cuda_grouped, cuda_lut, cuda_mma

    fold_cfg = cuda_fold.FoldConfig(n_tiles=1)
    jobs = [
        functools.partial(cuda_fold.compile_to_cubin, cuda_fold.gemv_defines(0, fold_cfg, 8, 128, 0) + GELU, "90"),
        functools.partial(cuda_fold.compile_to_cubin,
                          cuda_fold.gemv_defines(0, cuda_fold.FoldConfig(n_tiles=2, shared_act=True), 4, 128, 1) + GELU,
                          "90"),
        functools.partial(cuda_mma.compile_to_cubin, cuda_mma.prep_defines(1, torch.float32, "gelu"), "90",
                          name="ap_mma_prep"),
        functools.partial(cuda_lut.compile_to_cubin, cuda_lut.kernel_defines(1, torch.float32, 1, 8, 128, True, True,
                                                                             activation="gelu"), "90"),
    ]
    for cfg in (cuda_grouped.GroupedConfig(wn=1), cuda_grouped.GroupedConfig(wn=1, stages=3, ws=True)):
        jobs.append(functools.partial(cuda_grouped.compile_to_cubin, cuda_grouped.gemm_defines(0, cfg, 8, 128, 0) + GELU,
                                      cuda_grouped.gemm_arch(cfg, "90"), name=cfg.kernel_name, source=cfg.source))
    # Gemma-4's 704 on both served block shapes: groups of 64 (the offset in the weights) and -DTAIL64
    for cfg in (cuda_grouped.default_grouped_config(2048, 2, 8),
                cuda_grouped.GroupedConfig(wn=1, stages=3, row_warpgroups=2, offset_in_weights=True)):
        jobs.append(functools.partial(cuda_grouped.compile_to_cubin,
                                      cuda_grouped.gemm_defines(0, cfg, 8, 64, 0, tail64=True) + GELU,
                                      cuda_grouped.gemm_arch(cfg, "90"), name=cfg.kernel_name, source=cfg.source))
    assert_cubins(compile_in_parallel(jobs))
    assert "-DACT=1" in cuda_mma.prep_defines(1, torch.float32, "gelu")
    assert not any(d.startswith("-DACT") for d in cuda_mma.prep_defines(0, torch.bfloat16, "gelu"))  # w13's prep: no act
    assert "-DACT=1" not in cuda_lut.kernel_defines(0, torch.bfloat16, 1, 8, 128, activation="gelu")


def _layer(num_experts, hidden, inter, group, bits):
    p13 = random_ap_projection(num_experts, 2 * inter, hidden, bits, table_kind="ubcq", group_size=group, bits_min=2,
                               seed=1, device="cuda")
    p2 = random_ap_projection(num_experts, hidden, inter, bits[::-1], table_kind="ubcq", group_size=group, bits_min=2,
                              seed=2, device="cuda")
    return p13, p2


def _routing(m, num_experts, topk, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(m)]).to(torch.int32)
    return (torch.rand(m, topk, generator=g) + 0.1).cuda(), ids.cuda()


# (kernel, hidden, intermediate, group, M values): shapes each kernel takes
CASES = [
    ("mma", 512, 704, 64, (1, 5, 40)),  # Gemma-4-26B-A4B's intermediate: K = 704 ends half way through a chunk
    ("fold", 512, 768, 128, (1, 5, 40)),
    ("lut", 512, 768, 128, (1, 5)),
    ("grouped", 512, 768, 128, (300,)),
    # Gemma-4-26B-A4B's prefill: kernel="auto" routes its 704 (an odd multiple of 64: -DTAIL64) to the grouped kernel;
    # m = 100 runs the 128 x 64 block (25 pairs per expert), m = 300 the 256 x 128 one (75)
    ("grouped", 512, 704, 64, (100, 300)),
]


@needs_cuda
@pytest.mark.parametrize("kernel,hidden,inter,group,ms", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
@pytest.mark.parametrize("apply_w_in", [False, True])
def test_gelu_moe_matches_reference(kernel, hidden, inter, group, ms, apply_w_in):
    bits = [4, 3, 8, 2, 5, 4, 6, 4]
    p13, p2 = _layer(8, hidden, inter, group, bits)
    for m in ms:
        tw, ids = _routing(m, 8, 2, seed=m)
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        out = ap_fused_moe(x, tw, ids, p13.weights, p2.weights, kernel=kernel, activation="gelu",
                           apply_router_weight_on_input=apply_w_in)
        ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights, activation="gelu",
                                     apply_router_weight_on_input=apply_w_in)
        silu = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights,
                                      apply_router_weight_on_input=apply_w_in)
        assert rel_err(out, ref) < 2e-2, (kernel, m)
        assert rel_err(silu, ref) > 0.2, (kernel, m)  # the activation the kernel formed is the one asked for


@needs_cuda
@pytest.mark.parametrize("kernel", ["mma", "fold"])
def test_gelu_graph_replay_follows_page_table(kernel):
    inter, group = (704, 64) if kernel == "mma" else (768, 128)
    p13, p2 = _layer(8, 512, inter, group, [4] * 8)

    def call(x, tw, ids, w13, w2):
        return ap_fused_moe(x, tw, ids, w13, w2, kernel=kernel, activation="gelu")

    check_graph_replay(p13, p2, m=4, topk=2, kernel=kernel, call=call,
                       bit_mixes=([3] * 8, [2, 3, 4, 5, 6, 7, 8, 4]), activation="gelu")
