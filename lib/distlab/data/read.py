"""Stage 1: read Common Crawl WET and WARC files into documents.

WET ``conversion`` records already hold Common Crawl's plain-text extraction; WARC
``response`` records hold raw HTML, which we turn into main-content text with
trafilatura (a real boilerplate-removing extractor, as FineWeb does), keeping a blank
line between paragraphs so the Gopher paragraph rules can see them.

Bad input is data, not a crash, and one bad record costs one record. Common Crawl
writes every record as its own gzip member, so the reader decompresses member by
member: a corrupt member is one counted rejection and reading resumes at the next
member; a file cut short costs the record it was cut in; a record with a charset
Python cannot use, or HTML that fails to extract, is one rejection with its own
reason. A file that is not WARC at all (a stray ``.txt``, an image, a gzip of
something else) is one file-level rejection, ``read:not_warc``, and a zero-byte file
is a warning: neither floods the output with parser warnings or phantom documents.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import os
import re
import time
import zlib
from typing import Iterator

from warcio.archiveiterator import ArchiveIterator

from distlab.data.document import Document, Ledger, StageStats, text_hash

DEFAULT_MAX_DOC_BYTES = 2_000_000  # ~300k words: far beyond Gopher's 100k-word cap
GZIP_MAGIC = b"\x1f\x8b\x08"
WARC_MAGIC = b"WARC/"
_CHUNK = 1 << 20
_META_CHARSET = re.compile(rb"""<meta[^>]+charset=["']?([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
_HTTP_CHARSET = re.compile(r"charset=([A-Za-z0-9_.:-]+)", re.IGNORECASE)
_BLANK_RUNS = re.compile(r"\n{3,}")


def extract_html(html: str) -> str:
    """Main text of an HTML page (navigation, footers and ads removed), one paragraph per block.

    trafilatura's own text output ends every block *and* every ``<br>`` with a single
    newline, so paragraphs cannot be told from lines. We render each top-level block
    of its extraction tree separately (with trafilatura's renderer) and join blocks
    with a blank line: headings and paragraphs become paragraphs, a list stays one
    paragraph of lines."""
    import trafilatura  # noqa: PLC0415  trafilatura is the slowest import of the package; only HTML extraction needs it
    from trafilatura.xml import xmltotxt  # noqa: PLC0415  trafilatura is heavy; only HTML extraction needs it

    extracted = trafilatura.bare_extraction(html, include_comments=False, include_tables=False,
                                            with_metadata=False)
    if extracted is None or extracted.body is None:
        return ""
    blocks = []
    for block in extracted.body:
        lines = (line.strip() for line in xmltotxt(block, include_formatting=False).split("\n"))
        text = "\n".join(line for line in lines if line)
        if text:
            blocks.append(text)
    return "\n\n".join(blocks)


def declared_charset(http_content_type: str, body: bytes) -> str:
    """The page's own charset (HTTP header, else <meta>), defaulting to UTF-8."""
    found = _HTTP_CHARSET.search(http_content_type or "")
    if found:
        return found.group(1).lower()
    found = _META_CHARSET.search(body[:4096])
    return found.group(1).decode("ascii").lower() if found else "utf-8"


def usable_charset(name: str) -> str | None:
    """Python's codec for a declared charset, or None when it is unknown or not a text
    encoding (``punycode``, ``base64``, ``rot13`` are codecs, but not charsets of a page)."""
    try:
        info = codecs.lookup(name)
    except LookupError:
        return None
    return info.name if getattr(info, "_is_text_encoding", True) and info.name not in ("punycode", "idna") else None


def content_id(source: str, payload: bytes) -> str:
    """Id of a record that has no WARC-Record-ID: its file and a hash of its content.

    Two different records never share it (their content differs); two identical
    records do, and the record-id stage then keeps only the first."""
    return f"<{source}:sha1:{hashlib.sha1(payload).hexdigest()[:20]}>"


def _seek_magic(raw, data: bytes, start: int) -> tuple[bytes, int]:
    """Bytes from the next gzip header at or after ``data[start:]`` (reading on as needed),
    and how many bytes were passed over; ``b""`` when the file has no further header."""
    passed = 0
    while True:
        found = data.find(GZIP_MAGIC, start)
        if found >= 0:
            return data[found:], passed + found
        more = raw.read(_CHUNK)
        if not more:
            return b"", passed + len(data)
        keep = len(GZIP_MAGIC) - 1  # a header may straddle two reads
        passed += max(len(data) - keep, 0)
        data, start = data[-keep:] + more, 0


def gzip_members(raw, limit: int) -> Iterator[tuple[bytes | None, str | None, int]]:
    """Decompress a multi-member gzip file one member at a time.

    Yields ``(data, None, 0)`` for each member (its decompressed bytes, cut at
    ``limit``: the rest of an oversized member is decompressed and dropped);
    ``(None, "corrupt", skipped)`` once per damaged region, after which decompression
    resumes at the next member that decompresses (``skipped`` bytes passed over); and
    ``(None, "truncated", skipped)`` when the file ends inside a member."""
    pending, skipped = raw.read(_CHUNK), 0
    while pending:
        if not pending.startswith(GZIP_MAGIC):
            pending, passed = _seek_magic(raw, pending, 0)
            skipped += passed
            continue
        decompressor, parts, size, chunks = zlib.decompressobj(31), [], 0, [pending]
        try:
            chunk = pending
            while True:
                out = decompressor.decompress(chunk)
                if size < limit:
                    parts.append(out[:limit - size])
                size += len(out)
                if decompressor.eof:
                    break
                chunk = raw.read(_CHUNK)
                if not chunk:
                    if skipped:
                        yield None, "corrupt", skipped
                    yield None, "truncated", sum(map(len, chunks))
                    return
                chunks.append(chunk)
        except zlib.error:  # not a good member after all: skip past its header and look again
            pending, passed = _seek_magic(raw, b"".join(chunks), 1)
            skipped += passed
            continue
        if skipped:
            yield None, "corrupt", skipped
            skipped = 0
        yield b"".join(parts), None, 0
        pending = decompressor.unused_data or raw.read(_CHUNK)
    if skipped:
        yield None, "corrupt", skipped


class WarcReader:
    """Yields one Document per WET conversion / WARC HTML response record of a file."""

    name = "read"

    def __init__(self, max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES):
        self.max_doc_bytes = max_doc_bytes
        self.stats = StageStats(self.name)
        self.warnings: list[str] = []

    def __call__(self, path: str, ledger: Ledger) -> Iterator[Document]:
        source = os.path.basename(str(path))
        for doc, reason in self._outcomes(str(path), source):
            self.stats.docs_in += 1
            ledger.admit()
            if reason:
                ledger.reject(doc, f"{self.name}:{reason}")
            else:
                self.stats.docs_out += 1
                yield doc

    def _outcomes(self, path: str, source: str) -> Iterator[tuple[Document, str | None]]:
        """(document, rejection reason or None) for every document-like record; timed."""
        start = time.perf_counter()
        with open(path, "rb") as raw:
            head = raw.read(64)
            raw.seek(0)
            if not head:
                self.warnings.append(f"{source}: empty file (0 bytes), no documents")
                self.stats.counters["empty_files"] += 1
                return
            if head.startswith(GZIP_MAGIC):
                records = self._gzip_records(raw, source)
            elif head.lstrip().startswith(WARC_MAGIC):
                records = self._records(raw, source)  # an uncompressed WARC: one stream, no members
            else:
                records = iter([self._not_warc(source, "a file", head)])
            for outcome in records:
                self.stats.seconds += time.perf_counter() - start
                yield outcome
                start = time.perf_counter()
        self.stats.seconds += time.perf_counter() - start

    def _gzip_records(self, raw, source: str) -> Iterator[tuple[Document, str | None]]:
        first = True
        for data, problem, skipped in gzip_members(raw, self._member_limit()):
            if problem is not None:
                self.stats.counters[f"{problem}_members"] += 1
                self.stats.counters["bytes_skipped"] += skipped
                yield self._broken(source, problem, f"{problem} gzip data, {skipped} bytes skipped"), problem
                continue
            if first and not data.lstrip().startswith(WARC_MAGIC):
                yield self._not_warc(source, "a gzip file", data)
                return
            first = False
            if not data.lstrip().startswith(WARC_MAGIC):
                self.stats.counters["corrupt_records"] += 1
                yield self._broken(source, "corrupt", f"member does not start with WARC/: {data[:16]!r}"), "corrupt"
                continue
            yield from self._records(io.BytesIO(data), source)

    def _not_warc(self, source: str, kind: str, head: bytes) -> tuple[Document, str]:
        """A whole file that is not WARC: one rejection and one warning, never a parser's flood."""
        self.warnings.append(f"{source}: {kind} that is not WARC/WET (starts with {head[:16]!r}); skipped")
        self.stats.counters["not_warc_files"] += 1
        return self._broken(source, "not_warc", f"not a WARC/WET file: starts with {head[:16]!r}"), "not_warc"

    def _member_limit(self) -> int:
        return self.max_doc_bytes + (64 << 10)  # the record's own headers on top of the largest document

    def _broken(self, source: str, problem: str, detail: str) -> Document:
        """A placeholder document for what could not be read, so the ledger can count it."""
        return Document(f"<{source}:{problem}:{self.stats.docs_in}>", "", source=source, meta={"error": detail[:200]})

    def _records(self, stream, source: str) -> Iterator[tuple[Document, str | None]]:
        """The records of one gzip member (usually exactly one) or of an uncompressed file.

        A header warcio cannot parse loses the rest of this stream (one rejection); any
        other problem inside one record costs that record only."""
        records = ArchiveIterator(stream, check_digests=False)
        while True:
            try:
                record = next(records)
            except StopIteration:
                return
            except Exception as error:
                self.stats.counters["corrupt_records"] += 1
                yield self._broken(source, "corrupt", f"{type(error).__name__}: {error}"), "corrupt"
                return
            try:
                outcome = self._read_record(record, source)
            except Exception as error:
                outcome = (self._broken(source, "bad_record", f"{type(error).__name__}: {error}"), "bad_record")
            if outcome is not None:
                yield outcome

    def _read_record(self, record, source: str) -> tuple[Document, str | None] | None:
        kind = record.rec_type
        if kind not in ("conversion", "response"):
            self.stats.counters[f"skipped_{kind}_records"] += 1
            return None
        headers = record.rec_headers
        raw = record.content_stream().read(self.max_doc_bytes + 1)
        doc = Document(id=headers.get_header("WARC-Record-ID") or content_id(source, raw), text="",
                       url=headers.get_header("WARC-Target-URI") or "",
                       date=headers.get_header("WARC-Date") or "", source=source)
        if len(raw) > self.max_doc_bytes:
            return doc, "too_large"
        if kind == "conversion":
            if len(raw) < int(headers.get_header("Content-Length") or 0):
                return doc, "truncated"
            text, reason = self._decode(raw, "utf-8")
        else:
            http = record.http_headers
            status = http.get_statuscode() if http else ""
            content_type = (http.get_header("Content-Type") or "") if http else ""
            if status != "200":
                return doc, "http_status"
            if "html" not in content_type.lower():
                return doc, "not_html"
            text, reason = self._decode(raw, declared_charset(content_type, raw))
            if text is not None:
                text = extract_html(text)
        if text is None:
            return doc, reason
        doc.text = _BLANK_RUNS.sub("\n\n", text.replace("\r\n", "\n")).strip()
        doc.meta["hash_before"] = text_hash(doc.text)
        return doc, (None if doc.text else "empty")

    def _decode(self, raw: bytes, charset: str) -> tuple[str | None, str | None]:
        """(text, None) or (None, reason). A charset Python cannot use as a text encoding
        falls back to UTF-8 (counted); bytes that still do not decode are ``non_utf8`` /
        ``undecodable``."""
        codec = usable_charset(charset)
        if codec is None:
            self.stats.counters["unusable_charset"] += 1
            codec = "utf-8"
        try:
            return raw.decode(codec), None
        except (UnicodeError, ValueError):
            return None, "non_utf8" if codec == "utf-8" else "undecodable"


def parse_wet(path: str, max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES) -> list[Document]:
    """All readable documents of one WET/WARC file (the notebook's first step)."""
    return list(WarcReader(max_doc_bytes)(path, Ledger(keep_rows=False)))
