"""Stage 4a: the Gopher quality rules (Rae et al. 2021, appendix A.1.1).

Cheap heuristics that remove most machine-generated and non-prose pages: too short
or too long, odd word lengths, symbol-heavy text (hashtags, ellipses), bullet-list
pages, teaser pages of truncated lines, text without letters, and text that lacks
the English stop words that any real sentence contains. Every rejection names the
rule that fired (the first one, in the order below).
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from distlab.data.document import Document, Outcome, Stage

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
BULLETS = ("•", "●", "○", "▪", "◦", "‣", "∙", "·", "-", "–", "—", "*", ">")
ELLIPSES = ("...", "…")
_PUNCTUATION = string.punctuation + "“”‘’«»…–—•·"


def split_words(text: str) -> list[str]:
    """Whitespace tokens with surrounding punctuation removed; pure punctuation dropped."""
    stripped = (token.strip(_PUNCTUATION) for token in text.split())
    return [word for word in stripped if word]


@dataclass(frozen=True)
class GopherQualityRules:
    """The thresholds, Gopher's values by default."""

    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_hash_per_word: float = 0.1
    max_ellipsis_per_word: float = 0.1
    max_bullet_lines: float = 0.9
    max_ellipsis_lines: float = 0.3
    min_alpha_words: float = 0.8
    min_stop_words: int = 2

    def failure(self, text: str) -> str | None:
        """Name of the first rule the text breaks, or None if it passes them all."""
        words = split_words(text)
        n_words = len(words)
        if not self.min_words <= n_words <= self.max_words:
            return "word_count"
        mean_length = sum(map(len, words)) / n_words
        if not self.min_mean_word_length <= mean_length <= self.max_mean_word_length:
            return "mean_word_length"
        if text.count("#") / n_words > self.max_hash_per_word:
            return "hash_ratio"
        if (text.count("...") + text.count("…")) / n_words > self.max_ellipsis_per_word:
            return "ellipsis_ratio"
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if sum(line.startswith(BULLETS) for line in lines) / len(lines) > self.max_bullet_lines:
            return "bullet_lines"
        if sum(line.endswith(ELLIPSES) for line in lines) / len(lines) > self.max_ellipsis_lines:
            return "ellipsis_lines"
        tokens = text.split()
        if sum(any(ch.isalpha() for ch in token) for token in tokens) / len(tokens) < self.min_alpha_words:
            return "alpha_words"
        if len(STOP_WORDS.intersection(word.lower() for word in words)) < self.min_stop_words:
            return "stop_words"
        return None


GOPHER = GopherQualityRules()


def gopher_quality_failure(text: str) -> str | None:
    """The first Gopher quality rule ``text`` breaks (Gopher thresholds), or None."""
    return GOPHER.failure(text)


def passes_quality(text: str) -> bool:
    return GOPHER.failure(text) is None


class GopherQualityFilter(Stage):
    name = "quality"

    def __init__(self, rules: GopherQualityRules = GOPHER) -> None:
        super().__init__()
        self.rules = rules

    def process(self, doc: Document) -> Outcome:
        return self.rules.failure(doc.text) or doc
