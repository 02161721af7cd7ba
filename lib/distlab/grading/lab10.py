"""Lab 10 checkers: Gopher quality rules, PII patterns, MinHash/LSH dedup, line dedup, token shards; the quiz.

Each checker builds fresh random cases, runs the student's code and the reference
implementation in :mod:`distlab.data` on them, and reports the first disagreement
with what to look at.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from distlab.data.dedup import Deduper, candidate_probability
from distlab.data.shards import EOT, SHARD_DTYPE
from distlab.grading import quiz
from distlab.grading.contract import CheckFailed, first_line
from distlab.grading.harness import Edge, case_drawn, lab_seed
from distlab.grading.registry import Exercise


def _quality_cases(rng: random.Random) -> list[tuple[str, str]]:
    """(name, text): typical pages plus texts on both sides of every threshold."""
    from distlab.data import samples  # noqa: PLC0415  loads datasketch and warcio

    def words(n, extra=()):
        body = ["the", "and"] + [rng.choice(samples.NOUNS) for _ in range(n - 2 - len(extra))] + list(extra)
        rng.shuffle(body)
        return " ".join(body)

    def lines(n_special, n_plain, make_special):
        rows = [make_special(i) for i in range(n_special)] + [samples.prose_sentence(rng) for _ in range(n_plain)]
        rng.shuffle(rows)
        return "\n".join(rows)

    def lengths(counts: dict[int, int]) -> str:
        """'the' and 'and' (3 letters, the two stop words) and ``counts[L]`` random words of L letters: the mean
        word length is exactly what the counts make it."""
        body = ["the", "and"] + ["".join(rng.choice("bcdfghklmnprstvz") for _ in range(length))
                                 for length, n in counts.items() for _ in range(n)]
        rng.shuffle(body)
        return " ".join(body)

    bullet = lambda i: f"• {samples.prose_sentence(rng)}"  # noqa: E731
    teaser = lambda i: f"{samples.prose_sentence(rng)[:-1]} and more..."  # noqa: E731
    cases = [("prose", samples.prose(rng, rng.randint(60, 400))), ("seo spam", samples.seo_spam(rng)),
             ("boilerplate", samples.boilerplate(rng)), ("foreign", samples.foreign(rng)),
             ("49 words", words(49)), ("50 words", words(50)),
             ("long words", " ".join(["the", "and"] + ["extraordinarily"] * 60)),
             ("short words", " ".join(["the", "and"] + ["ox"] * 60)),
             # mean word length at its limits: 3 and 10 are kept, 10.5 is not (nor is it 10 when floored)
             ("mean word length 3", lengths({3: 58})), ("mean word length 10", lengths({10: 44, 11: 14})),
             ("mean word length 10.5", lengths({11: 44, 10: 14})),
             ("100,000 words", words(100_000)), ("100,001 words", words(100_001)),
             ("10% hashes", words(100, ["#tag"] * 10)), ("11% hashes", words(100, ["#tag"] * 11)),
             ("10% ellipses", words(100, ["so..."] * 10)), ("12% ellipses", words(100, ["so…"] * 12)),
             ("90% bullet lines", lines(18, 2, bullet)), ("95% bullet lines", lines(19, 1, bullet)),
             ("30% ellipsis lines", lines(6, 14, teaser)), ("35% ellipsis lines", lines(7, 13, teaser)),
             ("80% alphabetic", words(100, ["1999"] * 20)), ("75% alphabetic", words(100, ["42"] * 25)),
             # pure punctuation is a whitespace token without a letter, yet no word (split_words drops it): the
             # alphabetic ratio counts it, so these two tell whitespace tokens from words
             ("80% alphabetic, dashes", words(100, ["—"] * 20)), ("75% alphabetic, dashes", words(100, ["—"] * 25)),
             ("one stop word", " ".join(["the"] + [rng.choice(samples.NOUNS) for _ in range(80)])),
             ("no words", "... --- !!! ???")]
    rng.shuffle(cases)
    return cases


def check_quality(passes_quality) -> str:
    from distlab.data.quality import gopher_quality_failure  # noqa: PLC0415  loads datasketch and warcio

    rng = random.Random(lab_seed(10) + 1)
    cases = _quality_cases(rng)
    cases += [case for case in _quality_cases(rng) if not case[0].startswith("100,00")]  # once is enough
    for name, text in cases:
        case_drawn("10.1", name=name)
        rule = gopher_quality_failure(text)
        got = passes_quality(text)
        if bool(got) != (rule is None):
            why = f"it breaks the '{rule}' rule" if rule else "it passes every rule"
            raise CheckFailed(f"case '{name}': expected {rule is None} ({why}), got {got!r}; "
                              f"text begins {text[:90]!r}: {_quality_hint(name, rule)}")
    return f"{len(cases)} pages, every threshold on both sides"


def _quality_hint(name: str, rule: str | None) -> str:
    """Where to look when a page's verdict is wrong: the rule the case sits at the threshold of."""
    if "dashes" in name:
        return ("the alphabetic ratio counts whitespace tokens (text.split()), dashes and other pure punctuation "
                "included, not the words of split_words")
    if rule:
        return f"look at the '{rule}' rule: its threshold, and which side of it is kept"
    return "each rule's threshold is inclusive on the kept side (<= or >=): check the one this page is at"


def _pii_cases(rng: random.Random) -> list[tuple[str, str]]:
    from distlab.data import samples  # noqa: PLC0415  loads datasketch and warcio

    card = samples.card_number(rng)
    bad_card = card[:-1] + str((int(card[-1]) + 1) % 10)
    doi = _luhn_complete("1" + "".join(str(rng.randrange(10)) for _ in range(15)))  # passes Luhn, yet no card
    host = f"{rng.randint(1, 223)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
    return [("email", f"Write to {rng.choice(samples.NAMES).lower()}.{rng.randint(1, 99)}@mail.example.org today."),
            ("US phone", f"Call ({rng.randint(200, 999)}) {rng.randint(200, 999)}-{rng.randint(1000, 9999)} now."),
            ("dashed phone", f"Phone {rng.randint(200, 999)}-{rng.randint(200, 999)}-{rng.randint(1000, 9999)}."),
            ("phone with its country code", f"Toll free: 1-800-{rng.randint(200, 999)}-{rng.randint(1000, 9999)}."),
            ("international phone", f"London office: +44 20 {rng.randint(1000, 9999)} {rng.randint(1000, 9999)}."),
            ("IPv4", f"The host 10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)} answered."),
            ("IPv4 ending a sentence", f"The server was at {host}."),
            ("IPv6", f"Reach 2001:db8::{rng.randint(1, 65535):x} or fe80::{rng.randint(1, 255):x}:1 there."),
            ("Luhn-valid card", f"Paid with {card}."), ("card without spaces", f"Card {card.replace(' ', '')} ok."),
            ("Luhn-invalid digits (not a card)", f"Order number {bad_card}."),
            ("a DOI (not a card)", f"See doi:10.1080/{doi}."),
            ("version number (not an IP)", "Upgrade to version 2.1.3 of the tool."),
            ("clock time (not an IPv6)", "We met at 12:30:45 on Monday."),
            ("year range (not a phone)", "From 2019-2023 the river rose."),
            ("mixed", samples.with_pii(rng))]


def _luhn_complete(digits: str) -> str:
    """``digits`` with the check digit that makes it pass Luhn."""
    from distlab.data.pii import luhn_valid  # noqa: PLC0415  loads datasketch and warcio

    return next(digits + str(d) for d in range(10) if luhn_valid(digits + str(d)))


def check_pii(scrub_pii) -> str:
    from distlab.data.pii import scrub_pii as reference  # noqa: PLC0415  loads datasketch and warcio

    rng = random.Random(lab_seed(10) + 2)
    cases = _pii_cases(rng)
    for name, text in cases:
        case_drawn("10.2", name=name)
        want_text, want_counts = reference(text)
        got = scrub_pii(text)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailed(f"case '{name}': expected a (text, counts) tuple, got {type(got).__name__}")
        got_text, got_counts = got
        if got_text != want_text:
            raise CheckFailed(f"case '{name}': for {text[:120]!r} expected {want_text[:120]!r}, got {got_text[:120]!r}")
        if Counter({k: v for k, v in dict(got_counts).items() if v}) != want_counts:
            raise CheckFailed(f"case '{name}': expected counts {dict(want_counts)}, got {dict(got_counts)}: add "
                              "one to a kind's count for each match you replace, and none for a match you leave "
                              "as it is")
    return f"{len(cases)} texts: emails, phones, IPv4/IPv6, cards and look-alikes (DOIs, order numbers)"


def check_deduper(deduper_class) -> str:
    from distlab.data.samples import dedup_scores, near_duplicate_set  # noqa: PLC0415  loads datasketch and warcio

    seed = random.Random(lab_seed(10) + 3).randrange(1 << 30)
    docs, truth = near_duplicate_set(n_pairs=120, n_singletons=40, seed=seed, words=200)
    case_drawn("10.3", pairs=len(truth), singletons=len(docs) - 2 * len(truth))
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
                          f"{scores['true_duplicates']} pairs with Jaccard >= 0.85 were flagged (check the bands x "
                          "rows of the LSH, the 5-word shingles, and that kept documents are inserted)")
    if scores["precision"] < 0.85:
        raise CheckFailed(f"precision {scores['precision']:.2f} < 0.85: {scores['flagged'] - scores['correct']} of "
                          f"{scores['flagged']} flagged documents are not near-duplicates (verify candidates by "
                          "estimated Jaccard >= threshold)")
    _compare_with_reference(flagged, docs, Deduper())
    return ("recall and precision >= 0.85 on a fresh near-duplicate set with known Jaccard, every document decided "
            "as the reference decides it")


def _compare_with_reference(flagged: set[str], docs: list[tuple[str, str]], reference) -> None:
    """Every document decided as the library's Deduper decides it, which sketches with the same MinHash (128
    permutations, seed 1) and queries the same LSH bands: the decisions are the same whatever order a deduper
    tries its candidates in, so any difference is a mistake the scores were too coarse to show."""
    for doc_id, text in docs:
        sketch = reference.signature(text)
        estimates = {c: sketch.jaccard(reference.kept[c]) for c in reference.lsh.query(sketch)}
        match = reference.match(doc_id, sketch)
        if (doc_id in flagged) == (match is not None):
            continue
        if match is not None:
            raise CheckFailed(f"{doc_id} was kept, but {match}, kept before it, is a near-copy (estimated Jaccard "
                              f"{estimates[match]:.3f} >= {reference.threshold}): query the LSH with its sketch, "
                              "and insert every document you keep")
        near = max(estimates.items(), key=lambda item: item[1], default=None)
        why = (f"its LSH candidate {near[0]} has an estimated Jaccard of only {near[1]:.3f}" if near else
               "no kept document is an LSH candidate of it")
        raise CheckFailed(f"{doc_id} was flagged as a duplicate, but {why}: a candidate is a duplicate only when "
                          f"sketch.jaccard(kept sketch) >= threshold ({reference.threshold})")


def _line_dedup_corpus(rng: random.Random) -> tuple[list[str], int]:
    """Pages of a few sites: shared banners (some in just enough documents, some one short), a line
    repeated inside one page, whitespace around lines, blank lines, non-ASCII text."""
    from distlab.data import samples  # noqa: PLC0415  loads datasketch and warcio

    min_documents = rng.choice([2, 3, 4])
    banners = [f"Banner {n}: {samples.prose_sentence(rng)}" for n in range(6)]
    banners += ["© 2024 Café Müller — mentions légales"]
    reach = {banner: rng.choice([min_documents - 1, min_documents, min_documents + 2]) for banner in banners}
    pages = [[samples.prose_sentence(rng) for _ in range(rng.randint(2, 5))] for _ in range(rng.randint(12, 20))]
    for banner, count in reach.items():
        for page in rng.sample(pages, min(count, len(pages))):
            page.insert(rng.randrange(len(page) + 1), rng.choice([banner, f"  {banner}", f"{banner}\t"]))
    for page in rng.sample(pages, 3):
        page.insert(rng.randrange(len(page) + 1), "")
    # a removed banner between two blank lines: three blank lines left behind, collapsed into one
    removed = next(banner for banner in banners if reach[banner] >= min_documents)
    page = rng.choice(pages)
    at = rng.randrange(1, len(page))
    page[at:at] = ["", removed, ""]
    echo = rng.choice(pages)
    echo += [echo[0]] * min_documents  # a line repeated inside one page counts once for that page
    return ["\n".join(page) for page in pages], min_documents


def check_line_dedup(remove_repeated_lines) -> str:
    from distlab.data.line_dedup import document_frequencies  # noqa: PLC0415  loads datasketch and warcio
    from distlab.data.line_dedup import remove_repeated_lines as reference  # noqa: PLC0415  loads datasketch and warcio

    rng = random.Random(lab_seed(10) + 4)
    for case in range(3):
        texts, min_documents = _line_dedup_corpus(rng)
        frequencies = document_frequencies(texts)
        case_drawn("10.4", min_documents=min_documents, texts=texts,
                   repeated={line for line, n in frequencies.items() if n >= min_documents})
        want_texts, want_lines, want_bytes = reference(list(texts), min_documents)
        got = remove_repeated_lines(list(texts), min_documents)
        if not (isinstance(got, tuple) and len(got) == 3):
            raise CheckFailed(f"expected a (texts, lines_removed, bytes_removed) tuple, got {type(got).__name__}")
        got_texts, got_lines, got_bytes = got
        if len(got_texts) != len(texts):
            raise CheckFailed(f"{len(texts)} documents in, {len(got_texts)} out: return one text per document")
        for number, (text, want, have) in enumerate(zip(texts, want_texts, got_texts)):
            if want != have:
                raise CheckFailed(f"min_documents={min_documents}, document {number}: "
                                  + _line_dedup_hint(text, want, have, frequencies, texts, min_documents))
        if got_lines != want_lines:
            raise CheckFailed(f"min_documents={min_documents}: {got_lines} lines removed, expected {want_lines}: "
                              "count every removed line, once each, including a repeat inside one document")
        if got_bytes != want_bytes:
            chars = sum(len(line) for text, new in zip(texts, want_texts) for line in text.split("\n")
                        if line.strip() and line not in new.split("\n"))
            hint = " - that is characters: count UTF-8 bytes" if got_bytes == chars else ""
            raise CheckFailed(f"min_documents={min_documents}: {got_bytes} bytes removed, expected {want_bytes}{hint}: "
                              "add each removed line's UTF-8 length as it was, whitespace included, without its "
                              "newline")
    return "3 random corpora: banners at and just under the threshold, whitespace, blank lines, UTF-8 bytes"


def _line_dedup_hint(text: str, want: str, have: str, frequencies, texts: list[str], min_documents: int) -> str:
    """Why one document came out wrong: a line removed too eagerly, a line left in, or layout."""
    want_lines, have_lines = set(want.split("\n")), set(have.split("\n"))
    for line in text.split("\n"):
        key = line.strip()
        if line in want_lines and line not in have_lines and key:
            occurrences = sum(other.strip() == key for t in texts for other in t.split("\n"))
            why = (f"; it occurs {occurrences} times, but a line repeated inside one document counts once"
                   if occurrences >= min_documents else "")
            return (f"{line!r} was removed, but it is in only {frequencies[key]} documents{why}: keep every line "
                    f"found in fewer than min_documents = {min_documents} documents")
        if line not in want_lines and line in have_lines and key:
            return (f"{line!r} is in {frequencies[key]} documents (compared without surrounding whitespace) "
                    "and should be removed")
    return (f"expected {want[:80]!r}, got {have[:80]!r}: join the kept lines with newlines, collapse the blank "
            "lines left behind into one and strip the ends (a document that loses no line is returned unchanged)")


def check_token_writer(tokenize_to_bin) -> str:
    from distlab.data.samples import prose  # noqa: PLC0415  loads datasketch and warcio
    from distlab.data.shards import read_shard  # noqa: PLC0415  loads datasketch and warcio
    from distlab.data.shards import tokenize_to_bin as reference  # noqa: PLC0415  loads datasketch and warcio

    rng = random.Random(lab_seed(10) + 5)
    docs = [prose(rng, rng.randint(5, 80)) for _ in range(rng.randint(3, 7))]
    docs.insert(rng.randrange(len(docs)), "")
    docs.insert(rng.randrange(len(docs)), f"A page that quotes {SPECIAL_TEXT} in its own text.")
    docs.append("Unicode: naïve café – 東京 🚀")
    case_drawn("10.5", docs=docs)
    with tempfile.TemporaryDirectory() as directory:
        want_offsets = reference(docs, Path(directory) / "reference.bin")
        want = read_shard(Path(directory) / "reference.bin")
        path = Path(directory) / "student.bin"
        path.write_bytes(OLDER_SHARD)
        try:
            with _renames_watched() as renamed:
                got_offsets = tokenize_to_bin(list(docs), path)
        except ValueError as error:
            if "special token" in str(error):
                raise CheckFailed(f"a document holding the text {SPECIAL_TEXT} made the encoder raise "
                                  f"({first_line(error)[:80]}): use encode_ordinary, which reads special-token text "
                                  "in a document as plain text") from None
            raise
        if not path.exists():
            raise CheckFailed("no file was written at out_path")
        raw = path.read_bytes()
    got = np.frombuffer(raw[: len(raw) // 2 * 2], dtype="<u2")
    injected = (f": a document's own text {SPECIAL_TEXT} became the special token {EOT}: use encode_ordinary, not "
                "encode with allowed_special" if int((got == EOT).sum()) > int((want == EOT).sum()) else "")
    if len(raw) != 2 * len(want):
        if raw == OLDER_SHARD:
            injected = (": out_path still holds the file that was there before: write the shard to a temporary "
                        "name beside it, then os.replace() it over out_path")
        elif not raw:
            injected = ": the file is empty: write every document's span, [EOT] + its tokens, as uint16"
        raise CheckFailed(f"expected {2 * len(want)} bytes ({len(want)} uint16 tokens for {len(docs)} documents, "
                          f"each preceded by <|endoftext|> 50256), got {len(raw)} bytes{injected}")
    if not np.array_equal(got, want):
        first = int(np.argmax(got != want))
        raise CheckFailed(f"token {first} differs: expected {int(want[first])}, got {int(got[first])}"
                          + (injected or " (GPT-2 encode_ordinary, EOT before each document, uint16 little-endian)"))
    if list(map(int, got_offsets or [])) != want_offsets:
        raise CheckFailed(f"expected document offsets {want_offsets}, got {got_offsets}: offsets[i] is the index, "
                          "in tokens, of document i's <|endoftext|>: 0 for the first, then the total length of the "
                          "spans before it, one per document")
    if os.fspath(path) not in renamed:
        raise CheckFailed("out_path was written in place: write the shard to a temporary name beside it, then "
                          "os.replace() it over out_path, so a crash or a reader never sees half a shard")
    return (f"random documents (empty, Unicode and one quoting {SPECIAL_TEXT} included): byte-identical, offsets "
            "right, put in place with os.replace")


# What out_path holds before tokenize_to_bin runs: a file it must replace whole.
OLDER_SHARD = b"an older shard"
# What a web page may contain that must stay text: GPT-2's end-of-text marker, written out.
SPECIAL_TEXT = "<|endoftext|>"


@contextlib.contextmanager
def _renames_watched():
    """While in the block, the destinations of os.replace and os.rename (pathlib's replace and rename, shutil.move
    use them): how a file is put in place atomically. The real calls run; this only looks."""
    destinations: set[str] = set()
    real = {"replace": os.replace, "rename": os.rename}

    def watching(name):
        def call(src, dst, *args, **kwargs):
            result = real[name](src, dst, *args, **kwargs)
            destinations.add(os.fspath(dst))
            return result
        return call

    os.replace, os.rename = watching("replace"), watching("rename")
    try:
        yield destinations
    finally:
        os.replace, os.rename = real["replace"], real["rename"]


def _names(cases: list[dict]) -> set[str]:
    return {c.get("name", "") for c in cases}


# The boundaries each exercise's text names (harness.Edge; tests/grading/test_reference_seeds.py checks every seed's
# cases hold each): every Gopher threshold on both sides, pure punctuation among the whitespace tokens, no words at
# all; each PII type and its look-alikes; near-copies beside singletons; a banner at and one short of
# min_documents, a line repeated inside one page, whitespace, blank lines, non-ASCII; an empty document, Unicode and
# the literal <|endoftext|> in a shard.
EDGES = {
    "10.1": [Edge(f"'{name}'", lambda c, name=name: c["name"] == name) for name in (
        "49 words", "50 words", "10% hashes", "11% hashes", "10% ellipses", "12% ellipses", "90% bullet lines",
        "95% bullet lines", "30% ellipsis lines", "35% ellipsis lines", "80% alphabetic", "75% alphabetic",
        "80% alphabetic, dashes", "75% alphabetic, dashes", "one stop word", "no words", "long words",
        "short words", "mean word length 3", "mean word length 10", "mean word length 10.5", "100,000 words",
        "100,001 words")],
    "10.2": [Edge(f"'{name}'", lambda c, name=name: c["name"] == name) for name in (
        "email", "US phone", "phone with its country code", "international phone", "IPv4 ending a sentence", "IPv6",
        "Luhn-valid card", "Luhn-invalid digits (not a card)", "a DOI (not a card)", "version number (not an IP)",
        "clock time (not an IPv6)", "year range (not a phone)")],
    "10.3": [Edge("near-copies beside singletons", lambda c: c["pairs"] > 0 and c["singletons"] > 0)],
    "10.4": [Edge("min_documents 2, 3 or 4", lambda c: c["min_documents"] in (2, 3, 4)),
             Edge("a non-ASCII line", lambda c: any(not t.isascii() for t in c["texts"])),
             Edge("a line with surrounding whitespace", lambda c: any(line != line.strip() and line.strip()
                                                                        for t in c["texts"] for line in t.split("\n"))),
             Edge("a blank line", lambda c: any("" in t.split("\n") for t in c["texts"])),
             Edge("a removed line between blank lines",
                  lambda c: any(f"\n\n{line}\n\n" in t for t in c["texts"] for line in c["repeated"]))],
    "10.5": [Edge("an empty document", lambda c: "" in c["docs"]),
             Edge("non-ASCII text", lambda c: any(not d.isascii() for d in c["docs"])),
             Edge(f"the literal text {SPECIAL_TEXT}", lambda c: any(SPECIAL_TEXT in d for d in c["docs"]))],
}

# Surviving mutants of the solution cells that change nothing the exercises ask for (distlab notebooks
# mutants): key, as benchmarks/results/mutants.txt names it → why it is equivalent.
EQUIVALENT_MUTANTS = {
    '10.1 statements-swapped: `if (text.count("...") + text.count("…")) / len(words) > 0.1: return F…` → `lines = '
    '[line.strip() for line in text.splitlines() if line.strip()] …`':
        "two statements that do not read each other's names, in the other order",
    '10.1 statements-swapped: `if not 3 <= sum(len(w) for w in words) / len(words) <= 10: return Fal…` → `if '
    'text.count("#") / len(words) > 0.1: return False if not 3 <= sum(l…`':
        'two rules that each return False, tested in the other order: a page is rejected if it breaks either',
    '10.1 statements-swapped: `if sum(line.startswith(BULLETS) for line in lines) / len(lines) > 0.9…` → `if '
    'sum(line.endswith(("...", "…")) for line in lines) / len(lines) > …`':
        'two rules that each return False, tested in the other order: a page is rejected if it breaks either',
    '10.1 statements-swapped: `if text.count("#") / len(words) > 0.1: return False if (text.count(".…` → `if '
    '(text.count("...") + text.count("…")) / len(words) > 0.1: return F…`':
        'two rules that each return False, tested in the other order: a page is rejected if it breaks either',
    '10.3 compare: `sketch.jaccard(self.kept[candidate]) >= self.threshold` → `sketch.jaccard(self.kept[candidate]) '
    '> self.threshold`':
        'with 128 permutations an estimated Jaccard is a multiple of 1/128, and the threshold 0.8 is not one '
        '(102.4/128): no estimate equals it',
    '10.3 statements-swapped: `self.lsh.insert(doc_id, sketch) self.kept[doc_id] = sketch` → `self.kept[doc_id] = '
    'sketch self.lsh.insert(doc_id, sketch)`':
        "two statements that do not read each other's names, in the other order",
    '10.4 statements-swapped: `lines_removed += 1 bytes_removed += len(line.encode("utf-8"))` → `bytes_removed += '
    'len(line.encode("utf-8")) lines_removed += 1`':
        "two statements that do not read each other's names, in the other order",
    '10.4 statements-swapped: `repeated = {line for line, n in frequency.items() if n >= min_documen…` → `new_texts, '
    'lines_removed, bytes_removed = [], 0, 0 repeated = {line f…`':
        "two statements that do not read each other's names, in the other order",
    '10.5 statements-swapped: `chunks.append(np.array(span, dtype="<u2")) position += len(span)` → `position += '
    'len(span) chunks.append(np.array(span, dtype="<u2"))`':
        "two statements that do not read each other's names, in the other order",
    '10.5 statements-swapped: `for text in docs: span = [EOT] + encoding.encode_ordinary(text) offse…` → `temporary '
    '= f"{out_path}.tmp" for text in docs: span = [EOT] + encodi…`':
        "two statements that do not read each other's names, in the other order",
    '10.5 statements-swapped: `offsets.append(position) chunks.append(np.array(span, dtype="<u2"))` → '
    '`chunks.append(np.array(span, dtype="<u2")) offsets.append(position)`':
        "two statements that do not read each other's names, in the other order",
    '10.5 statements-swapped: `span = [EOT] + encoding.encode_ordinary(text) offsets.append(position)` → '
    '`offsets.append(position) span = [EOT] + encoding.encode_ordinary(text)`':
        "two statements that do not read each other's names, in the other order",
}

EXERCISES = [
    Exercise("10.1", "Gopher quality rules", 3, check_quality,
             references=("distlab.data.quality.passes_quality", "distlab.data.quality.gopher_quality_failure")),
    Exercise("10.2", "PII patterns", 2, check_pii,
             references=("distlab.data.pii.scrub_pii",)),
    Exercise("10.3", "MinHash + LSH near-dedup", 3, check_deduper,
             references=("distlab.data.dedup.Deduper",)),
    Exercise("10.4", "Line-level dedup across the corpus", 2, check_line_dedup,
             references=("distlab.data.line_dedup.remove_repeated_lines",)),
    Exercise("10.5", "Token-shard writer", 2, check_token_writer,
             references=("distlab.data.shards.tokenize_to_bin",)),
    quiz.number("Q10.1", "P(candidate) for J = {j} with {bands} bands x {rows} rows", rel_tol=0.01,
                given=dict(j=0.8, bands=16, rows=8),
                vary=dict(j=(0.5, 0.6, 0.7, 0.9), bands=(8, 20, 32), rows=(4, 5, 10)),
                solve=lambda j, bands, rows: float(candidate_probability(j, bands, rows)),
                hint="section 5, LSH: when does one band agree, and when does at least one of them?"),
    quiz.number("Q10.2", "standard error of a {k}-permutation MinHash estimate at J = {j}", rel_tol=0.03,
                given=dict(k=128, j=0.8), vary=dict(k=(32, 64, 256, 512), j=(0.5, 0.6, 0.9)),
                solve=lambda k, j: (j * (1 - j) / k) ** 0.5,  # a mean of k independent 0/1 draws, each 1 w.p. J
                hint="section 5, MinHash: the estimate is a fraction of k independent permutations"),
    quiz.choice("Q10.3", "which Gopher rule rejects 120 words with 14 hashtags", answer="b", options="abcd",
                hint="section 3: the quality rules' table; check each rule's ratio for this page"),
    quiz.choice("Q10.4", "which of these is a payment card number", answer="b", options="abcd",
                hint="section 4: Luhn, an issuer prefix and a card's grouping must all hold"),
    quiz.number("Q10.5", "terabytes of uint16 shards for {trillions}T tokens", rel_tol=0.02, given=dict(trillions=15),
                vary=dict(trillions=(1, 2, 5, 9, 36)), solve=lambda trillions: trillions * SHARD_DTYPE.itemsize,
                hint="section 7: how many bytes one token id takes in a shard"),
    quiz.choice("Q10.6", "DSIR or DoReMi: which learns domain weights with a proxy model", answer="b",
                options="ab", hint="section 10: which of the two needs a training run, and which only counts n-grams?"),
    quiz.number("Q10.7", "Llama 3 8B's 15T tokens as a multiple of its Chinchilla-optimal budget",
                answer=15e12 / (20 * 8e9), rel_tol=0.03,
                hint="section 7, '15T tokens for an 8B model': Chinchilla's tokens per parameter",
                fixed="a published fact: Llama 3 8B was trained on 15T tokens"),
]
