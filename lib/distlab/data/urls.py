"""Stage 2: URL dedup. The same page is crawled many times (http/https, tracking
parameters, trailing slashes); normalising the URL and keeping its first occurrence
removes exact repeats before the expensive near-dedup."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from distlab.data.document import Document, Outcome, Stage

TRACKING_PARAMS = ("utm_", "fbclid", "gclid", "mc_cid", "mc_eid", "ref_src")
DEFAULT_PORTS = {"http": "80", "https": "443"}


def normalize_url(url: str) -> str:
    """Canonical form: lower-case host, no scheme difference, default port, fragment,
    tracking parameters or trailing slash; remaining query parameters sorted."""
    url = url.strip()
    if not url:
        return ""
    parts = urlsplit(url if "://" in url else "http://" + url)
    host = (parts.hostname or "").lower().rstrip(".")
    if host.startswith("www."):
        host = host[4:]
    port = parts.port if parts.port is not None and str(parts.port) != DEFAULT_PORTS.get(parts.scheme.lower()) else None
    netloc = f"{host}:{port}" if port else host
    path = parts.path.rstrip("/") or "/"
    query = sorted((k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
                   if not k.lower().startswith(TRACKING_PARAMS))
    return urlunsplit(("", netloc, path, urlencode(query), "")).lstrip("/")


class UrlDedup(Stage):
    """Keep the first document for each normalised URL; later ones are ``url_duplicate``."""

    name = "url_dedup"

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[str, str] = {}  # normalised URL -> id of the document kept for it

    def process(self, doc: Document) -> Outcome:
        key = normalize_url(doc.url)
        if not key:
            return doc  # no URL to compare: near-dedup still sees the text
        if key in self.first:
            doc.meta["duplicate_of"] = self.first[key]
            return "url_duplicate"
        self.first[key] = doc.id
        return doc


class RecordIdDedup(Stage):
    """WARC record ids must be unique (lineage is keyed by them): keep the first."""

    name = "record_id"

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def process(self, doc: Document) -> Outcome:
        if doc.id in self.seen:
            doc.meta["duplicate_of"] = doc.id  # the first record with this id was kept
            return "duplicate_record_id"
        self.seen.add(doc.id)
        return doc
