"""Plot what a PagedWeight server did over time, from a pressure_bench / longbench_pressure results JSON.

For every system with a PagedWeight timeline: top, the committed bitwidth of every block (rows: layer-major,
then expert, w13 above w2) against time; bottom, KV bytes vs expert-weight bytes and the KV capacity.

    python benchmark/plot_timeline.py docs/results/longbench.json --out docs/results/longbench_timeline.png
    python benchmark/plot_timeline.py docs/results/pressure.json --slim docs/results/pressure.json

`--slim OUT` also writes a copy of the JSON without the per-block strings (what goes into git).
Needs matplotlib (`pip install 'pagedweight[demo]'`); the plot itself is pagedweight.bench.timeline_plot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pagedweight.bench.timeline_plot import plot


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
    out = a.out or a.results.with_name(a.results.stem + "_timeline.png")
    plot(doc, out)
    print(f"wrote {out}")
    if a.slim:
        a.slim.write_text(json.dumps(slim(doc), indent=1))
        print(f"wrote {a.slim}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
