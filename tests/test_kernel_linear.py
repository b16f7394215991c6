"""Dense AP linear (Triton) against the torch reference; CPU dispatch and reference address handling."""

from __future__ import annotations

import pytest
import torch

from pagedweight.kernels import APKernelConfig, ap_fused_moe, ap_linear
from pagedweight.kernels.reference import ap_fused_moe_reference, dequantize_expert
from pagedweight.kernels.testing import random_ap_projection
from pagedweight.kernels.weights import APMoEWeights
from tests.support.triton_kernels import HAS_CUDA, INTERPRET, KERNEL_DEVICE, needs_kernel_device, rel_err, run_under_interpreter, tolerance


@needs_kernel_device
@pytest.mark.parametrize("kind", ["bcq", "ubcq", "kmeans"])
@pytest.mark.parametrize("m,split_k,bias", [(1, 1, False), (7, 3, True), (33, 1, True)])
def test_linear_matches_reference(kind, m, split_k, bias):
    n, k = 80, 128
    proj = random_ap_projection(2, n, k, [3, 6], table_kind=kind, group_size=64, bits_min=2, seed=m, device=KERNEL_DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half().to(KERNEL_DEVICE)
    b = torch.randn(n).to(KERNEL_DEVICE) if bias else None
    cfg = APKernelConfig(block_m=16 if m < 32 else 32, block_n=32, block_k=64, split_k=split_k)
    for row in (0, 1):
        out = ap_linear(x, proj.weights, row=row, bias=b, backend="triton", config=cfg)
        ref = x.float() @ dequantize_expert(proj.weights, row).to(x.device).t() + (b if bias else 0)
        assert out.shape == (m, n) and out.dtype == x.dtype
        assert rel_err(out, ref) < tolerance(torch.float16)


@needs_kernel_device
@pytest.mark.parametrize("kind", ["bcq", "ubcq", "kmeans"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,bias", [(3, True), (130, False)])
def test_linear_prefill_path_matches_reference(kind, dtype, m, bias):
    """dequantize-then-GEMM (the default from LINEAR_DEQUANT_MIN_M rows on), forced also at a small M."""
    from pagedweight.kernels.config import LINEAR_DEQUANT_MIN_M, default_linear_config

    n, k = 80, 128
    proj = random_ap_projection(2, n, k, [5, 2], table_kind=kind, group_size=64, bits_min=2, seed=m, device=KERNEL_DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(KERNEL_DEVICE)
    b = torch.randn(n).to(dtype).to(KERNEL_DEVICE) if bias else None
    forced = APKernelConfig(block_m=16, block_n=32, block_k=64, dequant_chunk=1)
    default = default_linear_config(m, n, k, 64 if kind != "kmeans" else None)
    assert (default.dequant_chunk > 0) == (m >= LINEAR_DEQUANT_MIN_M)
    for row in (0, 1):
        ref = x.float() @ dequantize_expert(proj.weights, row).to(x.device).t() + (b.float() if bias else 0)
        for cfg in (forced, None):
            out = ap_linear(x, proj.weights, row=row, bias=b, backend="triton", config=cfg)
            assert out.shape == (m, n) and out.dtype == x.dtype
            assert rel_err(out, ref) < tolerance(dtype), (row, cfg)


def test_cpu_dispatch_runs_the_reference_and_reads_raw_addresses():
    """On CPU, auto = torch reference; without a resident view it reads the page table's host addresses."""
    p13 = random_ap_projection(3, 64, 32, [2, 4, 8], group_size=32, bits_min=2, seed=0)
    p2 = random_ap_projection(3, 32, 32, [5, 3, 2], group_size=32, bits_min=2, seed=1)
    bare13 = APMoEWeights(**{**vars(p13.weights), "resident": None})
    bare2 = APMoEWeights(**{**vars(p2.weights), "resident": None})
    x = torch.randn(4, 32)
    tw, ids = torch.rand(4, 2), torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2]])
    a = ap_fused_moe(x, tw, ids, p13.weights, p2.weights)
    b = ap_fused_moe_reference(x, tw, ids, bare13, bare2)
    assert torch.equal(a, b)


def test_stale_resident_view_is_an_error():
    p = random_ap_projection(2, 32, 32, [4, 4], group_size=32, bits_min=2, seed=0)
    stale = APMoEWeights(**{**vars(p.weights), "resident": lambda e: (p.planes[1 - e], p.tables[1 - e][4])})
    with pytest.raises(ValueError, match="does not match page-table row"):
        dequantize_expert(stale, 0)


def test_bad_inputs_name_the_problem():
    p = random_ap_projection(2, 64, 32, [4, 4], group_size=32, bits_min=2, seed=0)
    p2 = random_ap_projection(2, 32, 32, [4, 4], group_size=32, bits_min=2, seed=1)
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="topk_ids/topk_weights"):
        ap_fused_moe(x, torch.rand(3, 2), torch.zeros(2, 2, dtype=torch.int32), p.weights, p2.weights)
    with pytest.raises(ValueError, match="x must be"):
        ap_linear(torch.randn(3, 48), p.weights)
    with pytest.raises(ValueError, match="group_size that is a power of two >= 32"):
        APMoEWeights(page_table=torch.zeros(1, 10, dtype=torch.int64), table_kind="bcq", group_size=16, N=8, K=64,
                     bits_max=8, num_experts=1).check_triton_supported("w13")
    with pytest.raises(ValueError, match="multiple of 8"):
        APMoEWeights(page_table=torch.zeros(1, 10, dtype=torch.int64), table_kind="kmeans", group_size=128, N=8, K=20,
                     bits_max=8, num_experts=1)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        if INTERPRET:
            raise RuntimeError("TRITON_INTERPRET (skipped: interpreting)")
        ap_fused_moe(x, torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int32), p.weights, p2.weights, backend="triton")


@pytest.mark.skipif(INTERPRET or HAS_CUDA, reason="only in a plain CPU run: re-runs this file interpreted")
def test_linear_under_interpreter():
    run_under_interpreter(__file__)
