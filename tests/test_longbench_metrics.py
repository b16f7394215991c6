"""The official LongBench metrics against hand-computed cases, including the official quirks."""

from __future__ import annotations

import pytest

from pagedweight.longbench.datasets import (
    DATASET_SPECS,
    LONGBENCH_E_DATASETS,
    LONGBENCH_V1_DATASETS,
    get_spec,
)
from pagedweight.longbench.metrics import (
    METRICS,
    classification_score,
    code_sim_score,
    count_score,
    f1_score,
    normalize_answer,
    normalize_zh_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
)
from pagedweight.longbench.scoring import score_sample


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Cat's  hat!", "cats hat"),  # punctuation, article, repeated spaces
        ("An apple a day", "apple day"),
        ("the-end", "theend"),  # punctuation goes first, so "the" is no longer a word
        ("a.m.", "am"),
        ("Theatre", "theatre"),  # "the" only as a whole word
        ("  A  ", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_normalize_zh_answer_strips_chinese_and_ascii_punctuation_and_all_spaces() -> None:
    assert normalize_zh_answer("北京， 中国！A.b") == "北京中国ab"


def test_f1_score_counts_token_multisets() -> None:
    assert f1_score(["a", "a", "b"], ["a", "c"]) == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert f1_score([], ["a"]) == 0.0


def test_qa_f1_score() -> None:
    # pred tokens eiffel tower in paris (4), truth eiffel tower (2): P = 1/2, R = 1, F = 2/3
    assert qa_f1_score("The Eiffel Tower in Paris.", "Eiffel Tower") == pytest.approx(2 / 3)
    assert qa_f1_score("paris paris", "Paris") == pytest.approx(2 / 3)  # the repeat counts once in the overlap
    assert qa_f1_score("London", "Paris") == 0.0
    assert qa_f1_score("", "Paris") == 0.0
    assert qa_f1_score("the", "a") == 0.0  # both normalize to nothing


def test_qa_f1_zh_score_segments_with_jieba() -> None:
    assert qa_f1_zh_score("北京是首都", "首都是北京") == pytest.approx(1.0)
    # truth: 北京 ， 中国 -> punctuation token dropped -> [北京, 中国]; pred [北京]: P = 1, R = 1/2
    assert qa_f1_zh_score("北京", "北京，中国") == pytest.approx(2 / 3)


def test_rouge_l_single_sentence() -> None:
    # The rouge package counts words as sets: both texts have 5 distinct words, the LCS
    # "the cat on the mat" has 4 distinct words, so P = R = 4/5 and F = 0.8 (minus its 1e-8 smoothing).
    assert rouge_score("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(0.8, abs=1e-7)


def test_rouge_l_is_summary_level_over_sentences_split_on_periods() -> None:
    # hyp sentences "a b" and "c d" each share their words with the one reference sentence: union LCS = 4 of 4.
    assert rouge_score("a b. c d", "a b c d") == pytest.approx(1.0, abs=1e-7)
    # Word order matters within a sentence: LCS of "d c b a" and "a b c d" is one word: P = R = 1/4.
    assert rouge_score("d c b a", "a b c d") == pytest.approx(0.25, abs=1e-7)


def test_rouge_l_counts_repeated_words_once() -> None:
    assert rouge_score("the the the", "the") == pytest.approx(1.0, abs=1e-7)


def test_rouge_l_empty_hypothesis_scores_zero_like_the_official_bare_except() -> None:
    assert rouge_score("", "a summary") == 0.0
    assert rouge_score("...", "a summary") == 0.0  # only sentence separators


def test_rouge_zh_score_segments_before_rouge() -> None:
    assert rouge_zh_score("我爱北京", "我爱北京") == pytest.approx(1.0, abs=1e-7)
    assert rouge_zh_score("", "我爱北京") == 0.0


def test_count_score_is_the_fraction_of_correct_numbers() -> None:
    assert count_score("There are 3 or 4 paragraphs, I think 3", "3") == pytest.approx(2 / 3)
    assert count_score("no idea", "3") == 0.0
    assert count_score("13", "3") == 0.0  # whole numbers, not digits


def test_retrieval_scores() -> None:
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 1 or Paragraph 12", "Paragraph 12") == 0.5
    assert retrieval_score("Paragraph 2", "Paragraph 12") == 0.0
    assert retrieval_score("I cannot tell", "Paragraph 12") == 0.0
    assert retrieval_zh_score("段落3", "段落3") == 1.0
    assert retrieval_zh_score("段落3和段落5", "段落5") == 0.5
    with pytest.raises(ValueError, match="does not match the retrieval answer pattern"):
        retrieval_score("Paragraph 1", "1")


def test_code_sim_score_uses_the_first_non_comment_line() -> None:
    prediction = "\n```python\n# set x\nx = foo(1)\ny = 2\n"
    assert code_sim_score(prediction, "x = foo(1)") == 1.0
    # difflib ratio of "abcd" and "abce": 2 * 3 matches / 8 characters = 0.75
    assert code_sim_score("abcd", "abce") == 0.75
    assert code_sim_score("// only comments\n# here", "x = 1") == 0.0


def test_classification_score() -> None:
    classes = ["Entity", "Location", "Human being"]
    assert classification_score("Entity", "Entity", all_classes=classes) == 1.0
    assert classification_score("Entity or Location", "Entity", all_classes=classes) == 0.5
    assert classification_score("no class named", "Entity", all_classes=classes) == 0.0  # official: no fuzzy match


def test_classification_score_reproduces_the_official_remove_while_iterating() -> None:
    # Matches ["food", "seafood", "sea"]: removing "food" shifts the list, the loop then sees "sea" and
    # removes it too, leaving ["seafood"].
    assert classification_score("seafood", "seafood", all_classes=["food", "seafood", "sea"]) == 1.0
    # Matches ["sea", "food", "seafood"]: removing "sea" makes the loop skip "food", so it stays: 1/2.
    assert classification_score("seafood", "seafood", all_classes=["sea", "food", "seafood"]) == 0.5


def test_score_sample_takes_the_max_over_ground_truths_and_first_line_where_official() -> None:
    narrativeqa = get_spec("narrativeqa")
    assert score_sample(narrativeqa, "in 1342", ["1342", "in 1342"], None) == 1.0
    assert score_sample(narrativeqa, "1342\nextra words", ["1342"], None) < 1.0  # whole output scored
    triviaqa = get_spec("triviaqa")
    assert score_sample(triviaqa, "\n\nParis\nQuestion: next", ["Paris"], None) == 1.0  # first line only


def test_dataset_table_matches_the_official_configuration() -> None:
    assert len(LONGBENCH_V1_DATASETS) == 21 and len(LONGBENCH_E_DATASETS) == 13
    assert {n for n in LONGBENCH_V1_DATASETS if not DATASET_SPECS[n].use_chat_template} == {
        "trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p",
    }  # fmt: skip
    assert {n for n in LONGBENCH_V1_DATASETS if DATASET_SPECS[n].score_first_line} == {"trec", "triviaqa", "samsum", "lsht"}
    assert {n: DATASET_SPECS[n].max_new_tokens for n in ("narrativeqa", "qmsum", "passage_retrieval_en", "samsum")} == {
        "narrativeqa": 128, "qmsum": 512, "passage_retrieval_en": 32, "samsum": 128,
    }  # fmt: skip
    assert {n: DATASET_SPECS[n].metric for n in ("narrativeqa", "qmsum", "passage_retrieval_en")} == {
        "narrativeqa": "qa_f1_score", "qmsum": "rouge_score", "passage_retrieval_en": "retrieval_score",
    }  # fmt: skip
    assert all(spec.metric in METRICS for spec in DATASET_SPECS.values())
    assert DATASET_SPECS["qasper_e"].prompt_template == DATASET_SPECS["qasper"].prompt_template
    assert DATASET_SPECS["passage_retrieval_en"].prompt_template == (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        'the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
        "etc.\n\nThe answer is: "
    )
    with pytest.raises(ValueError, match="unknown LongBench dataset 'narrative_qa'"):
        get_spec("narrative_qa")
