"""Lab 10: a table of wrong answers students write, each run through ``distlab.check``: it fails, and the message
names the mistake (the rule, the case or what to look at), not only a number; the right answers pass.

Each wrong answer is the smallest change to a right one that a student plausibly makes (a '>=' for a '>', one
stop word instead of two, characters for bytes, the EOT after a document instead of before...). Several are the
library's answer with that one mistake applied to its output, which is exactly what the checker sees.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

import distlab
from distlab.data import dedup, line_dedup, pii, quality, shards
from distlab.grading.lab10 import EXERCISES

# ---------------------------------------------------------------- 10.1 Gopher quality rules


def forgets_stop_words(text):
    return quality.gopher_quality_failure(text) in (None, "stop_words")


def one_stop_word_is_enough(text):
    words = quality.split_words(text)
    return quality.gopher_quality_failure(text) in (None, "stop_words") and bool(
        quality.STOP_WORDS & {w.lower() for w in words})


def hash_ratio_inclusive(text):  # '>=' instead of '>': rejects a page with exactly 10% hashtags
    words = quality.split_words(text)
    return quality.passes_quality(text) and not (words and text.count("#") / len(words) >= 0.1)


def alphabetic_ratio_over_words(text):
    """Issue 46 item 26: the 80% alphabetic rule over split_words (pure punctuation dropped), not whitespace tokens."""
    failure = quality.gopher_quality_failure(text)
    if failure not in (None, "alpha_words"):
        return False
    words = quality.split_words(text)
    return sum(any(ch.isalpha() for ch in w) for w in words) / len(words) >= 0.8


def only_ascii_ellipses(text):  # counts '...' but not the single character '…'
    return quality.passes_quality(text.replace("…", ","))


def fifty_words_is_too_few(text):  # 50 < words instead of 50 <= words
    return quality.passes_quality(text) and len(quality.split_words(text)) > 50


def mean_word_length_floored(text):  # // for /: a mean of 10.5 letters becomes 10, inside the limit
    words = quality.split_words(text)
    if quality.gopher_quality_failure(text) not in (None, "mean_word_length") or not words:
        return False
    return 3 <= sum(len(w) for w in words) // len(words) <= 10


def mean_word_length_exclusive(text):  # 3 < mean instead of 3 <= mean: a page of 3-letter words is rejected
    words = quality.split_words(text)
    return quality.passes_quality(text) and sum(len(w) for w in words) / len(words) > 3


def one_word_too_many_allowed(text):  # 100_001 for 100_000
    failure = quality.gopher_quality_failure(text)
    return failure is None or (failure == "word_count" and 50 <= len(quality.split_words(text)) <= 100_001)


# ---------------------------------------------------------------- 10.2 PII patterns


def cards_without_luhn(text):
    scrubbed, counts = pii.scrub_pii(text)
    if re.search(r"Order number [\d ]+", scrubbed):
        counts["card"] += 1
    return re.sub(r"Order number [\d ]+", "Order number <CARD_NUMBER>", scrubbed), counts


def clock_time_as_ipv6(text):  # an IPv6 pattern with no ipaddress validation
    scrubbed, counts = pii.scrub_pii(text)
    new = re.sub(r"\b\d{1,2}:\d{2}:\d{2}\b", "<IP_ADDRESS>", scrubbed)
    if new != scrubbed:
        counts["ipv6"] += 1
    return new, counts


def ipv4_cannot_end_a_sentence(text):
    scrubbed, counts = pii.scrub_pii(text)
    return re.sub(r"<IP_ADDRESS>\.$", "", scrubbed), counts


def country_code_left_outside(text):  # '1-800-...' becomes '1-<PHONE>'
    scrubbed, counts = pii.scrub_pii(text)
    if re.search(r"\b1-800-\d{3}-\d{4}", text):
        scrubbed = scrubbed.replace("Toll free: <PHONE>", "Toll free: 1-<PHONE>")
    return scrubbed, counts


def counts_as_one_kind(text):  # every placeholder counted under "pii"
    scrubbed, counts = pii.scrub_pii(text)
    return scrubbed, Counter({"pii": sum(counts.values())}) if counts else counts


# ---------------------------------------------------------------- 10.3 MinHash + LSH


class Reference:
    threshold = dedup.DEFAULT_THRESHOLD

    def __init__(self, bands=16, rows=8):
        self.inner = dedup.Deduper(threshold=self.threshold, bands=bands, rows=rows)

    def is_duplicate(self, doc_id, text):
        return self.inner.is_duplicate(doc_id, text)


class TooFewBands(Reference):
    """4 bands x 32 rows: a pair at J = 0.9 is a candidate only 14% of the time."""

    def __init__(self):
        super().__init__(bands=4, rows=32)


class CandidatesUnverified(Reference):
    """The LSH's 16 x 8 bands, and every candidate taken for a duplicate without its estimated Jaccard."""

    def is_duplicate(self, doc_id, text):
        sketch = self.inner.signature(text)
        if self.inner.lsh.query(sketch):
            return True
        self.inner.lsh.insert(doc_id, sketch)
        return False


class UnverifiedCandidates(CandidatesUnverified):
    """32 bands x 4 rows and no Jaccard check: every loose candidate counts as a duplicate."""

    def __init__(self):
        super().__init__(bands=32, rows=4)


class NeverInserts(Reference):
    """Queries but forgets to insert the kept documents: nothing is ever found."""

    def is_duplicate(self, doc_id, text):
        sketch = self.inner.signature(text)
        return any(sketch.jaccard(self.inner.kept[c]) >= self.threshold for c in self.inner.lsh.query(sketch))


class InvertedAnswer(Reference):
    """Returns True for a new document and False for a copy."""

    def is_duplicate(self, doc_id, text):
        return not super().is_duplicate(doc_id, text)


# ---------------------------------------------------------------- 10.4 line dedup


def occurrences_not_documents(texts, min_documents):
    counts = Counter(line.strip() for text in texts for line in text.split("\n") if line.strip())
    repeated = {line for line, n in counts.items() if n >= min_documents}
    results = [line_dedup.strip_lines(text, repeated) for text in texts]
    return [r[0] for r in results], sum(r[1] for r in results), sum(r[2] for r in results)


def characters_not_bytes(texts, min_documents):
    new, lines, size = line_dedup.remove_repeated_lines(texts, min_documents)
    removed = [line for text, kept in zip(texts, new) for line in text.split("\n")
               if line.strip() and line not in kept.split("\n")]
    return new, lines, sum(len(line) for line in removed)


def more_than_min_documents(texts, min_documents):  # '>' instead of '>='
    return line_dedup.remove_repeated_lines(texts, min_documents + 1)


def blank_lines_left_behind(texts, min_documents):  # removes the lines, never collapses the blanks
    counts = Counter(line for text in texts for line in {x.strip() for x in text.split("\n")} if line)
    repeated = {line for line, n in counts.items() if n >= min_documents}
    new, lines, size = [], 0, 0
    for text in texts:
        kept = [line for line in text.split("\n") if line.strip() not in repeated]
        lines += len(text.split("\n")) - len(kept)
        size += sum(len(line.encode()) for line in text.split("\n") if line.strip() in repeated)
        new.append(text if len(kept) == len(text.split("\n")) else "\n".join(kept))
    return new, lines, size


# ---------------------------------------------------------------- 10.5 token shards


def _shard(docs, out_path, encode):
    spans = [[shards.EOT] + encode(text) for text in docs]
    shards.atomic_write_bytes(out_path, np.array([t for span in spans for t in span], dtype="<u2").tobytes())
    offsets = np.cumsum([0] + [len(span) for span in spans[:-1]]).tolist()
    return offsets


def encode_not_ordinary(docs, out_path):  # issue 46 item 24: encode(), which refuses special-token text
    return _shard(docs, out_path, shards.gpt2_encoding().encode)


def encode_with_every_special(docs, out_path):  # encode(allowed_special="all"): page text becomes a special token
    return _shard(docs, out_path, lambda text: shards.gpt2_encoding().encode(text, allowed_special="all"))


def written_in_place(docs, out_path):  # issue 46 item 24: no temporary file, no os.replace
    spans = [[shards.EOT] + shards.gpt2_encoding().encode_ordinary(text) for text in docs]
    with open(out_path, "wb") as handle:
        handle.write(np.array([t for span in spans for t in span], dtype="<u2").tobytes())
    return np.cumsum([0] + [len(span) for span in spans[:-1]]).tolist()


def never_replaced(docs, out_path):  # the shard written to its temporary name and left there
    return shards.tokenize_to_bin(docs, f"{out_path}.tmp")


def no_separator(docs, out_path):
    tokens = [t for d in docs for t in shards.gpt2_encoding().encode_ordinary(d)]
    np.array(tokens, dtype="<u2").tofile(out_path)
    return []


def int32_ids(docs, out_path):
    offsets = shards.tokenize_to_bin(docs, out_path)
    np.fromfile(out_path, dtype="<u2").astype(np.int32).tofile(out_path)
    return offsets


def eot_after_each_document(docs, out_path):
    encoding, tokens, offsets = shards.gpt2_encoding(), [], []
    for text in docs:
        offsets.append(len(tokens))
        tokens += encoding.encode_ordinary(text) + [shards.EOT]
    np.array(tokens, dtype="<u2").tofile(out_path)
    return offsets


def offsets_past_the_eot(docs, out_path):
    return [offset + 1 for offset in shards.tokenize_to_bin(docs, out_path)]


WRONG = [
    ("10.1", forgets_stop_words, r"stop_words"),
    ("10.1", one_stop_word_is_enough, r"stop_words"),
    ("10.1", hash_ratio_inclusive, r"10% hashes.*passes every rule"),
    ("10.1", only_ascii_ellipses, r"ellips"),
    ("10.1", alphabetic_ratio_over_words, r"'75% alphabetic, dashes'.*the alphabetic ratio counts whitespace tokens "
                                          r"\(text.split\(\)\), dashes and other pure punctuation included"),
    ("10.1", fifty_words_is_too_few, r"'50 words'.*passes every rule"),
    ("10.1", mean_word_length_floored, r"'mean word length 10.5'.*look at the 'mean_word_length' rule"),
    ("10.1", mean_word_length_exclusive, r"'mean word length 3'.*passes every rule.*inclusive on the kept side"),
    ("10.1", one_word_too_many_allowed, r"'100,001 words'.*look at the 'word_count' rule"),
    ("10.2", cards_without_luhn, r"Luhn-invalid"),
    ("10.2", clock_time_as_ipv6, r"clock time \(not an IPv6\)"),
    ("10.2", ipv4_cannot_end_a_sentence, r"IPv4 ending a sentence|expected counts"),
    ("10.2", country_code_left_outside, r"phone with its country code"),
    ("10.2", counts_as_one_kind, r"expected counts"),
    ("10.3", TooFewBands, r"recall .*bands x rows"),
    ("10.3", UnverifiedCandidates, r"precision .*verify candidates"),
    ("10.3", CandidatesUnverified, r"was flagged as a duplicate, but its LSH candidate \S+ has an estimated Jaccard of "
                                   r"only 0\.\d+: a candidate is a duplicate only when sketch.jaccard"),
    ("10.3", NeverInserts, r"recall .*kept documents are inserted"),
    ("10.3", InvertedAnswer, r"first copy of a document must be kept"),
    ("10.4", occurrences_not_documents, r"counts once"),
    ("10.4", characters_not_bytes, r"characters: count UTF-8 bytes"),
    ("10.4", more_than_min_documents, r"should be removed"),
    ("10.4", blank_lines_left_behind, r"collapse the blank"),
    ("10.5", never_replaced, r"out_path still holds the file that was there before: .*os.replace\(\) it over"),
    ("10.5", no_separator, r"50256"),
    ("10.5", int32_ids, r"bytes"),
    ("10.5", eot_after_each_document, r"EOT before each document"),
    ("10.5", offsets_past_the_eot, r"expected document offsets"),
    ("10.5", encode_not_ordinary, r"a document holding the text <\|endoftext\|> made the encoder raise .*use "
                                  r"encode_ordinary"),
    ("10.5", encode_with_every_special, r"a document's own text <\|endoftext\|> became the special token 50256: use "
                                        r"encode_ordinary"),
    ("10.5", written_in_place, r"out_path was written in place: write the shard to a temporary name beside it, then "
                               r"os.replace\(\) it"),
]


@pytest.mark.parametrize("exercise, wrong, names_it", WRONG, ids=[w.__name__ for _, w, _ in WRONG])
def test_wrong_answer_fails_and_names_the_mistake(exercise, wrong, names_it):
    result = distlab.check(exercise, wrong, quiet=True)
    assert result.status == "failed", (wrong.__name__, result.detail)
    assert re.search(names_it, result.detail), result.detail


def test_right_answers_pass():
    def own_quality(text):
        return quality.gopher_quality_failure(text) is None

    right = {"10.1": own_quality, "10.2": lambda text: pii.scrub_pii(text), "10.3": Reference,
             "10.4": lambda texts, k: line_dedup.remove_repeated_lines(texts, k),
             "10.5": lambda docs, path: shards.tokenize_to_bin(docs, path)}
    for exercise, answer in right.items():
        result = distlab.check(exercise, answer, quiet=True)
        assert result.status == "passed", (exercise, result.detail)


QUIZ_WRONG = {"Q10.1": 0.40, "Q10.2": 0.16, "Q10.3": "c", "Q10.4": "a", "Q10.5": 15, "Q10.6": "a", "Q10.7": 1875}
QUIZ_RIGHT = {"Q10.1": 1 - (1 - 0.8 ** 8) ** 16, "Q10.2": 0.0354, "Q10.3": "b", "Q10.4": "b", "Q10.5": 30,
              "Q10.6": "b", "Q10.7": 93.75}


@pytest.mark.parametrize("question", sorted(QUIZ_WRONG))
def test_quiz_wrong_answer_points_to_a_section_without_giving_the_answer(question):
    assert distlab.check(question, QUIZ_RIGHT[question], quiet=True).status == "passed"
    result = distlab.check(question, QUIZ_WRONG[question], quiet=True)
    assert result.status == "failed" and re.search(r"section \d+", result.detail), result.detail
    answer = QUIZ_RIGHT[question]
    shown = [f"{answer:.3g}", f"{answer:.2f}", f"{answer:g}"] if isinstance(answer, float | int) else []
    assert not any(text in result.detail for text in shown), result.detail
    assert not re.search(r"\^|\*\*|1 - \(|sqrt|√|\d+e\d+", result.detail), result.detail  # no formula or computation


def test_every_lab10_quiz_question_is_in_the_table():
    assert {e.id for e in EXERCISES if e.is_quiz} == set(QUIZ_WRONG)
