"""Perplexity and KL-to-reference of a causal LM on fixed token windows.

`evaluate(model, token_ids, reference_logits=None)` is the one quality measurement the project uses:
the MoEfication build picks its top-k with it, and the quality experiments call it on the same model with
its experts replaced by quantized weights. Both numbers are over the same predicted positions (every
position of every window except the last, which has no next token):

- ppl = exp(mean next-token negative log-likelihood), natural log.
- kl  = mean over positions of KL(P_reference || P_model) in nats, full-vocabulary distributions.

Reference logits are kept as float16 by default (a 1024-token window of a 49k vocabulary is 100 MB);
KL is computed in float32 from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@dataclass(frozen=True)
class QualityResult:
    ppl: float
    kl: float | None  # None when no reference was given
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # predicted positions measured

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def token_windows(tokenizer, text: str, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Tokenize text (no special tokens) and cut it into non-overlapping [n, seq_len] windows."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    count = len(ids) // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(ids[: count * seq_len], dtype=torch.long).view(count, seq_len)


def _check_windows(token_ids: torch.Tensor) -> None:
    if token_ids.dim() != 2 or token_ids.shape[1] < 2 or token_ids.dtype != torch.long:
        raise ValueError(f"token_ids must be a [windows, seq_len >= 2] long tensor, got {tuple(token_ids.shape)}")


@torch.inference_mode()
def _window_logits(model, window: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    output = model(input_ids=window.unsqueeze(0).to(device), use_cache=False)
    return output.logits[0, :-1].float()


@torch.inference_mode()
def reference_logits(
    model, token_ids: torch.Tensor, dtype: torch.dtype = torch.float16, progress: bool = True
) -> torch.Tensor:
    """Logits of a reference model on every window: [windows, seq_len - 1, vocab] in `dtype`, on CPU."""
    _check_windows(token_ids)
    rows = [
        _window_logits(model, window).to("cpu", dtype)
        for window in tqdm(token_ids, desc="reference logits", disable=not progress, unit="window")
    ]
    return torch.stack(rows)


@torch.inference_mode()
def evaluate(
    model,
    token_ids: torch.Tensor,
    reference_logits: torch.Tensor | Sequence[torch.Tensor] | None = None,
    progress: bool = True,
    per_window: bool = False,
) -> dict[str, float | int | None | list]:
    """Perplexity (and KL to the reference, if given) of `model` on [windows, seq_len] token windows.

    `reference_logits[i]` must be the reference model's logits for window i at positions 0..seq_len-2
    (what `reference_logits()` returns). Returns {"ppl", "kl", "nll", "tokens"}; "kl" is None without a
    reference. `per_window` adds "window_nll" and "window_kl": each window's summed NLL / KL in nats (what a
    window bootstrap resamples; benchmark/quality/bootstrap.py).
    """
    _check_windows(token_ids)
    if reference_logits is not None and len(reference_logits) != token_ids.shape[0]:
        raise ValueError(f"{len(reference_logits)} reference windows for {token_ids.shape[0]} token windows")
    total_nll = 0.0
    total_kl = 0.0
    positions = 0
    window_nll: list[float] = []
    window_kl: list[float] = []
    for index, window in enumerate(tqdm(token_ids, desc="evaluate", disable=not progress, unit="window")):
        logits = _window_logits(model, window)
        log_probs = F.log_softmax(logits, dim=-1)
        targets = window[1:].to(log_probs.device)
        window_nll.append(-log_probs.gather(1, targets[:, None]).sum().item())
        total_nll += window_nll[-1]
        if reference_logits is not None:
            reference = reference_logits[index].to(log_probs.device, torch.float32)
            if reference.shape != log_probs.shape:
                raise ValueError(f"reference window {index} has shape {tuple(reference.shape)}, "
                                 f"model logits {tuple(log_probs.shape)}")
            reference_log_probs = F.log_softmax(reference, dim=-1)
            kl = F.kl_div(log_probs, reference_log_probs, log_target=True, reduction="sum")
            window_kl.append(kl.item())
            total_kl += window_kl[-1]
        positions += targets.numel()
    nll = total_nll / positions
    out = QualityResult(
        ppl=float(torch.tensor(nll).exp()),
        kl=total_kl / positions if reference_logits is not None else None,
        nll=nll,
        tokens=positions,
    ).as_dict()
    if per_window:
        out.update(window_nll=window_nll, window_kl=window_kl if reference_logits is not None else None)
    return out
