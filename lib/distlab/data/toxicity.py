"""Stage 5b: toxicity / NSFW filtering with a trained classifier, or C4's blocklist.

C4 dropped every page containing any word of the "List of Dirty, Naughty, Obscene
and Otherwise Bad Words". Word lists are crude both ways: they drop innocent pages
("campus police had to escort him out", medical and LGBTQ+ pages, Dodge et al. 2021)
and miss abuse written in ordinary words. The default scorer here is a real
classifier that installs offline with its model: alt-profanity-check, a TF-IDF +
linear SVM trained on ~200k human-labelled offensive and clean texts, calibrated to a
probability. It was trained on short texts (comments, tweets), so a page is scored
line by line and its score is its worst line: one abusive line in a long page is not
averaged away. The blocklist stays available (``BlocklistScorer``; C4's list via
``--blocklist FILE``), and any callable ``text -> score in [0, 1]`` can be passed.

:func:`evaluate` measures a scorer on the lab's labelled sample
(:mod:`distlab.data.toxicity_sample`).
"""

from __future__ import annotations

import re
import time
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from distlab.data.document import Document, Ledger, Outcome, Stage
from distlab.data.toxicity_sample import SAMPLE

# A deliberately short default. For the C4 list: https://github.com/LDNOOBW/List-of-Dirty-Naughty-Obscene-and-Otherwise-Bad-Words
DEFAULT_BLOCKLIST = ("porn", "porno", "xxx", "nsfw", "camgirl", "camgirls", "hentai", "milf",
                     "nude", "nudes", "escort", "escorts", "sexcam")
DEFAULT_THRESHOLD = 0.5  # the classifier's calibrated decision point (its own predict() uses 0.5)
SCORERS = ("classifier", "blocklist")
_BATCH = 64


class BlocklistScorer:
    """1.0 if the text contains a blocklisted word (whole word, case-insensitive), else 0.0."""

    name = "blocklist"

    def __init__(self, words: Iterable[str] = DEFAULT_BLOCKLIST):
        self.words = sorted({w.strip().lower() for w in words if w.strip()})
        alternatives = "|".join(map(re.escape, self.words)) or r"(?!x)x"
        self.pattern = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)

    @classmethod
    def from_file(cls, path: str) -> "BlocklistScorer":
        with open(path, encoding="utf-8") as lines:
            return cls(lines)

    def __call__(self, text: str) -> float:
        return 1.0 if self.pattern.search(text) else 0.0


class ClassifierScorer:
    """alt-profanity-check's offensive-language classifier; a page scores as its worst line."""

    name = "classifier"

    def __init__(self, max_line_chars: int = 2000):
        self.max_line_chars = max_line_chars
        self._predict = None

    def line_scores(self, lines: Sequence[str]) -> np.ndarray:
        """P(offensive) of each line (the model loads on first use: importing scikit-learn takes a second)."""
        if self._predict is None:
            from profanity_check import predict_prob  # noqa: PLC0415  loads scikit-learn (a second)

            self._predict = predict_prob
        if not lines:
            return np.zeros(0)
        return np.asarray(self._predict([line[: self.max_line_chars] for line in lines]), dtype=float)

    def worst_lines(self, texts: Sequence[str]) -> list[tuple[float, str]]:
        """(score, line) of each text's worst line, all lines scored in one call (much faster batched)."""
        lines, owners = [], []
        for number, text in enumerate(texts):
            for line in text.split("\n"):
                if line.strip():
                    lines.append(line)
                    owners.append(number)
        worst = [(0.0, "")] * len(texts)
        for owner, score, line in zip(owners, self.line_scores(lines).tolist(), lines):
            if score > worst[owner][0]:
                worst[owner] = (score, line)
        return worst

    def score_batch(self, texts: Sequence[str]) -> list[float]:
        """One score per text: its worst line's."""
        return [score for score, _ in self.worst_lines(texts)]

    def __call__(self, text: str) -> float:
        return self.score_batch([text])[0]


def make_scorer(kind: str = "classifier", blocklist: Iterable[str] | None = None):
    """The scorer a pipeline configuration names: ``"classifier"`` or ``"blocklist"``."""
    if kind == "classifier":
        return ClassifierScorer()
    if kind == "blocklist":
        return BlocklistScorer(DEFAULT_BLOCKLIST if blocklist is None else blocklist)
    raise ValueError(f"unknown toxicity scorer {kind!r}: choose one of {', '.join(SCORERS)}")


class ToxicityFilter(Stage):
    """Reject documents whose toxicity score reaches ``threshold``; the reason names the scorer.

    A scorer with a ``worst_lines`` method is called on batches of documents (the
    stream stays lazy: a batch is scored when it is full or the input ends), and the
    line that decided a rejection is kept as its evidence."""

    name = "toxicity"

    def __init__(self, scorer: Callable[[str], float] | None = None, threshold: float = DEFAULT_THRESHOLD) -> None:
        super().__init__()
        self.scorer = scorer if scorer is not None else ClassifierScorer()
        self.threshold = threshold
        self.reason = getattr(self.scorer, "name", "classifier")

    def process(self, doc: Document) -> Outcome:
        return self._decide(doc, self.scorer(doc.text))

    def _decide(self, doc: Document, score: float, line: str = "") -> Outcome:
        if score >= self.threshold:
            doc.meta["toxicity_score"] = round(float(score), 4)
            if line:
                doc.meta["evidence"] = line[:200]  # the line that decided, for the rejection bucket
            return self.reason
        return doc

    def __call__(self, docs: Iterable[Document], ledger: Ledger) -> Iterator[Document]:
        if not hasattr(self.scorer, "worst_lines"):
            yield from super().__call__(docs, ledger)
            return
        batch: list[Document] = []
        for doc in docs:
            batch.append(doc)
            if len(batch) == _BATCH:
                yield from self._run_batch(batch, ledger)
                batch = []
        yield from self._run_batch(batch, ledger)

    def _run_batch(self, batch: list[Document], ledger: Ledger) -> Iterator[Document]:
        if not batch:
            return
        start = time.perf_counter()
        worst = self.scorer.worst_lines([doc.text for doc in batch])
        outcomes = [self._decide(doc, score, line) for doc, (score, line) in zip(batch, worst)]
        self.stats.seconds += time.perf_counter() - start
        for doc, outcome in zip(batch, outcomes):
            self.stats.docs_in += 1
            if isinstance(outcome, str):
                ledger.reject(doc, f"{self.name}:{outcome}")
            else:
                self.stats.docs_out += 1
                yield outcome


def evaluate(scorer: Callable[[str], float], sample=None, threshold: float = DEFAULT_THRESHOLD) -> dict:
    """Flag rate per label of the labelled sample, precision and recall of "toxic" (offensive or NSFW),
    and the sentences the scorer got wrong."""
    sample = SAMPLE if sample is None else sample
    texts = [text for _, text in sample]
    scores = scorer.score_batch(texts) if hasattr(scorer, "score_batch") else [scorer(text) for text in texts]
    flagged = [score >= threshold for score in scores]
    per_label: dict = {}
    for (label, _), hit in zip(sample, flagged):
        row = per_label.setdefault(label, {"flagged": 0, "total": 0})
        row["flagged"] += hit
        row["total"] += 1
    toxic = [label != "clean" for label, _ in sample]
    true_positives = sum(hit and bad for hit, bad in zip(flagged, toxic))
    return {"per_label": per_label,
            "precision": true_positives / max(sum(flagged), 1), "recall": true_positives / max(sum(toxic), 1),
            "wrong": [(label, text, round(float(score), 3))
                      for (label, text), score, hit in zip(sample, scores, flagged) if hit != (label != "clean")]}
