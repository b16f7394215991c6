"""Fused AP MoE (Triton) against the torch reference: random and adversarial routings, every bitwidth,
mixed per-expert bitwidths, every table kind (bcq, ubcq, kmeans), page-table rows rewritten between calls (and CUDA-graph
replays on GPU). Runs compiled on CUDA, interpreted on CPU (TRITON_INTERPRET=1, small shapes)."""

from __future__ import annotations

import pytest
import torch

from pagedweight.kernels import APKernelConfig, ap_fused_moe
from pagedweight.kernels.reference import ap_fused_moe_reference
from pagedweight.kernels.testing import random_ap_projection
from tests.support.triton_kernels import (
    HAS_CUDA,
    INTERPRET,
    KERNEL_DEVICE,
    needs_kernel_device,
    rel_err,
    run_under_interpreter,
    tolerance,
)

H, I = 64, 96  # I = 3 words: exercises a partial last N block and K = 96 (three 32-wide steps)


def make_layer(num_experts, bits13, bits2, kind, group=32, seed=0, device=None):
    """w13 uses `group`; w2 (K = I = 96) the largest of group, 32 that divides I."""
    device = device or KERNEL_DEVICE or "cpu"
    g2 = group if I % group == 0 else 32
    p13 = random_ap_projection(num_experts, 2 * I, H, bits13, table_kind=kind, group_size=group, bits_min=2, seed=seed, device=device)
    p2 = random_ap_projection(num_experts, H, I, bits2, table_kind=kind, group_size=g2, bits_min=2, seed=seed + 1, device=device)
    return p13, p2


def routing(m, num_experts, topk, pattern, seed=0):
    g = torch.Generator().manual_seed(seed)
    if pattern == "random":
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(m)])
    elif pattern == "one_expert":
        ids = torch.full((m, topk), num_experts - 1)
        ids[:, 1:] = torch.arange(topk - 1)  # slot 0 of every token -> the last expert
    elif pattern == "two_experts":  # the others get no tokens
        ids = torch.stack([torch.tensor([1, num_experts - 2])[torch.randperm(2, generator=g)][:topk] for _ in range(m)])
    else:
        raise ValueError(pattern)
    w = torch.rand(m, topk, generator=g) + 0.1
    return w.float(), ids.to(torch.int32)


def run_case(m, topk, kind, dtype, bits13, bits2, pattern="random", group=32, apply_w_in=False, use_asm=None, seed=0):
    num_experts = len(bits13)
    p13, p2 = make_layer(num_experts, bits13, bits2, kind, group, seed)
    dev = KERNEL_DEVICE
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(seed + 5)).to(dtype).to(dev)
    tw, ids = routing(m, num_experts, topk, pattern, seed)
    tw, ids = tw.to(dev), ids.to(dev)
    out = ap_fused_moe(x, tw, ids, p13.weights, p2.weights, backend="triton",
                       apply_router_weight_on_input=apply_w_in, use_asm=use_asm)
    ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights, apply_router_weight_on_input=apply_w_in)
    assert out.dtype == dtype and out.shape == (m, H)
    err = rel_err(out, ref)
    assert err < tolerance(dtype), f"rel err {err:.3e}"



@needs_kernel_device
@pytest.mark.parametrize("kind", ["bcq", "ubcq", "kmeans"])
@pytest.mark.parametrize("m,topk", [(1, 1), (3, 2), (11, 3)])
def test_random_routing_mixed_bits(kind, m, topk):
    run_case(m, topk, kind, torch.float16, [2, 5, 8, 3], [4, 7, 2, 6], seed=m)


@needs_kernel_device
@pytest.mark.parametrize("kind", ["bcq", "ubcq", "kmeans"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_every_bitwidth(kind, bits):
    run_case(5, 2, kind, torch.float16, [bits] * 3, [bits] * 3, seed=bits)


@needs_kernel_device
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_dtypes(dtype):
    run_case(6, 2, "bcq", dtype, [4, 3, 6], [3, 8, 4])


@needs_kernel_device
@pytest.mark.parametrize("kind", ["bcq", "ubcq", "kmeans"])
def test_all_tokens_to_one_expert(kind):
    run_case(19, 2, kind, torch.float16, [3, 4, 5, 6], [6, 5, 4, 3], pattern="one_expert")


@needs_kernel_device
def test_empty_experts():
    run_case(9, 2, "bcq", torch.float16, [2, 3, 4, 5, 6, 7, 8, 4], [8, 7, 6, 5, 4, 3, 2, 4], pattern="two_experts")


@needs_kernel_device
@pytest.mark.parametrize("kind", ["bcq", "ubcq"])
def test_group_64_and_router_weight_on_input(kind):
    run_case(4, 1, kind, torch.float16, [4, 5], [5, 4], group=64, apply_w_in=True)


@needs_kernel_device
@pytest.mark.skipif(KERNEL_DEVICE != "cuda", reason="inline PTX needs CUDA; the interpreter runs the emulation")
@pytest.mark.parametrize("use_asm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_asm_and_emulated_builds_agree(use_asm, dtype):
    run_case(8, 2, "bcq", dtype, [3, 8, 5], [2, 4, 7], use_asm=use_asm)


@needs_kernel_device
@pytest.mark.parametrize(
    "kind,prefetch,fuse,split13",
    [("bcq", False, True, 1), ("bcq", True, False, 2), ("kmeans", True, False, 2), ("kmeans", True, True, 1),
     ("bcq", False, False, 3), ("ubcq", True, True, 1), ("ubcq", False, False, 2)],
)
def test_block_m_32_split_k_prefetch_fused(kind, prefetch, fuse, split13):
    p13, p2 = make_layer(3, [4, 2, 8], [8, 3, 4], kind)
    dev = KERNEL_DEVICE
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(3)).half().to(dev)
    tw, ids = routing(40, 3, 2, "random", 3)
    stages = 1 if prefetch else 2
    cfg = (APKernelConfig(block_m=32, block_n=32, block_k=32, split_k=split13, num_warps=2, num_stages=stages,
                          prefetch=prefetch, fuse_gate_up=fuse),
           APKernelConfig(block_m=32, block_n=32, block_k=32, split_k=2, num_warps=2, num_stages=stages, prefetch=prefetch))
    out = ap_fused_moe(x, tw.to(dev), ids.to(dev), p13.weights, p2.weights, backend="triton", configs=cfg)
    ref = ap_fused_moe_reference(x.float(), tw.to(dev), ids.to(dev), p13.weights, p2.weights)
    assert rel_err(out, ref) < tolerance(torch.float16)


@needs_kernel_device
@pytest.mark.parametrize("dense_gemm", ["sglang", "triton"])
@pytest.mark.parametrize("kind,chunk,apply_w_in",
                         [("bcq", 1, False), ("kmeans", 2, True), ("bcq", 8, True), ("ubcq", 2, False)])
def test_dequantize_then_dense_prefill_path(kind, chunk, apply_w_in, dense_gemm):
    """Experts dequantized once into a scratch, in chunks (including one larger than E), then dense GEMMs:
    SGLang's own fused-MoE kernel on each chunk's view of the alignment, or ours."""
    if dense_gemm == "sglang":
        pytest.importorskip("sglang", reason="SGLang's fused-MoE GEMM needs SGLang (on the GPU machine: the devicekit)")
    p13, p2 = make_layer(3, [4, 2, 8], [3, 8, 5], kind)
    dev = KERNEL_DEVICE
    x = torch.randn(21, H, generator=torch.Generator().manual_seed(4)).half().to(dev)
    tw, ids = routing(21, 3, 2, "random", 4)
    tw, ids = tw.to(dev), ids.to(dev)
    cfg = (APKernelConfig(block_m=32, block_n=32, block_k=32, num_warps=2, dequant_chunk=chunk, dense_gemm=dense_gemm),
           APKernelConfig(block_m=32, block_n=32, block_k=32, num_warps=2))
    out = ap_fused_moe(x, tw, ids, p13.weights, p2.weights, backend="triton", configs=cfg,
                       apply_router_weight_on_input=apply_w_in)
    ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights, apply_router_weight_on_input=apply_w_in)
    assert rel_err(out, ref) < tolerance(torch.float16)


@needs_kernel_device
@pytest.mark.parametrize("dequant_kernel,overlap,chunk", [("triton", False, 2), ("auto", True, 1), ("auto", True, 2),
                                                          ("triton", True, 1)])
def test_prefill_rebuild_kernels_and_overlap(dequant_kernel, overlap, chunk):
    """The scratch rebuilt by either dequantization kernel, chunk c + 1 on a side stream while chunk c's GEMMs
    run (CUDA; on CPU the flag is a no-op): same answer as the reference, bcq with mixed bits per expert."""
    p13, p2 = make_layer(5, [4, 2, 8, 3, 6], [3, 8, 5, 2, 7], "bcq")
    dev = KERNEL_DEVICE
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(8)).half().to(dev)
    tw, ids = routing(37, 5, 2, "random", 8)
    tw, ids = tw.to(dev), ids.to(dev)
    cfg = (APKernelConfig(block_m=32, block_n=32, block_k=32, num_warps=2, dequant_chunk=chunk,
                          dequant_kernel=dequant_kernel, dequant_overlap=overlap),
           APKernelConfig(block_m=32, block_n=32, block_k=32, num_warps=2))
    out = ap_fused_moe(x, tw, ids, p13.weights, p2.weights, backend="triton", configs=cfg)
    ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights)
    assert rel_err(out, ref) < tolerance(torch.float16)


@needs_kernel_device
@pytest.mark.parametrize("path", ["split", "fused_gate_up", "dequant_prefill"])
@pytest.mark.parametrize("apply_w_in", [False, True])
def test_gelu_gated_experts(path, apply_w_in):
    """Gemma-4's GELU-gated experts on each Triton w13 path (activation="gelu"): equal to the reference, and not to
    the SiLU answer (the gate is the one asked for)."""
    p13, p2 = make_layer(3, [4, 2, 8], [3, 8, 5], "ubcq")
    dev = KERNEL_DEVICE
    x = torch.randn(21, H, generator=torch.Generator().manual_seed(6)).half().to(dev)
    tw, ids = routing(21, 3, 2, "random", 6)
    tw, ids = tw.to(dev), ids.to(dev)
    c13 = APKernelConfig(block_m=32, block_n=32, block_k=32, num_warps=2, fuse_gate_up=path == "fused_gate_up",
                         dequant_chunk=2 if path == "dequant_prefill" else 0,
                         dense_gemm="triton")
    cfg = (c13, APKernelConfig(block_m=32, block_n=32, block_k=32, num_warps=2))
    out = ap_fused_moe(x, tw, ids, p13.weights, p2.weights, backend="triton", configs=cfg, activation="gelu",
                       apply_router_weight_on_input=apply_w_in)
    ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights, activation="gelu",
                                 apply_router_weight_on_input=apply_w_in)
    silu = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights, apply_router_weight_on_input=apply_w_in)
    assert rel_err(out, ref) < tolerance(torch.float16)
    assert rel_err(silu, ref) > 10 * tolerance(torch.float16)


def test_dequant_kernel_choice_is_validated():
    with pytest.raises(ValueError, match="dequant_kernel"):
        APKernelConfig(dequant_chunk=1, dequant_kernel="fast")


@needs_kernel_device
def test_default_config_switches_to_dequantize_at_prefill_sizes():
    from pagedweight.kernels.config import default_moe_configs

    m, topk, e = 200, 2, 3  # 133 pairs per expert on average
    c13, _ = default_moe_configs(m, topk, e, I, H, (H, 32), (I, 32))
    assert c13.dequant_chunk > 0
    p13, p2 = make_layer(e, [5, 3, 4], [4, 6, 2], "bcq")
    dev = KERNEL_DEVICE
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(6)).half().to(dev)
    tw, ids = routing(m, e, topk, "random", 6)
    out = ap_fused_moe(x, tw.to(dev), ids.to(dev), p13.weights, p2.weights, backend="triton")
    ref = ap_fused_moe_reference(x.float(), tw.to(dev), ids.to(dev), p13.weights, p2.weights)
    assert rel_err(out, ref) < tolerance(torch.float16)


@needs_kernel_device
def test_rows_rewritten_between_calls_are_followed():
    """One compiled kernel, one page-table tensor: rewriting rows changes bitwidths without recompiling."""
    p13, p2 = make_layer(3, [8, 8, 8], [8, 8, 8], "bcq")
    dev = KERNEL_DEVICE
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1)).half().to(dev)
    tw, ids = routing(5, 3, 2, "random", 1)
    tw, ids = tw.to(dev), ids.to(dev)
    w13, w2 = p13.weights, p2.weights
    for bits in ([2, 5, 3], [8, 2, 6]):
        new13, new2 = p13.recommit(bits), p2.recommit(bits[::-1])
        w13.page_table.copy_(new13.page_table)  # same tensor (address), new contents
        w2.page_table.copy_(new2.page_table)
        out = ap_fused_moe(x, tw, ids, w13, w2, backend="triton")
        ref = ap_fused_moe_reference(x.float(), tw, ids, new13, new2)
        assert rel_err(out, ref) < tolerance(torch.float16)


@needs_kernel_device
@pytest.mark.skipif(KERNEL_DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_cuda_graph_replay_follows_page_table():
    p13, p2 = make_layer(4, [8] * 4, [8] * 4, "bcq")
    x = torch.randn(3, H, device="cuda").half()
    tw, ids = routing(3, 4, 2, "random", 2)
    tw, ids = tw.cuda(), ids.cuda()
    w13, w2 = p13.weights, p2.weights
    ap_fused_moe(x, tw, ids, w13, w2)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ap_fused_moe(x, tw, ids, w13, w2)
    for bits in ([2, 3, 4, 5], [7, 6, 8, 2]):
        new13, new2 = p13.recommit(bits), p2.recommit(bits)
        w13.page_table.copy_(new13.page_table)
        w2.page_table.copy_(new2.page_table)
        g.replay()
        ref = ap_fused_moe_reference(x.float(), tw, ids, new13, new2)
        assert rel_err(out, ref) < tolerance(torch.float16)


@pytest.mark.skipif(INTERPRET or HAS_CUDA, reason="only in a plain CPU run: re-runs this file interpreted")
def test_moe_under_interpreter():
    run_under_interpreter(__file__)
