"""Generation through an in-process engine with SGLang's `Engine.generate` signature.

Any object works whose `generate(input_ids=[[...], ...], sampling_params=[{...}, ...])` returns one dict
per prompt with "text" and "meta_info" (finish_reason, prompt_tokens, completion_tokens), e.g.
`sglang.Engine(model_path=...)`. Requests are sent in batches of `batch_size`; the engine schedules a
batch internally, so every sample of a batch records the batch's wall time as its latency, and there is
no time-to-first-token.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from typing import Any

from pagedweight.longbench.backend import BackendError, GenerationBackend
from pagedweight.longbench.request import GenerationRequest, GenerationResult


def _finish_reason(meta_info: dict[str, Any]) -> str | None:
    reason = meta_info.get("finish_reason")
    if isinstance(reason, dict):  # SGLang reports {"type": "length", ...}
        return reason.get("type")
    return reason


class EngineBackend(GenerationBackend):
    def __init__(self, engine: Any, batch_size: int = 8) -> None:
        if not callable(getattr(engine, "generate", None)):
            raise TypeError(f"{type(engine).__name__} has no generate(); pass an sglang.Engine or a compatible object")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.engine = engine
        self.batch_size = batch_size

    def describe(self) -> dict[str, Any]:
        return {"backend": "engine", "engine": type(self.engine).__name__, "batch_size": self.batch_size}

    def run(self, requests: Iterable[GenerationRequest]) -> Iterator[tuple[GenerationRequest, GenerationResult]]:
        pending = iter(requests)
        while batch := list(itertools.islice(pending, self.batch_size)):
            for request in batch:
                if request.endpoint != "completions" or request.prompt_token_ids is None:
                    raise BackendError(
                        f"{request.dataset} sample {request.sample_id}: the engine backend takes token ids; "
                        "use endpoint 'completions' (the chat endpoint exists only over HTTP)"
                    )
            started_at = time.time()
            start = time.perf_counter()
            outputs = self.engine.generate(
                input_ids=[list(r.prompt_token_ids or ()) for r in batch],
                sampling_params=[{"max_new_tokens": r.max_new_tokens, "temperature": 0.0} for r in batch],
            )
            latency = time.perf_counter() - start
            if isinstance(outputs, dict):
                outputs = [outputs]
            if len(outputs) != len(batch):
                raise BackendError(f"engine returned {len(outputs)} outputs for a batch of {len(batch)} prompts")
            for request, output in zip(batch, outputs):
                meta_info = output.get("meta_info") or {}
                yield request, GenerationResult(
                    text=output["text"],
                    finish_reason=_finish_reason(meta_info),
                    prompt_tokens=meta_info.get("prompt_tokens"),
                    completion_tokens=meta_info.get("completion_tokens"),
                    latency_s=latency,
                    ttft_s=None,
                    started_at=started_at,
                )
