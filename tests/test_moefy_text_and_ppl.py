"""Calibration/evaluation text splits and the perplexity / KL measurement, on hand-checkable cases."""

from __future__ import annotations

import math

import pytest
import torch

from pagedweight.moefy.perplexity import evaluate, reference_logits, token_windows


class FixedLogits(torch.nn.Module):
    """A 'language model' whose next-token logits are the same row at every position."""

    def __init__(self, row: torch.Tensor):
        super().__init__()
        self.row = torch.nn.Parameter(row.clone(), requires_grad=False)

    def forward(self, input_ids, use_cache=False):
        logits = self.row.expand(*input_ids.shape, -1)
        return type("Output", (), {"logits": logits})()


def test_uniform_model_has_perplexity_vocab_size():
    ids = torch.randint(0, 10, (3, 8))
    result = evaluate(FixedLogits(torch.zeros(10)), ids, progress=False)
    assert result["ppl"] == pytest.approx(10.0, rel=1e-5)
    assert result["kl"] is None and result["tokens"] == 3 * 7


def test_kl_hand_case_and_zero_to_itself():
    ids = torch.zeros(2, 5, dtype=torch.long)
    model = FixedLogits(torch.log(torch.tensor([0.5, 0.5])))
    reference_model = FixedLogits(torch.log(torch.tensor([0.9, 0.1])))
    reference = reference_logits(reference_model, ids, dtype=torch.float32, progress=False)
    result = evaluate(model, ids, reference, progress=False)
    expected_kl = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert result["kl"] == pytest.approx(expected_kl, rel=1e-5)
    assert result["ppl"] == pytest.approx(2.0, rel=1e-5)  # always p = 0.5 for the observed token
    assert evaluate(reference_model, ids, reference, progress=False)["kl"] == pytest.approx(0.0, abs=1e-7)
    per = evaluate(model, ids, reference, progress=False, per_window=True)  # what the window bootstrap resamples
    assert per["window_nll"] == pytest.approx([4 * math.log(2.0)] * 2, rel=1e-5)
    assert per["window_kl"] == pytest.approx([4 * expected_kl] * 2, rel=1e-5)
    assert "window_nll" not in result


def test_evaluate_rejects_bad_input():
    model = FixedLogits(torch.zeros(4))
    with pytest.raises(ValueError, match="windows"):
        evaluate(model, torch.zeros(8, dtype=torch.long), progress=False)
    with pytest.raises(ValueError, match="reference windows"):
        evaluate(model, torch.zeros(2, 4, dtype=torch.long), torch.zeros(1, 3, 4), progress=False)


def test_token_windows_cuts_non_overlapping_windows():
    tokenizer = lambda text, add_special_tokens: {"input_ids": list(range(len(text.split())))}  # noqa: E731
    windows = token_windows(tokenizer, "a " * 25, seq_len=8, max_windows=2)
    assert windows.tolist() == [list(range(8)), list(range(8, 16))]
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(tokenizer, "a b", seq_len=8)


def test_text_splits_are_disjoint_and_deterministic():
    text = pytest.importorskip("pagedweight.moefy.text")
    pytest.importorskip("gensim")
    for kind in text.TEXT_KINDS:
        documents = text.documents(kind)
        calibration = {doc.title for doc in documents if doc.split == "calibration"}
        evaluation = {doc.title for doc in documents if doc.split == "evaluation"}
        assert calibration and evaluation and not calibration & evaluation
        assert len(text.evaluation_text(kind)) > 50_000
        assert len(text.calibration_text(kind)) > len(text.evaluation_text(kind))
        assert text.calibration_text(kind, max_chars=1000) == text.calibration_text(kind, max_chars=1000)
        assert len(text.calibration_text(kind, max_chars=1000)) <= 1000
    wiki = text.evaluation_text("wiki")
    assert "'''" not in wiki and "[[" not in wiki  # markup is stripped
    with pytest.raises(ValueError, match="unknown text kind"):
        text.calibration_text("poetry")
