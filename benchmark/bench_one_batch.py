#!/usr/bin/env python3
"""`python -m sglang.bench_one_batch` with SGLang's plugins loaded, so --enable-paged-weight is accepted.

SGLang's one-batch benchmark builds ServerArgs and a ModelRunner in-process without calling load_plugins();
this wrapper calls it first and then hands over unchanged (same flags, same result file).

`--dummy-unit-norms` (this wrapper's own flag, taken off before SGLang parses the rest): with `--load-format dummy`
and without --enable-paged-weight, set every RMSNorm weight to 1 after loading, as PagedWeight does for its dummy
models (pagedweight/serving/dummy_weights.py). A stock run then routes like the PagedWeight run it is compared
with: SGLang's U(-1e-3, 1e-3) norms leave router logits of ~1e-5, and where a model adds a score-correction bias
of the same dummy size (GLM-4.5, DeepSeek-V3) the bias alone picks the experts, the same few for every token, so
stock would read a fraction of the expert bytes the PagedWeight run reads.

`--warmup-every-batch` (also this wrapper's): SGLang warms up at the first batch size only, so the first prefill at
every other size pays for compiling that size's kernels (Triton, NVRTC, autotuning) inside its timed latency. With
the flag, each (batch size, input length) of the sweep first runs once untimed (8 output tokens) and then timed, so
prefill latencies compare across systems at every batch size.

`--result-filename F`: SGLang appends every size's result to F only after the whole sweep, so a sweep that dies at
its last size (an out-of-memory at batch 64) leaves nothing; this wrapper appends each timed size's row the moment it
is measured instead (same JSON lines, SGLang's own write turned off), and the sizes before a failure survive.
"""

import functools
import inspect
import sys

WARMUP_OUTPUT_LEN = 8


def install_unit_norms() -> None:
    from sglang.srt.model_executor.model_runner import ModelRunner

    from pagedweight.serving.dummy_weights import unit_norm_weights

    load_model = ModelRunner.load_model

    def load_model_with_unit_norms(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        if str(self.server_args.load_format) != "dummy":
            raise SystemExit("--dummy-unit-norms needs --load-format dummy")
        print(f"bench_one_batch: --dummy-unit-norms: {unit_norm_weights(self.model)} RMSNorm weights set to 1",
              flush=True)
        return result

    ModelRunner.load_model = load_model_with_unit_norms


def install_result_per_batch(result_filename: str) -> None:
    """Append each timed run's result to `result_filename` as it returns (rank 0); the first call is SGLang's warmup."""
    import json

    from sglang.benchmark import one_batch

    run_once = one_batch.latency_test_run_once
    signature = inspect.signature(run_once)
    seen_warmup = []

    @functools.wraps(run_once)  # its signature stays SGLang's, for a wrapper installed over this one
    def run_once_and_write(*args, **kwargs):
        result = run_once(*args, **kwargs)
        if not seen_warmup:
            seen_warmup.append(True)
            return result
        if result is not None and signature.bind(*args, **kwargs).arguments["tp_rank"] == 0:
            with open(result_filename, "a") as f:
                f.write(json.dumps(result) + "\n")
        return result

    one_batch.latency_test_run_once = run_once_and_write


def take_result_filename(argv: list[str]) -> str | None:
    """Remove `--result-filename F` (or `=F`) from argv and hand SGLang an empty one (its end-of-sweep write off)."""
    for i, arg in enumerate(argv):
        if arg == "--result-filename" and i + 1 < len(argv):
            path = argv[i + 1]
            argv[i:i + 2] = ["--result-filename", ""]
            return path or None
        if arg.startswith("--result-filename="):
            path = arg.split("=", 1)[1]
            argv[i] = "--result-filename="
            return path or None
    return None


def install_warmup_every_batch() -> None:
    from sglang.benchmark import one_batch

    run_once = one_batch.latency_test_run_once
    signature = inspect.signature(run_once)
    warmed: set[tuple[int, int]] = set()

    # wraps: inspect.signature of this wrapper is SGLang's, so the per-batch writer installed over it can bind tp_rank
    @functools.wraps(run_once)
    def run_once_after_a_warmup(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        key = (bound.arguments["batch_size"], bound.arguments["input_len"])
        if warmed and key not in warmed:  # the first call is SGLang's own warmup, at the first size
            bound.arguments["rank_print"](f"bench_one_batch: --warmup-every-batch: untimed run at batch size {key[0]}, "
                                          f"input length {key[1]}")
            warm = signature.bind(*args, **kwargs)
            warm.arguments.update(
                reqs=one_batch.prepare_synthetic_inputs_for_latency_test(*key),
                output_len=min(WARMUP_OUTPUT_LEN, bound.arguments["output_len"]),
                rank_print=lambda *a, **k: None, log_decode_step=0, profile=False,
            )
            run_once(*warm.args, **warm.kwargs)
        warmed.add(key)
        return run_once(*bound.args, **bound.kwargs)

    one_batch.latency_test_run_once = run_once_after_a_warmup


if __name__ == "__main__":
    from sglang.srt.plugins import load_plugins

    load_plugins()
    if "--dummy-unit-norms" in sys.argv:
        sys.argv.remove("--dummy-unit-norms")
        install_unit_norms()
    if "--warmup-every-batch" in sys.argv:
        sys.argv.remove("--warmup-every-batch")
        install_warmup_every_batch()
    result_filename = take_result_filename(sys.argv)
    if result_filename is not None:
        install_result_per_batch(result_filename)  # outside the warmups: sees SGLang's calls only

    from sglang.benchmark.one_batch import cli_main

    cli_main()
