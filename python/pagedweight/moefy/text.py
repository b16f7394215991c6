"""English calibration and evaluation text from gensim's package data, with disjoint splits.

Two text kinds, so experiments can calibrate on one and evaluate on the other (workload shift):

- "wiki": the Wikipedia extract `enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`
  (about 100 articles after dropping redirects), wiki markup stripped with gensim's `filter_wiki`.
- "news": `lee_background.cor` (Lee et al. news corpus, 299 one-line articles) plus `lee.cor` (49 more).

Documents, never fragments of one, are assigned to a split by a stable hash of their content, so the
calibration and evaluation texts share no document and the split does not depend on file order or on
the Python hash seed. About one document in five goes to evaluation.
"""

from __future__ import annotations

import bz2
import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

TextKind = Literal["wiki", "news"]
TEXT_KINDS: tuple[str, ...] = ("wiki", "news")
Split = Literal["calibration", "evaluation"]

WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
NEWS_FILES: tuple[str, ...] = ("lee_background.cor", "lee.cor")
EVALUATION_BUCKETS = 2  # of 10: the share of documents held out for evaluation
DOCUMENT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Document:
    title: str
    text: str

    @property
    def split(self) -> Split:
        bucket = zlib.crc32(self.title.encode("utf-8")) % 10
        return "evaluation" if bucket < EVALUATION_BUCKETS else "calibration"


def gensim_test_data_dir() -> Path:
    try:
        import gensim
    except ImportError as error:  # the text is part of gensim's wheel; there is no other source
        raise ImportError("pagedweight.moefy.text needs gensim (`pip install gensim`)") from error
    path = Path(gensim.__file__).parent / "test" / "test_data"
    if not path.is_dir():
        raise FileNotFoundError(f"gensim is installed but has no test data directory at {path}")
    return path


_WIKI_QUOTES = re.compile(r"'{2,}")
_WIKI_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.MULTILINE)
_EMPTY_PARENS = re.compile(r"\(\s*[;,]?\s*\)")
_SPACES = re.compile(r"[ \t]+")
_BLANK_LINES = re.compile(r"\n\s*\n+")


def clean_wiki_text(raw: str) -> str:
    """Plain prose from wiki markup: gensim's filter_wiki, then the bold/italic quotes and headings."""
    from gensim.corpora.wikicorpus import filter_wiki

    text = filter_wiki(raw)
    text = _WIKI_QUOTES.sub("", text)
    text = _WIKI_HEADING.sub(r"\1", text)
    text = _EMPTY_PARENS.sub("", text)  # filter_wiki leaves "( ; )" where foreign-script templates were
    text = _SPACES.sub(" ", text)
    text = "\n".join(line.strip() for line in text.splitlines())
    return _BLANK_LINES.sub("\n\n", text).strip()


@lru_cache(maxsize=None)
def documents(kind: TextKind) -> tuple[Document, ...]:
    """All documents of one text kind, in file order."""
    data_dir = gensim_test_data_dir()
    if kind == "wiki":
        from gensim.corpora.wikicorpus import extract_pages

        docs = []
        with bz2.open(data_dir / WIKI_FILE) as handle:
            for title, raw, _page_id in extract_pages(handle):
                if raw.lstrip().upper().startswith("#REDIRECT"):
                    continue
                text = clean_wiki_text(raw)
                if len(text) >= 200:  # stubs and disambiguation leftovers are not prose
                    docs.append(Document(title=title, text=text))
        return tuple(docs)
    if kind == "news":
        docs = []
        for file_name in NEWS_FILES:
            lines = (data_dir / file_name).read_text(encoding="utf-8", errors="replace").splitlines()
            for index, line in enumerate(lines):
                if line.strip():
                    docs.append(Document(title=f"{file_name}:{index}", text=line.strip()))
        return tuple(docs)
    raise ValueError(f"unknown text kind {kind!r}; choose one of {', '.join(TEXT_KINDS)}")


def split_text(kind: TextKind, split: Split, max_chars: int | None = None) -> str:
    """The documents of one split joined by blank lines, optionally cut at a document boundary."""
    if split not in ("calibration", "evaluation"):
        raise ValueError(f"unknown split {split!r}")
    if max_chars is not None and max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    parts: list[str] = []
    length = 0
    for doc in documents(kind):
        if doc.split != split:
            continue
        if max_chars is not None and parts and length + len(doc.text) > max_chars:
            break
        parts.append(doc.text)
        length += len(doc.text) + len(DOCUMENT_SEPARATOR)
    text = DOCUMENT_SEPARATOR.join(parts)
    return text[:max_chars] if max_chars is not None else text


def calibration_text(kind: TextKind = "wiki", max_chars: int | None = None) -> str:
    """Text for calibration (router fitting, sensitivity statistics); disjoint from evaluation_text."""
    return split_text(kind, "calibration", max_chars)


def evaluation_text(kind: TextKind = "wiki", max_chars: int | None = None) -> str:
    """Held-out text for perplexity / KL measurements; disjoint from calibration_text."""
    return split_text(kind, "evaluation", max_chars)
