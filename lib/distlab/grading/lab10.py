"""Lab 10 checkers: Gopher quality rules, PII patterns, MinHash/LSH dedup, token shards.

Each checker builds fresh random cases, runs the student's code and the reference
implementation in :mod:`distlab.data` on them, and reports the first disagreement.
"""

from __future__ import annotations

import random
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from distlab.grading import CheckFailed
from distlab.grading.registry import Exercise


def _quality_cases(rng: random.Random) -> list[tuple[str, str]]:
    """(name, text): typical pages plus texts on both sides of every threshold."""
    from distlab.data import samples

    def words(n, extra=()):
        body = ["the", "and"] + [rng.choice(samples.NOUNS) for _ in range(n - 2 - len(extra))] + list(extra)
        rng.shuffle(body)
        return " ".join(body)

    def lines(n_special, n_plain, make_special):
        rows = [make_special(i) for i in range(n_special)] + [samples.prose_sentence(rng) for _ in range(n_plain)]
        rng.shuffle(rows)
        return "\n".join(rows)

    bullet = lambda i: f"• {samples.prose_sentence(rng)}"  # noqa: E731
    teaser = lambda i: f"{samples.prose_sentence(rng)[:-1]} and more..."  # noqa: E731
    cases = [("prose", samples.prose(rng, rng.randint(60, 400))), ("seo spam", samples.seo_spam(rng)),
             ("boilerplate", samples.boilerplate(rng)), ("foreign", samples.foreign(rng)),
             ("49 words", words(49)), ("50 words", words(50)),
             ("long words", " ".join(["the", "and"] + ["extraordinarily"] * 60)),
             ("short words", " ".join(["the", "and"] + ["ox"] * 60)),
             ("10% hashes", words(100, ["#tag"] * 10)), ("11% hashes", words(100, ["#tag"] * 11)),
             ("10% ellipses", words(100, ["so..."] * 10)), ("12% ellipses", words(100, ["so…"] * 12)),
             ("90% bullet lines", lines(18, 2, bullet)), ("95% bullet lines", lines(19, 1, bullet)),
             ("30% ellipsis lines", lines(6, 14, teaser)), ("35% ellipsis lines", lines(7, 13, teaser)),
             ("80% alphabetic", words(100, ["1999"] * 20)), ("75% alphabetic", words(100, ["42"] * 25)),
             ("one stop word", " ".join(["the"] + [rng.choice(samples.NOUNS) for _ in range(80)])),
             ("no words", "... --- !!! ???")]
    rng.shuffle(cases)
    return cases


def check_quality(passes_quality) -> str:
    from distlab.data.quality import gopher_quality_failure

    rng = random.Random()
    cases = _quality_cases(rng) + _quality_cases(rng)
    for name, text in cases:
        rule = gopher_quality_failure(text)
        got = passes_quality(text)
        if bool(got) != (rule is None):
            why = f"it breaks the '{rule}' rule" if rule else "it passes every rule"
            raise CheckFailed(f"case '{name}': expected {rule is None} ({why}), got {got!r}; "
                              f"text begins {text[:90]!r}")
    return f"{len(cases)} pages, every threshold on both sides"


def _pii_cases(rng: random.Random) -> list[tuple[str, str]]:
    from distlab.data import samples

    card = samples.card_number(rng)
    bad_card = card[:-1] + str((int(card[-1]) + 1) % 10)
    return [("email", f"Write to {rng.choice(samples.NAMES).lower()}.{rng.randint(1, 99)}@mail.example.org today."),
            ("US phone", f"Call ({rng.randint(200, 999)}) {rng.randint(200, 999)}-{rng.randint(1000, 9999)} now."),
            ("dashed phone", f"Phone {rng.randint(200, 999)}-{rng.randint(200, 999)}-{rng.randint(1000, 9999)}."),
            ("international phone", f"London office: +44 20 {rng.randint(1000, 9999)} {rng.randint(1000, 9999)}."),
            ("IPv4", f"The host 10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)} answered."),
            ("IPv6", f"Reach 2001:db8::{rng.randint(1, 65535):x} or fe80::{rng.randint(1, 255):x}:1 there."),
            ("Luhn-valid card", f"Paid with {card}."), ("card without spaces", f"Card {card.replace(' ', '')} ok."),
            ("Luhn-invalid digits (not a card)", f"Order number {bad_card}."),
            ("version number (not an IP)", "Upgrade to version 2.1.3 of the tool."),
            ("clock time (not an IPv6)", "We met at 12:30:45 on Monday."),
            ("year range (not a phone)", "From 2019-2023 the river rose."),
            ("mixed", samples.with_pii(rng))]


def check_pii(scrub_pii) -> str:
    from distlab.data.pii import scrub_pii as reference

    rng = random.Random()
    cases = _pii_cases(rng)
    for name, text in cases:
        want_text, want_counts = reference(text)
        got = scrub_pii(text)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailed(f"case '{name}': expected a (text, counts) tuple, got {type(got).__name__}")
        got_text, got_counts = got
        if got_text != want_text:
            raise CheckFailed(f"case '{name}': for {text[:120]!r} expected {want_text[:120]!r}, got {got_text[:120]!r}")
        if Counter({k: v for k, v in dict(got_counts).items() if v}) != want_counts:
            raise CheckFailed(f"case '{name}': expected counts {dict(want_counts)}, got {dict(got_counts)}")
    return f"{len(cases)} texts: emails, phones, IPv4/IPv6, Luhn cards and look-alikes"


def check_deduper(deduper_class) -> str:
    from distlab.data.samples import dedup_scores, near_duplicate_set

    seed = random.randrange(1 << 30)
    docs, truth = near_duplicate_set(n_pairs=120, n_singletons=40, seed=seed, words=200)
    deduper = deduper_class()
    flagged = {doc_id for doc_id, text in docs if deduper.is_duplicate(doc_id, text)}
    originals = {original for original, _, _ in truth.values()}
    wrongly_flagged_originals = sorted(flagged & originals)
    scores = dedup_scores(flagged, truth)
    if wrongly_flagged_originals:
        raise CheckFailed(f"the first copy of a document must be kept, but {wrongly_flagged_originals[0]} was flagged "
                          "(is_duplicate should be False for a document with no earlier near-copy)")
    if scores["recall"] < 0.85:
        raise CheckFailed(f"recall {scores['recall']:.2f} < 0.85: only {scores['correct']} of "
                          f"{scores['true_duplicates']} pairs with Jaccard >= 0.85 were flagged (check the bands x rows "
                          "of the LSH, the 5-word shingles, and that kept documents are inserted)")
    if scores["precision"] < 0.85:
        raise CheckFailed(f"precision {scores['precision']:.2f} < 0.85: {scores['flagged'] - scores['correct']} of "
                          f"{scores['flagged']} flagged documents are not near-duplicates (verify candidates by "
                          "estimated Jaccard >= threshold)")
    return "recall and precision >= 0.85 on a fresh near-duplicate set with known Jaccard"


def check_token_writer(tokenize_to_bin) -> str:
    from distlab.data.samples import prose
    from distlab.data.shards import read_shard, tokenize_to_bin as reference

    rng = random.Random()
    docs = [prose(rng, rng.randint(5, 80)) for _ in range(rng.randint(3, 7))]
    docs.insert(rng.randrange(len(docs)), "")
    docs.append("Unicode: naïve café – 東京 🚀")
    with tempfile.TemporaryDirectory() as directory:
        want_offsets = reference(docs, Path(directory) / "reference.bin")
        want = read_shard(Path(directory) / "reference.bin")
        got_offsets = tokenize_to_bin(list(docs), Path(directory) / "student.bin")
        path = Path(directory) / "student.bin"
        if not path.exists():
            raise CheckFailed("no file was written at out_path")
        raw = path.read_bytes()
    if len(raw) != 2 * len(want):
        raise CheckFailed(f"expected {2 * len(want)} bytes ({len(want)} uint16 tokens for {len(docs)} documents, "
                          f"each preceded by <|endoftext|> 50256), got {len(raw)} bytes")
    got = np.frombuffer(raw, dtype="<u2")
    if not np.array_equal(got, want):
        first = int(np.argmax(got != want))
        raise CheckFailed(f"token {first} differs: expected {int(want[first])}, got {int(got[first])} "
                          "(GPT-2 encode_ordinary, EOT before each document, uint16 little-endian)")
    if list(map(int, got_offsets or [])) != want_offsets:
        raise CheckFailed(f"expected document offsets {want_offsets}, got {got_offsets}")
    return "random documents (empty and Unicode included): byte-identical, offsets right"


EXERCISES = [
    Exercise("10.1", "Gopher quality rules", 3, check_quality),
    Exercise("10.2", "PII patterns", 2, check_pii),
    Exercise("10.3", "MinHash + LSH near-dedup", 3, check_deduper),
    Exercise("10.4", "Token-shard writer", 2, check_token_writer),
]
