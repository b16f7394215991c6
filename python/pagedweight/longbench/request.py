"""What the harness sends to a backend and what comes back, as plain typed records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True)
class GenerationRequest:
    """One greedy generation for one LongBench sample.

    For endpoint "completions" the backend sends `prompt_token_ids` (chat template already applied when
    the dataset uses one); sending ids rather than text keeps the server from adding a second BOS token.
    For endpoint "chat" it sends `prompt` as the single user message and the server applies its template.
    """

    sample_id: str
    dataset: str
    endpoint: Endpoint
    prompt: str  # the dataset prompt after middle truncation, before any chat template
    prompt_token_ids: tuple[int, ...] | None
    max_new_tokens: int
    original_prompt_tokens: int  # length of the untruncated dataset prompt
    truncated: bool


@dataclass(frozen=True)
class GenerationResult:
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_s: float  # request sent -> last byte received
    ttft_s: float | None  # request sent -> first generated text (streaming only)
    started_at: float  # unix time the request was sent
