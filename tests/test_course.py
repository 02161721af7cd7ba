"""The course text agrees with the notebooks: every measured figure a chapter quotes is in a real output."""

import json
import re
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((REPO / "course").glob("[0-9][0-9]_*.md"))
OUTPUT_BLOCK = re.compile(r"^```output[^\n]*\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _notebook_outputs(path: Path) -> str:
    """Every cell's printed text; a cell's stream chunks are joined as printed (the kernel splits one print
    burst into several outputs depending on timing), cells and other outputs by a newline."""
    nb = nbformat.read(path, as_version=4)
    texts = []
    for cell in nb.cells:
        streams = {}
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                streams[output["name"]] = streams.get(output["name"], "") + output["text"]
            elif "text/plain" in output.get("data", {}):
                texts.append(output["data"]["text/plain"])
        texts.extend(streams.values())
    return _normalise("\n".join(texts))


def _quotable_sources(chapter: Path) -> str:
    sources = [_notebook_outputs(p) for p in (REPO / "solutions").glob(f"{chapter.name[:2]}_*.ipynb")]
    sources += [_normalise(p.read_text(encoding="utf-8")) for p in (REPO / "benchmarks" / "results").glob("*.txt")]
    return "\n".join(sources)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_quoted_outputs_appear_in_the_solution_notebook(chapter):
    sources = _quotable_sources(chapter)
    for match in OUTPUT_BLOCK.finditer(chapter.read_text(encoding="utf-8")):
        block = _normalise(match["body"])
        assert block in sources, f"{chapter.name}: this quoted output is not in the notebook any more:\n{block}"


def test_the_readmes_quoted_outputs_are_saved_benchmark_results():
    """The README's figures (what the install downloads) are a benchmark's saved output, rewritten by rerunning it."""
    saved = "\n".join(_normalise(p.read_text(encoding="utf-8"))
                      for p in (REPO / "benchmarks" / "results").glob("*.txt"))
    blocks = [_normalise(m["body"]) for m in OUTPUT_BLOCK.finditer((REPO / "README.md").read_text(encoding="utf-8"))]
    assert blocks and all(block in saved for block in blocks), blocks


def test_interview_map_points_at_sections_that_exist():
    """Each question names notebook sections by heading (*in italics*); a renamed heading breaks the map."""
    headings = set()
    for path in (REPO / "solutions").glob("[0-9][0-9]_*.ipynb"):
        notebook = json.loads(path.read_text(encoding="utf-8"))
        headings |= {line.lstrip("#").strip() for cell in notebook["cells"] if cell["cell_type"] == "markdown"
                     for line in "".join(cell["source"]).splitlines() if line.startswith("##")}
    text = (REPO / "course" / "interview_map.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| question")]
    assert len(rows) >= 13
    for row in rows:
        cited = re.findall(r"\*([^*]+)\*", row.split("|")[2])
        assert cited, row
        assert not (missing := [c for c in cited if c not in headings]), f"{missing} are no notebook headings"
    for chapter in re.findall(r"\]\((\w+\.md)\)", text):
        assert (REPO / "course" / chapter).exists(), chapter


# A figure with a unit (bytes, time, rate) or an unqualified percentage in a chapter's table is a measurement or a
# derived number; a threshold written with ≤/≥ is a rule. Formulas ($…$) and code (`…`) are not figures.
_TABLE_FIGURE = re.compile(r"(?<![\w.≤≥<>])(?<![≤≥<>] )\d[\d,]*(\.\d+)?\s*(GiB|GB|MiB|MB|KiB|KB|TB|ms|µs|s|min|h|days"
                           r"|TFLOP/s|GB/s|tokens/s|%)(?![\w/])")
_FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_tables_of_figures_are_quoted_outputs(chapter):
    """A table that shows measured or computed figures is printed by a cell and quoted in an ```output block
    (checked above), never typed into the chapter, where it would go stale when the code or the model changes."""
    text = _FENCED.sub("", chapter.read_text(encoding="utf-8"))
    text = re.sub(r"\$[^$\n]*\$|`[^`\n]*`", "", text)
    typed = [line for line in text.splitlines() if line.startswith("|") and _TABLE_FIGURE.search(line)]
    assert not typed, (f"{chapter.name}: these table rows show figures no cell printed; print the table in the "
                       f"solution notebook and quote it in an ```output block:\n" + "\n".join(typed))


# Every sentence about another system (NCCL, PyTorch internals, Megatron-LM, torchtitan, DeepSpeed, a paper's figure)
# names its source as a numbered reference [n] that the chapter's "## References" list resolves. These chapters must
# carry such a list; any other chapter that has one is checked the same way. Add a chapter's number once it has its.
CHAPTERS_WITH_REFERENCES = ("04", "05", "06", "07", "08", "09", "10", "11", "12", "13")
_REFERENCES = re.compile(r"^## References[^\n]*\n(?P<body>.*?)(?=^## |\Z)", re.MULTILINE | re.DOTALL)
_ENTRY_START = re.compile(r"^(?:[-*]|\d+\.|\[\d+\])\s.*$", re.MULTILINE)  # a list item of the references
_REFERENCE_ENTRY = re.compile(r"^(?:[-*] )?\[(\d+)\] \S")  # "[3] Author, *Title*, venue, §2.1"
# [3], [3, 5], [3–5], [3, §2.1], [3, Table 4]; not a link [3](...)
_CITATION = re.compile(r"\[(\d+(?:\s*[,–-]\s*\d+)*)(?:,\s*[^\]\d\s][^\]\n]*)?\](?!\()")
_CODE_OR_MATH = re.compile(r"^```.*?^```|\$\$.*?\$\$|\$[^$\n]*\$|`[^`\n]*`", re.MULTILINE | re.DOTALL)


def _cited(text: str) -> set[int]:
    """The reference numbers the text cites, outside code and formulas (where [3] is an index)."""
    numbers = set()
    for match in _CITATION.finditer(_CODE_OR_MATH.sub("", text)):
        for part in match[1].split(","):
            first, _, last = part.strip().replace("–", "-").partition("-")
            numbers.update(range(int(first), int(last or first) + 1))
    return numbers


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_every_citation_resolves_and_every_reference_is_cited(chapter):
    text = chapter.read_text(encoding="utf-8")
    listing = _REFERENCES.search(text)
    if listing is None:
        assert chapter.name[:2] not in CHAPTERS_WITH_REFERENCES, (
            f"{chapter.name}: no '## References' list; name the source of every sentence about another system as "
            f"[n] and list the sources there, one '[n] author, title, venue, section' (or repository path and "
            f"function, or documentation page) per line")
        return
    items = _ENTRY_START.findall(listing["body"])
    assert not (unnumbered := [i for i in items if not _REFERENCE_ENTRY.match(i)]), (
        f"{chapter.name}: references the text cannot point at; number them '[n] ...':\n" + "\n".join(unnumbered))
    entries = [int(_REFERENCE_ENTRY.match(i)[1]) for i in items]
    assert entries and entries == list(range(1, len(entries) + 1)), (
        f"{chapter.name}: references numbered {entries}, not 1, 2, 3, ...")
    cited = _cited(text[:listing.start()] + text[listing.end():])
    assert not (unknown := sorted(cited - set(entries))), f"{chapter.name}: {unknown} cited but not in its references"
    assert not (uncited := sorted(set(entries) - cited)), f"{chapter.name}: references {uncited} are never cited"
