"""`pagedweight moefy`: registered in the CLI, rejects bad settings before downloading anything."""

from __future__ import annotations

import pytest

from pagedweight.cli import build_parser, main


def test_moefy_subcommand_parses_defaults(tmp_path):
    args = build_parser().parse_args(["moefy", "--out", str(tmp_path / "m")])
    assert args.command == "moefy" and args.num_experts == 16 and args.top_k == 12
    assert args.also_top_k == () and args.split == "activations" and not args.no_refit_down


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-experts", "8", "--top-k", "9"], "outside"),
        (["--top-k", "17"], "outside"),
        (["--also-top-k", "0"], "outside"),
        (["--num-experts", "1"], "at least 2"),
        (["--gguf", "/nonexistent/model.gguf"], "is not a file"),
    ],
)
def test_moefy_rejects_bad_settings(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["moefy", "--out", str(tmp_path / "m"), *argv])


def test_also_top_k_must_be_integers(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["moefy", "--out", str(tmp_path / "m"), "--also-top-k", "two"])
    assert "comma-separated integers" in capsys.readouterr().err
