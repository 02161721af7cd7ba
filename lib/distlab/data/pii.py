"""Stage 5a: scrub personally identifiable information before it reaches the model.

Regular expressions find emails, phone numbers, IPv4/IPv6 addresses and payment
card numbers; candidates are validated (the ``ipaddress`` module for IPs, the Luhn
checksum for cards) so that version strings, dates and order numbers survive.
Matches become placeholders and are counted per type. Cards are matched first so
their digit groups are never mistaken for phone numbers.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

from distlab.data.document import Document, Outcome, Stage

PLACEHOLDERS = {"email": "<EMAIL>", "card": "<CARD_NUMBER>", "ipv6": "<IP_ADDRESS>",
                "ipv4": "<IP_ADDRESS>", "phone": "<PHONE>"}

EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
IPV6 = re.compile(r"(?<![0-9A-Fa-f:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![0-9A-Fa-f:])")
IPV4 = re.compile(r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\d.])")
PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]?\d{2,4}){2,3}"  # +44 20 7946 0958
    r"|\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}"  # (555) 123-4567
    r"|\d{3}[.-]\d{3}[.-]\d{4}"  # 555-123-4567
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


def _is_card(match: str) -> bool:
    digits = re.sub(r"[ -]", "", match)
    return 13 <= len(digits) <= 19 and luhn_valid(digits)


def _is_ipv6(match: str) -> bool:
    try:
        ipaddress.IPv6Address(match)
    except ValueError:
        return False
    return True


# (type, pattern, validator): applied in this order on the text left by the previous ones.
DETECTORS = (
    ("email", EMAIL, None),
    ("card", CARD, _is_card),
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
