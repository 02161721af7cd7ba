"""Lab 10 stages one at a time, on real files (warcio), real fastText and real tiktoken."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distlab.data.dedup import Deduper, candidate_probability, flag_probability, jaccard, shingles
from distlab.data.document import AccountingError, Document, Ledger, run_stages
from distlab.data.language import LanguageFilter, detect_language, is_english
from distlab.data.line_dedup import LineDedup, remove_repeated_lines
from distlab.data.pii import looks_like_card, luhn_valid, scrub_pii
from distlab.data.quality import gopher_quality_failure, passes_quality
from distlab.data.read import WarcReader, parse_wet
from distlab.data.repetition import duplicate_ngram_char_fraction, gopher_repetition_failure, top_ngram_char_fraction
from distlab.data.samples import (
    SampleRecord,
    card_number,
    dedup_scores,
    foreign,
    near_duplicate_set,
    prose,
    threshold_pairs,
    write_records,
)
from distlab.data.shards import EOT, VENV_TIKTOKEN, encode_document, gpt2_encoding, read_shard, tokenize_to_bin
from distlab.data.toxicity import (
    DEFAULT_MIN_SHARE,
    DEFAULT_THRESHOLD,
    AdultContentRule,
    BlocklistScorer,
    ClassifierScorer,
    PageScorer,
    ToxicityFilter,
    evaluate,
    page_metrics,
)
from distlab.data.toxicity_sample import real_page_labels
from distlab.data.urls import UrlDedup, normalize_url

RNG = random.Random(7)
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"  # the course machines' real pages
GOOD = prose(random.Random(1), 200)


def record(text: str, number: int, **kw) -> SampleRecord:
    return SampleRecord("test", text, kw.pop("url", f"https://example.com/{number}"),
                        kw.pop("record_id", f"<urn:uuid:00000000-0000-4000-8000-{number:012d}>"), **kw)


def read_all(path, **kw) -> tuple[list[Document], Ledger]:
    ledger = Ledger()
    docs = list(WarcReader(**kw)(str(path), ledger))
    return docs, ledger


# --- read ---------------------------------------------------------------------------------------

def test_wet_reader_keeps_id_url_date_source(tmp_path):
    path = tmp_path / "a.warc.wet.gz"
    write_records(path, [record(GOOD, 1), record("second page text", 2)])
    docs, ledger = read_all(path)
    assert [d.text for d in docs] == [GOOD, "second page text"]
    assert docs[0].id == "<urn:uuid:00000000-0000-4000-8000-000000000001>"
    assert docs[0].url == "https://example.com/1" and docs[0].date.startswith("2024-")
    assert docs[0].source == "a.warc.wet.gz" and ledger.documents_in == 2 and not ledger.rejected


def test_warc_reader_extracts_main_text_from_html(tmp_path):
    path = tmp_path / "b.warc.gz"
    write_records(path, [record(GOOD, 1)], kind="warc")
    [doc] = parse_wet(path)
    assert "The " in doc.text and "All rights reserved" not in doc.text  # footer boilerplate removed
    assert "<p>" not in doc.text and len(doc.text.split()) > 150


def test_empty_huge_and_non_utf8_records_are_counted_not_crashing(tmp_path):
    path = tmp_path / "c.warc.wet.gz"
    write_records(path, [record("", 1), record(GOOD, 2), record("", 3, raw="caf\xe9 cr\xe8me".encode("latin-1")),
                         record("word " * 5000, 4)])
    docs, ledger = read_all(path, max_doc_bytes=10_000)
    assert [d.text for d in docs] == [GOOD]
    assert ledger.rejected == {"read:empty": 1, "read:non_utf8": 1, "read:too_large": 1}
    ledger.check_balance(kept=1)


# --- urls, language, quality, repetition, pii, toxicity --------------------------------------

def test_normalize_url_merges_trivial_variants_only():
    same = ["https://www.Example.com/a/?utm_source=x&b=2&a=1#top", "http://example.com:80/a?a=1&b=2",
            "HTTPS://example.com:443/a/?b=2&a=1&fbclid=abc"]
    assert len({normalize_url(u) for u in same}) == 1
    assert normalize_url("https://example.com/a") != normalize_url("https://example.com/b")
    assert normalize_url("https://example.com:8080/a") != normalize_url("https://example.com/a")


def test_url_dedup_keeps_first_occurrence():
    docs = [Document(str(i), "x", url=u) for i, u in enumerate(
        ["https://a.com/x", "http://a.com/x/", "https://a.com/y", "", ""])]
    ledger = Ledger()
    kept = list(UrlDedup()(docs, ledger))
    assert [d.id for d in kept] == ["0", "2", "3", "4"] and ledger.rejected == {"url_dedup:url_duplicate": 1}


def test_language_id_with_lite_model_and_deliberate_cap():
    assert is_english(GOOD)
    for seed in range(6):
        text = foreign(random.Random(seed))
        language, score = detect_language(text)
        assert language != "en" and score > 0.65, (language, score)
    # newlines do not break fastText, and a long English page is judged on more than 80 chars
    assert detect_language("Home | Login\n" + GOOD)[0] == "en"
    ledger = Ledger()
    stage = LanguageFilter(languages=("de",), threshold=0.5)
    kept = list(stage([Document("en", GOOD), Document("de", "Der Garten ist sehr schön und wir gehen "
                                                            "morgen mit unseren Freunden in die Stadt.")], ledger))
    assert [d.id for d in kept] == ["de"] and ledger.rejected == {"language:other_language": 1}


def quality_text(n_words=80, word="water", extra=""):
    return " ".join(["the", "of"] + [word] * (n_words - 2)) + extra


@pytest.mark.parametrize("text,rule", [
    ("the cat and the dog " * 5, "word_count"),
    (" ".join(["the", "and"] + ["supercalifragilistic"] * 60), "mean_word_length"),
    (" ".join(["the", "and"] + ["#tag"] * 20 + ["river"] * 60), "hash_ratio"),
    (" ".join(["the", "and"] + ["wait..."] * 20 + ["river"] * 60), "ellipsis_ratio"),
    ("\n".join(f"• the river of stones number {i}" for i in range(20)), "bullet_lines"),
    ("\n".join(f"the river of stones went on and on {i}..." if i % 2 else f"the river {i} of stones flowed"
               for i in range(20)), "ellipsis_lines"),
    (" ".join(["the", "and"] + ["12345"] * 20 + ["river"] * 60), "alpha_words"),
    (" ".join(["river", "stones"] * 40), "stop_words"),
])
def test_each_gopher_quality_rule_fires_with_its_name(text, rule):
    assert gopher_quality_failure(text) == rule
    assert not passes_quality(text)


def test_gopher_quality_passes_prose_and_respects_boundaries():
    assert passes_quality(GOOD)
    base = ["the", "and"] + ["river"] * 48
    assert gopher_quality_failure(" ".join(base)) is None  # exactly 50 words
    assert gopher_quality_failure(" ".join(base[:-1])) == "word_count"
    ten_percent = ["the", "and"] + ["river"] * 88 + ["#x"] * 10  # 100 words, 10 hashes: allowed
    assert gopher_quality_failure(" ".join(ten_percent)) is None
    assert gopher_quality_failure(" ".join(ten_percent + ["#y"])) == "hash_ratio"


def test_repetition_measures_match_hand_computation():
    words = "a b c a b c x".split()
    assert top_ngram_char_fraction(words, 2) == pytest.approx(4 / 7)  # "a b" twice
    assert duplicate_ngram_char_fraction(words, 3) == pytest.approx(6 / 7)  # both "a b c", overlap once
    assert duplicate_ngram_char_fraction("p q r s t".split(), 2) == 0.0


@pytest.mark.parametrize("text,rule", [
    ("\n".join(["Buy now and save."] * 5 + [f"line {i} is new" for i in range(5)]), "dup_line_frac"),
    ("\n\n".join(["A repeated paragraph of the page."] * 2 + ["\n".join(GOOD.replace("\n\n", " ").split(". "))]),
     "dup_para_frac"),
    (" ".join(f"cheap watches {w}" for w in prose(random.Random(3), 60).split()), "top_2gram_char_frac"),
])
def test_repetition_rules_fire_with_their_names(text, rule):
    assert gopher_repetition_failure(text) == rule


def test_repetition_passes_prose_and_catches_repeated_passages():
    assert gopher_repetition_failure(GOOD) is None
    repeated = GOOD + " " + " ".join(GOOD.split()[:60])
    assert gopher_repetition_failure(repeated).startswith(("dup_", "top_"))


def test_pii_placeholders_and_counts():
    card = card_number(random.Random(0))
    text = (f"Mail ana.b@mail.example.org, call (555) 123-4567 or +44 20 7946 0958. Hosts 10.0.0.1, "
            f"2001:db8::1. Card {card}. Not PII: 4111 1111 1111 1112, version 1.2.3, 12:30:45, 2021-2023.")
    scrubbed, counts = scrub_pii(text)
    assert counts == {"email": 1, "phone": 2, "ipv4": 1, "ipv6": 1, "card": 1}
    for placeholder in ("<EMAIL>", "<PHONE>", "<IP_ADDRESS>", "<CARD_NUMBER>"):
        assert placeholder in scrubbed
    assert "4111 1111 1111 1112" in scrubbed and "1.2.3" in scrubbed and "12:30:45" in scrubbed
    assert luhn_valid(card.replace(" ", "")) and not luhn_valid("4111111111111112")


@pytest.mark.parametrize("text,expected", [
    ("server at 192.0.2.146.", "server at <IP_ADDRESS>."),  # an address may end a sentence
    ("hosts 10.0.0.1, 10.0.0.2 and 10.0.0.3.", "hosts <IP_ADDRESS>, <IP_ADDRESS> and <IP_ADDRESS>."),
    ("version 1.2.3.4.5 of the firmware", "version 1.2.3.4.5 of the firmware"),
    ("doi:10.1080/10629360902949567.", "doi:10.1080/10629360902949567."),  # a DOI is not a card
    ("ISBN 9780306406157 and order 9999 9999 9999 9995", "ISBN 9780306406157 and order 9999 9999 9999 9995"),
    ("Amex 3782 822463 10005 accepted", "Amex <CARD_NUMBER> accepted"),
    ("mixed 4111-1111 1111-1111 grouping", "mixed 4111-1111 1111-1111 grouping"),
    ("call 1-800-873-2730 today", "call <PHONE> today"),  # the country code belongs to the number
    ("call 1 (800) 555-0199 or +1-800-555-0199", "call <PHONE> or <PHONE>"),
])
def test_pii_on_real_world_shapes(text, expected):
    assert scrub_pii(text)[0] == expected


def test_looks_like_card_needs_issuer_grouping_and_luhn():
    assert looks_like_card("4111111111111111") and looks_like_card("4111 1111 1111 1111")
    assert not looks_like_card("10629360902949567")  # Luhn-valid, but no card network starts with 1
    assert not looks_like_card("4111 11111 1111 111")  # not how cards are grouped
    assert not looks_like_card("4111111111111112")  # fails Luhn


def test_toxicity_classifier_catches_abuse_a_blocklist_misses_and_spares_escorts():
    classifier = ClassifierScorer()
    assert classifier("Campus police had to escort him out of the building.") < DEFAULT_THRESHOLD
    assert BlocklistScorer()("Campus police had to escort him out of the building.") == 1.0
    page = GOOD + "\n\nComment: shut up you stupid idiot, nobody cares about your garbage."
    assert classifier(page) > 0.9 > classifier(GOOD)  # the worst line decides, not the average
    assert BlocklistScorer()(page) == 0.0
    texts = [GOOD, page, "A calm page."]
    assert classifier.score_batch(texts) == [classifier(text) for text in texts]


def test_toxicity_filter_default_scorer_reasons_and_batching():
    ledger = Ledger()
    abuse = "Fuck off, you moron. Nobody wants your garbage here, you pathetic idiot."
    docs = [Document(f"d{i}", GOOD) for i in range(70)] + [Document("bad", GOOD + "\n" + abuse)]
    kept = list(ToxicityFilter()(iter(docs), ledger))  # more than one batch; the default is the page scorer
    assert [d.id for d in kept] == [f"d{i}" for i in range(70)]
    assert ledger.rejected == {"toxicity:abuse": 1} and docs[-1].meta["evidence"] == abuse
    ledger = Ledger()
    kept = list(ToxicityFilter(ClassifierScorer())(iter(docs), ledger))
    assert ledger.rejected == {"toxicity:classifier": 1} and docs[-1].meta["toxicity_score"] > 0.5
    blocklist = ToxicityFilter(BlocklistScorer())
    assert [d.id for d in blocklist([Document("x", "free porn here"), Document("y", "Essex")], ledger)] == ["y"]
    custom = list(ToxicityFilter(scorer=lambda text: 0.9 if "river" in text else 0.1)(
        [Document("r", "river"), Document("s", "sea")], ledger))
    assert [d.id for d in custom] == ["s"]
    assert ledger.rejected == {"toxicity:classifier": 2, "toxicity:blocklist": 1}


def test_page_scorer_catches_nsfw_spam_and_one_comment_but_not_one_misfired_line():
    scorer = PageScorer()
    spam = GOOD + "\n\nClick here for free xxx videos."
    comment = GOOD + "\n\nComment: shut up you stupid idiot, nobody cares about your garbage."
    long_page = "\n\n".join([GOOD] * 12 + ["Go kill yourself."])  # one flagged line, well under 2% of the page
    innocent = GOOD + "\n\nCampus police had to escort him out.\nThe museum has a nude statue."
    verdicts = scorer.assess([spam, comment, long_page, innocent, GOOD],
                             urls=["", "", "", "", "https://www.pornhub.example/"])
    assert ClassifierScorer()(spam) < DEFAULT_THRESHOLD  # what the classifier alone misses
    assert [v.reason for v in verdicts] == ["nsfw", "abuse", None, None, "nsfw"], verdicts
    assert verdicts[1].share >= DEFAULT_MIN_SHARE > verdicts[2].share > 0 and verdicts[2].worst > 0.9
    assert verdicts[0].evidence == "Click here for free xxx videos." and verdicts[4].evidence.startswith("https://")
    rule = AdultContentRule()
    assert rule.line_hit("Hot milfs want sex tonight") and not rule.line_hit("Our escort service takes patients")
    assert rule.line_hit("naked webcam girls") and not rule.line_hit("Adam and Eve naked in the garden")
    assert scorer(spam) == 1.0 and scorer(GOOD) == 0.0


def test_page_metrics_say_none_where_a_rate_has_no_denominator():
    m = page_metrics([True, False, True, False], [True, True, False, False])
    assert (m["precision"], m["recall"], m["false_positive_rate"]) == (0.5, 0.5, 0.5)
    clean_only = page_metrics([False, False], [False, False])
    assert clean_only["recall"] is None and clean_only["precision"] is None and clean_only["false_positive_rate"] == 0


def test_real_page_labels_are_well_formed_and_cover_the_shared_samples():
    labels = real_page_labels()
    assert len(labels) >= 50 and {label for label, _ in labels.values()} <= {"clean", "nsfw", "offensive"}
    assert all(reason and len(reason) < 120 for _, reason in labels.values())
    if SHARED_DATA.is_dir():  # the pages are only on the course machines
        ids = {doc.id for path in sorted(SHARED_DATA.rglob("*.gz")) for doc in WarcReader()(path, Ledger())}
        assert ids == set(labels)


def test_threshold_pairs_straddle_the_threshold_and_the_flag_model_is_an_s_curve():
    docs, truth = threshold_pairs(n_pairs=40, words=120, seed=1)
    values = sorted(value for _, value, _ in truth.values())
    assert len(docs) == 80 and values[0] < 0.7 and values[-1] > 0.95
    assert sum(0.75 <= v <= 0.85 for v in values) >= 6
    assert all(is_dup == (value >= 0.8) for _, value, is_dup in truth.values())
    model = flag_probability([0.6, 0.8, 0.95], 16, 8, trials=4000)
    assert model[0] < 0.05 and 0.3 < model[1] < 0.7 and model[2] > 0.95
    assert np.all(model <= candidate_probability([0.6, 0.8, 0.95], 16, 8) + 0.02)


def test_classifier_beats_the_blocklist_on_the_labelled_sample():
    classifier, blocklist = evaluate(ClassifierScorer()), evaluate(BlocklistScorer())
    assert classifier["per_label"]["offensive"]["flagged"] > 0.8 * classifier["per_label"]["offensive"]["total"]
    assert blocklist["per_label"]["offensive"]["flagged"] == 0  # abuse needs no dirty word
    assert classifier["recall"] > blocklist["recall"] and classifier["precision"] >= 0.85
    assert ("clean", "Campus police had to escort him out of the building.", 1.0) in blocklist["wrong"]


# --- line dedup ----------------------------------------------------------------------------------

def test_remove_repeated_lines_counts_documents_not_occurrences():
    banner, nav = "We use cookies. Accept", "Home | About"
    texts = [f"{banner}\nfirst page text\n{nav}", f"  {banner}  \nsecond page\n\n{nav}\n{nav}",
             f"third page\n{banner}", "fourth page\nfourth page\nfourth page", f"{nav}\nfifth"]
    new, lines, size = remove_repeated_lines(texts, min_documents=3)
    assert new == ["first page text", "second page", "third page", "fourth page\nfourth page\nfourth page", "fifth"]
    # the banner is in 3 documents, the nav bar in 3 (twice in one), "fourth page" in 1: 4 + 4 lines removed
    assert lines == 7 and size == 3 * len(banner) + 4 + 4 * len(nav)
    assert remove_repeated_lines(texts, min_documents=4)[1] == 0
    assert remove_repeated_lines(["a\n\n\nb"], 2)[0] == ["a\n\n\nb"]  # untouched text is returned as it was
    with pytest.raises(ValueError, match="at least 2"):
        remove_repeated_lines(texts, min_documents=1)


def test_line_dedup_stage_fits_then_strips_and_rejects_pages_left_too_short():
    banner = "Subscribe to our newsletter for the latest news and offers"
    docs = [Document(str(i), f"{banner}\n{prose(random.Random(i), 80)}") for i in range(3)]
    docs.append(Document("stub", f"{banner}\nOnly a few words of its own."))
    stage = LineDedup(min_documents=3)
    with pytest.raises(RuntimeError, match="fit"):
        stage.process(docs[0])
    ledger = Ledger()
    kept = list(stage.fit(docs)(docs, ledger))
    assert [d.id for d in kept] == ["0", "1", "2"] and all(banner not in d.text for d in kept)
    assert ledger.rejected == {"line_dedup:too_short": 1}
    assert stage.stats.counters["lines_removed"] == 4 and stage.stats.counters["bytes_removed"] == 4 * len(banner)


# --- near dedup --------------------------------------------------------------------------------

def test_lsh_band_choice_matters():
    # datasketch picks 9 x 13 for (0.8, 128): a J=0.8 pair is a candidate only ~40% of the time
    assert candidate_probability(0.8, 9, 13) < 0.45
    assert candidate_probability(0.8, 16, 8) > 0.94 and candidate_probability(0.85, 16, 8) > 0.99


def test_dedup_recall_and_precision_targets_on_ground_truth():
    docs, truth = near_duplicate_set(n_pairs=200, n_singletons=100, seed=0)
    deduper = Deduper()
    flagged = {}
    for doc_id, text in docs:
        original = deduper.match(doc_id, deduper.signature(text))
        if original is not None:
            flagged[doc_id] = original
    assert all(truth[copy][0] == original for copy, original in flagged.items() if copy in truth)
    scores = dedup_scores(flagged, truth)
    assert scores["true_duplicates"] == 100
    assert all(value >= 0.85 for _, value, dup in truth.values() if dup)
    assert scores["recall"] >= 0.95, scores
    assert scores["precision"] >= 0.95, scores


def test_shingles_ignore_case_punctuation_and_digits():
    assert shingles("The cat, sat ON the mat 1999!") == shingles("the cat sat on the mat 2024")
    assert jaccard({1, 2}, {2, 3}) == pytest.approx(1 / 3)


# --- tokenize --------------------------------------------------------------------------------

def test_tokenize_to_bin_writes_uint16_le_with_eot_between_documents(tmp_path):
    texts = ["Hello world.", "", "Second document, longer than the first."]
    offsets = tokenize_to_bin(texts, tmp_path / "s.bin")
    tokens = read_shard(tmp_path / "s.bin")
    raw = (tmp_path / "s.bin").read_bytes()
    assert np.frombuffer(raw, dtype="<u2").tolist() == tokens.tolist()
    expected = []
    for text in texts:
        expected += [EOT] + gpt2_encoding().encode_ordinary(text)
    assert tokens.tolist() == expected and offsets == [0, 4, 5]
    assert all(tokens[o] == EOT for o in offsets)
    assert gpt2_encoding().decode(tokens[offsets[2] + 1:].tolist()) == texts[2]
    assert encode_document("x").dtype == np.dtype("<u2")


def test_ledger_raises_when_documents_go_missing():
    ledger = Ledger()
    ledger.admit(3)
    ledger.reject(Document("a", ""), "x:y")
    with pytest.raises(AccountingError):
        ledger.check_balance(kept=1)
    ledger.check_balance(kept=2)
    assert list(run_stages([], [], ledger)) == []


def test_lab_10_tokenizes_offline_from_the_files_make_install_left():
    """`make install` leaves GPT-2's BPE files in the venv: with no cache configured, no shared folder and every
    connection refused, the tokenizer still loads (an offline room after one online install)."""
    if not (VENV_TIKTOKEN.is_dir() and any(VENV_TIKTOKEN.iterdir())):
        pytest.fail(f"{VENV_TIKTOKEN} is empty: run make install (it copies or fetches GPT-2's files there)")
    offline = ("import pathlib, socket\n"
               "def refuse(*args, **kwargs):\n"
               "    raise OSError('network blocked by the test')\n"
               "socket.socket.connect = refuse\n"
               "import distlab.data.shards as shards\n"
               "shards._REPO_SHARED_TIKTOKEN = pathlib.Path('/nonexistent')\n"
               "print(shards.encode_document('Hello world').tolist())\n")
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", offline], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[50256, 15496, 995]", done.stdout
