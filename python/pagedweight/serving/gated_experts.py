"""Routed MoE over AP experts whose gate is not SiLU (Gemma-4: GELU), one expert at a time through `ap_linear`.

The fused AP MoE kernels (sgl-kernel-ext, `ap_fused_moe`) compute SwiGLU experts only. A GELU-gated layer runs
here instead: for each expert that received tokens, h = W13_e x (the expert's page-table row, at its committed
bitwidth), a = act(h[:, :I]) * h[:, I:], y = W2_e a, summed with the routing weights. It reads the same page
tables as the fused kernels, so the pager, the planner and the bitwidths in force are unchanged; it costs one
host sync per layer (the used experts) and a launch pair per expert, so it is the correct path, not the fast one,
and it cannot be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# SGLang's MoE activation names -> the gate function (SGLang's "gelu" is gelu_and_mul: the erf form, as its Triton
# MoE runner and fused_moe_native use for Gemma-4)
GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu}


def ap_gated_moe_per_expert(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13,
    w2,
    *,
    activation: str,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """sum_s w[t, s] * W2_e(act(W1_e x_t) * W3_e x_t), e = topk_ids[t, s]; [M, H] in hidden's dtype.

    `w13` / `w2`: the layer's APMoEWeights (pagedweight.kernels). Expert ids outside the table (other ranks'
    experts under expert parallelism) contribute nothing, as in SGLang."""
    from pagedweight.kernels import ap_linear

    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"AP experts take the gate activations {sorted(GATE_ACTIVATIONS)}, got {activation!r}")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # the used experts are read back to the host (torch.unique): a graph would replay one step's expert set
        raise RuntimeError(f"PagedWeight error: {activation}-gated AP experts run expert by expert and cannot be captured "
                           "in a CUDA graph yet; start the server with --disable-cuda-graph")
    act = GATE_ACTIVATIONS[activation]
    inter = w2.K
    ids = topk_ids.long()
    out = torch.zeros(hidden.shape[0], w2.N, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < w13.num_experts:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        rw = topk_weights[tok, slot].float()[:, None]
        x = hidden[tok]
        if apply_router_weight_on_input:
            x = (x.float() * rw).to(hidden.dtype)
        h = ap_linear(x, w13, row=e).float()
        a = (act(h[:, :inter]) * h[:, inter:]).to(hidden.dtype)
        y = ap_linear(a, w2, row=e).float()
        out.index_add_(0, tok, y if apply_router_weight_on_input else y * rw)
    return out.to(hidden.dtype)
