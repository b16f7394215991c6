"""CUDA timing shared by the benchmarks (benchmark/): CUDA events around each run, an L2 flush before it, warm-up and
capture of a CUDA graph, and the summary of the times. One place, so every benchmark times the same way."""

from __future__ import annotations

import statistics
from typing import Callable, Optional

import torch

FLUSH_BYTES = 256 << 20  # more than the H200's 50 MB L2: zeroing it before a run makes the run read from HBM


def summarize_us(times_us: list[float]) -> dict:
    """median, min, p10, p90 and the count of a list of microsecond times."""
    if not times_us:
        raise ValueError("no times to summarize")
    ts = sorted(times_us)
    n = len(ts)
    return dict(median=statistics.median(ts), min=ts[0], p10=ts[int(0.1 * (n - 1))], p90=ts[int(0.9 * (n - 1))], reps=n)


def flush_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)


def cuda_setup() -> tuple[torch.device, int, torch.Tensor]:
    """(the CUDA device, its SM count, the buffer time_cuda zeroes to flush L2 before each run)."""
    dev = torch.device("cuda")
    return dev, torch.cuda.get_device_properties(dev).multi_processor_count, flush_buffer(dev)


def time_cuda(run: Callable[[], object], reps: int, flush: Optional[torch.Tensor] = None) -> dict:
    """summarize_us of `reps` runs timed by CUDA events on the current stream (`flush` zeroed before each)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    return summarize_us([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])


def capture_graph(call: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """A CUDA graph of call(), after `warmup` calls on a side stream (compiles and allocator work stay outside the
    capture) and followed by three replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_time(call: Callable[[], object], reps: int, flush: Optional[torch.Tensor]) -> dict:
    """time_cuda of the replays of call()'s CUDA graph."""
    return time_cuda(capture_graph(call).replay, reps, flush)


def replay_median_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median microseconds of one replay of a captured graph (no flush)."""
    return time_cuda(graph.replay, reps)["median"]
