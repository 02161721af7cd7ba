"""Stage 1: read Common Crawl WET and WARC files into documents.

WET ``conversion`` records already hold Common Crawl's plain-text extraction; WARC
``response`` records hold raw HTML, which we turn into main-content text with
trafilatura (a real boilerplate-removing extractor, as FineWeb does). Bad input is
data, not a crash: empty, oversized, undecodable and truncated records are counted
as rejections with a reason, so the accounting still balances.
"""

from __future__ import annotations

import gzip
import os
import re
import time
import zlib
from typing import Iterator, Optional

from warcio.archiveiterator import ArchiveIterator
from warcio.exceptions import ArchiveLoadFailed

from distlab.data.document import Document, Ledger, StageStats, text_hash

DEFAULT_MAX_DOC_BYTES = 2_000_000  # ~300k words: far beyond Gopher's 100k-word cap
_META_CHARSET = re.compile(rb"""<meta[^>]+charset=["']?([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
_HTTP_CHARSET = re.compile(r"charset=([A-Za-z0-9_.:-]+)", re.IGNORECASE)


class TruncatedInput(OSError):
    """The gzip stream ended before its end-of-stream marker (an interrupted download)."""


class _StrictGzipReader:
    """Decompress gzip ourselves so truncation raises instead of looking like a clean end.

    warcio treats an EOFError while parsing a record header as "no more records", so a
    file cut inside a header would silently lose its tail. Python's gzip module raises
    EOFError on truncation; we re-raise it as :class:`TruncatedInput`."""

    def __init__(self, raw):
        self.gzip = gzip.GzipFile(fileobj=raw)

    def read(self, size: int = -1) -> bytes:
        try:
            return self.gzip.read(size)
        except EOFError as error:
            raise TruncatedInput(str(error)) from error

    def tell(self) -> int:
        return self.gzip.tell()


# What a broken gzip stream or WARC header looks like when we meet it.
READ_ERRORS = (ArchiveLoadFailed, zlib.error, TruncatedInput, OSError, ValueError, IndexError)


def extract_html(html: str) -> str:
    """Main text of an HTML page (navigation, footers and ads removed)."""
    import trafilatura  # imported lazily: it is the slowest import of the package

    return trafilatura.extract(html, include_comments=False, include_tables=False) or ""


def declared_charset(http_content_type: str, body: bytes) -> str:
    """The page's own charset (HTTP header, else <meta>), defaulting to UTF-8."""
    found = _HTTP_CHARSET.search(http_content_type or "")
    if found:
        return found.group(1).lower()
    found = _META_CHARSET.search(body[:4096])
    return found.group(1).decode("ascii").lower() if found else "utf-8"


class WarcReader:
    """Yields one Document per WET conversion / WARC HTML response record of a file."""

    name = "read"

    def __init__(self, max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES):
        self.max_doc_bytes = max_doc_bytes
        self.stats = StageStats(self.name)

    def __call__(self, path: str, ledger: Ledger) -> Iterator[Document]:
        source = os.path.basename(str(path))
        with open(path, "rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            records = ArchiveIterator(_StrictGzipReader(raw) if gzipped else raw, check_digests=False)
            broken = False
            while not broken:
                start = time.perf_counter()
                try:
                    record = next(records)
                    outcome = self._read_record(record, source)
                except StopIteration:
                    break
                except READ_ERRORS as error:
                    # A truncated gzip or a corrupt header ends what can be read of the
                    # file: the record we were in becomes one counted rejection.
                    broken = True
                    self.stats.counters["corrupt_files"] += 1
                    outcome = (Document(f"{source}@{records.offset}", "", source=source,
                                        meta={"error": f"{type(error).__name__}: {error}"[:200]}),
                               "truncated_or_corrupt")
                finally:
                    self.stats.seconds += time.perf_counter() - start
                if outcome is None:
                    continue  # warcinfo, request, metadata: not documents
                doc, reason = outcome
                self.stats.docs_in += 1
                ledger.admit()
                if reason:
                    ledger.reject(doc, f"{self.name}:{reason}")
                else:
                    self.stats.docs_out += 1
                    yield doc

    def _read_record(self, record, source: str) -> Optional[tuple[Document, Optional[str]]]:
        kind = record.rec_type
        if kind not in ("conversion", "response"):
            self.stats.counters[f"skipped_{kind}_records"] += 1
            return None
        headers = record.rec_headers
        doc = Document(
            id=headers.get_header("WARC-Record-ID") or f"{source}@{record.length}",
            text="", url=headers.get_header("WARC-Target-URI") or "",
            date=headers.get_header("WARC-Date") or "", source=source)
        expected = int(headers.get_header("Content-Length") or 0)
        raw = record.content_stream().read(self.max_doc_bytes + 1)
        if len(raw) > self.max_doc_bytes:
            return doc, "too_large"
        if kind == "conversion":
            if len(raw) < expected:
                return doc, "truncated_or_corrupt"
            text, charset = self._decode(raw, "utf-8")
        else:
            http = record.http_headers
            status = http.get_statuscode() if http else ""
            content_type = (http.get_header("Content-Type") or "") if http else ""
            if status != "200":
                return doc, "http_status"
            if "html" not in content_type.lower():
                return doc, "not_html"
            text, charset = self._decode(raw, declared_charset(content_type, raw))
            if text is not None:
                text = extract_html(text)
        if text is None:
            return doc, "non_utf8" if charset == "utf-8" else "undecodable"
        doc.text = text.replace("\r\n", "\n").strip()
        doc.meta["hash_before"] = text_hash(doc.text)
        return doc, (None if doc.text else "empty")

    @staticmethod
    def _decode(raw: bytes, charset: str) -> tuple[Optional[str], str]:
        try:
            return raw.decode(charset), charset
        except LookupError:  # a charset name Python does not know: try UTF-8
            return WarcReader._decode(raw, "utf-8") if charset != "utf-8" else (None, charset)
        except UnicodeDecodeError:
            return None, charset


def parse_wet(path: str, max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES) -> list[Document]:
    """All readable documents of one WET/WARC file (the notebook's first step)."""
    return list(WarcReader(max_doc_bytes)(path, Ledger(keep_rows=False)))
