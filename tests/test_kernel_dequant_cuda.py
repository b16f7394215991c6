"""The CUDA prefill dequantization (cuda_dequant.py): every variant builds (CPU, NVRTC), refusals name their
reason, and on a GPU it writes bit for bit what the Triton dequantization writes and matches the torch
reference's dense weights, on random and adversarial shapes (odd N, groups of 32..256, 1..8 bits mixed per
expert, a chunk running past the last expert)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedweight.kernels.cuda_dequant import (
    compile_to_cubin,
    cuda_dequant_unsupported,
    dequantize_chunk_cuda,
    kernel_defines,
)
from pagedweight.kernels.reference import dequantize_expert
from pagedweight.kernels.testing import random_ap_projection
from pagedweight.kernels.triton_dequant_moe import dequantize_chunk
from pagedweight.kernels.triton_moe import _TL_DTYPE, input_permutation

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="the CUDA dequantization needs a GPU")


# ---------------------------------------------------------------- CPU: build, refusals


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_variant_compiles_for_sm90(dtype):
    for bits_max in range(1, 9):
        for uniform in (False, True):
            cubin = compile_to_cubin(kernel_defines(dtype, bits_max, uniform), "90")
            assert cubin[:4] == b"\x7fELF", "NVRTC did not return a cubin"


def test_refusals_name_the_reason():
    bcq = random_ap_projection(2, 64, 256, [4, 3], table_kind="bcq", group_size=128, bits_min=3).weights
    km = random_ap_projection(2, 64, 256, [4, 3], table_kind="kmeans", bits_min=3).weights
    g16 = random_ap_projection(1, 64, 256, [4], table_kind="bcq", group_size=16, bits_min=4).weights
    scratch = torch.empty(2, 64, 256, dtype=torch.bfloat16)
    assert "k-means" in cuda_dequant_unsupported(km, scratch) or "kmeans" in cuda_dequant_unsupported(km, scratch)
    assert "group size 16" in cuda_dequant_unsupported(g16, scratch[:1])
    assert "CUDA" in cuda_dequant_unsupported(bcq, scratch)
    assert "dtype" in cuda_dequant_unsupported(bcq, scratch.float())
    huge = dataclasses.replace(bcq, N=2**18, K=2**14)  # 2^31 output words: past the kernel's 32-bit indexing
    assert "too large" in cuda_dequant_unsupported(huge, scratch)
    with pytest.raises(ValueError, match="CUDA dequantization cannot run.*CUDA device"):
        dequantize_chunk_cuda(bcq, scratch, 0)
    with pytest.raises(ValueError, match="CUDA dequantization cannot run"):
        dequantize_chunk(bcq, scratch, 0, None, 64, 128, False, kernel="cuda")
    with pytest.raises(ValueError, match="kernel must be"):
        dequantize_chunk(bcq, scratch, 0, None, 64, 128, False, kernel="fast")


# ---------------------------------------------------------------- CUDA: correctness


def _reference_scratch(w, e: int, dtype) -> torch.Tensor:
    """Expert e's dense weight in the scratch's tile column order, from the torch reference."""
    dense = dequantize_expert(w, e).float()
    perm = input_permutation(w.K, w.table_kind, dense.device)
    return dense[:, perm.to(dense.device)].to(dtype)


@needs_cuda
@pytest.mark.parametrize("kind", ["bcq", "ubcq"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n,k,group,bits",
    [
        (64, 256, 128, [4, 4, 4]),
        (300, 384, 32, [2, 8, 5]),  # odd N, group of one word
        (129, 1408, 128, [1, 3, 7]),  # Qwen's w2 K, one plane
        (1000, 2048, 64, [8, 6, 2]),
        (96, 512, 256, [5, 5, 3]),
    ],
)
def test_matches_triton_bit_for_bit_and_the_reference(kind, dtype, n, k, group, bits):
    dev = torch.device("cuda")
    proj = random_ap_projection(len(bits), n, k, bits, table_kind=kind, group_size=group, bits_min=1, seed=n,
                                device=dev)
    w = proj.weights
    got = torch.full((len(bits), n, k), float("nan"), dtype=dtype, device=dev)
    dequantize_chunk_cuda(w, got, 0)
    want = torch.empty_like(got)
    dequantize_chunk(w, want, 0, _TL_DTYPE[dtype], 64, min(group, 128), True, kernel="triton")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "differs from the Triton dequantization"
    for e in range(len(bits)):
        ref = _reference_scratch(w, e, torch.float32)
        err = float((got[e].float() - ref).norm() / ref.norm())
        assert err < (8e-3 if dtype == torch.bfloat16 else 2e-3), (e, err)


@needs_cuda
def test_chunk_past_the_last_expert_leaves_its_slot_untouched():
    dev = torch.device("cuda")
    proj = random_ap_projection(5, 128, 256, [3, 4, 5, 6, 7], table_kind="bcq", group_size=128, bits_min=3,
                                seed=9, device=dev)
    w = proj.weights
    scratch = torch.full((2, 128, 256), 7.0, dtype=torch.bfloat16, device=dev)
    dequantize_chunk(w, scratch, 4, None, 64, 128, True)  # auto -> CUDA; experts 4 and (absent) 5
    torch.testing.assert_close(scratch[0].float(), _reference_scratch(w, 4, torch.bfloat16).float(), rtol=2e-2,
                               atol=2e-3)
    assert bool((scratch[1] == 7.0).all()), "the slot past the last expert was written"


@needs_cuda
def test_follows_a_rewritten_page_table_under_graph_replay():
    dev = torch.device("cuda")
    proj = random_ap_projection(2, 256, 512, [4, 4], table_kind="bcq", group_size=128, bits_min=2, seed=3,
                                device=dev)
    w = proj.weights
    scratch = torch.empty(2, 256, 512, dtype=torch.bfloat16, device=dev)
    dequantize_chunk_cuda(w, scratch, 0)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dequantize_chunk_cuda(w, scratch, 0)
    for bits in ([2, 8], [6, 3]):
        w.page_table.copy_(proj.recommit(bits).page_table)
        graph.replay()
        torch.cuda.synchronize()
        for e in range(2):
            ref = _reference_scratch(proj.recommit(bits), e, torch.float32)
            assert float((scratch[e].float() - ref).norm() / ref.norm()) < 8e-3, (bits, e)
