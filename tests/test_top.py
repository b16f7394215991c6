"""`pagedweight top`: the frame it renders from a known state (heat map, bytes, transition rate, pressure, pager),
and one clear line for an unreachable or non-PagedWeight server. tests/test_e2e_paging.py runs it against a CPU server.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from pagedweight.cli import main
from pagedweight.tools.top import Sample, TopError, fetch_state, heat_map, render


def _state(transitions: int = 10) -> dict:
    blocks = [[layer, e, proj, bits, bits] for layer in (0, 1) for e in range(4) for proj, bits in
              (("w13", 8 if (layer, e) != (1, 2) else 3), ("w2", 8 if (layer, e) != (0, 1) else 4))]
    return {
        "policy": "HotnessPolicy", "iteration": 7, "reloads_held": False,
        "committed_bits_histogram": {"8": 14, "3": 1, "4": 1},
        "weights_resident_bytes": 3 * 2**30, "weights_desired_bytes": 2 * 2**30, "weights_bytes_at_floor": 2**30,
        "budget": {"total": 8 * 2**30, "used": {"kv": 4 * 2**30, "weights": 3 * 2**30}, "reserved": {}, "free": 2**30,
                   "refusals": 0},
        "elastic_kv": {"capacity_tokens": 5000, "max_tokens": 9000, "min_tokens": 1000, "mapped_bytes": 4 * 2**30},
        "kv": {"waiting_blocks": 3, "capacity_blocks": 300, "offload_below_blocks": 20, "reload_above_blocks": 60,
               "offload_signals": 2, "relax_signals": 1},
        "queued_blocks": 5, "inflight_bytes": 2**29, "ops": {"loading": 1, "ready": 0, "retiring": 0},
        "counters": {"transitions": transitions, "offloads_committed": 6, "reloads_committed": 4},
        "blocks": blocks,
    }


def test_heat_map_shows_the_lowest_bitwidth_of_each_expert():
    rows = heat_map(_state()["blocks"])
    assert rows == ["L0   8488", "L1   8838"]
    wide = heat_map([[0, e, "w13", 1 + e % 8, 1] for e in range(130)], width=40)
    assert len(wide) == 5 and wide[0].startswith("L0   1234") and wide[1].startswith("     ")  # wrapped, one label
    assert heat_map([]) == ["(no expert blocks)"]
    assert "\x1b[48;5;" in heat_map(_state()["blocks"], colour=True)[0]


def test_render_reports_bytes_rates_pressure_and_pager():
    frame = render(Sample(_state(40), at=12.0), Sample(_state(10), at=2.0))
    assert "policy HotnessPolicy" in frame and "iteration 7" in frame
    assert "resident    3.00 GiB" in frame and "desired    2.00 GiB" in frame
    assert "kv    4.00 GiB" in frame and "free    1.00 GiB" in frame
    assert "capacity 5000 tokens (max 9000, min 1000)" in frame
    assert "waiting 3 of 300 KV blocks; offload below 20 free, reload above 60" in frame
    assert "queued 5 blocks" in frame and "loading:1" in frame
    assert "transitions 40 (3.0/s)  offloads 6  reloads 4" in frame  # (40 - 10) / 10 s
    assert "3b:1 4b:1 8b:14" in frame
    assert frame.endswith("L0   8488\nL1   8838")
    assert "(-)" in render(Sample(_state(), at=1.0))  # no rate from one sample
    small = _state()
    small.update(weights_resident_bytes=5 * 2**20, weights_desired_bytes=3 * 2**10, weights_bytes_at_floor=512)
    frame = render(Sample(small, at=1.0))
    assert "resident    5.00 MiB  desired    3.00 KiB  at floor     512 B" in frame


class _Handler(BaseHTTPRequestHandler):
    body: dict = {}

    def do_GET(self):  # noqa: N802 (http.server's name)
        data = json.dumps(self.body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    def serve(body: dict) -> str:
        handler = type("H", (_Handler,), {"body": body})
        srv = HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    servers: list = []
    yield serve
    for s in servers:
        s.shutdown()


def test_once_prints_one_frame_from_the_server(fake_server, capsys):
    url = fake_server({"internal_states": [{"paged_weight": _state()}]})
    assert main(["top", "--url", url, "--once"]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("L1   8838") and "\x1b[2J" not in out
    assert fetch_state(url)["iteration"] == 7


def test_bad_servers_get_one_clear_line(fake_server, capsys):
    plain = fake_server({"internal_states": [{"other": 1}]})
    assert main(["top", "--url", plain, "--once"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("PagedWeight error:") and "--enable-paged-weight" in err[0]
    assert main(["top", "--url", plain, "--once", "--rank", "3"]) == 2
    assert "--rank 3" in capsys.readouterr().err
    with pytest.raises(TopError, match="is the server up"):
        fetch_state("http://127.0.0.1:9", timeout=2)
