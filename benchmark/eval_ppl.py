"""Perplexity and KL-to-reference of a Hugging Face model directory on held-out gensim text.

    python benchmark/eval_ppl.py --model OUT/smollm2-moe [--reference DENSE_OR_BF16_DIR] \
        [--text-kind wiki|news] [--seq-len 1024] [--windows 8] [--json results.json]

The measurement itself is `pagedweight.moefy.perplexity.evaluate(model, token_ids, reference_logits=None)`
(re-exported here), which other experiments call directly on a model whose experts were replaced by
quantized weights. Token windows come from `pagedweight.moefy.text.evaluation_text(kind)`, whose documents
are disjoint from the calibration text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pagedweight.moefy.perplexity import evaluate, reference_logits, token_windows
from pagedweight.moefy.text import TEXT_KINDS, evaluation_text

__all__ = ["evaluate", "reference_logits", "token_windows", "load_causal_lm", "main"]


def load_causal_lm(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise SystemExit(f"{path} is not a Hugging Face model directory (no config.json)")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="HF model directory to measure")
    parser.add_argument("--reference", type=Path, default=None, help="HF model directory whose logits define KL")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: --model)")
    parser.add_argument("--text-kind", choices=TEXT_KINDS, default="wiki")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=8, help="number of non-overlapping windows")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the result here too")
    args = parser.parse_args(argv)
    if args.seq_len < 2 or args.windows < 1:
        parser.error("--seq-len must be >= 2 and --windows >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer or args.model))
    token_ids = token_windows(tokenizer, evaluation_text(args.text_kind), args.seq_len, args.windows)
    reference = None
    if args.reference is not None:
        reference_model = load_causal_lm(args.reference)
        reference = reference_logits(reference_model, token_ids)
        del reference_model
    result = evaluate(load_causal_lm(args.model), token_ids, reference)
    record = {
        "model": str(args.model),
        "reference": str(args.reference) if args.reference else None,
        "text_kind": args.text_kind,
        "seq_len": args.seq_len,
        "windows": int(token_ids.shape[0]),
        **result,
    }
    print(json.dumps(record, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
