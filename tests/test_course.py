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
