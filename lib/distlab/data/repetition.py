"""Stage 4b: the Gopher repetition rules (Rae et al. 2021, table A1).

Spam and boilerplate repeat themselves: the same line on every page section, the
same keyword phrase over and over. Gopher measures repetition at three scales -
whole lines and paragraphs, the single most frequent 2/3/4-gram, and all duplicated
5..10-grams - each as a fraction of the document's characters.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from distlab.data.document import Document, Outcome, Stage
from distlab.data.quality import split_words

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def duplicate_fractions(pieces: list[str]) -> tuple[float, float]:
    """(fraction of pieces that repeat an earlier one, fraction of their characters)."""
    seen: set[str] = set()
    duplicates = duplicate_chars = 0
    for piece in pieces:
        if piece in seen:
            duplicates += 1
            duplicate_chars += len(piece)
        else:
            seen.add(piece)
    total_chars = sum(map(len, pieces))
    return duplicates / max(len(pieces), 1), duplicate_chars / max(total_chars, 1)


def ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return list(zip(*(words[i:] for i in range(n))))


def top_ngram_char_fraction(words: list[str], n: int) -> float:
    """Characters covered by the most frequent n-gram (all its occurrences) / all word characters."""
    counts = Counter(ngrams(words, n))
    if not counts:
        return 0.0
    gram, count = counts.most_common(1)[0]
    if count < 2:
        return 0.0
    return count * sum(map(len, gram)) / max(sum(map(len, words)), 1)


def duplicate_ngram_char_fraction(words: list[str], n: int) -> float:
    """Characters of words inside any n-gram that occurs more than once / all word characters.

    Every occurrence of a repeated n-gram counts, and a word covered by overlapping
    repeated n-grams counts once (Gopher's definition)."""
    grams = ngrams(words, n)
    counts = Counter(grams)
    covered = bytearray(len(words))
    for start, gram in enumerate(grams):
        if counts[gram] > 1:
            covered[start:start + n] = b"\x01" * n
    total = sum(map(len, words))
    return sum(len(word) for word, hit in zip(words, covered) if hit) / max(total, 1)


@dataclass(frozen=True)
class GopherRepetitionRules:
    max_dup_line_frac: float = 0.30
    max_dup_para_frac: float = 0.30
    max_dup_line_char_frac: float = 0.20
    max_dup_para_char_frac: float = 0.20
    max_top_ngram_char_frac: dict = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    max_dup_ngram_char_frac: dict = field(default_factory=lambda: {
        5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10})

    def failure(self, text: str) -> str | None:
        """Name of the first repetition rule ``text`` breaks, or None."""
        lines = [line.strip() for line in text.split("\n") if line.strip()]
        line_frac, line_char_frac = duplicate_fractions(lines)
        if line_frac > self.max_dup_line_frac:
            return "dup_line_frac"
        paragraphs = [p.strip() for p in _PARAGRAPH_BREAK.split(text) if p.strip()]
        para_frac, para_char_frac = duplicate_fractions(paragraphs)
        if para_frac > self.max_dup_para_frac:
            return "dup_para_frac"
        if line_char_frac > self.max_dup_line_char_frac:
            return "dup_line_char_frac"
        if para_char_frac > self.max_dup_para_char_frac:
            return "dup_para_char_frac"
        words = split_words(text)
        for n, limit in self.max_top_ngram_char_frac.items():
            if top_ngram_char_fraction(words, n) > limit:
                return f"top_{n}gram_char_frac"
        for n, limit in self.max_dup_ngram_char_frac.items():
            if duplicate_ngram_char_fraction(words, n) > limit:
                return f"dup_{n}gram_char_frac"
        return None


GOPHER_REPETITION = GopherRepetitionRules()


def gopher_repetition_failure(text: str) -> str | None:
    return GOPHER_REPETITION.failure(text)


class GopherRepetitionFilter(Stage):
    name = "repetition"

    def __init__(self, rules: GopherRepetitionRules = GOPHER_REPETITION) -> None:
        super().__init__()
        self.rules = rules

    def process(self, doc: Document) -> Outcome:
        return self.rules.failure(doc.text) or doc
