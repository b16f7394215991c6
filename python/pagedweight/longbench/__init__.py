"""LongBench (v1 and LongBench-E) evaluation against a running SGLang server or an in-process engine.

Command line: `pagedweight-longbench run|score|make-fixtures` (or `python -m pagedweight.longbench`).
From Python, build a LongBenchRunConfig and a backend (OpenAIHTTPBackend or EngineBackend) and call
run_longbench(); see docs/longbench.md.
"""

from pagedweight.longbench.datasets import DATASET_SPECS, LONGBENCH_E_DATASETS, LONGBENCH_V1_DATASETS, DatasetSpec
from pagedweight.longbench.engine_backend import EngineBackend
from pagedweight.longbench.http_backend import HTTPBackendConfig, OpenAIHTTPBackend
from pagedweight.longbench.prompts import PromptOptions
from pagedweight.longbench.report import LongBenchReport, write_report
from pagedweight.longbench.runner import LongBenchRunConfig, run_longbench, score_only

__all__ = [
    "DATASET_SPECS",
    "LONGBENCH_E_DATASETS",
    "LONGBENCH_V1_DATASETS",
    "DatasetSpec",
    "EngineBackend",
    "HTTPBackendConfig",
    "LongBenchReport",
    "LongBenchRunConfig",
    "OpenAIHTTPBackend",
    "PromptOptions",
    "run_longbench",
    "score_only",
    "write_report",
]
