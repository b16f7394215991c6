"""Dense GEMMs of the prefill path on SGLang's own bf16/fp16 fused-MoE Triton kernel (dense_gemm="sglang").

The prefill path (triton_dequant_moe.py) rebuilds each expert once per call into a dense scratch; what
remains is an ordinary grouped GEMM, which SGLang ships tuned per GPU (`fused_moe_kernel` and its JSON
configs). This runs that kernel on the scratch. Measured on the H200 (docs/results/kernel.md) it is no faster
than our own dense kernel (equal on Mixtral, 14% slower on Qwen1.5-MoE at M=2048): the dequantization, not
the GEMM, is what the prefill path waits on. It stays as the comparison the kernel benchmark times.

Experts go through the scratch in chunks, but SGLang's kernel takes one (sorted ids, expert ids) layout
for all experts. A chunk's view of the shared alignment, built on the device with no host sync (so it
stays CUDA-graph capturable), hides the other experts' blocks:
  - their expert id becomes -1, so the kernel returns early (`filter_expert`), and
  - their sorted ids become `num_pairs` (padding), so the zeros it writes on that early return are masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedweight.kernels.align import MoEAlignment

# SGLang's get_default_config for bf16 at M > E (prefill), used when no SGLang execution context exists
# (kernel tests and scripts outside a server); inside a server SGLang's own lookup (tuned JSON) decides.
_UNTUNED = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8}


@dataclass(frozen=True)
class SGLangMoEConfigs:
    up: dict[str, Any]  # w13 launch config (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages)
    down: dict[str, Any]  # w2, same BLOCK_SIZE_M (both share one alignment)
    source: str  # "sglang" (SGLang's lookup: tuned JSON or its default) or "untuned" (no SGLang context)

    @property
    def block_m(self) -> int:
        return int(self.up["BLOCK_SIZE_M"])


def _has_sglang_context() -> bool:
    from sglang.srt.runtime_context import get_exec

    try:
        get_exec()
    except ValueError:
        return False
    return True


def sglang_moe_configs(num_tokens: int, num_experts: int, inter: int, hidden: int, topk: int,
                       dtype: torch.dtype) -> SGLangMoEConfigs:
    """The configs SGLang's own bf16 MoE would use for this layer shape and token count."""
    if not _has_sglang_context():
        return SGLangMoEConfigs(dict(_UNTUNED), dict(_UNTUNED), "untuned")
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import (
        get_config_dtype_str,
        try_get_optimal_moe_config,
    )

    up, (down, _) = try_get_optimal_moe_config(
        (num_experts, 2 * inter, hidden), (num_experts, hidden, inter), topk, get_config_dtype_str(dtype),
        num_tokens, return_down_config=True,
    )
    down = dict(down) if down else dict(up)
    down["BLOCK_SIZE_M"] = up["BLOCK_SIZE_M"]
    return SGLangMoEConfigs(dict(up), down, "sglang")


def chunk_view(align: MoEAlignment, e0: int, chunk: int, num_experts: int, num_pairs: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted ids, expert ids) of `align` restricted to experts [e0, e0 + chunk), ids relative to e0."""
    eid = align.expert_ids
    if e0 == 0 and chunk >= num_experts:
        return align.sorted_ids, eid
    inside = (eid >= e0) & (eid < e0 + chunk)
    eid_c = torch.where(inside, eid - e0, torch.full_like(eid, -1))
    keep = inside.repeat_interleave(align.block_size)[: align.sorted_ids.numel()]
    sid_c = torch.where(keep, align.sorted_ids, torch.full_like(align.sorted_ids, num_pairs))
    return sid_c, eid_c


def sglang_moe_chunk(a: torch.Tensor, c: torch.Tensor, scratch: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, align: MoEAlignment, e0: int, num_experts: int, *, rows_per_a: int,
                     mul_routed_weight: bool, config: dict[str, Any]) -> None:
    """c[pair] = (w[pair] *) a[pair // rows_per_a] @ scratch[e(pair) - e0]^T for the pairs of this chunk.

    a: [*, K] activations (tokens for w13, rows_per_a = top-k; pairs for w2, rows_per_a = 1);
    c: [num_pairs, N] in a's dtype; scratch: [chunk, N, K]; topk_weights [M, top-k] float32."""
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import invoke_fused_moe_kernel

    import triton.language as tl

    if int(config["BLOCK_SIZE_M"]) != align.block_size:
        raise ValueError(f"SGLang config BLOCK_SIZE_M={config['BLOCK_SIZE_M']} != alignment block {align.block_size}")
    num_pairs = topk_ids.numel()
    sid, eid = chunk_view(align, e0, scratch.shape[0], num_experts, num_pairs)
    invoke_fused_moe_kernel(
        a, scratch, None, c, None, None, None, topk_weights, topk_ids, sid, eid, align.num_tokens_post_padded,
        mul_routed_weight, rows_per_a, config, tl.float16 if a.dtype == torch.float16 else tl.bfloat16,
        use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
        per_channel_quant=False, block_shape=None, filter_expert=True,
    )
