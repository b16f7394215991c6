"""What a running SGLang server says about itself, for the tokenizer default and the run report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx


class ServerUnreachableError(RuntimeError):
    pass


@dataclass(frozen=True)
class ServerInfo:
    base_url: str
    model_info: dict[str, Any]  # /model_info: model_path, tokenizer_path, architectures, ...
    served_models: list[dict[str, Any]]  # /v1/models "data"
    server_args: dict[str, Any] = field(default_factory=dict)  # /server_info, the small scalar fields

    @property
    def served_model_name(self) -> str:
        if not self.served_models:
            raise ServerUnreachableError(f"{self.base_url}/v1/models lists no model; pass --model explicitly")
        return str(self.served_models[0]["id"])

    @property
    def tokenizer_path(self) -> str:
        # SGLang sets tokenizer_path to model_path unless --tokenizer-path was given at launch.
        path = self.model_info.get("tokenizer_path") or self.model_info.get("model_path")
        if not path:
            raise ServerUnreachableError(f"{self.base_url}/model_info reports no model or tokenizer path; pass --tokenizer")
        return str(path)

    @property
    def max_model_len(self) -> int | None:
        for model in self.served_models:
            if model.get("max_model_len"):
                return int(model["max_model_len"])
        return None


def _get_json(client: httpx.Client, base_url: str, paths: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """GET the first of `paths` the server knows (newer SGLang renamed /get_model_info to /model_info)."""
    last_status = None
    for path in paths:
        try:
            response = client.get(base_url + path)
        except httpx.HTTPError as e:
            raise ServerUnreachableError(
                f"cannot reach the SGLang server at {base_url} ({type(e).__name__}: {e}). Start it first, e.g. "
                "`python -m sglang.launch_server --model-path MODEL --port 30000`, and pass --base-url."
            ) from e
        if response.status_code == 200:
            return path, response.json()
        last_status = response.status_code
    raise ServerUnreachableError(f"{base_url}: none of {', '.join(paths)} answered (last HTTP status {last_status})")


# Scalar server arguments worth keeping in the report; the full /server_info is large.
_SERVER_FIELDS = (
    "version", "model_path", "tokenizer_path", "context_length", "mem_fraction_static", "max_running_requests",
    "max_total_tokens", "chunked_prefill_size", "tp_size", "dp_size", "dtype", "kv_cache_dtype",
    "quantization", "attention_backend", "moe_runner_backend", "enable_mixed_chunk", "schedule_policy",
)  # fmt: skip


def fetch_server_info(base_url: str, timeout_s: float = 30.0) -> ServerInfo:
    base_url = base_url.rstrip("/")
    with httpx.Client(timeout=timeout_s) as client:
        _, model_info = _get_json(client, base_url, ("/model_info", "/get_model_info"))
        _, models = _get_json(client, base_url, ("/v1/models",))
        _, server = _get_json(client, base_url, ("/server_info", "/get_server_info"))
    server_args = {key: server[key] for key in _SERVER_FIELDS if key in server}
    # PagedWeight's own server arguments (--enable-paged-weight, --paged-weight-*) say which system ran.
    server_args.update(
        {k: v for k, v in server.items() if "paged_weight" in k and isinstance(v, (str, int, float, bool, type(None)))}
    )
    return ServerInfo(base_url=base_url, model_info=model_info, served_models=list(models.get("data") or []), server_args=server_args)
