"""KV-cache pressure signal, evaluated once per scheduler iteration in O(1).

Free KV blocks F_blk = allocator available + radix-cache evictable (both in blocks of `page_size`
tokens). Below the threshold T_blk the weights must give memory to the KV cache:

    D = max(0, T_blk + 1 - F_blk) * B_KV          (PagedWeight's offload target, bytes)

Reloads need the opposite with hysteresis, so the system does not oscillate around T_blk: the relax
signal fires after F_blk stayed above T_hi (> T_blk) for `relax_checks` consecutive iterations, and then
the streak starts over, so a long quiet period yields one relax every `relax_checks` iterations. Its
`relax_bytes = (F_blk - T_hi) * B_KV` is the KV memory that could go back to the weights while keeping
T_hi blocks free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PressureReading:
    free_blocks: int
    target_bytes: int  # D; > 0 means offload now
    relax: bool
    relax_bytes: int  # > 0 only when relax


class KVPressureSignal:
    def __init__(self, threshold_blocks: int, bytes_per_block: int, relax_blocks: int, relax_checks: int = 8) -> None:
        if threshold_blocks < 0:
            raise ValueError(f"threshold_blocks (T_blk) must be >= 0, got {threshold_blocks}")
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block (B_KV) must be positive, got {bytes_per_block}")
        if relax_blocks <= threshold_blocks:
            raise ValueError(
                f"relax_blocks (T_hi={relax_blocks}) must exceed threshold_blocks (T_blk={threshold_blocks}) "
                "to leave a hysteresis band"
            )
        if relax_checks < 1:
            raise ValueError(f"relax_checks must be >= 1, got {relax_checks}")
        self.threshold_blocks = threshold_blocks
        self.bytes_per_block = bytes_per_block
        self.relax_blocks = relax_blocks
        self.relax_checks = relax_checks
        self._streak = 0
        self.checks = 0
        self.offload_signals = 0
        self.relax_signals = 0

    def update(self, available_blocks: int, evictable_blocks: int = 0, waiting_blocks: int = 0) -> PressureReading:
        """`waiting_blocks`: KV blocks a waiting request lacks (queue-aware pressure); they count as used, so
        free may go negative and the target grows by them."""
        if available_blocks < 0 or evictable_blocks < 0 or waiting_blocks < 0:
            raise ValueError(
                f"block counts must be >= 0, got {available_blocks} + {evictable_blocks} free, {waiting_blocks} waiting"
            )
        self.checks += 1
        free = available_blocks + evictable_blocks - waiting_blocks
        target = max(0, self.threshold_blocks + 1 - free) * self.bytes_per_block
        if target:
            self.offload_signals += 1
        self._streak = self._streak + 1 if free > self.relax_blocks else 0
        relax = self._streak >= self.relax_checks
        if relax:
            self._streak = 0
            self.relax_signals += 1
        relax_bytes = (free - self.relax_blocks) * self.bytes_per_block if relax else 0
        return PressureReading(max(free, 0), target, relax, relax_bytes)
