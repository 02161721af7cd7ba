"""A GENERATED sample crawl for the lab: clearly synthetic, with known answers.

Real Common Crawl files are large and need the internet; the lab and the tests run
offline on WET/WARC files written here with warcio. Every document is labelled with
the kind of page it imitates - good prose, SEO spam, boilerplate, non-English,
prose with PII, toxic pages (an abusive comment, or NSFW spam), near-duplicates of
known Jaccard, URL repeats, and broken records - so each filter's decisions can be
compared with the truth. Like Common Crawl's own WET text, the pages of a site carry
its navigation bar and footer, and most carry the same cookie banner: the lines that
line-level dedup exists to remove.

Nothing here is real web text: sentences are drawn from small word lists.
"""

from __future__ import annotations

import io
import json
import random
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

from distlab.data.dedup import jaccard, shingles

GENERATED_NOTICE = "GENERATED SAMPLE (synthetic text written by distlab.data.samples, not real web pages)"
SAMPLE_DATE = "2024-05-18T01:58:10Z"
# Mirrors copy a page after it is published, so a crawl meets the copy later: the near-dedup stage keeps the
# earliest-crawled member of a cluster, which is then the original.
MIRROR_DATE = "2024-05-25T11:20:00Z"

NOUNS = """river mountain village teacher library garden engineer harbour market bridge museum
forest orchard student farmer painter kitchen window letter station railway valley island
festival journey lantern meadow notebook ocean pianist harvest castle workshop bakery
physician carpenter compass glacier hospital journalist laboratory lighthouse merchant
neighbour parliament pilgrim professor reservoir sailor scientist shepherd telescope
theatre traveller vineyard volunteer weaver climate council engine factory history
language lesson memory method museum network pattern question record region season
signal society storm surface system theory tradition valley winter summer morning evening
century decade village cottage chapel meadow cathedral canal tunnel highway airport""".split()
ADJECTIVES = """quiet ancient bright careful curious distant early famous gentle golden honest
humble local modern narrow patient practical rapid rural silent simple steady sudden
tall useful warm wooden young northern southern eastern western heavy light small large
remarkable ordinary familiar foreign generous modest busy empty crowded fragile""".split()
VERBS = """built visited described painted repaired studied measured crossed explained
followed opened restored designed collected recorded planted discovered protected
organised improved carried watched noticed prepared finished changed""".split()
ADVERBS = """slowly carefully quietly suddenly gradually eventually patiently rarely often
usually finally barely clearly happily""".split()
NAMES = """Anna Brian Clara Daniel Elena Felix Grace Henry Irene James Karen Lucas Maria
Nathan Olivia Peter Rosa Samuel Teresa Victor""".split()
TEMPLATES = (
    "The {adj} {noun} that {name} {verb} was {adv} {verb2} by the {noun2} of the {noun3}.",
    "In the {adj} {noun}, {name} {verb} a {noun2} with the help of a {adj2} {noun3}.",
    "Many people have {verb} the {noun} to be {adj}, and {name} {adv} {verb2} that {noun2}.",
    "{name} said that the {noun} of the {adj} {noun2} had to be {verb} before the {noun3}.",
    "After the {noun} was {verb}, the {adj} {noun2} {adv} {verb2} its {noun3} with care.",
    "It is {adj} to see how the {noun} and the {noun2} have {verb} the {adj2} {noun3}.",
    "Each {noun} in the {noun2} was {verb} with a {adj} {noun3}, {adv} and without fuss.",
    "The {noun2} {verb} by {name} became the {adj} {noun} of the {adj2} {noun3} for years.",
)

# Tiny phrasebooks: enough for fastText to recognise the language, not real text.
FOREIGN = {
    "fr": ("Le {n} de la {n2} est très {a} et nous avons visité la ville avec nos amis pendant l'été.",
           ["village", "musée", "jardin", "château", "marché", "fleuve", "bibliothèque"],
           ["belle", "ancienne", "grande", "tranquille", "célèbre"]),
    "de": ("Der {n} in der {n2} ist sehr {a}, und wir haben gestern mit unseren Freunden darüber gesprochen.",
           ["Garten", "Bahnhof", "Markt", "Fluss", "Wald", "Bibliothek", "Schule"],
           ["schön", "alt", "groß", "ruhig", "bekannt"]),
    "es": ("El {n} de la {n2} es muy {a} y todos los vecinos del pueblo lo visitan durante el verano.",
           ["mercado", "museo", "jardín", "castillo", "río", "biblioteca", "puente"],
           ["bonito", "antiguo", "grande", "tranquilo", "famoso"]),
}
CHINESE = ("我们的城市有很多美丽的公园和古老的建筑。", "每年夏天很多游客来这里参观历史博物馆。",
           "老师和学生一起在图书馆里读书。", "这条河流经过一个安静的小村庄。", "他们昨天在市场上买了新鲜的水果和蔬菜。")

SPAM_PRODUCTS = ["cheap watches", "best loans", "discount shoes", "free casino bonus", "weight loss pills"]
BLOCKED_WORDS = ["porn", "xxx", "camgirls", "nsfw"]
ABUSIVE_COMMENTS = ("Comment: shut up you stupid idiot, nobody cares about your garbage.",
                    "Reply: what a load of crap, the author is a moron.",
                    "Guest wrote: go to hell you pathetic loser.")
COOKIE_BANNER = "We use cookies to give you the best experience on our website. Accept all cookies."
N_SITES = 12


def site_header(site: int) -> str:
    return f"Home | News | Shop | About site{site} | Contact"


def site_footer(site: int) -> str:
    return f"© 2024 site{site}.example.com · Privacy · Terms of use"


def random_uuid(rng: random.Random) -> str:
    return f"<urn:uuid:{uuid.UUID(int=rng.getrandbits(128), version=4)}>"


def prose_sentence(rng: random.Random) -> str:
    pick = rng.choice
    return pick(TEMPLATES).format(
        adj=pick(ADJECTIVES), adj2=pick(ADJECTIVES), noun=pick(NOUNS), noun2=pick(NOUNS), noun3=pick(NOUNS),
        verb=pick(VERBS), verb2=pick(VERBS), adv=pick(ADVERBS), name=pick(NAMES))


def prose(rng: random.Random, n_words: int = 250) -> str:
    """English-like paragraphs of about ``n_words`` words that pass every quality rule."""
    paragraphs, count = [], 0
    while count < n_words:
        sentences = [prose_sentence(rng) for _ in range(rng.randint(3, 6))]
        count += sum(len(s.split()) for s in sentences)
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)


def seo_spam(rng: random.Random) -> str:
    product = rng.choice(SPAM_PRODUCTS)
    lines = [f"Buy {product} online now. The best {product} at the lowest price. Order {product} today!"
             for _ in range(rng.randint(8, 15))]
    return "\n".join(lines)


def keyword_stuffing(rng: random.Random) -> str:
    product = rng.choice(SPAM_PRODUCTS)
    words = []
    for _ in range(rng.randint(12, 20)):
        words += [product, "best", product, "deal", "with", "the", "top", product, "and", "more", product, "offers"]
    return " ".join(words)


def boilerplate(rng: random.Random) -> str:
    """Pages Gopher's quality rules catch: menus, product bullet lists, teasers, hashtags, tables."""
    kind = rng.randrange(5)
    if kind == 0:
        return "Home | About us | Contact | Login | Register\nCookie policy | Terms of use\n© 2024 All rights reserved"
    if kind == 1:
        return "\n".join(f"• {rng.choice(ADJECTIVES).title()} {rng.choice(NOUNS)} with free delivery and a gift box"
                         f" - ${rng.randint(5, 99)}.99" for _ in range(rng.randint(12, 20)))
    if kind == 2:
        return "\n".join(f"{prose_sentence(rng)[:-1]} and the rest of the story continues..."
                         for _ in range(rng.randint(8, 12)))
    if kind == 3:
        tags = " ".join(f"#{rng.choice(NOUNS)}" for _ in range(60))
        return f"Photos from the weekend with the family and the dog. {tags}"
    return "\n".join(" ".join(str(rng.randint(100, 99999)) for _ in range(8)) + " total" for _ in range(12))


def foreign(rng: random.Random) -> str:
    language = rng.choice(sorted(FOREIGN) + ["zh"])
    if language == "zh":
        return "".join(rng.choice(CHINESE) for _ in range(rng.randint(10, 20)))
    template, nouns, adjectives = FOREIGN[language]
    return " ".join(template.format(n=rng.choice(nouns), n2=rng.choice(nouns), a=rng.choice(adjectives))
                    for _ in range(rng.randint(10, 16)))


def card_number(rng: random.Random) -> str:
    """A Luhn-valid 16-digit Visa-style test number, printed in groups of four."""
    digits = [4] + [rng.randrange(10) for _ in range(14)]
    total = sum(d if i % 2 else (d * 2 - 9 if d > 4 else d * 2) for i, d in enumerate(digits))
    digits.append((10 - total % 10) % 10)
    text = "".join(map(str, digits))
    return " ".join(text[i:i + 4] for i in range(0, 16, 4))


def with_pii(rng: random.Random) -> str:
    name = rng.choice(NAMES).lower()
    details = (f"You can write to {name}.{rng.randint(1, 99)}@example.org or call ({rng.randint(200, 999)}) "
               f"{rng.randint(200, 999)}-{rng.randint(1000, 9999)}. The old server was at "
               f"192.168.{rng.randint(0, 255)}.{rng.randint(1, 254)} and 2001:db8::{rng.randint(1, 9999):x}. "
               f"Payment with card {card_number(rng)} was accepted.")
    body = prose(rng, 200).split("\n\n")
    body.insert(1, details)
    return "\n\n".join(body)


def toxic(rng: random.Random) -> str:
    """Prose with an abusive comment (a classifier's catch) or an NSFW spam line (a blocklist's)."""
    body = prose(rng, 150).split("\n\n")
    if rng.random() < 0.5:
        body.insert(1, rng.choice(ABUSIVE_COMMENTS))
    else:
        body.insert(1, f"Click here for free {rng.choice(BLOCKED_WORDS)} videos.")
    return "\n\n".join(body)


def with_site_boilerplate(rng: random.Random, text: str, site: int) -> str:
    """The page as a WET extraction shows it: site navigation on top, footer below, usually a cookie banner."""
    lines = [site_header(site), text, site_footer(site)]
    if rng.random() < 0.8:
        lines.insert(0, COOKIE_BANNER)
    return "\n".join(lines)


def edit_words(rng: random.Random, text: str, fraction: float) -> str:
    """Replace about ``fraction`` of the words with random nouns (a near-duplicate)."""
    words = text.split(" ")
    for position in rng.sample(range(len(words)), max(1, int(fraction * len(words)))):
        words[position] = rng.choice(NOUNS)
    return " ".join(words)


@dataclass
class SampleRecord:
    kind: str  # the truth label
    text: str
    url: str
    record_id: str = ""
    raw: bytes = b""  # set for deliberately broken payloads
    extra: dict = field(default_factory=dict)
    date: str = SAMPLE_DATE  # the WARC-Date the crawl records


def _page_html(title: str, text: str) -> str:
    paragraphs = "".join(f"<p>{p}</p>" for p in text.split("\n\n"))
    return (f"<html><head><title>{title}</title><meta charset='utf-8'></head><body>"
            f"<nav><a href='/'>Home</a> | <a href='/about'>About</a> | <a href='/shop'>Shop</a></nav>"
            f"<article><h1>{title}</h1>{paragraphs}</article>"
            f"<footer>Copyright 2024. All rights reserved. Privacy policy.</footer></body></html>")


def write_records(path: Path, records: list[SampleRecord], kind: str = "wet") -> None:
    """Write records as a gzipped WET (``conversion``) or WARC (HTML ``response``) file."""
    with open(path, "wb") as handle:
        writer = WARCWriter(handle, gzip=True)
        info = writer.create_warcinfo_record(path.name, {"software": "distlab.data.samples", "note": GENERATED_NOTICE})
        info.rec_headers.replace_header("WARC-Date", SAMPLE_DATE)
        info.rec_headers.replace_header("WARC-Record-ID", f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, path.name)}>")
        writer.write_record(info)
        for record in records:
            headers = {"WARC-Record-ID": record.record_id, "WARC-Date": record.date}
            if kind == "wet":
                payload = record.raw or record.text.encode("utf-8")
                warc = writer.create_warc_record(record.url, "conversion", payload=io.BytesIO(payload),
                                                 length=len(payload), warc_content_type="text/plain",
                                                 warc_headers_dict=headers)
            else:
                payload = record.raw or _page_html(record.url.rsplit("/", 1)[-1], record.text).encode("utf-8")
                http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
                warc = writer.create_warc_record(record.url, "response", payload=io.BytesIO(payload),
                                                 length=len(payload), http_headers=http, warc_headers_dict=headers)
            writer.write_record(warc)


def truncate_file(path: Path, keep_fraction: float = 0.6) -> None:
    """Cut a gzip file mid-stream, as an interrupted download leaves it."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: int(len(data) * keep_fraction)])


@dataclass
class GeneratedSample:
    files: list  # paths of the WET/WARC files, in order
    labels: dict  # record id -> kind
    near_duplicates: list  # (original id, copy id, exact Jaccard)
    directory: Path = Path(".")


def generate_sample(directory, seed: int = 0, docs_per_file: int = 60, n_files: int = 3,
                    with_broken_file: bool = True) -> GeneratedSample:
    """Write the lab's generated crawl: ``n_files`` WET files, one WARC file of HTML pages,
    and optionally one truncated WET file. Returns the files and the truth labels."""
    rng = random.Random(seed)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    makers = {"good": lambda: prose(rng, rng.randint(120, 500)), "spam": lambda: seo_spam(rng),
              "stuffing": lambda: keyword_stuffing(rng), "boilerplate": lambda: boilerplate(rng),
              "foreign": lambda: foreign(rng), "pii": lambda: with_pii(rng), "toxic": lambda: toxic(rng)}
    mix = ["good"] * 10 + ["spam", "stuffing"] + ["boilerplate"] * 3 + ["foreign"] * 3 + ["pii"] * 2 + ["toxic"]
    all_records: list[list[SampleRecord]] = []
    originals: list[SampleRecord] = []
    near_duplicates = []
    for file_number in range(n_files):
        records = []
        for number in range(docs_per_file):
            kind = rng.choice(mix)
            site = rng.randrange(N_SITES)
            url = f"https://site{site}.example.com/{kind}/{file_number}-{number}"
            text = makers[kind]()
            if kind in ("good", "pii", "toxic"):
                text = with_site_boilerplate(rng, text, site)
            record = SampleRecord(kind, text, url, random_uuid(rng))
            records.append(record)
            if kind == "good":
                originals.append(record)
        # near-duplicates of earlier good pages (possibly from an earlier file), exact copies, URL repeats
        for _ in range(docs_per_file // 10):
            original = rng.choice(originals)
            copy = SampleRecord("near_duplicate", edit_words(rng, original.text, rng.choice([0.0, 0.01, 0.02])),
                                f"https://mirror{rng.randrange(9)}.example.net/copy/{rng.getrandbits(32):x}",
                                random_uuid(rng), date=MIRROR_DATE)
            near_duplicates.append((original.record_id, copy.record_id,
                                    round(jaccard(shingles(original.text), shingles(copy.text)), 4)))
            records.insert(rng.randrange(len(records) + 1), copy)
        for _ in range(docs_per_file // 20):
            original = rng.choice(originals)
            repeat = SampleRecord("url_repeat", prose(rng, 200),
                                  original.url.replace("https://", "http://") + "/?utm_source=feed", random_uuid(rng))
            records.append(repeat)
        all_records.append(records)
    # Broken and awkward records in the first file: empty, non-UTF-8, duplicate record id.
    first = all_records[0]
    first.append(SampleRecord("empty", "", "https://empty.example.com/", random_uuid(rng)))
    first.append(SampleRecord("non_utf8", "", "https://latin1.example.com/", random_uuid(rng),
                              raw="Café crème brûlée – prix spécial".encode("cp1252") * 20))
    reused = next(record for record in first if record.kind == "good").record_id
    first.append(SampleRecord("duplicate_id", prose(rng, 150), "https://dup-id.example.com/", reused))

    files = []
    for number, records in enumerate(all_records):
        path = directory / f"generated-{number:02d}.warc.wet.gz"
        write_records(path, records, "wet")
        files.append(path)
    html_records = [SampleRecord(kind, makers[kind](), f"https://news{n}.example.org/article-{n}", random_uuid(rng))
                    for n, kind in enumerate(["good"] * 6 + ["boilerplate", "foreign"])]
    path = directory / "generated-html.warc.gz"
    write_records(path, html_records, "warc")
    files.append(path)
    all_records.append(html_records)
    if with_broken_file:
        broken = [SampleRecord("truncated", prose(rng, 300), f"https://cut.example.com/{n}", random_uuid(rng))
                  for n in range(6)]
        path = directory / "generated-truncated.warc.wet.gz"
        write_records(path, broken, "wet")
        truncate_file(path)
        files.append(path)
        all_records.append(broken)
    labels = {}
    for records in all_records:
        for record in records:
            labels.setdefault(record.record_id, record.kind)
    (directory / "labels.json").write_text(json.dumps({"notice": GENERATED_NOTICE, "labels": labels,
                                                       "near_duplicates": near_duplicates}, indent=1))
    return GeneratedSample(files, labels, near_duplicates, directory)


def near_duplicate_set(n_pairs: int = 200, n_singletons: int = 200, seed: int = 0,
                       positive_range=(0.85, 1.0), negative_range=(0.3, 0.7), words: int = 300):
    """Documents and the ground truth for measuring near-dedup.

    Half the pairs are near-duplicates with exact shingle Jaccard in ``positive_range``,
    half are hard negatives (shared content, Jaccard in ``negative_range``); nothing is
    generated in between, so every pair has an unambiguous label. Returns
    ``(docs, truth)``: ``docs`` is a list of ``(id, text)`` in order, ``truth`` maps a
    copy's id to ``(original id, exact Jaccard, is_duplicate)``.
    """
    rng = random.Random(seed)
    docs, truth = [], {}
    for number in range(n_pairs):
        original = prose(rng, words)
        base = shingles(original)
        want_duplicate = number % 2 == 0
        low, high = positive_range if want_duplicate else negative_range
        while True:
            fraction = rng.uniform(0.0, 0.05) if want_duplicate else rng.uniform(0.07, 0.3)
            copy = edit_words(rng, original, fraction)
            value = jaccard(base, shingles(copy))
            if low <= value <= high:
                break
        docs.append((f"pair{number}-a", original))
        docs.append((f"pair{number}-b", copy))
        truth[f"pair{number}-b"] = (f"pair{number}-a", round(value, 4), want_duplicate)
    docs += [(f"single{n}", prose(rng, words)) for n in range(n_singletons)]
    order = rng.sample(range(n_pairs), n_pairs)
    # keep each pair's original before its copy, shuffle pairs and singletons between them
    pairs = [docs[2 * i:2 * i + 2] for i in order]
    singles = docs[2 * n_pairs:]
    mixed = pairs + [[single] for single in singles]
    rng.shuffle(mixed)
    return [doc for group in mixed for doc in group], truth


def threshold_pairs(n_pairs: int = 320, low: float = 0.6, high: float = 1.0, threshold: float = 0.8,
                    seed: int = 0, words: int = 300):
    """Pairs whose exact shingle Jaccard is spread evenly over [low, high], so that many sit right at the
    threshold: the hard part of near-dedup, which :func:`near_duplicate_set` leaves out on purpose.

    Pair k aims at J = low + (k + 1/2)(high - low)/n_pairs (within 0.01 where a copy can reach it).
    Returns ``(docs, truth)``
    as :func:`near_duplicate_set` does, a copy being a true duplicate when its Jaccard is >= ``threshold``."""
    rng = random.Random(seed)
    docs, truth = [], {}
    step = (high - low) / n_pairs
    for number in range(n_pairs):
        target = low + (number + 0.5) * step
        original = prose(rng, words)
        base = shingles(original)
        # each replaced word breaks about 5 shingles: J ~ (1 - 5f) / (1 + 5f) for a fraction f of words replaced
        guess = (1 - target) / (5 * (1 + target)) * len(original.split(" "))
        best = None
        for _ in range(40):  # near J = 1 one replaced word is a step of ~0.03: take the closest of 40 tries
            replaced = round(rng.uniform(0.7, 1.3) * guess)
            copy = edit_words(rng, original, replaced / len(original.split(" "))) if replaced else original
            value = jaccard(base, shingles(copy))
            if best is None or abs(value - target) < abs(best[1] - target):
                best = (copy, value)
            if abs(value - target) <= 0.01:
                break
        copy, value = best
        docs += [(f"pair{number}-a", original), (f"pair{number}-b", copy)]
        truth[f"pair{number}-b"] = (f"pair{number}-a", round(value, 4), value >= threshold)
    return docs, truth


def dedup_scores(flagged, truth: dict) -> dict:
    """Recall and precision of a dedup run, from the ids it flagged as near-duplicates.

    Recall: true near-duplicates (Jaccard in the positive range) that were flagged.
    Precision: flagged documents that are true near-duplicates."""
    flagged = set(flagged)
    positives = {copy for copy, (_, _, is_duplicate) in truth.items() if is_duplicate}
    correct = flagged & positives
    return {"recall": len(correct) / max(len(positives), 1), "precision": len(correct) / max(len(flagged), 1),
            "true_duplicates": len(positives), "flagged": len(flagged), "correct": len(correct)}
