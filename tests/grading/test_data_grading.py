"""The lab 10 checkers pass the reference implementation and fail wrong ones helpfully."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from distlab.data import dedup, line_dedup, pii, quality, shards
from distlab.grading import CheckFailed, check
from distlab.grading.lab10 import (
    EXERCISES,
    check_deduper,
    check_line_dedup,
    check_pii,
    check_quality,
    check_token_writer,
)


class ReferenceDeduper:
    def __init__(self):
        self.inner = dedup.Deduper()

    def is_duplicate(self, doc_id, text):
        return self.inner.is_duplicate(doc_id, text)


class TooFewBands(ReferenceDeduper):
    """4 bands x 32 rows: a pair at J = 0.9 is a candidate only 14% of the time."""

    def __init__(self):
        self.inner = dedup.Deduper(bands=4, rows=32)


class UnverifiedCandidates:
    """32 bands x 4 rows and no Jaccard check: every loose candidate counts as a duplicate."""

    def __init__(self):
        self.inner = dedup.Deduper(bands=32, rows=4)

    def is_duplicate(self, doc_id, text):
        sketch = self.inner.signature(text)
        if self.inner.lsh.query(sketch):
            return True
        self.inner.lsh.insert(doc_id, sketch)
        return False


def test_reference_implementations_pass():
    assert "every threshold" in check_quality(quality.passes_quality)
    assert "cards and look-alikes" in check_pii(pii.scrub_pii)
    assert "recall" in check_deduper(ReferenceDeduper)
    assert "UTF-8 bytes" in check_line_dedup(line_dedup.remove_repeated_lines)
    assert "byte-identical" in check_token_writer(shards.tokenize_to_bin)


def test_wrong_quality_rules_fail_with_the_rule_named():
    def forgets_stop_words(text):
        return quality.gopher_quality_failure(text) in (None, "stop_words")

    with pytest.raises(CheckFailed, match="stop_words"):
        check_quality(forgets_stop_words)

    def strict_hashes(text):  # '>=' instead of '>': rejects exactly 10% hashes
        words = quality.split_words(text)
        return quality.passes_quality(text) and not (words and text.count("#") / len(words) >= 0.1)

    with pytest.raises(CheckFailed, match="10% hashes"):
        check_quality(strict_hashes)


def test_wrong_pii_fails_with_the_case():
    def no_luhn(text):
        text, counts = pii.scrub_pii(text)
        return re.sub(r"Order number [\d ]+", "Order number <CARD_NUMBER>", text), counts

    with pytest.raises(CheckFailed, match="Luhn-invalid"):
        check_pii(no_luhn)

    with pytest.raises(CheckFailed, match="IPv4 ending a sentence|expected counts"):
        check_pii(lambda text: (re.sub(r"<IP_ADDRESS>\.$", "", pii.scrub_pii(text)[0]), pii.scrub_pii(text)[1]))

    def luhn_only_cards(text):  # cards by Luhn alone: a DOI's digits become a card number
        scrubbed, counts = pii.scrub_pii(text)
        doi = re.search(r"10\.1080/(\d+)", scrubbed)
        if doi and pii.luhn_valid(doi.group(1)):
            scrubbed = scrubbed.replace(doi.group(1), "<CARD_NUMBER>")
            counts["card"] += 1
        return scrubbed, counts

    with pytest.raises(CheckFailed, match="DOI"):
        check_pii(luhn_only_cards)


def test_bad_band_choice_fails_on_recall_and_missing_verification_on_precision():
    with pytest.raises(CheckFailed, match="recall"):
        check_deduper(TooFewBands)
    with pytest.raises(CheckFailed, match="precision"):
        check_deduper(UnverifiedCandidates)


def test_wrong_line_dedup_fails_with_what_to_look_at():
    def occurrences_not_documents(texts, min_documents):
        counts = Counter(line.strip() for text in texts for line in text.split("\n") if line.strip())
        repeated = {line for line, n in counts.items() if n >= min_documents}
        results = [line_dedup.strip_lines(text, repeated) for text in texts]
        return [r[0] for r in results], sum(r[1] for r in results), sum(r[2] for r in results)

    with pytest.raises(CheckFailed, match="counts once"):
        check_line_dedup(occurrences_not_documents)

    def characters_not_bytes(texts, min_documents):
        new, lines, size = line_dedup.remove_repeated_lines(texts, min_documents)
        removed = [line for text, kept in zip(texts, new) for line in text.split("\n")
                   if line.strip() and line not in kept.split("\n")]
        return new, lines, sum(len(line) for line in removed)

    with pytest.raises(CheckFailed, match="characters: count UTF-8 bytes"):
        check_line_dedup(characters_not_bytes)

    def exact_lines_only(texts, min_documents):  # "  banner" and "banner" counted as different lines
        counts = Counter(line for text in texts for line in set(text.split("\n")) if line.strip())
        repeated = {line for line, n in counts.items() if n >= min_documents}
        new = ["\n".join(line for line in text.split("\n") if line not in repeated) for text in texts]
        return new, 0, 0

    with pytest.raises(CheckFailed, match="should be removed|collapse the blank|lines removed"):
        check_line_dedup(exact_lines_only)


def test_quiz_answers_are_right_and_wrong_ones_get_the_hint():
    questions = {e.id: e for e in EXERCISES if e.is_quiz}
    assert len(questions) >= 5
    answers = {"Q10.1": 0.947, "Q10.2": 0.0354, "Q10.3": "b", "Q10.4": "b", "Q10.5": 30, "Q10.6": "b"}
    for question_id, answer in answers.items():
        assert questions[question_id].checker(answer) == "correct"
    with pytest.raises(CheckFailed, match="section 5"):
        questions["Q10.1"].checker(0.40)  # datasketch's own 9 x 13 choice


def test_wrong_token_writer_fails():
    def no_separator(docs, out_path):
        tokens = [t for d in docs for t in shards.gpt2_encoding().encode_ordinary(d)]
        np.array(tokens, dtype="<u2").tofile(out_path)
        return []

    with pytest.raises(CheckFailed, match="50256"):
        check_token_writer(no_separator)

    def int32(docs, out_path):
        offsets = shards.tokenize_to_bin(docs, out_path)
        np.fromfile(out_path, dtype="<u2").astype(np.int32).tofile(out_path)
        return offsets

    with pytest.raises(CheckFailed, match="bytes"):
        check_token_writer(int32)


def test_untouched_stub_is_not_attempted(capsys):
    def stub(text):
        raise NotImplementedError("Exercise 10.1: replace this line with your solution")

    result = check("10.1", stub)
    assert result.status == "not attempted" and result.points == 0
    assert check("10.2", pii.scrub_pii, quiet=True).status == "passed"
