"""Turning a LongBench sample into a generation request, as THUDM/LongBench pred.py does.

pred.py (`get_pred`):
    prompt = prompt_format.format(**json_obj)
    tokenized_prompt = tokenizer(prompt, truncation=False, return_tensors="pt").input_ids[0]
    if len(tokenized_prompt) > max_length:
        half = int(max_length/2)
        prompt = tokenizer.decode(tokenized_prompt[:half], skip_special_tokens=True) \
               + tokenizer.decode(tokenized_prompt[-half:], skip_special_tokens=True)
    if dataset not in ["trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"]:
        prompt = build_chat(tokenizer, prompt, model_name)
The middle is cut because the instructions sit at both ends of every template. pred.py's per-model
`build_chat` is replaced by the tokenizer's own chat template, which is what SGLang serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedweight.longbench.data import LongBenchSample
from pagedweight.longbench.datasets import DatasetSpec
from pagedweight.longbench.request import Endpoint, GenerationRequest


@dataclass(frozen=True)
class PromptOptions:
    max_prompt_tokens: int
    endpoint: Endpoint  # endpoint for datasets that use the chat template
    use_chat_template: bool = True  # False: raw prompts for every dataset (base models)

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 2:
            raise ValueError(f"--max-prompt-tokens must be at least 2, got {self.max_prompt_tokens}")


def render_prompt(spec: DatasetSpec, sample: LongBenchSample) -> str:
    # pred.py formats with the whole JSON object; the templates only use {context} and {input}.
    return spec.prompt_template.format(context=sample.context, input=sample.input)


def truncate_middle(prompt: str, tokenizer: Any, max_tokens: int) -> tuple[str, int, bool]:
    """(prompt, its length in tokens before truncation, whether it was cut), exactly as pred.py."""
    token_ids = tokenizer(prompt, truncation=False).input_ids
    if len(token_ids) <= max_tokens:
        return prompt, len(token_ids), False
    half = int(max_tokens / 2)
    kept = tokenizer.decode(token_ids[:half], skip_special_tokens=True) + tokenizer.decode(
        token_ids[-half:], skip_special_tokens=True
    )
    return kept, len(token_ids), True


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_token_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of the prompt as one user turn plus the generation prompt.

    The template text already contains BOS where the model wants one, so it is tokenized without
    adding special tokens again.
    """
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def build_request(
    spec: DatasetSpec, sample: LongBenchSample, tokenizer: Any, options: PromptOptions
) -> GenerationRequest:
    prompt, original_tokens, truncated = truncate_middle(render_prompt(spec, sample), tokenizer, options.max_prompt_tokens)
    wants_chat = spec.use_chat_template and options.use_chat_template
    if wants_chat and options.endpoint == "chat":
        endpoint: Endpoint = "chat"
        token_ids = None
    elif wants_chat:
        if not has_chat_template(tokenizer):
            raise ValueError(
                f"dataset {spec.name} is prompted through the chat template, but tokenizer "
                f"{getattr(tokenizer, 'name_or_path', tokenizer)!r} has none. For a base model pass "
                "--no-chat-template; otherwise pass --tokenizer with the chat model's tokenizer."
            )
        endpoint, token_ids = "completions", tuple(chat_prompt_token_ids(tokenizer, prompt))
    else:
        # No chat template: tokenized with special tokens, as pred.py does before model.generate.
        endpoint, token_ids = "completions", tuple(tokenizer(prompt).input_ids)
    return GenerationRequest(
        sample_id=sample.sample_id,
        dataset=spec.name,
        endpoint=endpoint,
        prompt=prompt,
        prompt_token_ids=token_ids,
        max_new_tokens=spec.max_new_tokens,
        original_prompt_tokens=original_tokens,
        truncated=truncated,
    )
