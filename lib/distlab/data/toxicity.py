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

The pipeline's default is :class:`PageScorer`, a *document-level* decision: one line
of a comment-trained model is a poor verdict on a whole page (it fires on a medical
explainer's "cells are damaged"), and the same model misses NSFW spam ("Click here for
free xxx videos." scores 0.01: its training data was abuse, not advertising). So a page
is abusive only when the lines the classifier flags make up a share of its characters
(``min_share``), and NSFW when a small adult-term rule fires (:class:`AdultContentRule`:
one unambiguous term, two distinct suggestive words in a line, or an unambiguous term in
the URL's host, as FineWeb's URL filter does).

:func:`evaluate` measures a scorer on the lab's labelled sample
(:mod:`distlab.data.toxicity_sample`); :func:`page_metrics` scores page decisions against
labels (the real pages the lab labelled by reading them are in ``real_page_labels.json``).
"""

from __future__ import annotations

import re
import time
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence
from urllib.parse import urlsplit

import numpy as np

from distlab.data.document import Document, Ledger, Outcome, Stage
from distlab.data.toxicity_sample import SAMPLE

# A deliberately short default. For the C4 list: https://github.com/LDNOOBW/List-of-Dirty-Naughty-Obscene-and-Otherwise-Bad-Words
DEFAULT_BLOCKLIST = ("porn", "porno", "xxx", "nsfw", "camgirl", "camgirls", "hentai", "milf",
                     "nude", "nudes", "escort", "escorts", "sexcam")
DEFAULT_THRESHOLD = 0.5  # the classifier's calibrated decision point (its own predict() uses 0.5)
# A page is abusive when flagged lines are at least this share of its characters: one abusive comment under an
# article (the generated toxic pages: ~3%) is caught, one misfired sentence in a long clean page (~1%) is not.
DEFAULT_MIN_SHARE = 0.02
# Adult terms with (almost) no innocent use: one is enough. Words with innocent uses (escort, nude, sex education,
# naked in a painting) count only when two distinct ones share a line.
ADULT_TERMS = ("porn", "porno", "pornhub", "xxx", "nsfw", "hentai", "camgirl", "camgirls", "sexcam", "sexcams",
               "milf", "milfs", "xvideos")
SUGGESTIVE_WORDS = ("sex", "sexy", "nude", "nudes", "naked", "horny", "erotic", "escort", "escorts", "hardcore",
                    "tits", "pussy", "cock", "slut", "sluts", "fuck", "fucked", "busty", "babes", "anal", "webcam",
                    "uncensored", "hookup")
SCORERS = ("page", "classifier", "blocklist")
_BATCH = 64


def nonblank_lines(texts: Sequence[str]) -> tuple[list[str], list[int]]:
    """Every non-blank line of a batch of texts and the index of the text it came from: scored in one classifier
    call (a batch is much faster than a call per page), then credited back to each page."""
    lines, owners = [], []
    for number, text in enumerate(texts):
        for line in text.split("\n"):
            if line.strip():
                lines.append(line)
                owners.append(number)
    return lines, owners

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
        lines, owners = nonblank_lines(texts)
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


class AdultContentRule:
    """NSFW spam by words: a line with one unambiguous adult term or two distinct suggestive words,
    or a URL whose host contains an unambiguous term (FineWeb's URL filter works on the URL alone)."""

    name = "adult"

    def __init__(self, terms: Iterable[str] = ADULT_TERMS, suggestive: Iterable[str] = SUGGESTIVE_WORDS):
        self.terms = frozenset(t.lower() for t in terms)
        self.suggestive = frozenset(w.lower() for w in suggestive)
        self._word = re.compile(r"[a-z]+")

    def line_hit(self, line: str) -> bool:
        words = set(self._word.findall(line.lower()))
        return bool(words & self.terms) or len(words & self.suggestive) >= 2

    def url_hit(self, url: str) -> bool:
        host = urlsplit(url).hostname or ""
        return any(term in host for term in self.terms)

    def evidence(self, text: str, url: str = "") -> str:
        """The first line (or the URL) that makes the page NSFW; "" if none does."""
        if url and self.url_hit(url):
            return url
        return next((line for line in text.split("\n") if line.strip() and self.line_hit(line)), "")

    def __call__(self, text: str) -> float:
        return 1.0 if self.evidence(text) else 0.0


class Verdict(NamedTuple):
    """A page-level decision: ``reason`` is None for a kept page, else "abuse" or "nsfw"."""

    reason: str | None
    share: float  # characters in lines the classifier flags / characters of the page
    worst: float  # the worst line's classifier score (what the line-level rule would compare with 0.5)
    evidence: str  # the line (or URL) that decided


class PageScorer:
    """Document-level toxicity: abuse when flagged lines (classifier >= ``line_threshold``) are at least
    ``min_share`` of the page's characters; NSFW when :class:`AdultContentRule` fires."""

    name = "page"

    def __init__(self, line_threshold: float = DEFAULT_THRESHOLD, min_share: float = DEFAULT_MIN_SHARE,
                 classifier: ClassifierScorer | None = None, adult: AdultContentRule | None = None):
        self.line_threshold, self.min_share = line_threshold, min_share
        self.classifier = classifier if classifier is not None else ClassifierScorer()
        self.adult = adult if adult is not None else AdultContentRule()

    def assess(self, texts: Sequence[str], urls: Sequence[str] | None = None) -> list[Verdict]:
        """One verdict per text, every line of the batch scored in one classifier call."""
        urls = [""] * len(texts) if urls is None else urls
        lines, owners = nonblank_lines(texts)
        flagged_chars, total_chars = [0] * len(texts), [0] * len(texts)
        worst = [(0.0, "")] * len(texts)
        for owner, score, line in zip(owners, self.classifier.line_scores(lines).tolist(), lines):
            total_chars[owner] += len(line)
            if score >= self.line_threshold:
                flagged_chars[owner] += len(line)
            if score > worst[owner][0]:
                worst[owner] = (score, line)
        verdicts = []
        for number, (text, url) in enumerate(zip(texts, urls)):
            share = flagged_chars[number] / max(total_chars[number], 1)
            nsfw = self.adult.evidence(text, url)
            if share >= self.min_share and share > 0:
                verdicts.append(Verdict("abuse", share, worst[number][0], worst[number][1]))
            elif nsfw:
                verdicts.append(Verdict("nsfw", share, worst[number][0], nsfw))
            else:
                verdicts.append(Verdict(None, share, worst[number][0], ""))
        return verdicts

    def __call__(self, text: str) -> float:
        return 0.0 if self.assess([text])[0].reason is None else 1.0


def make_scorer(kind: str = "page", blocklist: Iterable[str] | None = None,
                threshold: float = DEFAULT_THRESHOLD):
    """The scorer a pipeline configuration names: ``"page"``, ``"classifier"`` or ``"blocklist"``."""
    if kind == "page":
        return PageScorer(line_threshold=threshold)
    if kind == "classifier":
        return ClassifierScorer()
    if kind == "blocklist":
        return BlocklistScorer(DEFAULT_BLOCKLIST if blocklist is None else blocklist)
    raise ValueError(f"unknown toxicity scorer {kind!r}: choose one of {', '.join(SCORERS)}")


class ToxicityFilter(Stage):
    """Reject documents whose toxicity score reaches ``threshold``; the reason names the scorer.

    A scorer with a ``worst_lines`` method (or a page scorer's ``assess``) is called on
    batches of documents (the stream stays lazy: a batch is scored when it is full or the
    input ends), and the line that decided a rejection is kept as its evidence. A page
    scorer decides itself; its reason is ``abuse`` or ``nsfw``."""

    name = "toxicity"

    def __init__(self, scorer: Callable[[str], float] | None = None, threshold: float = DEFAULT_THRESHOLD) -> None:
        super().__init__()
        self.scorer = scorer if scorer is not None else PageScorer(line_threshold=threshold)
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

    @staticmethod
    def _page_decision(doc: Document, verdict: Verdict) -> Outcome:
        if verdict.reason is None:
            return doc
        doc.meta["toxicity_share"] = round(verdict.share, 4)
        doc.meta["evidence"] = verdict.evidence[:200]
        return verdict.reason

    def __call__(self, docs: Iterable[Document], ledger: Ledger) -> Iterator[Document]:
        if not hasattr(self.scorer, "worst_lines") and not hasattr(self.scorer, "assess"):
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
        if hasattr(self.scorer, "assess"):
            verdicts = self.scorer.assess([doc.text for doc in batch], [doc.url for doc in batch])
            outcomes = [self._page_decision(doc, verdict) for doc, verdict in zip(batch, verdicts)]
        else:
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
    if hasattr(scorer, "assess"):  # a page scorer decides itself; each sentence is a one-line page
        scores = [0.0 if verdict.reason is None else 1.0 for verdict in scorer.assess(texts)]
    else:
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


def page_metrics(flagged: Sequence[bool], toxic: Sequence[bool]) -> dict:
    """Precision, recall and false-positive rate of page decisions against labels; a rate whose
    denominator is zero (nothing flagged, no toxic page, no clean page) is None, not a made-up 0 or 1."""
    pairs = list(zip(flagged, toxic))
    true_pos = sum(f and t for f, t in pairs)
    false_pos = sum(f and not t for f, t in pairs)
    positives, negatives, hits = sum(t for _, t in pairs), sum(not t for _, t in pairs), sum(f for f, _ in pairs)
    return {"pages": len(pairs), "toxic": positives, "flagged": hits, "true_positives": true_pos,
            "false_positives": false_pos,
            "precision": true_pos / hits if hits else None, "recall": true_pos / positives if positives else None,
            "false_positive_rate": false_pos / negatives if negatives else None}
