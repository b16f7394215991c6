"""moe_align_block_size: torch version against a plain-Python oracle, the Triton and CUDA versions against it."""

from __future__ import annotations

import pytest
import torch

from pagedweight.kernels.align import aligned_sizes, moe_align_block_size, moe_align_block_size_torch
from tests.support.triton_kernels import HAS_CUDA, INTERPRET, KERNEL_DEVICE, needs_kernel_device, run_under_interpreter


def oracle(ids: torch.Tensor, bs: int, e: int):
    flat = ids.reshape(-1).tolist()
    out, experts = [], []
    for x in range(e):
        pairs = [i for i, v in enumerate(flat) if v == x]
        if not pairs:
            continue
        n = -(-len(pairs) // bs) * bs
        out += pairs + [len(flat)] * (n - len(pairs))
        experts += [x] * (n // bs)
    return out, experts


CASES = [
    ("random", lambda g: torch.randint(0, 6, (7, 2), generator=g), 4, 6),
    ("one_expert", lambda g: torch.full((9, 3), 2), 4, 5),
    ("empty_experts", lambda g: torch.tensor([[0, 7], [7, 0], [0, 7]]), 16, 8),
    ("dropped_ids", lambda g: torch.tensor([[-1, 1], [1, 3], [3, -1]]), 2, 4),
    ("single", lambda g: torch.tensor([[3]]), 16, 4),
    ("many", lambda g: torch.randint(0, 60, (300, 4), generator=g), 16, 60),
]
# prefill sizes (the CUDA alignment, from CUDA_ALIGN_MIN_PAIRS pairs): uneven warp chunks, dropped ids, empty experts
BIG_CASES = [
    ("qwen3_like", lambda g: torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(777)]), 64, 128),
    ("skewed_dropped", lambda g: torch.where(torch.rand(1000, 2, generator=g) < 0.1, -1,
                                             torch.randint(0, 3, (1000, 2), generator=g) * 3), 128, 10),
    ("int64_few_experts", lambda g: torch.randint(0, 8, (4096, 2), generator=g).long(), 128, 8),
    # Qwen3-30B-A3B at 8192 tokens: 65536 pairs, every expert kept in the shared-memory stash
    ("qwen3_8192_stashed", lambda g: torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(8192)]), 128, 128),
    # 1024 experts leave the stash ~46k pairs: 60000 read their experts from global memory again in the second pass
    ("many_experts_past_the_stash", lambda g: torch.where(torch.rand(7500, 8, generator=g) < 0.05, -1,
                                                          torch.randint(0, 1024, (7500, 8), generator=g)), 64, 1024),
]


def check(al, ids, bs, e):
    exp_sorted, exp_experts = oracle(ids, bs, e)
    max_padded, max_blocks = aligned_sizes(ids.numel(), e, bs)
    assert al.sorted_ids.shape == (max_padded,) and al.expert_ids.shape == (max_blocks,)
    total = int(al.num_tokens_post_padded.item())
    assert total == len(exp_sorted)
    assert al.sorted_ids[:total].tolist() == exp_sorted
    assert (al.sorted_ids[total:] == ids.numel()).all()
    assert al.expert_ids[: total // bs].tolist() == exp_experts
    assert (al.expert_ids[total // bs :] == -1).all()


@pytest.mark.parametrize("name,make,bs,e", CASES, ids=[c[0] for c in CASES])
def test_torch_align_matches_oracle(name, make, bs, e):
    ids = make(torch.Generator().manual_seed(0)).to(torch.int32)
    check(moe_align_block_size_torch(ids, bs, e), ids, bs, e)


@needs_kernel_device
@pytest.mark.parametrize("name,make,bs,e", CASES, ids=[c[0] for c in CASES])
def test_triton_align_matches_oracle(name, make, bs, e):
    ids = make(torch.Generator().manual_seed(0)).to(torch.int32)
    if KERNEL_DEVICE == "cuda":
        from pagedweight.kernels.align import MoEAlignment
        from pagedweight.kernels.cuda_align import moe_align_block_size_cuda
        from pagedweight.kernels.triton_align import moe_align_block_size_triton

        for fn in (moe_align_block_size_cuda, moe_align_block_size_triton):  # both, whatever the size rule picks
            al = MoEAlignment(*fn(ids.cuda(), bs, e), block_size=bs)
            check(type(al)(*(t.cpu() for t in (al.sorted_ids, al.expert_ids, al.num_tokens_post_padded)),
                           block_size=bs), ids, bs, e)
        al = moe_align_block_size(ids.cuda(), bs, e)
    else:
        from pagedweight.kernels.align import MoEAlignment
        from pagedweight.kernels.triton_align import moe_align_block_size_triton

        al = MoEAlignment(*moe_align_block_size_triton(ids, bs, e), block_size=bs)
    check(type(al)(*(t.cpu() for t in (al.sorted_ids, al.expert_ids, al.num_tokens_post_padded)), block_size=bs), ids, bs, e)


@pytest.mark.skipif(INTERPRET or HAS_CUDA, reason="only in a plain CPU run: re-runs this file interpreted")
def test_align_under_interpreter():
    run_under_interpreter(__file__)


def test_cuda_align_shared_memory_sizes():
    """Two sizes, so two cached kernels: 48 KB while the tables and a stash of every pair fit it (decode, small
    prefills), else all the device allows; the stash then holds what is left, the rest read from global memory."""
    from pagedweight.kernels.cuda_align import shared_bytes, stash_capacity, table_bytes

    optin = 227 * 1024
    assert shared_bytes(128, 64, optin) == shared_bytes(128, 13000, optin) == 48 * 1024
    assert shared_bytes(128, 16384, optin) == shared_bytes(128, 65536, optin) == optin
    assert stash_capacity(128, optin) >= 65536 and stash_capacity(128, 48 * 1024) >= 13000
    assert table_bytes(1024) > 48 * 1024 and shared_bytes(1024, 8, optin) == optin  # the tables alone pass 48 KB
    assert stash_capacity(1024, table_bytes(1024)) == 0 and 0 < stash_capacity(1024, optin) < 60000


def test_cuda_align_raises_the_shared_memory_limit_at_48_kb(monkeypatch):
    """Both of the alignment's sizes (48 KB exactly, and the device's opt-in maximum) launch only once the kernel's
    limit is raised: torch's launcher refuses 48 KB and up without it (session 34's GPU run of the 48 KB size)."""
    from pagedweight.kernels import nvrtc
    from pagedweight.kernels.cuda_align import _SOURCE, SMALL_SHARED, shared_bytes

    raised = []

    class Kernel:
        def set_shared_memory_config(self, nbytes):
            raised.append(nbytes)

    monkeypatch.setattr(nvrtc, "load_kernel", lambda *args: Kernel())
    nvrtc.cached_kernel.cache_clear()
    try:
        for smem in (shared_bytes(128, 64, 227 * 1024), shared_bytes(128, 65536, 227 * 1024), 48 * 1024 - 16):
            nvrtc.cached_kernel(_SOURCE, "ap_moe_align", (), 0, smem)
    finally:
        nvrtc.cached_kernel.cache_clear()  # no fake kernel left for the GPU tests after this one
    assert raised == [SMALL_SHARED, 227 * 1024]  # nothing raised under 48 KB: the default limit serves


def test_cuda_align_compiles_for_sm90():
    from pagedweight.kernels.cuda_align import compile_to_cubin

    assert compile_to_cubin("90")[:4] == b"\x7fELF"
    from tests.support.cuda_kernel_cases import sass_of

    # it lets a programmatic dependent (the fold MoE's prep) launch early, and waits for nothing itself
    sass = sass_of(compile_to_cubin("90"))
    assert "PREEXIT" in sass and "ACQBULK" not in sass


@pytest.mark.skipif(not HAS_CUDA, reason="the CUDA alignment needs a CUDA device")
@pytest.mark.parametrize("name,make,bs,e", BIG_CASES, ids=[c[0] for c in BIG_CASES])
def test_cuda_align_matches_torch_at_prefill_sizes(name, make, bs, e):
    from pagedweight.kernels.align import CUDA_ALIGN_MIN_PAIRS

    ids = make(torch.Generator().manual_seed(0))
    ids = ids if ids.dtype == torch.int64 else ids.to(torch.int32)
    assert ids.numel() >= CUDA_ALIGN_MIN_PAIRS  # moe_align_block_size takes the CUDA kernel
    al = moe_align_block_size(ids.cuda(), bs, e)
    ref = moe_align_block_size_torch(ids, bs, e)
    for got, want in zip((al.sorted_ids, al.expert_ids, al.num_tokens_post_padded),
                         (ref.sorted_ids, ref.expert_ids, ref.num_tokens_post_padded)):
        assert torch.equal(got.cpu(), want), name
