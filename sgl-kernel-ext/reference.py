"""Torch reference of the AP MoE and AP linear kernels: the correctness oracle and the CPU path.

Each used expert is dequantized with `pagedweight.format.layout.dequantize` from what its page-table row
says (bitwidth, table, planes), then the MoE is computed in float32:

    out[t] = sum_s w[t, s] * W2_e (act(W1_e[:I] x_t) * W1_e[I:] x_t),  e = topk_ids[t, s]

(act: SiLU, or GELU for Gemma-4: activation.py)

Addresses are turned back into tensors with `weights.resident(e)` when given (its data_ptrs must equal
the row: a stale view is an error), otherwise, for CPU page tables only, by reading the addressed host
memory directly (the same trust the Triton kernel places in the table).
"""

from __future__ import annotations

import ctypes

import torch

from pagedweight.format.layout import dequantize
from pagedweight.kernels.activation import check_activation, gate_act
from pagedweight.kernels.weights import PT_BITS, PT_PLANES, PT_TABLE, APMoEWeights


def _host_tensor(addr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if addr == 0:
        raise ValueError("page table row points to address 0 (plane or table not resident)")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    buf = (ctypes.c_char * nbytes).from_address(addr)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def expert_tensors(w: APMoEWeights, e: int) -> tuple[int, list[torch.Tensor], torch.Tensor]:
    """(q, planes[:q], table) of expert e as the page table row describes them."""
    row = [int(v) for v in w.page_table[e].tolist()]
    q = row[PT_BITS]
    if not 1 <= q <= w.bits_max:
        raise ValueError(f"expert {e}: committed bitwidth {q} outside 1..{w.bits_max}")
    table_addr, plane_addrs = row[PT_TABLE], row[PT_PLANES : PT_PLANES + q]
    if w.resident is not None:
        planes, table = w.resident(e)
        planes = list(planes)[:q]
        got = [t.data_ptr() for t in planes]
        if len(planes) < q or got != plane_addrs or table.data_ptr() != table_addr:
            raise ValueError(
                f"expert {e}: the resident view does not match page-table row {row} "
                f"(view planes {got}, table {table.data_ptr()}); rebuild the view after moving planes"
            )
        if tuple(table.shape) != w.table_shape(q):
            raise ValueError(f"expert {e}: {q}-bit table has shape {tuple(table.shape)}, expected {w.table_shape(q)}")
        return q, planes, table
    if w.page_table.is_cuda:
        raise ValueError("a CUDA page table needs weights.resident to be read back on the host")
    planes = [_host_tensor(a, (w.N, w.K // 8), torch.uint8) for a in plane_addrs]
    return q, planes, _host_tensor(table_addr, w.table_shape(q), torch.float16)


def dequantize_expert(w: APMoEWeights, e: int) -> torch.Tensor:
    """W_e at its committed bitwidth, float32 [N, K]."""
    q, planes, table = expert_tensors(w, e)
    stacked = torch.stack([p.to(table.device) for p in planes])
    return dequantize(stacked, table, q, w.table_kind, w.group_size)


def ap_linear_reference(x: torch.Tensor, w: APMoEWeights, *, row: int = 0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W_row^T (+ bias) in float32, returned in x's dtype."""
    wt = dequantize_expert(w, row).to(x.device)
    y = x.float() @ wt.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def ap_fused_moe_reference(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: APMoEWeights,
    w2: APMoEWeights,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    check_moe_args(hidden, topk_weights, topk_ids, w13, w2, activation)
    inter = w2.K
    x = hidden.float()
    ids = topk_ids.long()
    tw = topk_weights.float()
    out = torch.zeros(hidden.shape[0], w2.N, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < w13.num_experts:
            continue  # non-local expert (expert parallelism): contributes nothing, as in SGLang
        tok, slot = (ids == e).nonzero(as_tuple=True)
        rw = tw[tok, slot][:, None]
        xe = x[tok] * rw if apply_router_weight_on_input else x[tok]
        h = xe @ dequantize_expert(w13, e).to(x.device).t()
        a = gate_act(h[:, :inter], activation) * h[:, inter:]
        y = a @ dequantize_expert(w2, e).to(x.device).t()
        out.index_add_(0, tok, y if apply_router_weight_on_input else y * rw)
    return out.to(hidden.dtype)


def check_moe_args(hidden, topk_weights, topk_ids, w13: APMoEWeights, w2: APMoEWeights, activation: str) -> None:
    """Shape/dtype checks shared by the reference and the Triton path (no device sync)."""
    check_activation(activation)
    if hidden.dim() != 2 or hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hidden must be [M, H] bf16/fp16/fp32, got {hidden.dtype} {tuple(hidden.shape)}")
    m = hidden.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids/topk_weights must both be [M={m}, k], got {tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if w13.K != hidden.shape[1]:
        raise ValueError(f"w13 in_features {w13.K} != hidden size {hidden.shape[1]}")
    if w13.N != 2 * w2.K or w2.N != hidden.shape[1]:
        raise ValueError(
            f"w13 must be [2*I, H] and w2 [H, I]: got w13 N={w13.N} K={w13.K}, w2 N={w2.N} K={w2.K}, H={hidden.shape[1]}"
        )
    if w13.num_experts != w2.num_experts:
        raise ValueError(f"w13 has {w13.num_experts} experts, w2 has {w2.num_experts}")
