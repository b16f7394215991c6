"""Shared pieces of the CUDA kernel tests (test_kernel_lut.py, test_kernel_mma.py, ...): parallel NVRTC builds, the
error measure, the tolerance per activation dtype, the routings, and the CUDA-graph replay over rewritten page
tables."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from pagedweight.kernels import ap_fused_moe
from pagedweight.kernels.reference import ap_fused_moe_reference


def compile_in_parallel(jobs: list[Callable[[], bytes]]) -> list[bytes]:
    """The NVRTC builds `jobs` (each returns a cubin) on every core, in job order: NVRTC releases the GIL, so the CPU
    compile checks of many kernel variants take a fraction of their serial time."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda job: job(), jobs))


def ptxas_report(source: Path, name: str, compute_capability: str, defines: list[str]) -> str:
    """NVRTC's log of one kernel built with `ptxas -v`: its registers, spills and the assembler's performance
    warnings (such as wgmma serialization, C7510), which a successful build otherwise drops."""
    import ctypes

    from torch.cuda._utils import _get_gpu_rtc_library
    from torch.utils.cpp_extension import include_paths

    from pagedweight.kernels.nvrtc import source_text

    lib = _get_gpu_rtc_library()
    # a define no source reads, unique per call: an identical program may come from a compile cache with no ptxas
    # log (seen on the GPU machine: the second identical build's log was empty)
    nonce = f"-DPTXAS_REPORT_NONCE={uuid.uuid4().int & 0xFFFFFFFF}"
    opts = [f"--gpu-architecture=sm_{compute_capability}", *(f"-I{p}" for p in include_paths("cuda")), *defines,
            nonce, "--ptxas-options=-v"]
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source_text(source).encode(), f"{name}.cu".encode(), 0, None,
                                  None) == 0
    try:
        lib.nvrtcAddNameExpression(prog, name.encode())
        res = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts)))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    if res != 0:
        raise RuntimeError(f"{name}: NVRTC build failed:\n{log.value.decode()}")
    text = log.value.decode()
    if f"entry function '{name}'" not in text:
        raise RuntimeError(f"{name}: NVRTC built it but its log has no ptxas report ({len(text)} characters): "
                           f"{text[:300]!r}")
    return text


def assert_cubins(cubins: list[bytes]) -> None:
    assert cubins and all(c[:4] == b"\x7fELF" for c in cubins), "NVRTC did not return a cubin"


def sass_of(cubin: bytes) -> str:
    """The SASS of a cubin, by the cuobjdump that ships with triton's NVIDIA backend (or one on PATH)."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(bundled) if bundled.exists() else shutil.which("cuobjdump")
    if tool is None:
        raise RuntimeError("no cuobjdump: neither triton's NVIDIA backend nor PATH has one")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().cpu(), ref.float().cpu()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def tol(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 5e-3


# (experts, top-k, tokens, routing pattern) of the MoE reference tests: one token, a few, one expert taking all, 60
# experts at top 4, top 8, and more pairs than a block of slots
MOE_REFERENCE_CASES = [(8, 2, 1, "random"), (8, 2, 4, "random"), (8, 1, 3, "one_expert"), (60, 4, 1, "random"),
                       (60, 4, 16, "random"), (16, 8, 5, "one_expert"), (8, 2, 40, "random"), (4, 2, 70, "one_expert")]


def mixed_bits(num_experts: int) -> tuple[list[int], list[int]]:
    """Per-expert bitwidths of w13 and w2 cycling through every bitwidth 1..8 (offset by 3), mixed in one launch."""
    return [1 + (e % 8) for e in range(num_experts)], [1 + ((e + 3) % 8) for e in range(num_experts)]


def check_moe_dtypes(p13, p2, tw: torch.Tensor, ids: torch.Tensor, m: int, hidden: int, kernel: str) -> None:
    """`ap_fused_moe(kernel=...)` against the fp32 reference for bf16, fp16 and fp32 activations, with the routing
    weight applied after w2 and on the input: the output keeps the input's dtype and shape, within tol(dtype)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(m, hidden, device="cuda").to(dtype)
        for apply_w_in in (False, True):
            ref = ap_fused_moe_reference(x.float(), tw, ids, p13.weights, p2.weights,
                                         apply_router_weight_on_input=apply_w_in)
            out = ap_fused_moe(x, tw, ids, p13.weights, p2.weights, kernel=kernel,
                               apply_router_weight_on_input=apply_w_in)
            assert out.dtype == dtype and out.shape == (m, hidden)
            assert rel_err(out, ref) < tol(dtype), (kernel, dtype, apply_w_in)


def routing(m: int, num_experts: int, topk: int, pattern: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) on CUDA: "random" distinct experts per token, or "one_expert" (slot 0 of every
    token -> the last expert; most experts get nothing)."""
    g = torch.Generator().manual_seed(seed)
    if pattern == "random":
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(m)])
    elif pattern == "one_expert":
        ids = torch.stack([torch.randperm(num_experts - 1, generator=g)[:topk] for _ in range(m)])
        ids[:, 0] = num_experts - 1
    else:
        raise ValueError(pattern)
    w = torch.rand(m, topk, generator=g) + 0.1
    return w.float().cuda(), ids.to(torch.int32).cuda()


def check_graph_replay(p13, p2, m: int, topk: int, kernel: str, bit_mixes, call=None, activation: str = "silu") -> None:
    """Capture ap_fused_moe(kernel=...) (or `call(x, tw, ids, w13, w2)`) once, then rewrite both page tables and
    replay: every replay must follow the rows it finds (no recapture)."""
    num_experts = p13.weights.num_experts
    tw, ids = routing(m, num_experts, topk, "random")
    x = torch.randn(m, p13.weights.K, device="cuda", dtype=torch.bfloat16)
    w13, w2 = p13.weights, p2.weights
    if call is None:
        def call(x, tw, ids, w13, w2):
            return ap_fused_moe(x, tw, ids, w13, w2, kernel=kernel)
    call(x, tw, ids, w13, w2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(x, tw, ids, w13, w2)
    for bits in bit_mixes:
        r13, r2 = p13.recommit(bits), p2.recommit(bits[::-1])
        w13.page_table.copy_(r13.page_table)
        w2.page_table.copy_(r2.page_table)
        graph.replay()
        torch.cuda.synchronize()
        ref = ap_fused_moe_reference(x.float(), tw, ids, r13, r2, activation=activation)
        assert rel_err(out, ref) < 2e-2, bits
