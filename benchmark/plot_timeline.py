"""Plot what a PagedWeight server did over time, from a pressure_bench / longbench_pressure results JSON.

For every system with a PagedWeight timeline: top, the committed bitwidth of every block (rows: layer-major,
then expert, w13 above w2) against time; bottom, KV bytes vs expert-weight bytes and the KV capacity.

    python benchmark/plot_timeline.py docs/results/longbench.json --out docs/results/longbench_timeline.png
    python benchmark/plot_timeline.py docs/results/pressure.json --slim docs/results/pressure.json

`--slim OUT` also writes a copy of the JSON without the per-block strings (what goes into git).
Needs matplotlib (not a dependency of the package: `pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paged = [s for s in doc["systems"] if any(x.get("block_bits") for x in s.get("timeline") or [])]
    if not paged:
        raise SystemExit("no PagedWeight timeline with block bitwidths in this file")
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
        ax2.plot(t, [s["kv_bytes"] / 2**30 for s in tl], label="KV bytes (GiB)")
        ax2.plot(t, [s["weight_bytes"] / 2**30 for s in tl], label="expert weight bytes (GiB)")
        ax2.plot(t, [(s["kv_bytes"] + s["weight_bytes"]) / 2**30 for s in tl], "--", label="sum")
        ax2.set_xlabel("seconds since the server was ready")
        ax2.set_ylabel("GiB")
        ax2.legend(loc="best", fontsize=8)
        ax3 = ax2.twinx()
        ax3.plot(t, [s["mean_bits"] for s in tl], color="gray", alpha=0.5, label="mean bits")
        ax3.set_ylabel("mean committed bits")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


def slim(doc: dict[str, Any]) -> dict[str, Any]:
    """The same results without per-block strings and block keys (they are in the figure)."""
    out = json.loads(json.dumps(doc))
    for s in out["systems"]:
        s.pop("block_keys", None)
        for x in s.get("timeline") or []:
            x.pop("block_bits", None)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, default=None, help="PNG to write (default: next to the JSON)")
    p.add_argument("--slim", type=Path, default=None)
    a = p.parse_args()
    doc = json.loads(a.results.read_text())
    plot(doc, a.out or a.results.with_name(a.results.stem + "_timeline.png"))
    if a.slim:
        a.slim.write_text(json.dumps(slim(doc), indent=1))
        print(f"wrote {a.slim}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
