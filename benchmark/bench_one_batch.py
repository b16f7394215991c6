#!/usr/bin/env python3
"""`python -m sglang.bench_one_batch` with SGLang's plugins loaded, so --enable-paged-weight is accepted.

SGLang's one-batch benchmark builds ServerArgs and a ModelRunner in-process without calling load_plugins();
this wrapper calls it first and then hands over unchanged (same flags, same result file).
"""

if __name__ == "__main__":
    from sglang.srt.plugins import load_plugins

    load_plugins()

    from sglang.benchmark.one_batch import cli_main

    cli_main()
