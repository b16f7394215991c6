"""A PNG of what a PagedWeight server did over time, from a timeline of `StateSample`s (state_sampler.py).

For every system with block bitwidths in its timeline: top, the committed bitwidth of every block (rows:
layer-major, then expert, w13 above w2) against time; bottom, KV bytes vs expert-weight bytes and the mean
committed bitwidth. `doc` is a results JSON's shape: {"systems": [{"system", "timeline", "block_keys"}, ...]}.
Needs matplotlib (`pip install 'pagedweight[demo]'`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def require_matplotlib():
    """matplotlib, or a one-line error that names the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the timeline PNG needs matplotlib: pip install 'pagedweight[demo]' (or matplotlib)") from None
    return matplotlib


def bits_matrix(system: dict[str, Any]) -> tuple[list[float], list[list[int]]]:
    """Times and, per time, the committed bits of every block (unchanged samples carry the last string)."""
    times, rows, last = [], [], None
    for s in system.get("timeline") or []:
        if s.get("block_bits"):
            last = s["block_bits"]
        if last is None:
            continue
        times.append(s["t_s"])
        rows.append([int(c) for c in last])
    return times, rows


def plot(doc: dict[str, Any], out: Path) -> None:
    matplotlib = require_matplotlib()

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paged = [s for s in doc["systems"] if any(x.get("block_bits") for x in s.get("timeline") or [])]
    if not paged:
        raise ValueError("no PagedWeight timeline with block bitwidths to plot")
    fig, axes = plt.subplots(2, len(paged), figsize=(7 * len(paged), 7), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]})
    for col, sysd in enumerate(paged):
        times, rows = bits_matrix(sysd)
        m = np.array(rows).T  # blocks x time
        ax = axes[0][col]
        im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis", vmin=2, vmax=8,
                       extent=[times[0], times[-1], m.shape[0], 0])
        keys = sysd.get("block_keys") or []
        if keys:
            layers = sorted({k[0] for k in keys})
            step = max(1, len(layers) // 8)
            ticks = [next(i for i, k in enumerate(keys) if k[0] == layer) for layer in layers[::step]]
            ax.set_yticks(ticks, [f"L{layers[::step][i]}" for i in range(len(ticks))])
        ax.set_title(f"{sysd['system']}: committed bits per block (layer, expert, proj)")
        fig.colorbar(im, ax=ax, label="bits")
        ax2 = axes[1][col]
        tl = [s for s in sysd["timeline"] if s.get("kv_bytes") is not None]
        t = [s["t_s"] for s in tl]
        top = max((s["kv_bytes"] + s["weight_bytes"] for s in tl), default=0)
        unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)  # a tiny model's bytes in MiB
        ax2.plot(t, [s["kv_bytes"] / scale for s in tl], label=f"KV bytes ({unit})")
        ax2.plot(t, [s["weight_bytes"] / scale for s in tl], label=f"expert weight bytes ({unit})")
        ax2.plot(t, [(s["kv_bytes"] + s["weight_bytes"]) / scale for s in tl], "--", label="sum")
        ax2.set_xlabel("seconds since the server was ready")
        ax2.set_ylabel(unit)
        ax2.legend(loc="best", fontsize=8)
        ax3 = ax2.twinx()
        ax3.plot(t, [s["mean_bits"] for s in tl], color="gray", alpha=0.5, label="mean bits")
        ax3.set_ylabel("mean committed bits")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
