"""Stage 5b: toxicity / NSFW filtering, in the manner of C4.

C4 dropped every page containing any word of the "List of Dirty, Naughty, Obscene
and Otherwise Bad Words". Word lists are crude (they also drop medical and LGBTQ+
pages), so the filter takes any *scorer*: a callable ``text -> score in [0, 1]``.
The default scorer is a blocklist; a classifier (e.g. a fastText or transformer
toxicity model) drops in by passing ``ToxicityFilter(scorer=my_model)``.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Optional

from distlab.data.document import Document, Outcome, Stage

# A deliberately short default. For the C4 list: https://github.com/LDNOOBW/List-of-Dirty-Naughty-Obscene-and-Otherwise-Bad-Words
DEFAULT_BLOCKLIST = ("porn", "porno", "xxx", "nsfw", "camgirl", "camgirls", "hentai", "milf",
                     "nude", "nudes", "escort", "escorts", "sexcam")


class BlocklistScorer:
    """1.0 if the text contains a blocklisted word (whole word, case-insensitive), else 0.0."""

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


class ToxicityFilter(Stage):
    """Reject documents whose toxicity score reaches ``threshold``."""

    name = "toxicity"

    def __init__(self, scorer: Optional[Callable[[str], float]] = None, threshold: float = 0.5) -> None:
        super().__init__()
        self.scorer = scorer if scorer is not None else BlocklistScorer()
        self.threshold = threshold

    def process(self, doc: Document) -> Outcome:
        score = self.scorer(doc.text)
        if score >= self.threshold:
            doc.meta["toxicity_score"] = score
            return "blocklist" if isinstance(self.scorer, BlocklistScorer) else "classifier"
        return doc
