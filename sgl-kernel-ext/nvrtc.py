"""NVRTC builds of this folder's CUDA sources, from torch's CUDA wheels (no CUDA toolkit needed)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.M)


def source_text(source: Path) -> str:
    """The source with each `#include "name"` of a file next to it pasted in (NVRTC gets no include path)."""
    return _LOCAL_INCLUDE.sub(lambda m: (source.parent / m.group(1)).read_text(), source.read_text())


def compile_cubin(source: Path, name: str, compute_capability: str, defines: list[str]) -> bytes:
    """One kernel of `source` compiled without a device: the CI check that every variant builds."""
    from torch.cuda._utils import _nvrtc_compile

    cubin, _ = _nvrtc_compile(source_text(source), name, compute_capability, nvcc_options=list(defines))
    return cubin


def load_kernel(source: Path, name: str, defines: list[str], device_index: int, compute_capability: str | None = None):
    """One kernel of `source` compiled and loaded on a device (~1 s; callers cache it per variant). A
    `compute_capability` such as "90a" selects the architecture-specific target (wgmma); None: the device's."""
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(source_text(source), name, compute_capability=compute_capability,
                                          nvcc_options=list(defines))


@functools.lru_cache(maxsize=None)
def cached_kernel(source: Path, name: str, defines: tuple[str, ...], device_index: int, shared_bytes: int = 0,
                  compute_capability: str | None = None):
    """load_kernel once per (source, kernel, variant, device) and process; `shared_bytes` above the default 48 KB
    also raises the kernel's dynamic shared-memory limit."""
    kernel = load_kernel(source, name, list(defines), device_index, compute_capability)
    if shared_bytes > 48 * 1024:
        kernel.set_shared_memory_config(shared_bytes)
    return kernel
