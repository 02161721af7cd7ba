"""Exact line-level deduplication across the corpus, as C4, CCNet and Dolma do it.

Document-level dedup (URL, MinHash) removes pages that are copies of each other. It
leaves the text that *every* page of a site repeats: cookie banners, navigation bars,
"Share this article", copyright footers. Those lines are not near-duplicate pages, but
a model trained on them learns to emit cookie banners. The remedy is global and
simple: count in how many documents each line occurs (its document frequency), and
remove a line that occurs in ``min_documents`` or more documents from *every*
document. A page left with too little of its own text is then rejected.

Only the corpus can say which lines repeat, so this is a two-pass stage: :meth:`LineDedup.fit`
counts over all documents, then the stage strips them one by one. It runs after near
dedup: copies of a page are gone by then, so an article syndicated on three sites is
one document, and its paragraphs are not mistaken for boilerplate.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

from distlab.data.document import Document, Outcome, Stage
from distlab.data.quality import GOPHER, split_words

DEFAULT_MIN_DOCUMENTS = 3
_BLANK_RUNS = re.compile(r"\n(?:[ \t]*\n)+")


def line_key(line: str) -> str | None:
    """What counts as "the same line": the line without surrounding whitespace; None if blank."""
    key = line.strip()
    return key or None


def document_frequencies(texts: Iterable[str]) -> Counter:
    """For each line, the number of documents it occurs in (a line repeated inside one document counts once)."""
    counts: Counter = Counter()
    for text in texts:
        counts.update({key for key in map(line_key, text.split("\n")) if key})
    return counts


def strip_lines(text: str, repeated) -> tuple[str, int, int]:
    """``text`` without the lines whose key is in ``repeated``: (new text, lines removed, UTF-8 bytes removed).

    A text that loses no line is returned unchanged; otherwise the blank lines left
    behind are collapsed to one (paragraphs stay paragraphs) and the ends stripped."""
    kept, removed, removed_bytes = [], 0, 0
    for line in text.split("\n"):
        if line_key(line) in repeated:
            removed += 1
            removed_bytes += len(line.encode("utf-8"))
        else:
            kept.append(line)
    if not removed:
        return text, 0, 0
    return _BLANK_RUNS.sub("\n\n", "\n".join(kept)).strip(), removed, removed_bytes


def remove_repeated_lines(texts: list[str], min_documents: int = DEFAULT_MIN_DOCUMENTS) -> tuple[list[str], int, int]:
    """Remove every line that occurs in ``min_documents`` or more of ``texts`` from all of them.

    Returns (new texts, lines removed, UTF-8 bytes removed): the reference for exercise 10.5."""
    if min_documents < 2:
        raise ValueError(f"min_documents must be at least 2 (a line in 1 document is not repeated), "
                         f"got {min_documents}")
    frequencies = document_frequencies(texts)
    repeated = {key for key, count in frequencies.items() if count >= min_documents}
    new_texts, lines, size = [], 0, 0
    for text in texts:
        new_text, removed, removed_bytes = strip_lines(text, repeated)
        new_texts.append(new_text)
        lines += removed
        size += removed_bytes
    return new_texts, lines, size


class LineDedup(Stage):
    """Strips corpus-wide repeated lines; rejects a page left with fewer than ``min_words`` words.

    Call :meth:`fit` on all documents first. Lines and bytes removed are the stage's
    counters (``lines_removed``, ``bytes_removed``, ``documents_changed``)."""

    name = "line_dedup"

    def __init__(self, min_documents: int = DEFAULT_MIN_DOCUMENTS, min_words: int = GOPHER.min_words) -> None:
        super().__init__()
        if min_documents < 2:
            raise ValueError(f"min_documents must be at least 2, got {min_documents}")
        self.min_documents = min_documents
        self.min_words = min_words
        self.repeated: set | None = None

    def fit(self, docs: Iterable[Document]) -> "LineDedup":
        return self.use(self.repeated_lines(document_frequencies(doc.text for doc in docs)))

    def repeated_lines(self, frequencies: Counter) -> set:
        """The lines of ``frequencies`` (line -> documents it occurs in) that this stage removes. A distributed
        engine counts the corpus in hash partitions and asks each partition's counts in turn."""
        return {key for key, count in frequencies.items() if count >= self.min_documents}

    def use(self, repeated: set) -> "LineDedup":
        """Remove these lines (what :meth:`fit` found, or the union of partitions' :meth:`repeated_lines`)."""
        self.repeated = repeated
        self.stats.counters["repeated_lines"] = len(repeated)
        return self

    def process(self, doc: Document) -> Outcome:
        if self.repeated is None:
            raise RuntimeError("LineDedup.fit(documents) must run before the stage: it needs the whole corpus")
        text, removed, removed_bytes = strip_lines(doc.text, self.repeated)
        if not removed:
            return doc
        self.stats.counters.update(lines_removed=removed, bytes_removed=removed_bytes, documents_changed=1)
        doc.meta["lines_removed"] = removed
        if len(split_words(text)) < self.min_words:
            return "too_short"
        doc.text = text
        return doc
