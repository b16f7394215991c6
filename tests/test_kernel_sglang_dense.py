"""The prefill path's chunk view of a shared alignment (sglang_dense_moe.chunk_view) and its config checks;
the GEMMs themselves are compared with the torch reference in test_kernel_moe.py (dense_gemm="sglang")."""

from __future__ import annotations

import pytest
import torch

from pagedweight.kernels import APKernelConfig
from pagedweight.kernels.align import moe_align_block_size_torch
from pagedweight.kernels.sglang_dense_moe import chunk_view, sglang_moe_configs


def test_chunk_view_hides_other_experts_blocks():
    ids = torch.tensor([[0, 3], [1, 3], [2, 0], [3, 1]])  # 8 pairs over 4 experts
    align = moe_align_block_size_torch(ids, 4, 4)
    num_pairs = ids.numel()
    bs = align.block_size
    seen = torch.zeros(num_pairs, dtype=torch.int64)
    for e0 in (0, 2):
        sid, eid = chunk_view(align, e0, 2, 4, num_pairs)
        assert sid.shape == align.sorted_ids.shape and eid.shape == align.expert_ids.shape
        for b in range(eid.numel()):
            rows = sid[b * bs:(b + 1) * bs]
            orig = int(align.expert_ids[b])
            if e0 <= orig < e0 + 2:
                assert int(eid[b]) == orig - e0  # relative to the chunk
                assert torch.equal(rows, align.sorted_ids[b * bs:(b + 1) * bs])
            else:  # the kernel returns early and its zero writes are all masked
                assert int(eid[b]) == -1 and bool((rows >= num_pairs).all())
        valid = sid[sid < num_pairs]
        seen.index_add_(0, valid.long(), torch.ones_like(valid, dtype=torch.int64))
        # every pair the chunk keeps is routed to one of its experts
        assert set(ids.reshape(-1)[valid.long()].tolist()) <= {e0, e0 + 1}
    assert torch.equal(seen, torch.ones(num_pairs, dtype=torch.int64))  # each pair in exactly one chunk


def test_chunk_view_of_all_experts_is_the_alignment_itself():
    ids = torch.tensor([[0, 1], [1, 2]])
    align = moe_align_block_size_torch(ids, 4, 3)
    sid, eid = chunk_view(align, 0, 8, 3, ids.numel())
    assert sid is align.sorted_ids and eid is align.expert_ids


def test_configs_say_where_they_come_from():
    pytest.importorskip("sglang", reason="the tuned-config lookup reads SGLang's tables (on the GPU machine: the devicekit)")
    from pagedweight.kernels.sglang_dense_moe import _has_sglang_context

    cfg = sglang_moe_configs(2048, 8, 14336, 4096, 2, torch.bfloat16)
    assert cfg.source == ("sglang" if _has_sglang_context() else "untuned")
    assert cfg.up["BLOCK_SIZE_M"] == cfg.down["BLOCK_SIZE_M"] == cfg.block_m


def test_dense_gemm_is_validated():
    with pytest.raises(ValueError, match="dense_gemm"):
        APKernelConfig(dense_gemm="cublas")
