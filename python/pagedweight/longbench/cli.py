"""`pagedweight-longbench` / `python -m pagedweight.longbench`: run, score, and make fixture data.

  run            ask a running SGLang server for every unanswered sample, then score and report
  score          re-score existing predictions (no server needed)
  make-fixtures  write small LongBench-format files for tests and smoke runs
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pagedweight.longbench.datasets import DATASET_SPECS, get_spec, is_longbench_e

logger = logging.getLogger("pagedweight.longbench")


class UsageError(ValueError):
    """Bad command-line input; printed without a traceback."""


def _dataset_list(value: str) -> list[str]:
    names = [name for part in value.split(",") for name in part.split() if name]
    if not names:
        raise argparse.ArgumentTypeError("--datasets is empty; give comma-separated names such as narrativeqa,qmsum")
    for name in names:
        try:
            get_spec(name)
        except ValueError as e:  # argparse shows ArgumentTypeError messages, not ValueError ones
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def select_datasets(data_dir: Path, requested: list[str] | None, longbench_e: bool) -> tuple[str, ...]:
    """The requested datasets, or every known dataset with a file in data_dir (v1, or LongBench-E with --longbench-e)."""
    if requested:
        return tuple(requested)
    if not data_dir.is_dir():
        raise UsageError(f"--data-dir {data_dir} is not a directory")
    candidates = [n for n in DATASET_SPECS if is_longbench_e(n) == longbench_e]
    found = tuple(n for n in candidates if (data_dir / f"{n}.jsonl").is_file())
    if not found:
        kind = "LongBench-E ('<dataset>_e.jsonl')" if longbench_e else "LongBench ('<dataset>.jsonl')"
        raise UsageError(
            f"no {kind} data files in {data_dir}; expected names like {', '.join(candidates[:4])}, ... "
            f"(unzip THUDM/LongBench's data.zip there, or run `make-fixtures --out {data_dir}`)"
        )
    return found


def _add_selection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, required=True, help="directory with one <dataset>.jsonl per dataset")
    parser.add_argument("--out", type=Path, required=True, help="output directory (predictions/, results.json, results.md)")
    parser.add_argument(
        "--datasets", type=_dataset_list, default=None,
        help="comma-separated dataset names (default: every known dataset with a file in --data-dir)",
    )  # fmt: skip
    parser.add_argument("--longbench-e", action="store_true", help="default to the LongBench-E files (<dataset>_e.jsonl)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedweight-longbench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="generate with a running SGLang server, then score")
    _add_selection_args(run)
    run.add_argument("--base-url", default="http://127.0.0.1:30000", help="SGLang server URL, without /v1")
    run.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    run.add_argument("--tokenizer", default=None, help="HF tokenizer name or path (default: the server's tokenizer_path)")
    run.add_argument("--trust-remote-code", action="store_true", help="allow custom tokenizer code from the model repo")
    run.add_argument(
        "--max-prompt-tokens", type=int, default=None,
        help="truncate longer prompts in the middle to this many tokens (official: 31500 for 32k-context models)",
    )  # fmt: skip
    run.add_argument(
        "--api", choices=("completions", "chat"), default="completions",
        help="completions: /v1/completions with the chat template applied here; chat: /v1/chat/completions. "
        "Datasets without a chat template (trec, triviaqa, samsum, lsht, lcc, repobench-p) always use /v1/completions.",
    )  # fmt: skip
    run.add_argument("--no-chat-template", action="store_true", help="send raw prompts for every dataset (base models)")
    run.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    run.add_argument("--stream", action="store_true", help="stream responses to measure time to first token")
    run.add_argument("--limit", type=int, default=None, help="only the first N samples of each dataset")
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    run.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token if the server wants one")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.set_defaults(func=_cmd_run)

    score = sub.add_parser("score", help="score existing predictions in --out")
    _add_selection_args(score)
    score.set_defaults(func=_cmd_score)

    fixtures = sub.add_parser("make-fixtures", help="write small LongBench-format test files")
    fixtures.add_argument("--out", type=Path, required=True, help="directory to write the .jsonl files into")
    fixtures.add_argument("--samples", type=int, default=6, help="samples per file")
    fixtures.add_argument("--paragraphs", type=int, default=30, help="paragraphs per passage_retrieval_en sample")
    fixtures.add_argument("--passkey-filler", type=int, default=200, help="filler sentences groups per passkey sample (~19 words each)")
    fixtures.add_argument("--seed", type=int, default=0)
    fixtures.set_defaults(func=_cmd_make_fixtures)
    return parser


def _print_summary(report, json_path: Path, md_path: Path) -> None:
    from pagedweight.longbench.report import to_markdown

    print(to_markdown(report))
    print(f"wrote {json_path} and {md_path}")


def _cmd_run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagedweight.longbench.http_backend import HTTPBackendConfig, OpenAIHTTPBackend
    from pagedweight.longbench.prompts import PromptOptions
    from pagedweight.longbench.report import write_report
    from pagedweight.longbench.runner import LongBenchRunConfig, run_longbench
    from pagedweight.longbench.server_info import fetch_server_info

    datasets = select_datasets(args.data_dir, args.datasets, args.longbench_e)
    server = fetch_server_info(args.base_url)
    if args.max_prompt_tokens is None:
        context = server.max_model_len
        raise UsageError(
            "--max-prompt-tokens is required: prompts longer than this are cut in the middle. "
            + (f"The server's context length is {context}; leave room for up to 512 new tokens and the chat "
               f"template, e.g. --max-prompt-tokens {max(context - 600, 2)}." if context else
               "Use the model's context length minus 512 new tokens and some room for the chat template.")
        )  # fmt: skip
    tokenizer_name = args.tokenizer or server.tokenizer_path
    logger.info("tokenizer: %s%s", tokenizer_name, "" if args.tokenizer else " (reported by the server)")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name, trust_remote_code=args.trust_remote_code)
    model = args.model or server.served_model_name
    config = LongBenchRunConfig(
        data_dir=args.data_dir,
        out_dir=args.out,
        datasets=datasets,
        prompt=PromptOptions(
            max_prompt_tokens=args.max_prompt_tokens, endpoint=args.api, use_chat_template=not args.no_chat_template
        ),
        tokenizer=tokenizer_name,
        model=model,
        limit=args.limit,
    )
    backend = OpenAIHTTPBackend(
        HTTPBackendConfig(
            base_url=args.base_url, model=model, concurrency=args.concurrency, stream=args.stream,
            timeout_s=args.timeout, api_key=args.api_key,
        )  # fmt: skip
    )
    try:
        report = run_longbench(config, backend, tokenizer, server=server, show_progress=not args.no_progress)
    finally:
        backend.close()
    _print_summary(report, *write_report(report, args.out))
    return 0


def _cmd_score(args: argparse.Namespace) -> int:
    from pagedweight.longbench.report import write_report
    from pagedweight.longbench.runner import score_only

    report = score_only(args.data_dir, args.out, select_datasets(args.data_dir, args.datasets, args.longbench_e))
    if all(s.n_scored == 0 for s in report.scores):
        raise UsageError(f"no predictions for these datasets under {args.out / 'predictions'}; make them with `run` first")
    _print_summary(report, *write_report(report, args.out))
    return 0


def _cmd_make_fixtures(args: argparse.Namespace) -> int:
    from pagedweight.longbench.fixtures import FixtureOptions, make_fixtures

    options = FixtureOptions(
        samples_per_file=args.samples, retrieval_paragraphs=args.paragraphs,
        passkey_filler_repeats=args.passkey_filler, seed=args.seed,
    )  # fmt: skip
    for dataset, path in make_fixtures(args.out, options).items():
        print(f"{dataset}: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _build_parser().parse_args(argv)
    from pagedweight.tools.extras import require_extra

    require_extra("longbench", "pagedweight-longbench")
    from pagedweight.longbench.backend import BackendError
    from pagedweight.longbench.data import LongBenchDataError
    from pagedweight.longbench.metrics import MetricDependencyError
    from pagedweight.longbench.predictions import PredictionsFileError
    from pagedweight.longbench.runner import SettingsMismatchError
    from pagedweight.longbench.server_info import ServerUnreachableError

    expected = (
        UsageError, LongBenchDataError, BackendError, MetricDependencyError, PredictionsFileError,
        SettingsMismatchError, ServerUnreachableError,
    )  # fmt: skip
    try:
        return int(args.func(args) or 0)
    except expected as e:
        print(f"pagedweight-longbench: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        # Input problems found while building prompts (e.g. a tokenizer without a chat template).
        print(f"pagedweight-longbench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
