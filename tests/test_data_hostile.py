"""Lab 10 reader on hostile input: one bad record costs one record, a non-WARC file is one rejection."""

from __future__ import annotations

import gzip
import io
import random

import pytest
from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

from distlab.data.document import Ledger
from distlab.data.read import WarcReader, parse_wet
from distlab.data.repetition import GOPHER_REPETITION, duplicate_fractions, gopher_repetition_failure
from distlab.data.samples import SampleRecord, prose, truncate_file, write_records


def record(text: str, number: int) -> SampleRecord:
    return SampleRecord("test", text, f"https://example.com/{number}",
                        f"<urn:uuid:00000000-0000-4000-8000-{number:012d}>")


def read_all(path):
    ledger, reader = Ledger(), WarcReader()
    docs = list(reader(str(path), ledger))
    ledger.check_balance(len(docs))
    return docs, ledger, reader


def html_response(writer: WARCWriter, url: str, body: bytes, charset: str = "utf-8", record_id: str | None = None):
    http = StatusAndHeaders("200 OK", [("Content-Type", f"text/html; charset={charset}")], protocol="HTTP/1.1")
    headers = {"WARC-Record-ID": record_id} if record_id else None
    warc = writer.create_warc_record(url, "response", payload=io.BytesIO(body), length=len(body), http_headers=http,
                                     warc_headers_dict=headers)
    if record_id == "":
        warc.rec_headers.remove_header("WARC-Record-ID")
    writer.write_record(warc)


def page(number: int, words: int = 80) -> bytes:
    return f"<html><body><article><p>{prose(random.Random(number), words)}</p></article></body></html>".encode()


def test_a_record_with_a_charset_python_cannot_use_costs_nothing_else(tmp_path):
    path = tmp_path / "charsets.warc.gz"
    with open(path, "wb") as handle:
        writer = WARCWriter(handle, gzip=True)
        charsets = ["utf-8", "punycode", "utf-8", "x-no-such-charset", "utf-8", "base64", "utf-8"]
        for number, charset in enumerate(charsets):
            html_response(writer, f"https://example.com/{number}", page(number), charset)
    docs, ledger, reader = read_all(path)
    assert ledger.documents_in == 7 and len(docs) == 7  # was: UnicodeError ended the file after 2
    assert reader.stats.counters["unusable_charset"] == 3


def test_a_corrupt_gzip_member_costs_one_record_and_reading_resumes(tmp_path):
    path = tmp_path / "corrupt.warc.wet.gz"
    write_records(path, [record(prose(random.Random(n), 300), n) for n in range(22)])
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 40] = bytes(40)
    path.write_bytes(bytes(data))
    docs, ledger, reader = read_all(path)
    assert ledger.documents_in == 22 and len(docs) == 21  # was: 14 counted, the rest silently gone
    assert ledger.rejected == {"read:corrupt": 1}
    assert reader.stats.counters["bytes_skipped"] > 0
    assert all(len(doc.text.split()) >= 250 for doc in docs)


def test_garbage_between_members_is_skipped_and_counted_once(tmp_path):
    path = tmp_path / "garbage.warc.wet.gz"
    write_records(path, [record(prose(random.Random(n), 200), n) for n in range(6)])
    data = path.read_bytes()
    cut = data.index(b"\x1f\x8b\x08", len(data) // 2)
    path.write_bytes(data[:cut] + b"\x1f\x8b\x08 not a gzip member at all " * 20 + data[cut:])
    docs, ledger, _ = read_all(path)
    assert len(docs) == 6 and ledger.rejected == {"read:corrupt": 1}


@pytest.mark.parametrize("keep_fraction", [0.3, 0.5, 0.8, 0.97])
def test_a_truncated_file_costs_the_record_it_was_cut_in(tmp_path, keep_fraction):
    path = tmp_path / "cut.warc.wet.gz"
    write_records(path, [record(prose(random.Random(n), 300), n) for n in range(8)])
    truncate_file(path, keep_fraction)
    docs, ledger, _ = read_all(path)
    assert ledger.rejected == {"read:truncated": 1}
    assert 0 < ledger.documents_in <= 9 and len(docs) == ledger.documents_in - 1
    assert all(len(d.text.split()) >= 250 for d in docs)  # whatever was returned is complete


@pytest.mark.parametrize("name,content", [
    ("notes.gz", gzip.compress(b"GET / HTTP/1.1\nHost: example.com\n\n" * 200, mtime=0)),
    ("notes.txt", b"just some text\n" * 50),
    ("picture.png", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4),
], ids=["notes.gz", "notes.txt", "picture.png"])  # ids by name: every test worker must collect the same ids
def test_a_file_that_is_not_warc_is_one_rejection_and_one_warning(tmp_path, capfd, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    docs, ledger, reader = read_all(path)
    assert docs == [] and ledger.documents_in == 1 and ledger.rejected == {"read:not_warc": 1}
    assert len(reader.warnings) == 1 and "not WARC" in reader.warnings[0]
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""  # no parser warning flood


def test_an_empty_file_is_a_warning_and_no_documents(tmp_path):
    path = tmp_path / "empty.warc.wet.gz"
    path.write_bytes(b"")
    docs, ledger, reader = read_all(path)
    assert docs == [] and ledger.documents_in == 0
    assert reader.warnings == ["empty.warc.wet.gz: empty file (0 bytes), no documents"]


def test_records_without_an_id_get_a_content_hash_not_a_length(tmp_path):
    path = tmp_path / "no-ids.warc.gz"
    first, second = page(1), page(2)
    second = second[:len(first)] if len(second) > len(first) else second + b" " * (len(first) - len(second))
    assert len(first) == len(second) and first != second  # same length, different pages
    with open(path, "wb") as handle:
        writer = WARCWriter(handle, gzip=True)
        for number, body in enumerate([first, second, first]):
            html_response(writer, f"https://example.com/{number}", body, record_id="")
    docs, _, _ = read_all(path)
    assert len(docs) == 3
    assert docs[0].id != docs[1].id  # was: both "no-ids.warc.gz@<length>", a false duplicate
    assert docs[0].id == docs[2].id and "sha1:" in docs[0].id  # the same content is the same record


def test_html_keeps_its_paragraphs_so_gopher_paragraph_rules_fire(tmp_path):
    path = tmp_path / "paragraphs.warc.gz"
    paragraph = prose(random.Random(1), 40).replace("\n\n", " ")
    others = [prose(random.Random(n), 40).replace("\n\n", " ") for n in (2, 3, 4)]
    body = ("<html><body><article><h1>Title of the page</h1><p>" + paragraph + "</p>"
            + "".join(f"<p>{other}</p><p>{paragraph}</p>" for other in others)
            + "<ul><li>first point of a list</li><li>second point of a list</li></ul>"
            + "</article></body></html>").encode()
    with open(path, "wb") as handle:
        html_response(WARCWriter(handle, gzip=True), "https://example.com/p", body)
    [doc] = parse_wet(path)
    paragraphs = doc.text.split("\n\n")
    assert paragraphs[0] == "Title of the page" and paragraphs.count(paragraph) == 4
    assert "- first point of a list\n- second point of a list" in paragraphs  # a list is one paragraph of lines
    repeated_paragraphs, _ = duplicate_fractions(paragraphs)
    assert repeated_paragraphs == pytest.approx(3 / 9) and repeated_paragraphs > GOPHER_REPETITION.max_dup_para_frac
    assert gopher_repetition_failure(doc.text) is not None
