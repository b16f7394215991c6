"""Public entry points: `ap_fused_moe` and `ap_linear`, dispatching CUDA -> Triton, CPU -> torch reference.

Set `backend="triton"` to run the Triton kernels on CPU tensors (only under TRITON_INTERPRET=1, for
tests); `backend="reference"` forces the torch oracle on any device. On CUDA, `kernel` picks between the
Triton tile kernels, the CUDA activation-side-table kernel for binary-coded planes at decode sizes
(cuda_lut.py), the CUDA tensor-core kernels for ubcq planes at small batches (cuda_mma.py, cuda_fold.py) and the
grouped GEMM for ubcq planes at prefill sizes (cuda_grouped.py): "auto" takes
a CUDA kernel where it is eligible and measured faster, "lut" / "mma" / "fold" / "grouped" demand one (an ineligible block
raises, naming why). No path falls back silently: an unsupported combination raises.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Literal, Optional

import torch

from pagedweight.kernels.align import moe_align_block_size
from pagedweight.kernels.config import (
    LINEAR_LUT_MAX_M,
    APKernelConfig,
    default_linear_config,
    default_moe_configs,
    prefer_fold,
    prefer_grouped,
    prefer_lut,
    prefer_mma,
)
from pagedweight.kernels.reference import ap_fused_moe_reference, ap_linear_reference, check_moe_args
from pagedweight.kernels.weights import APMoEWeights

Backend = Literal["auto", "triton", "reference"]
Kernel = Literal["auto", "tiles", "lut", "mma", "fold", "grouped"]
CUDA_KERNELS = ("lut", "mma", "fold", "grouped")


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _pick_backend(t: torch.Tensor, backend: Backend) -> str:
    if backend == "reference":
        return "reference"
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if t.is_cuda:
        return "triton"
    if backend == "triton":
        if not triton_interpreting():
            raise RuntimeError("the Triton AP kernels run on CPU tensors only under TRITON_INTERPRET=1")
        return "triton"
    return "reference"


def _check_kernel(kernel: Kernel, path: str) -> None:
    if kernel not in ("auto", "tiles") + CUDA_KERNELS:
        raise ValueError(f"kernel must be 'auto', 'tiles', 'lut', 'mma', 'fold' or 'grouped', got {kernel!r}")
    if kernel in CUDA_KERNELS and path == "reference":
        raise ValueError(f"kernel={kernel!r} cannot run: it is a CUDA kernel and the inputs are not on a CUDA device "
                         "(or backend='reference' was asked for)")


def _use_cuda_kernel(name: str, kernel: Kernel, on_cuda: bool, weights: tuple[APMoEWeights, ...], wins: bool,
                     explicit_config: bool, call_why: Optional[str] = None) -> bool:
    """Whether the CUDA kernel `name` ("lut", "mma", "fold" or "grouped") runs (kernel=name raises where it
    cannot). `call_why`: why this call's size is past the kernel's limits (None: it fits)."""
    if kernel not in ("auto", name):
        return False
    if name == "lut":
        from pagedweight.kernels.cuda_lut import lut_unsupported as unsupported
    elif name == "mma":
        from pagedweight.kernels.cuda_mma import mma_unsupported as unsupported
    elif name == "fold":
        from pagedweight.kernels.cuda_fold import fold_unsupported as unsupported
    else:
        from pagedweight.kernels.cuda_grouped import grouped_unsupported as unsupported

    why = "it is a CUDA kernel and the inputs are not on a CUDA device" if not on_cuda else None
    for w in weights:
        why = why or unsupported(w)
    if why is None and name == "fold" and len(weights) == 2:
        from pagedweight.kernels.cuda_fold import fold_moe_unsupported

        why = fold_moe_unsupported(*weights)
    if why is None and name == "grouped":
        from pagedweight.kernels.cuda_grouped import grouped_moe_unsupported

        why = "it serves the MoE layer only" if len(weights) != 2 else grouped_moe_unsupported(*weights)
    why = why or call_why
    if kernel == name:
        if why is not None:
            raise ValueError(f"kernel={name!r} cannot run: {why}")
        return True
    return why is None and wins and not explicit_config


def moe_kernel_rules(m: int, topk: int, num_experts: int, intermediate: int) -> tuple[tuple[str, bool], ...]:
    """(CUDA kernel, whether its size rule wins) in the order ap_fused_moe asks them: their ranges overlap and the
    first that wins and can run serves the call. The MMA kernel also takes the fold kernel's range, where fold
    cannot run (groups under 128, an intermediate size that is not a multiple of 128)."""
    fold = prefer_fold(m, topk, num_experts, intermediate)
    grouped = prefer_grouped(m, topk, num_experts)  # intermediate sizes that are odd multiples of 64 too (-DTAIL64)
    return (("fold", fold), ("mma", fold or prefer_mma(m, topk, num_experts)), ("lut", prefer_lut(m, topk, num_experts)),
            ("grouped", grouped))


def auto_moe_kernel(m: int, topk: int, w13: APMoEWeights, w2: APMoEWeights, *, on_cuda: bool = True,
                    kernel: Kernel = "auto", explicit_config: bool = False,
                    apply_router_weight_on_input: bool = False) -> Optional[str]:
    """The CUDA kernel ap_fused_moe runs for a call of m tokens (None: the Triton path); the one place the choice is
    made, so the benchmarks label their rows with what the server runs. A call past the grouped kernel's size limits
    (grouped_call_unsupported) goes to the next rule that wins, or the Triton path."""
    from pagedweight.kernels.cuda_grouped import default_block_m, grouped_call_unsupported

    for name, wins in moe_kernel_rules(m, topk, w13.num_experts, w2.K):
        call_why = None
        if name == "grouped" and (wins or kernel == "grouped"):  # sized only where it may run
            call_why = grouped_call_unsupported(m, topk, w13, w2, default_block_m(m, topk, w13.num_experts),
                                                apply_router_weight_on_input)
        if _use_cuda_kernel(name, kernel, on_cuda, (w13, w2), wins, explicit_config, call_why):
            return name
    return None


def ap_fused_moe(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: APMoEWeights,
    w2: APMoEWeights,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    backend: Backend = "auto",
    configs: Optional[tuple[APKernelConfig, APKernelConfig]] = None,
    use_asm: Optional[bool] = None,
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """Routed MoE over AP experts: sum_s w[t,s] * down_e(act(gate_e x_t) * up_e x_t), e = topk_ids[t,s].

    `activation`: the gate's, "silu" (SwiGLU) or "gelu" (Gemma-4), on every kernel (activation.py).

    hidden [M, H] bf16/fp16/fp32, topk_weights [M, k] fp32, topk_ids [M, k] int32/int64 -> [M, H] in
    hidden's dtype. Expert bitwidths, tables and planes are read from w13/w2's page tables at run time.
    `configs` overrides the (w13, w2) launch configs; `use_asm` (default: on for CUDA) selects the
    packed-half2 inline PTX (False runs the plain-Triton emulation of the same arithmetic). Passing
    `configs` selects the tile kernels unless kernel="lut".
    """
    check_moe_args(hidden, topk_weights, topk_ids, w13, w2, activation)
    path = _pick_backend(hidden, backend)
    _check_kernel(kernel, path)
    if path == "reference":
        return ap_fused_moe_reference(
            hidden, topk_weights, topk_ids, w13, w2,
            activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
        )
    m, topk = topk_ids.shape
    name = auto_moe_kernel(m, topk, w13, w2, on_cuda=hidden.is_cuda, kernel=kernel, explicit_config=configs is not None,
                           apply_router_weight_on_input=apply_router_weight_on_input)
    if name is not None:
        if m == 0:
            return torch.zeros_like(hidden)
        if name == "grouped":
            from pagedweight.kernels.cuda_grouped import ap_fused_moe_grouped as fused_moe
        elif name == "fold":
            from pagedweight.kernels.cuda_fold import ap_fused_moe_fold as fused_moe
        elif name == "mma":
            from pagedweight.kernels.cuda_mma import ap_fused_moe_mma as fused_moe
        else:
            from pagedweight.kernels.cuda_lut import ap_fused_moe_lut as fused_moe
        return fused_moe(hidden, topk_weights, topk_ids, w13, w2, activation=activation,
                         apply_router_weight_on_input=apply_router_weight_on_input)
    from pagedweight.kernels.triton_moe import ap_fused_moe_triton, compute_dtype

    w13.check_triton_supported("w13")
    w2.check_triton_supported("w2")
    if configs is None:
        sms = torch.cuda.get_device_properties(hidden.device).multi_processor_count if hidden.is_cuda else 132
        configs = default_moe_configs(
            m, topk, w13.num_experts, w2.K, w2.N, (w13.K, w13.bcq_group), (w2.K, w2.bcq_group), num_sms=sms
        )
    if m == 0:
        return torch.zeros_like(hidden)
    sglang_cfgs = None
    if configs[0].dequant_chunk > 0 and configs[0].dense_gemm == "sglang":
        # SGLang's kernel runs the prefill GEMMs with its own config; both share our alignment, so its
        # BLOCK_SIZE_M sets the alignment's block size
        from pagedweight.kernels.sglang_dense_moe import sglang_moe_configs

        sglang_cfgs = sglang_moe_configs(m, w13.num_experts, w2.K, w2.N, topk, compute_dtype(hidden.dtype))
        configs = tuple(replace(c, block_m=sglang_cfgs.block_m) for c in configs)
    align = moe_align_block_size(topk_ids, configs[0].block_m, w13.num_experts)
    return ap_fused_moe_triton(
        hidden.contiguous(), topk_weights.contiguous(), topk_ids, w13, w2, align, configs[0], configs[1],
        apply_router_weight_on_input=apply_router_weight_on_input,
        use_asm=hidden.is_cuda if use_asm is None else use_asm, sglang_configs=sglang_cfgs, activation=activation,
    )


def ap_linear(
    x: torch.Tensor,
    w: APMoEWeights,
    *,
    row: int = 0,
    bias: Optional[torch.Tensor] = None,
    backend: Backend = "auto",
    config: Optional[APKernelConfig] = None,
    use_asm: Optional[bool] = None,
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """y = x @ W^T (+ bias) for the AP block in page-table row `row` of `w` (x [M, K] -> [M, N])."""
    if x.dim() != 2 or x.shape[1] != w.K:
        raise ValueError(f"x must be [M, K={w.K}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16/fp16/fp32, got {x.dtype}")
    if not 0 <= row < w.num_experts:
        raise ValueError(f"row {row} outside the page table's {w.num_experts} rows")
    if bias is not None and tuple(bias.shape) != (w.N,):
        raise ValueError(f"bias must be [N={w.N}], got {tuple(bias.shape)}")
    if kernel == "grouped":
        raise ValueError("kernel='grouped' serves the MoE layer (ap_fused_moe) only; a dense linear takes "
                         "'auto', 'tiles', 'lut', 'mma' or 'fold'")
    path = _pick_backend(x, backend)
    _check_kernel(kernel, path)
    if path == "reference":
        return ap_linear_reference(x, w, row=row, bias=bias)
    # the MMA and fold kernels serve a dense linear when asked (kernel="mma" / "fold"); they are not timed
    # against the tiles on dense shapes yet, so "auto" keeps the measured LUT / tiles / dequantization rules
    if _use_cuda_kernel("fold", kernel, x.is_cuda, (w,), False, config is not None):
        from pagedweight.kernels.cuda_fold import ap_linear_fold

        if x.shape[0] == 0:
            return x.new_zeros(0, w.N)
        return ap_linear_fold(x, w, row, bias)
    if _use_cuda_kernel("mma", kernel, x.is_cuda, (w,), False, config is not None):
        from pagedweight.kernels.cuda_mma import ap_linear_mma

        if x.shape[0] == 0:
            return x.new_zeros(0, w.N)
        return ap_linear_mma(x, w, row, bias)
    if _use_cuda_kernel("lut", kernel, x.is_cuda, (w,), 0 < x.shape[0] <= LINEAR_LUT_MAX_M, config is not None):
        from pagedweight.kernels.cuda_lut import ap_linear_lut

        if x.shape[0] == 0:
            return x.new_zeros(0, w.N)
        return ap_linear_lut(x, w, row, bias)
    from pagedweight.kernels.triton_linear import ap_linear_triton

    w.check_triton_supported("linear")
    if x.shape[0] == 0:
        return x.new_zeros(0, w.N)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
    cfg = config or default_linear_config(x.shape[0], w.N, w.K, w.bcq_group, num_sms=sms)
    return ap_linear_triton(x.contiguous(), w, row, bias, cfg, use_asm=x.is_cuda if use_asm is None else use_asm)
