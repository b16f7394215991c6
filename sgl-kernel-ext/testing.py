"""Random AP projections at real shapes, for tests and benchmarks (values are plausible, not trained).

Planes are uniform random bits. bcq tables: alpha_p ~ scale * 2**-p * U(0.5, 1.5), offsets ~ N(0, scale/10),
scale = 1/sqrt(K); k-means LUTs: sorted N(0, scale) values per row. Speed does not depend on values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pagedweight.kernels.weights import APMoEWeights, build_ap_moe_weights


@dataclass
class RandomAPProjection:
    planes: list[list[torch.Tensor]]  # [expert][plane] -> [N, K/8] uint8
    tables: list[dict[int, torch.Tensor]]  # [expert][bits] -> table
    weights: APMoEWeights  # page table at `bits`

    def recommit(self, bits: Sequence[int]) -> APMoEWeights:
        """Weights whose page table points at the given per-expert bitwidths."""
        w = self.weights
        return build_ap_moe_weights(
            self.planes, [t[b] for t, b in zip(self.tables, bits)], list(bits),
            table_kind=w.table_kind, group_size=w.group_size, bits_max=w.bits_max,
        )


def random_table(n: int, k: int, bits: int, kind: str, group_size: int, gen: torch.Generator) -> torch.Tensor:
    """A random table on gen's device."""
    scale = k**-0.5
    dev = gen.device
    if kind == "bcq":
        g = k // group_size
        alpha = torch.rand(bits, n, g, generator=gen, device=dev) + 0.5
        alpha *= scale * (0.5 ** torch.arange(bits, dtype=torch.float32, device=dev))[:, None, None]
        off = torch.randn(1, n, g, generator=gen, device=dev) * (scale / 10)
        return torch.cat([alpha, off]).to(torch.float16)
    if kind == "ubcq":  # scale of the lowest plane (the top plane's coefficient is scale * 2^(bits-1)), offset
        g = k // group_size
        step = (torch.rand(1, n, g, generator=gen, device=dev) + 0.5) * (scale * 0.5 ** (bits - 1))
        off = torch.randn(1, n, g, generator=gen, device=dev) * (scale / 10)
        return torch.cat([step, off]).to(torch.float16)
    lut = torch.sort(torch.randn(n, 2**bits, generator=gen, device=dev) * scale, dim=-1).values
    return lut.to(torch.float16)


def random_ap_projection(
    num_experts: int, n: int, k: int, bits: Sequence[int], *, table_kind: str = "bcq", group_size: int = 128,
    bits_max: int = 8, bits_min: int | None = None, seed: int = 0, device: torch.device | str = "cpu",
) -> RandomAPProjection:
    """Experts with every plane resident and tables for bits_min..bits_max; page table at `bits`."""
    if len(bits) != num_experts:
        raise ValueError(f"need one bitwidth per expert, got {len(bits)} for {num_experts}")
    gen = torch.Generator(device=device).manual_seed(seed)  # generate in place: GBs at real shapes
    lo = min(bits) if bits_min is None else bits_min
    planes, tables = [], []
    for _ in range(num_experts):
        pl = torch.randint(0, 256, (bits_max, n, k // 8), dtype=torch.uint8, generator=gen, device=device)
        planes.append([pl[p] for p in range(bits_max)])
        tables.append({b: random_table(n, k, b, table_kind, group_size, gen) for b in range(lo, bits_max + 1)})
    weights = build_ap_moe_weights(
        planes, [t[b] for t, b in zip(tables, bits)], list(bits),
        table_kind=table_kind, group_size=group_size, bits_max=bits_max,
    )
    return RandomAPProjection(planes=planes, tables=tables, weights=weights)
