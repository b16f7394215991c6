"""Small LongBench-format data files for tests and smoke runs, generated without any download.

The real LongBench data cannot be fetched everywhere, so this writes files in the official layout
(one JSONL per dataset; fields input, context, answers, length, dataset, language, all_classes, _id) that
exercise the same code path. The text is a seeded, procedurally generated gazetteer of fictional towns:
every paragraph carries checkable facts (name, river, founding year, trade), so a capable model can
answer, and a test double can answer deterministically by reading the prompt.

Files written (names decide the official template, generation length and metric):
  passage_retrieval_en.jsonl   30 paragraphs + a paraphrased abstract of one; answer "Paragraph k"
  passage_retrieval_en_e.jsonl the same at 20/60/120 paragraphs, so LongBench-E length buckets fill
  passkey.jsonl                a 5-digit pass key hidden at varying depth in filler (project-defined task)
  narrativeqa.jsonl            a story of several paragraphs and a founding-year question
  qmsum.jsonl                  a meeting transcript and a query with a one-sentence reference answer
`length` is the context's word count, as in LongBench's English files.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "st", "tr", "gr")
_VOWELS = ("a", "e", "i", "o", "u", "ei", "ou", "ia")
_CODAS = ("", "n", "r", "s", "l", "m", "th", "nd", "rk")
_TRADES = (
    ("glassmaking", "glass"), ("wool weaving", "cloth"), ("salt mining", "salt"), ("shipbuilding", "ships"),
    ("clockmaking", "clocks"), ("paper milling", "paper"), ("cheese making", "cheese"), ("bell founding", "bells"),
    ("tanning", "leather"), ("rope making", "rope"), ("brewing", "beer"), ("pottery", "pots"),
)  # fmt: skip
_LANDMARKS = ("a stone bridge", "a watermill", "a covered market", "a bell tower", "a lighthouse", "an old granary")
_SEASONS = ("spring", "summer", "autumn", "winter")
_PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass(frozen=True)
class Town:
    name: str
    river: str
    founded: int
    trade: str
    product: str
    landmark: str
    population: int
    festival_season: str

    def paragraph(self) -> str:
        return (
            f"{self.name} is a small town on the banks of the {self.river}. It was founded in {self.founded} by "
            f"settlers who came up the river in search of good land. For centuries its people lived from "
            f"{self.trade}, and the {self.product} made in {self.name} went to markets far away. The town is known "
            f"for {self.landmark}, which visitors still come to see. Today about {self.population} people live "
            f"there, and every {self.festival_season} the town holds a festival that lasts three days."
        )

    def abstract(self) -> str:
        # A paraphrase: same facts, different words, so retrieval cannot be done by copying a sentence.
        return (
            f"This passage describes {self.name}, a river settlement on the {self.river} dating back to "
            f"{self.founded}, whose economy long depended on {self.product}."
        )


def _name(rng: random.Random) -> str:
    syllables = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(2, 3))]
    return "".join(syllables).capitalize()


def make_towns(rng: random.Random, count: int) -> list[Town]:
    names: set[str] = set()
    towns = []
    while len(towns) < count:
        name = _name(rng)
        # Names must be unique and not contain each other, so a name identifies one paragraph.
        if name in names or any(name.lower() in n.lower() or n.lower() in name.lower() for n in names):
            continue
        names.add(name)
        trade, product = rng.choice(_TRADES)
        towns.append(
            Town(
                name=name,
                river=f"river {_name(rng)}",
                founded=rng.randint(1100, 1899),
                trade=trade,
                product=product,
                landmark=rng.choice(_LANDMARKS),
                population=rng.randint(800, 40000),
                festival_season=rng.choice(_SEASONS),
            )
        )
    return towns


def _sample_id(dataset: str, index: int, context: str) -> str:
    return hashlib.sha256(f"{dataset}/{index}/{context}".encode()).hexdigest()[:48]


def _record(dataset: str, index: int, context: str, input_: str, answers: list[str]) -> dict[str, Any]:
    return {
        "input": input_,
        "context": context,
        "answers": answers,
        "length": len(context.split()),
        "dataset": dataset,
        "language": "en",
        "all_classes": None,
        "_id": _sample_id(dataset, index, context),
    }


def passage_retrieval_sample(rng: random.Random, dataset: str, index: int, paragraphs: int) -> dict[str, Any]:
    towns = make_towns(rng, paragraphs)
    target = rng.randrange(paragraphs)
    # The official files number paragraphs "Paragraph 1: ..." separated by blank lines.
    context = "\n\n".join(f"Paragraph {i + 1}: {town.paragraph()}" for i, town in enumerate(towns))
    return _record(dataset, index, context, towns[target].abstract(), [f"Paragraph {target + 1}"])


def passkey_sample(rng: random.Random, index: int, filler_repeats: int) -> dict[str, Any]:
    key = rng.randint(10000, 99999)
    depth = rng.randint(0, filler_repeats)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    parts = [_PASSKEY_FILLER] * filler_repeats
    parts.insert(depth, needle)
    return _record("passkey", index, " ".join(parts), "What is the pass key? The pass key is", [str(key)])


def narrativeqa_sample(rng: random.Random, index: int, paragraphs: int) -> dict[str, Any]:
    towns = make_towns(rng, paragraphs)
    town = rng.choice(towns)
    story = "\n\n".join(t.paragraph() for t in towns)
    question = f"In which year was {town.name} founded?"
    return _record("narrativeqa", index, story, question, [str(town.founded), f"in {town.founded}"])


def qmsum_sample(rng: random.Random, index: int, turns: int) -> dict[str, Any]:
    towns = make_towns(rng, turns)
    speakers = ("Project Manager", "Marketing", "Industrial Designer", "User Interface")
    lines = []
    for i, town in enumerate(towns):
        speaker = speakers[i % len(speakers)]
        lines.append(
            f"{speaker}: I looked into {town.name} on the {town.river}. They have done {town.trade} since "
            f"{town.founded}, and about {town.population} people live there now."
        )
    chosen = rng.choice(towns)
    query = f"What did the group say about {chosen.name}?"
    answer = (
        f"The group noted that {chosen.name} lies on the {chosen.river}, has done {chosen.trade} since "
        f"{chosen.founded}, and has about {chosen.population} inhabitants."
    )
    return _record("qmsum", index, "\n".join(lines), query, [answer])


@dataclass(frozen=True)
class FixtureOptions:
    samples_per_file: int = 6
    retrieval_paragraphs: int = 30
    passkey_filler_repeats: int = 200
    story_paragraphs: int = 8
    transcript_turns: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("samples_per_file", "retrieval_paragraphs", "passkey_filler_repeats", "story_paragraphs", "transcript_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def make_fixtures(out_dir: Path, options: FixtureOptions = FixtureOptions()) -> dict[str, Path]:
    """Write the fixture files into out_dir; returns dataset name -> path. Same seed, same bytes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = options.samples_per_file
    e_paragraphs = (20, 60, 120)  # ~1.4k, ~4.2k and ~8.4k words: one sample per LongBench-E bucket
    builders: dict[str, Callable[[random.Random, int], dict[str, Any]]] = {
        "passage_retrieval_en": lambda r, i: passage_retrieval_sample(r, "passage_retrieval_en", i, options.retrieval_paragraphs),
        "passage_retrieval_en_e": lambda r, i: passage_retrieval_sample(r, "passage_retrieval_en_e", i, e_paragraphs[i % 3]),
        "passkey": lambda r, i: passkey_sample(r, i, options.passkey_filler_repeats),
        "narrativeqa": lambda r, i: narrativeqa_sample(r, i, options.story_paragraphs),
        "qmsum": lambda r, i: qmsum_sample(r, i, options.transcript_turns),
    }
    written = {}
    for dataset, build in builders.items():
        # One generator per file, so changing one file's options leaves the others unchanged.
        rng = random.Random(f"{options.seed}/{dataset}")
        path = out_dir / f"{dataset}.jsonl"
        _write_jsonl(path, [build(rng, i) for i in range(n)])
        written[dataset] = path
    return written
