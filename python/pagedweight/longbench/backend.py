"""The interface between the harness and whatever generates text (an HTTP server or an in-process engine)."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from typing import Any

from pagedweight.longbench.request import GenerationRequest, GenerationResult


class BackendError(RuntimeError):
    """A generation request failed; the message names the sample and what the backend said."""


class GenerationBackend(abc.ABC):
    """Runs greedy generations, several at a time, and yields each result as soon as it is ready.

    `run` pulls requests lazily from the iterable, so the harness tokenizes the next prompts while
    earlier ones are generating. Results come back in completion order, not request order. On a failed
    request the backend stops taking new requests, still yields the ones already in flight that
    succeed (so they are saved), and then raises BackendError.
    """

    @abc.abstractmethod
    def run(self, requests: Iterable[GenerationRequest]) -> Iterator[tuple[GenerationRequest, GenerationResult]]: ...

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Settings worth recording in the run report."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
