"""NVRTC builds of this folder's CUDA sources, from torch's CUDA wheels (no CUDA toolkit needed)."""

from __future__ import annotations

from pathlib import Path

import torch


def compile_cubin(source: Path, name: str, compute_capability: str, defines: list[str]) -> bytes:
    """One kernel of `source` compiled without a device: the CI check that every variant builds."""
    from torch.cuda._utils import _nvrtc_compile

    cubin, _ = _nvrtc_compile(source.read_text(), name, compute_capability, nvcc_options=list(defines))
    return cubin


def load_kernel(source: Path, name: str, defines: list[str], device_index: int):
    """One kernel of `source` compiled and loaded on a device (~1 s; callers cache it per variant)."""
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(source.read_text(), name, nvcc_options=list(defines))
