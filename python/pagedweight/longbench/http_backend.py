"""Generation through the OpenAI-compatible HTTP API of a running SGLang server.

Requests are greedy (temperature 0) and go to /v1/completions with token ids, or to
/v1/chat/completions with one user message. With streaming on, the time to first token is the time from
sending the request to the first chunk that carries text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import httpx

from pagedweight.longbench.backend import BackendError, GenerationBackend
from pagedweight.longbench.request import GenerationRequest, GenerationResult


@dataclass(frozen=True)
class HTTPBackendConfig:
    base_url: str  # e.g. http://127.0.0.1:30000 (no /v1)
    model: str  # the served model name sent in the "model" field
    concurrency: int = 8
    stream: bool = False
    timeout_s: float = 3600.0  # one request; long prompts can queue for a long time under pressure
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {self.concurrency}")


def _request_body(request: GenerationRequest, config: HTTPBackendConfig) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.max_new_tokens,
        "temperature": 0.0,  # greedy, like pred.py's do_sample=False, num_beams=1
        "n": 1,
        "stream": config.stream,
    }
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    if request.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
        return "/v1/chat/completions", body
    if request.prompt_token_ids is None:
        raise ValueError(f"sample {request.sample_id}: a /v1/completions request needs prompt token ids")
    body["prompt"] = list(request.prompt_token_ids)
    return "/v1/completions", body


def _choice_text(choice: dict[str, Any], chat: bool, streaming: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    part = choice.get("delta" if streaming else "message") or {}
    return part.get("content") or ""


class OpenAIHTTPBackend(GenerationBackend):
    def __init__(self, config: HTTPBackendConfig) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._client = httpx.Client(
            base_url=config.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency),
        )

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "openai-http",
            "base_url": self.config.base_url,
            "model": self.config.model,
            "concurrency": self.config.concurrency,
            "stream": self.config.stream,
        }

    def close(self) -> None:
        self._client.close()

    def _fail(self, request: GenerationRequest, what: str) -> BackendError:
        return BackendError(f"{request.dataset} sample {request.sample_id}: {what}")

    def generate(self, request: GenerationRequest) -> GenerationResult:
        path, body = _request_body(request, self.config)
        started_at = time.time()
        start = time.perf_counter()
        try:
            if self.config.stream:
                return self._generate_streaming(request, path, body, started_at, start)
            response = self._client.post(path, json=body)
        except httpx.ConnectError as e:
            raise self._fail(
                request, f"cannot reach {self.config.base_url}{path} ({e}); is the SGLang server running there?"
            ) from e
        except httpx.HTTPError as e:
            raise self._fail(request, f"request to {path} failed: {type(e).__name__}: {e}") from e
        latency = time.perf_counter() - start
        if response.status_code != 200:
            raise self._fail(request, f"{path} returned HTTP {response.status_code}: {response.text[:500]}")
        payload = response.json()
        choices = payload.get("choices") or []
        if not choices:
            raise self._fail(request, f"{path} returned no choices: {response.text[:500]}")
        usage = payload.get("usage") or {}
        return GenerationResult(
            text=_choice_text(choices[0], chat=request.endpoint == "chat", streaming=False),
            finish_reason=choices[0].get("finish_reason"),
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            latency_s=latency,
            ttft_s=None,
            started_at=started_at,
        )

    def _generate_streaming(
        self, request: GenerationRequest, path: str, body: dict[str, Any], started_at: float, start: float
    ) -> GenerationResult:
        pieces: list[str] = []
        ttft: float | None = None
        finish_reason: str | None = None
        usage: dict[str, Any] = {}
        with self._client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                raise self._fail(request, f"{path} returned HTTP {response.status_code}: {response.read()[:500]!r}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue  # SSE comments and blank separators
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise self._fail(request, f"{path} streamed an error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    text = _choice_text(choice, chat=request.endpoint == "chat", streaming=True)
                    if text and ttft is None:
                        ttft = time.perf_counter() - start
                    pieces.append(text)
                    finish_reason = choice.get("finish_reason") or finish_reason
        return GenerationResult(
            text="".join(pieces),
            finish_reason=finish_reason,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            latency_s=time.perf_counter() - start,
            ttft_s=ttft,
            started_at=started_at,
        )

    def run(self, requests: Iterable[GenerationRequest]) -> Iterator[tuple[GenerationRequest, GenerationResult]]:
        pending_requests = iter(requests)
        in_flight: dict[Future[GenerationResult], GenerationRequest] = {}
        first_error: BaseException | None = None
        with ThreadPoolExecutor(max_workers=self.config.concurrency, thread_name_prefix="longbench-http") as pool:

            def refill() -> None:
                while first_error is None and len(in_flight) < self.config.concurrency:
                    request = next(pending_requests, None)
                    if request is None:
                        return
                    in_flight[pool.submit(self.generate, request)] = request

            refill()
            while in_flight:
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    request = in_flight.pop(future)
                    error = future.exception()
                    if error is not None:
                        if not isinstance(error, BackendError):  # e.g. a malformed JSON response
                            wrapped = self._fail(request, f"{type(error).__name__}: {error}")
                            wrapped.__cause__ = error
                            error = wrapped
                        first_error = first_error or error
                        continue
                    yield request, future.result()
                refill()
        if first_error is not None:
            raise first_error
