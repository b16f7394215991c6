"""Triton kernels over any-precision (AP) bit-planes, and their torch references (docs/kernels.md).

    ap_fused_moe(hidden, topk_weights, topk_ids, w13, w2, *, activation="silu",
                 apply_router_weight_on_input=False) -> [M, H]
    ap_linear(x, w, *, row=0, bias=None) -> [M, N]
    moe_align_block_size(topk_ids, block_size, num_experts) -> MoEAlignment

CUDA tensors run the Triton kernels; CPU tensors the torch reference (pagedweight.kernels.reference).
"""

from pagedweight.kernels.align import MoEAlignment, moe_align_block_size, moe_align_block_size_torch
from pagedweight.kernels.api import ap_fused_moe, ap_linear
from pagedweight.kernels.config import APKernelConfig
from pagedweight.kernels.weights import (
    PT_BITS,
    PT_PLANES,
    PT_TABLE,
    APMoEWeights,
    build_ap_moe_weights,
    page_table_row,
)

__all__ = [
    "APKernelConfig",
    "APMoEWeights",
    "MoEAlignment",
    "PT_BITS",
    "PT_PLANES",
    "PT_TABLE",
    "ap_fused_moe",
    "ap_linear",
    "build_ap_moe_weights",
    "moe_align_block_size",
    "moe_align_block_size_torch",
    "page_table_row",
]
