"""NVRTC builds of this folder's CUDA sources, from torch's CUDA wheels (no CUDA toolkit needed)."""

from __future__ import annotations

import ctypes
import functools
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

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


# torch's launcher refuses 48 KB of dynamic shared memory and more unless the kernel's limit was raised first
SHARED_OPTIN_FROM = 48 * 1024


@functools.lru_cache(maxsize=None)
def cached_kernel(source: Path, name: str, defines: tuple[str, ...], device_index: int, shared_bytes: int = 0,
                  compute_capability: str | None = None):
    """load_kernel once per (source, kernel, variant, device) and process; `shared_bytes` of 48 KB or more also
    raises the kernel's dynamic shared-memory limit (SHARED_OPTIN_FROM)."""
    kernel = load_kernel(source, name, list(defines), device_index, compute_capability)
    if shared_bytes >= SHARED_OPTIN_FROM:
        kernel.set_shared_memory_config(shared_bytes)
    return kernel


def build_in_parallel(builds: list[Callable[[], object]], device_index: int, workers: int = 16) -> list:
    """Run kernel builds (NVRTC, then the module load) on a thread pool: NVRTC releases the GIL. A new thread has no
    current CUDA context, and loading a module needs one, so each worker first makes the device's primary context
    (the one torch uses) current."""
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    libcuda = _get_gpu_runtime_library()
    with torch.cuda.device(device_index):
        torch.cuda.synchronize()  # the primary context exists and is current here
        ctx = ctypes.c_void_p()
        _check_cuda(libcuda.cuCtxGetCurrent(ctypes.byref(ctx)))

    def run(build):
        _check_cuda(libcuda.cuCtxSetCurrent(ctx))
        return build()

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(builds)))) as pool:
        return list(pool.map(run, builds))


# cuLaunchKernelEx's configuration (cuda.h, CUDA 12): the grid, the block, the stream and a list of attributes
class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


def launch(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], args: list, shared_mem: int = 0,
           pdl: bool = False) -> None:
    """Launch a loaded kernel on the current stream; `pdl` launches it as a programmatic dependent of the kernel before
    it (it may start while that one finishes, and must `griddepcontrol.wait` before reading its outputs). Without
    `pdl` this is the kernel's own launch."""
    if not pdl:
        kernel(grid=grid, block=block, args=args, shared_mem=shared_mem)
        return
    keep, params = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_cuda:
                raise ValueError("kernel tensor arguments must be CUDA tensors")
            v = ctypes.c_void_p(a.data_ptr())
        elif isinstance(a, bool) or not isinstance(a, int):
            raise TypeError(f"kernel arguments are CUDA tensors or ints, got {type(a).__name__}")
        else:
            v = ctypes.c_int(a)
        keep.append(v)
        params.append(ctypes.cast(ctypes.byref(v), ctypes.c_void_p))
    param_array = (ctypes.c_void_p * len(params))(*params)
    attr = _LaunchAttribute(id=_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), ctypes.pointer(attr), 1)
    libcuda = torch.cuda._utils._get_gpu_runtime_library()
    rc = libcuda.cuLaunchKernelEx(ctypes.byref(cfg), kernel.func, param_array, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUDA driver error {rc}")
