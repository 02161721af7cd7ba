"""Stage 5a: scrub personally identifiable information before it reaches the model.

Regular expressions find emails, phone numbers, IPv4/IPv6 addresses and payment
card numbers; candidates are validated (the ``ipaddress`` module for IPv6; for cards
an issuer prefix, a card's grouping and the Luhn checksum) so that version strings,
dates, DOIs and order numbers survive. Matches become placeholders and are counted
per type. Cards are matched first so their digit groups are never mistaken for
phone numbers; a phone keeps its country code (``1-800-...`` is one number).
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

from distlab.data.document import Document, Outcome, Stage

PLACEHOLDERS = {"email": "<EMAIL>", "card": "<CARD_NUMBER>", "ipv6": "<IP_ADDRESS>",
                "ipv4": "<IP_ADDRESS>", "phone": "<PHONE>"}

EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
# A card candidate is a run of 13-19 digits, optionally grouped by spaces or dashes, standing alone:
# not glued to a word, a path or a decimal (a DOI such as 10.1080/10629360902949567 is not a card).
CARD = re.compile(r"(?<![\w./-])\d(?:[ -]?\d){12,18}(?![\w/-]|[.,]\d)")
# Issuer prefixes (IIN ranges) of the card networks: Visa, Mastercard, Amex, Diners, Discover, JCB, UnionPay.
CARD_ISSUER = re.compile(r"4|5[1-5]|2(?:22[1-9]|2[3-9]\d|[3-6]\d\d|7[01]\d|720)|3[47]|3(?:0[0-5]|[68])"
                         r"|6(?:011|4[4-9]|5|2)|35(?:2[89]|[3-8]\d)")
IPV6 = re.compile(r"(?<![0-9A-Fa-f:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![0-9A-Fa-f:])")
# An address may end a sentence ("server at 192.0.2.146."), but not continue as a longer dotted number.
IPV4 = re.compile(r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?!\.?\d)")
PHONE = re.compile(
    r"(?<![\w+-])(?:"
    r"\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]?\d{2,4}){2,3}"  # +44 20 7946 0958
    r"|(?:1[ .-]?)?\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}"  # (555) 123-4567, 1 (800) 555-0199
    r"|(?:1[.-])?\d{3}[.-]\d{3}[.-]\d{4}"  # 555-123-4567, 1-800-873-2730: the country code is part of it
    r")(?!\w)")


def luhn_valid(digits: str) -> bool:
    """The checksum every payment card number satisfies (and ~90% of random digit runs fail)."""
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = int(char)
        if position % 2 == 1:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


def looks_like_card(candidate: str) -> bool:
    """A payment card number: 13-19 digits from a card network's issuer range, printed as
    one run or in the groups cards use (4-4-4-4..., or Amex/Diners 4-6-5 / 4-6-4, one kind
    of separator), and passing Luhn. Any one test alone lets through order numbers, ISBNs
    and DOIs: a random digit run passes Luhn one time in ten."""
    separators = set(re.findall(r"[ -]", candidate))
    groups = [len(group) for group in re.split(r"[ -]", candidate)]
    if len(separators) > 1:
        return False
    if len(groups) > 1 and groups not in ([4, 6, 5], [4, 6, 4]) and not (
            all(size == 4 for size in groups[:-1]) and 1 <= groups[-1] <= 4):
        return False
    digits = re.sub(r"[ -]", "", candidate)
    return 13 <= len(digits) <= 19 and CARD_ISSUER.match(digits) is not None and luhn_valid(digits)


def _is_ipv6(match: str) -> bool:
    try:
        ipaddress.IPv6Address(match)
    except ValueError:
        return False
    return True


# (type, pattern, validator): applied in this order on the text left by the previous ones.
DETECTORS = (
    ("email", EMAIL, None),
    ("card", CARD, looks_like_card),
    ("ipv6", IPV6, _is_ipv6),
    ("ipv4", IPV4, None),
    ("phone", PHONE, None),
)


def scrub_pii(text: str) -> tuple[str, Counter]:
    """Text with PII replaced by placeholders, and how many of each type were replaced."""
    counts: Counter = Counter()
    for kind, pattern, valid in DETECTORS:
        def replace(match: re.Match, kind=kind, valid=valid) -> str:
            if valid is not None and not valid(match.group()):
                return match.group()
            counts[kind] += 1
            return PLACEHOLDERS[kind]

        text = pattern.sub(replace, text)
    return text, counts


class PiiScrubber(Stage):
    """Replaces PII in place; never rejects. Counts per type go to the stage's counters."""

    name = "pii"

    def process(self, doc: Document) -> Outcome:
        doc.text, counts = scrub_pii(doc.text)
        if counts:
            doc.meta["pii"] = dict(counts)
            self.stats.counters.update(counts)
        return doc
