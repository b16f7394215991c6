"""Optional dependency groups (pyproject's extras) of the offline tools, and the one-line refusal when one is
missing. The serving plugin needs none of them."""

from __future__ import annotations

import importlib.util

# extra -> the modules its tool needs before it starts (the pip names are the same)
EXTRAS: dict[str, tuple[str, ...]] = {
    "longbench": ("httpx", "rouge", "fuzzywuzzy"),  # jieba too, for the zh datasets only (metrics.py says so)
    "moefy": ("gguf", "gensim", "scipy"),
}
DISTRIBUTION = "pagedweight-sglang"


def missing_modules(extra: str) -> list[str]:
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require_extra(extra: str, command: str) -> None:
    """Exit with one line naming the missing packages and the install command, before the tool does anything."""
    missing = missing_modules(extra)
    if missing:
        raise SystemExit(f"{command}: needs the {extra} extra ({', '.join(missing)} not installed): "
                         f"pip install '{DISTRIBUTION}[{extra}]'")
