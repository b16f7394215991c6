"""The official LongBench v1 metrics, behaviour-for-behaviour.

Source: THUDM/LongBench metrics.py. Each function takes (prediction, ground_truth, **kwargs) and returns a
score in [0, 1]; eval.py takes the max over ground truths, and the dataset score is 100 x the mean.
Quirks of the official code are kept on purpose (they change scores, and scores must be comparable
with published numbers); each one is marked "official quirk".

Third-party pieces are the ones the official code uses:
  * ROUGE-L F: the `rouge` package (pltrdy/rouge 1.0.1), `Rouge().get_scores(..., avg=True)["rouge-l"]["f"]`.
  * Chinese word segmentation: `jieba` (precise mode). Without it the zh metrics refuse to run
    rather than score with a different segmentation.
  * Code similarity: `fuzzywuzzy.fuzz.ratio` (rounded integer percentage).
"""

from __future__ import annotations

import re
import string
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

MetricFn = Callable[..., float]

_ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
_EN_PUNCTUATION = frozenset(string.punctuation)
_ALL_PUNCTUATION = frozenset(string.punctuation + _ZH_PUNCTUATION)


class MetricDependencyError(RuntimeError):
    """A metric's third-party dependency is missing; the message says which package to install."""


def _jieba_cut(text: str) -> list[str]:
    try:
        import jieba
    except ImportError:
        raise MetricDependencyError(
            "the Chinese LongBench metrics (qa_f1_zh_score, rouge_zh_score) segment words with jieba, "
            "which is not installed: run `pip install jieba`, or leave out the zh datasets "
            "(multifieldqa_zh, dureader, vcsum, lsht, passage_retrieval_zh)"
        ) from None
    return list(jieba.cut(text, cut_all=False))


def jieba_available() -> bool:
    try:
        import jieba  # noqa: F401
    except ImportError:
        return False
    return True


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (SQuAD normalization).

    Order matters and is the official one: lower -> remove punctuation -> remove articles -> fix spaces.
    So "The-end" becomes "theend" (the hyphen goes before "the" could be seen as an article).
    """
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _EN_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(s: str) -> str:
    """Lower text and remove (ASCII and Chinese) punctuation and all whitespace."""
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _ALL_PUNCTUATION)
    return "".join(text.split())


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str], **kwargs: Any) -> float:
    """Token-multiset F1 between two token lists."""
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    prediction_tokens = [normalize_zh_answer(t) for t in _jieba_cut(prediction)]
    ground_truth_tokens = [normalize_zh_answer(t) for t in _jieba_cut(ground_truth)]
    return f1_score([t for t in prediction_tokens if t], [t for t in ground_truth_tokens if t])


def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F (summary level) as the `rouge` package computes it.

    That package splits both texts into sentences on ".", and counts words as a *set* (its Ngrams are
    exclusive), so repeated words count once. It raises on an empty hypothesis and can hit Python's
    recursion limit on very long common subsequences; the official code catches every exception and
    scores 0.0 (official quirk: a bare `except`), so we do the same for Exception.
    """
    from rouge import Rouge

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # official: `except: return 0.0`
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return rouge_score(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


def count_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Fraction of the numbers in the prediction that equal the ground truth."""
    numbers = re.findall(r"\d+", prediction)
    right_num = sum(1 for number in numbers if str(number) == str(ground_truth))
    return 0.0 if not numbers else right_num / len(numbers)


def _id_retrieval_score(prediction: str, ground_truth: str, pattern: str) -> float:
    matches = re.findall(pattern, ground_truth)
    if not matches:
        # The official code would raise IndexError here; say what is wrong with the data instead.
        raise ValueError(f"ground truth {ground_truth!r} does not match the retrieval answer pattern {pattern!r}")
    ground_truth_id = matches[0]
    numbers = re.findall(r"\d+", prediction)
    right_num = sum(1 for number in numbers if str(number) == str(ground_truth_id))
    return 0.0 if not numbers else right_num / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Ground truth "Paragraph k": fraction of the numbers in the prediction that equal k."""
    return _id_retrieval_score(prediction, ground_truth, r"Paragraph (\d+)")


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return _id_retrieval_score(prediction, ground_truth, r"段落(\d+)")


def _fuzz_ratio(a: str, b: str) -> int:
    with warnings.catch_warnings():
        # fuzzywuzzy warns once that it uses difflib when python-Levenshtein is absent; which matcher
        # is in use is recorded in the run report (code_sim_backend) instead.
        warnings.simplefilter("ignore", UserWarning)
        from fuzzywuzzy import fuzz
    return fuzz.ratio(a, b)


def code_sim_backend() -> str:
    """Which sequence matcher fuzzywuzzy uses here (difflib or python-Levenshtein): scores can differ."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from fuzzywuzzy import fuzz
    return f"fuzzywuzzy ({fuzz.SequenceMatcher.__module__})"


def code_sim_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """fuzz.ratio between the ground truth and the first output line that is not a comment or fence."""
    first_code_line = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            first_code_line = line
            break
    return _fuzz_ratio(first_code_line, ground_truth) / 100


def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """1/len(matches) if the ground-truth class is among the class names found in the prediction."""
    all_classes: Sequence[str] = kwargs["all_classes"]
    em_match_list = [class_name for class_name in all_classes if class_name in prediction]
    # Official quirk: a class that is a substring of the ground truth is dropped, but by removing from the
    # list while iterating over it, which skips the element after each removal. Reproduced exactly.
    for match_term in em_match_list:
        if match_term in ground_truth and match_term != ground_truth:
            em_match_list.remove(match_term)
    # Official quirk: the code tests `em_match_list != 0`, always true for a list, so the difflib
    # best-match branch never runs and a prediction naming no class scores 0.
    if ground_truth in em_match_list:
        return 1.0 / len(em_match_list)
    return 0.0


METRICS: dict[str, MetricFn] = {
    "qa_f1_score": qa_f1_score,
    "qa_f1_zh_score": qa_f1_zh_score,
    "rouge_score": rouge_score,
    "rouge_zh_score": rouge_zh_score,
    "classification_score": classification_score,
    "retrieval_score": retrieval_score,
    "retrieval_zh_score": retrieval_zh_score,
    "count_score": count_score,
    "code_sim_score": code_sim_score,
}

ZH_METRICS = frozenset({"qa_f1_zh_score", "rouge_zh_score"})
