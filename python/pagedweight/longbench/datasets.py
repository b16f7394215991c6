"""The LongBench v1 / LongBench-E dataset table: prompt template, generation length, metric, language.

Everything here is copied from THUDM/LongBench (v1, now under LongBench/ in that repository):
  * prompt templates   -- config/dataset2prompt.json
  * generation lengths -- config/dataset2maxlen.json
  * metric per dataset -- eval.py `dataset2metric`
  * the six datasets that get no chat template -- pred.py, `get_pred`:
        if dataset not in ["trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"]:
            prompt = build_chat(tokenizer, prompt, model_name)
  * the four datasets scored on the first line of the output -- eval.py `scorer`:
        if dataset in ["trec", "triviaqa", "samsum", "lsht"]:
            prediction = prediction.lstrip('\\n').split('\\n')[0]
  * the LongBench-E dataset list -- pred.py (`if args.e: datasets = [...]`), files named `{dataset}_e.jsonl`.

The narrativeqa template keeps the official "asconcisely" typo on purpose: scores are only comparable to
published LongBench numbers if the prompt is byte-identical to config/dataset2prompt.json.

One project-defined synthetic task, `passkey`, is also listed (official=False). It is not part of
LongBench; the fixture generator produces it and reports mark it as synthetic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DatasetSpec:
    """How one dataset is prompted, generated and scored."""

    name: str
    prompt_template: str  # str.format template with {context} and {input}
    max_new_tokens: int
    metric: str  # a key of pagedweight.longbench.metrics.METRICS
    language: str  # "en" or "zh"
    use_chat_template: bool
    score_first_line: bool
    official: bool = True


# config/dataset2prompt.json (THUDM/LongBench), verbatim.
_PROMPTS: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是：",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# config/dataset2maxlen.json (THUDM/LongBench), verbatim.
_MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

# eval.py `dataset2metric` (THUDM/LongBench).
_METRICS: dict[str, str] = {
    "narrativeqa": "qa_f1_score",
    "qasper": "qa_f1_score",
    "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score",
    "hotpotqa": "qa_f1_score",
    "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score",
    "dureader": "rouge_zh_score",
    "gov_report": "rouge_score",
    "qmsum": "rouge_score",
    "multi_news": "rouge_score",
    "vcsum": "rouge_zh_score",
    "trec": "classification_score",
    "triviaqa": "qa_f1_score",
    "samsum": "rouge_score",
    "lsht": "classification_score",
    "passage_retrieval_en": "retrieval_score",
    "passage_count": "count_score",
    "passage_retrieval_zh": "retrieval_zh_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}

_ZH_DATASETS = frozenset({"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"})
_NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
_FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})

# pred.py, in this order (the order of the LongBench paper's tables).
LONGBENCH_V1_DATASETS: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
    "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
    "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p",
)  # fmt: skip
LONGBENCH_E_BASE_DATASETS: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
    "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
LONGBENCH_E_DATASETS: tuple[str, ...] = tuple(f"{name}_e" for name in LONGBENCH_E_BASE_DATASETS)

# Project-defined synthetic task (not LongBench): find a number hidden in filler text. count_score gives
# the fraction of numbers in the answer that equal the key, so "The pass key is 71432." scores 1.0.
PASSKEY_SPEC = DatasetSpec(
    name="passkey",
    prompt_template=(
        "There is an important piece of information hidden inside a lot of irrelevant text. "
        "Find it and memorize it.\n\n{context}\n\n{input}"
    ),
    max_new_tokens=32,
    metric="count_score",
    language="en",
    use_chat_template=True,
    score_first_line=False,
    official=False,
)


def _official_spec(base_name: str, file_name: str) -> DatasetSpec:
    return DatasetSpec(
        name=file_name,
        prompt_template=_PROMPTS[base_name],
        max_new_tokens=_MAX_NEW_TOKENS[base_name],
        metric=_METRICS[base_name],
        language="zh" if base_name in _ZH_DATASETS else "en",
        use_chat_template=base_name not in _NO_CHAT_TEMPLATE,
        score_first_line=base_name in _FIRST_LINE,
    )


DATASET_SPECS: dict[str, DatasetSpec] = {
    **{name: _official_spec(name, name) for name in LONGBENCH_V1_DATASETS},
    **{f"{name}_e": _official_spec(name, f"{name}_e") for name in LONGBENCH_E_BASE_DATASETS},
    PASSKEY_SPEC.name: PASSKEY_SPEC,
}


def is_longbench_e(name: str) -> bool:
    """LongBench-E files are scored in length buckets as well as overall (eval.py `scorer_e`)."""
    return name in LONGBENCH_E_DATASETS


def get_spec(name: str) -> DatasetSpec:
    try:
        return DATASET_SPECS[name]
    except KeyError:
        known = ", ".join(DATASET_SPECS)
        raise ValueError(
            f"unknown LongBench dataset {name!r}; known datasets are: {known}. "
            "The name is the data file's name without '.jsonl' (LongBench-E files end in '_e')."
        ) from None
