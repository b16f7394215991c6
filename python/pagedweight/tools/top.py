"""`pagedweight top --url URL`: a live terminal view of one PagedWeight server.

Polls SGLang's `/get_server_info` (the runtime's state under `internal_states[rank].paged_weight`) and redraws:
the committed bitwidth of every expert block as a layer x expert heat map, bytes in weights / KV cache / free
budget, bitwidth transitions per second, the KV pressure signal against its offload and reload thresholds, and
the pager's queue. `--once` prints one frame and exits (scripts, tests, a tmux capture).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional

# committed bitwidth -> ANSI 256-colour background (cold blue at 1 bit .. hot red at 8), for --color
_COLOURS = {1: 17, 2: 18, 3: 25, 4: 31, 5: 37, 6: 142, 7: 208, 8: 196}


class TopError(RuntimeError):
    """A state that cannot be fetched or read; the CLI prints it as one line."""


@dataclass(frozen=True)
class Sample:
    state: dict
    at: float  # monotonic seconds when it was fetched


def fetch_state(url: str, rank: int = 0, timeout: float = 10.0) -> dict:
    """The `paged_weight` state of one scheduler (TP rank `rank`) from `url`/get_server_info."""
    endpoint = url.rstrip("/") + "/get_server_info"
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout) as resp:
            info = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise TopError(f"cannot read {endpoint}: {e} (is the server up? pass its address with --url)") from e
    states = info.get("internal_states") or []
    if not 0 <= rank < len(states):
        raise TopError(f"{endpoint} lists {len(states)} scheduler states; --rank {rank} is not one of them")
    state = states[rank].get("paged_weight")
    if not state:
        raise TopError(f"{url} serves no PagedWeight state: start it with --enable-paged-weight")
    return state


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (a tiny test model and an H200 alike)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:7.2f} {unit}"
    return f"{int(n):7d} B"


def heat_map(blocks: list, colour: bool = False, width: int = 120) -> list[str]:
    """One text row per layer: the committed bitwidth of each expert (the lowest over its projections), a digit
    per expert, wrapped to `width` columns; '.' for an expert without blocks."""
    by_cell: dict[tuple[int, int], int] = {}
    for layer, expert, _proj, committed, _desired in blocks:
        key = (int(layer), int(expert))
        by_cell[key] = min(by_cell.get(key, 99), int(committed))
    if not by_cell:
        return ["(no expert blocks)"]
    layers = sorted({k[0] for k in by_cell})
    experts = max(k[1] for k in by_cell) + 1
    per_line = max(8, width - 8)
    rows = []
    for layer in layers:
        cells = []
        for e in range(experts):
            bits = by_cell.get((layer, e))
            ch = "." if bits is None else str(bits)
            if colour and bits is not None:
                ch = f"\x1b[48;5;{_COLOURS.get(bits, 0)}m{ch}\x1b[0m"
            cells.append(ch)
        for start in range(0, experts, per_line):
            label = f"L{layer:<3d}" if start == 0 else "    "
            rows.append(f"{label} {''.join(cells[start:start + per_line])}")
    return rows


def render(now: Sample, before: Optional[Sample] = None, colour: bool = False, width: int = 120) -> str:
    """One frame of the view from the latest state (and the one before it, for rates)."""
    st = now.state
    counters = st.get("counters", {})
    transitions = int(counters.get("transitions", 0))
    rate = "-"
    if before is not None and now.at > before.at:
        earlier = int(before.state.get("counters", {}).get("transitions", 0))
        rate = f"{(transitions - earlier) / (now.at - before.at):.1f}/s"
    budget = st.get("budget", {})
    used = budget.get("used", {})
    kv_state = st.get("elastic_kv") or {}
    kv = st.get("kv", {})
    hist = " ".join(f"{b}b:{n}" for b, n in sorted(st.get("committed_bits_histogram", {}).items(), key=lambda i: int(i[0])))
    lines = [
        f"PagedWeight  policy {st.get('policy', '?')}  iteration {st.get('iteration', '?')}"
        f"{'  reloads held' if st.get('reloads_held') else ''}",
        f"weights  resident {_size(st.get('weights_resident_bytes', 0))}  desired {_size(st.get('weights_desired_bytes', 0))}"
        f"  at floor {_size(st.get('weights_bytes_at_floor', 0))}",
        f"budget   total {_size(budget.get('total', 0))}  "
        + "  ".join(f"{k} {_size(v)}" for k, v in sorted(used.items()))
        + f"  free {_size(budget.get('free', 0))}",
        f"KV cache capacity {kv_state.get('capacity_tokens', '?')} tokens (max {kv_state.get('max_tokens', '?')}, "
        f"min {kv_state.get('min_tokens', '?')})  mapped {_size(kv_state.get('mapped_bytes', 0))}",
        f"pressure waiting {kv.get('waiting_blocks', '?')} of {kv.get('capacity_blocks', '?')} KV blocks; offload "
        f"below {kv.get('offload_below_blocks', '?')} free, reload above {kv.get('reload_above_blocks', '?')}; signals "
        f"offload {kv.get('offload_signals', 0)} relax {kv.get('relax_signals', 0)}",
        f"pager    queued {st.get('queued_blocks', 0)} blocks  in flight {_size(st.get('inflight_bytes', 0))}  "
        f"ops {' '.join(f'{k}:{v}' for k, v in st.get('ops', {}).items())}",
        f"transitions {transitions} ({rate})  offloads {counters.get('offloads_committed', 0)}  reloads "
        f"{counters.get('reloads_committed', 0)}",
        f"committed bits  {hist}",
        "",
        "committed bitwidth per layer x expert (lowest over its projections):",
        *heat_map(st.get("blocks", []), colour=colour, width=width),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        before = None
        while True:
            now = Sample(fetch_state(args.url, args.rank), time.monotonic())
            frame = render(now, before, colour=args.color, width=args.width)
            if args.once:
                print(frame)
                return 0
            sys.stdout.write("\x1b[H\x1b[2J" + frame + "\n")
            sys.stdout.flush()
            before = now
            time.sleep(args.interval)
    except TopError as e:
        print(f"PagedWeight error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("top", help="live terminal view of a PagedWeight server (bitwidths, bytes, pager)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the server's base URL")
    p.add_argument("--rank", type=int, default=0, help="TP rank whose state to show (default 0)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--color", action="store_true", help="colour the heat map (ANSI 256 colours)")
    p.add_argument("--width", type=int, default=120, help="columns of the heat map before it wraps")
    p.set_defaults(func=run)
