"""The lab 10 checkers pass the reference implementation and fail wrong ones helpfully."""

from __future__ import annotations

import re

import numpy as np
import pytest

from distlab.data import dedup, pii, quality, shards
from distlab.grading import CheckFailed, check
from distlab.grading.lab10 import check_deduper, check_pii, check_quality, check_token_writer


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
    assert "Luhn" in check_pii(pii.scrub_pii)
    assert "recall" in check_deduper(ReferenceDeduper)
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


def test_bad_band_choice_fails_on_recall_and_missing_verification_on_precision():
    with pytest.raises(CheckFailed, match="recall"):
        check_deduper(TooFewBands)
    with pytest.raises(CheckFailed, match="precision"):
        check_deduper(UnverifiedCandidates)


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
