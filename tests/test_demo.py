"""The demo (pagedweight.tools.demo, scripts/demo.py): its pieces on synthetic states, and the whole run on the CPU engine.

End to end it must show what the product does: a burst lowers bitwidths (at least one offload line), every
request is answered while that happens, the quiet period reloads every block to the parent bitwidth, and the
timeline PNG is written.
"""

from __future__ import annotations

import argparse

import pytest

from pagedweight.bench.state_sampler import StateSample
from pagedweight.bench.timeline_plot import plot
from pagedweight.tools.demo import ChangePrinter, describe_histogram, run


def _sample(t, hist, cap, bits=None):
    n = sum(hist.values())
    mean = sum(int(b) * c for b, c in hist.items()) / n
    return StateSample(t_s=t, token_capacity=cap, kv_bytes=cap * 100, weight_bytes=int(mean * 1000), mean_bits=mean,
                       histogram=hist, block_bits=bits)


def _min_bits(state_line: str) -> int:
    """The narrowest bitwidth in a '[demo] t=...  bits 8b x 40, 4b x 8  |  ...' line."""
    part = state_line.split(" bits ", 1)[1].split("|", 1)[0]
    return min(int(item.strip().split("b x")[0]) for item in part.split(","))


def test_histogram_text_widest_first():
    assert describe_histogram({"4": 8, "8": 40, "2": 1}) == "8b x 40, 4b x 8, 2b x 1"
    assert describe_histogram({}) == "-" and describe_histogram(None) == "-"


def test_change_printer_prints_changes_only_and_counts_directions():
    lines = []
    pr = ChangePrinter(lines.append)
    for s in (_sample(0, {"8": 4}, 700), _sample(1, {"8": 4}, 700), _sample(2, {"8": 2, "4": 2}, 900),
              _sample(3, {"8": 2, "4": 2}, 900), _sample(4, {"8": 2, "4": 2}, 950), _sample(5, {"8": 4}, 700)):
        pr(s)
    assert len(lines) == 4, lines  # start, offload, KV grows with the same bits, reload
    assert pr.offloads_seen == 1 and pr.reloads_seen == 1
    assert "bits 8b x 2, 4b x 2  |  KV 900 tokens" in lines[1]


def test_timeline_png_from_samples(tmp_path):
    from dataclasses import asdict

    timeline = [asdict(_sample(t, h, c, bits)) for t, h, c, bits in (
        (0, {"8": 4}, 700, "8888"), (1, {"8": 2, "4": 2}, 900, "8484"), (2, {"8": 4}, 700, "8888"))]
    out = tmp_path / "t.png"
    plot({"systems": [{"system": "PagedWeight", "timeline": timeline, "block_keys": [[0, e, "w13"] for e in range(4)]}]},
         out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000
    with pytest.raises(ValueError, match="no PagedWeight timeline"):
        plot({"systems": [{"system": "stock", "timeline": [{"t_s": 0}]}]}, out)


@pytest.mark.e2e
def test_demo_shows_offload_answers_and_reload(tmp_path, capsys):
    args = argparse.Namespace(arch="qwen2_moe", ap_dir=None, work=tmp_path / "demo", requests=6, input_len=100,
                              output_len=40, start_timeout_s=600.0, reload_timeout_s=300.0)
    seen = run(args)
    out = capsys.readouterr().out
    assert seen["offloads"] > 0 and seen["offload_lines"] >= 1, out
    assert seen["answers"] == [40] * 6, out
    assert seen["reloaded"] and seen["reload_lines"] >= 1, out
    assert seen["initial_histogram"] == {"8": sum(seen["initial_histogram"].values())}
    lines = out.splitlines()
    state_lines = [ln for ln in lines if ln.startswith("[demo] t=")]
    lowered = [i for i, ln in enumerate(lines) if ln in state_lines and _min_bits(ln) < 8]
    answers = [i for i, ln in enumerate(lines) if ln.startswith("[demo] answer ")]
    assert lowered and len(answers) == 6, out
    assert lowered[0] < answers[-1], "the bitwidths moved while the burst was still being answered"
    assert _min_bits(state_lines[-1]) == 8, "the last state line shows every block back at 8 bits"
    assert (tmp_path / "demo" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
