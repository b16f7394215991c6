"""`pagedweight` command line: a thin dispatcher over subcommands.

Each subcommand lives in its own module, which exposes `register_cli(subparsers)`; that function adds its
parser and sets `func` (args -> exit code). To add a command, append its module to COMMAND_MODULES.
Command modules must keep their top-level imports light (import torch/transformers inside functions
where possible) so `pagedweight --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMAND_MODULES: tuple[str, ...] = (
    "pagedweight.tools.tiny_model",  # make-tiny
    "pagedweight.tools.convert",  # convert
    "pagedweight.tools.calibrate",  # calibrate
    "pagedweight.moefy.cli",  # moefy
    "pagedweight.tools.top",  # top
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedweight", description="PagedWeight for SGLang: offline tools and a "
                                     "live view of a server")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register_cli(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
