"""Merge systems from several pressure_bench / longbench_pressure results files into one (same machine, same
flags), e.g. when one system was re-run after a fix or in a later device call.

    python benchmark/merge_runs.py --kind pressure --out docs/results/pressure.json \\
        runA.json:static_bf16,pagedweight runB.json:pagedweight_poison --superseded runA.json:pagedweight_poison \\
        --note "why"

Each input is FILE:SYSTEM[,SYSTEM...]. `--superseded` systems are kept under "superseded" (with the note), not
in the comparison. For --kind pressure the headline is recomputed from the merged systems.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _pick(spec: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    path, _, names = spec.rpartition(":")
    doc = json.loads(Path(path).read_text())
    wanted = names.split(",")
    by = {s["system"]: s for s in doc["systems"]}
    missing = [n for n in wanted if n not in by]
    if missing:
        raise SystemExit(f"{path} has no system(s) {missing}; it has {sorted(by)}")
    return doc, [dict(by[n], source_command=doc.get("command"), source_date_utc=doc.get("date_utc")) for n in wanted]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="FILE:SYSTEM[,SYSTEM...]")
    p.add_argument("--kind", choices=("pressure", "longbench"), required=True)
    p.add_argument("--superseded", nargs="*", default=[])
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    docs, systems = [], []
    for spec in a.inputs:
        doc, picked = _pick(spec)
        docs.append(doc)
        systems += picked
    merged = {k: v for k, v in docs[0].items() if k not in ("systems", "headline", "command")}
    merged["commands"] = sorted({d["command"] for d in docs})
    merged["merge_command"] = "python " + " ".join(sys.argv)
    merged["systems"] = systems
    if a.superseded:
        merged["superseded"] = [s for spec in a.superseded for s in _pick(spec)[1]]
        merged["superseded_note"] = a.note
    if a.kind == "pressure":
        from pressure_bench import headline

        merged = {"headline": headline(systems), **merged}
    a.out.write_text(json.dumps(merged, indent=1))
    print(f"wrote {a.out}" + (f": headline {merged['headline']}" if "headline" in merged else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
