"""A student's lab in a real browser: JupyterLab on localhost, headless Chromium, the real UI.

A second test answers one exercise of lab 12 wrong (the data order is not restored on resume), runs All, and
finds the exercise's ✗ line, every later cell executed, no traceback anywhere (the cell of the Young/Daly widget
says in one line to finish exercise 12.4, which is left undone), and the same per-exercise results from
`distlab grade` on the same notebook.

Lab 01 is opened from a temporary copy of labs/ with its stubs in place and run with Run > Run
All Cells. The test then reads what the page shows: every cell ran and none raised, the
matplotlib figures are PNG images the browser decoded, the exercise stubs show their
"(not attempted)" line, and the ipywidgets calculator answers a preset chosen in its dropdown
and a key press on its ZeRO-stage slider with new output from the kernel. Screenshots go to
$DISTLAB_SCREENSHOTS (or the test's tmp dir). Skipped, with one line, where Debian's chromium
and chromium-driver are not installed (`make browser-deps` installs them as root).
"""

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import nbformat
import pytest

from distlab.grading.classroom import grade_notebook
from wrong_answers import wrong_lab

from browser import Chromium, JupyterLab, NotebookPage, find_chromium

pytest.importorskip("selenium", reason="browser test skipped: selenium is not installed (pip install -e '.[test]')")
from selenium.webdriver.common.by import By  # noqa: E402  (after the skip above)
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LAB = "01_memory_math.ipynb"
BROWSER, CHROMEDRIVER = find_chromium()

pytestmark = [
    pytest.mark.skipif(not (BROWSER and CHROMEDRIVER),
                       reason="browser test skipped: Debian's chromium and chromium-driver are not installed "
                              "(as root: apt-get install chromium chromium-driver, or make browser-deps)"),
    pytest.mark.timeout(900),  # a hang guard for a loaded machine; the waits below fail sooner, with a screenshot
    pytest.mark.usefixtures("no_leftover_ranks"),
]

START, LOAD, RUN_ALL, WIDGET = 180, 180, 420, 120  # seconds: generous, each wait fails with what it waited for

# What the page shows, read in one round trip: output texts per code cell (in notebook order),
# the PNG images the browser decoded, and the lines of the calculator's widget output.
OUTPUTS_JS = """
const cells = [...document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-CodeCell')];
return cells.map(cell => ({
  text: [...cell.querySelectorAll('.jp-OutputArea-output')].map(o => o.innerText).join('\\n'),
  pngs: [...cell.querySelectorAll('.jp-OutputArea-output img')]
        .filter(img => img.src.startsWith('data:image/png') && img.complete && img.naturalWidth > 0).length,
  widgets: cell.querySelectorAll('.jp-OutputArea-output .jupyter-widgets').length,
}));
"""
CALCULATOR_JS = """
const line = [...document.querySelectorAll('.jp-NotebookPanel .widget-output')]
  .flatMap(o => o.innerText.split('\\n')).find(l => l.includes('per rank:'));
return line || null;
"""


def control(driver, kind: str, label: str):
    """The ipywidgets control of class widget-`kind` whose label reads `label`."""
    found = driver.find_elements(By.XPATH, f"//div[contains(@class,'widget-{kind}')]"
                                           f"[.//label[normalize-space()='{label}']]")
    return found[0] if found else None


def per_rank_gib(line: str) -> float:
    match = re.search(r"per rank: ([\d,.]+) GiB", line)
    assert match, f"the calculator printed {line!r}, expected '... per rank: <number> GiB ...'"
    return float(match.group(1).replace(",", ""))


@pytest.fixture
def shots(tmp_path):
    folder = Path(os.environ.get("DISTLAB_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def direct_localhost():
    """Behind a corporate proxy, our requests to the server and to chromedriver go straight to them."""
    current = os.environ.get("no_proxy") or os.environ.get("NO_PROXY") or ""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("no_proxy", "NO_PROXY"):
            patch.setenv(name, ",".join(filter(None, [current, "127.0.0.1", "localhost"])))
        yield


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory, direct_localhost):
    """One JupyterLab for every test here: starting one costs a loaded machine many seconds of CPU."""
    home = tmp_path_factory.mktemp("browser")
    root = home / "labs"
    shutil.copytree(REPO / "labs", root)  # the server and the kernel write here, never into the repository
    with JupyterLab(root, home / "jupyter", start_timeout=START) as lab:
        yield lab
    assert not lab.left_behind, f"JupyterLab processes left running: {lab.left_behind}"


@pytest.fixture
def jupyter(lab_server):
    """The shared JupyterLab; the kernels a test started are shut down as it ends, ranks and all."""
    yield lab_server
    lab_server.shutdown_kernels()


@pytest.fixture
def browser(tmp_path, direct_localhost):
    with Chromium(BROWSER, CHROMEDRIVER, tmp_path / "chromium") as chromium:
        yield chromium.driver
    assert not chromium.left_behind, f"Chromium processes left running: {chromium.left_behind}"


def test_lab_runs_in_jupyterlab_in_chromium(jupyter, browser, shots):
    page = NotebookPage(browser, shots)
    started = time.monotonic()
    with page.screenshot_on_failure():
        page.open(f"{jupyter.url}/lab/tree/{LAB}?token={jupyter.token}", timeout=LOAD)
        opened = time.monotonic()
        cells = page.run_all(timeout=RUN_ALL)["prompts"]
        ran = time.monotonic()
        page.screenshot("1-after-run-all")
        kernels = jupyter.kernels()
        assert [k.cmdline()[0] for k in kernels] == [sys.executable], (
            f"expected one kernel running {sys.executable}, found {[k.cmdline() for k in kernels]}")
        assert_no_cell_raised(page, jupyter.root_dir / LAB, len(cells))
        assert_stub_and_figures(page)
        answers = exercise_calculator(page)
    print(f"browser test: {len(cells)} code cells ran; JupyterLab loaded in {opened - started:.1f} s, "
          f"Run All took {ran - opened:.1f} s, the rest {time.monotonic() - ran:.1f} s; calculator "
          f"{' -> '.join(answers)}; screenshots in {shots}")


def assert_no_cell_raised(page: NotebookPage, notebook: Path, n_code_cells: int) -> dict:
    """File > Save Notebook writes what the page holds: every code cell ran, none holds an error."""
    before = notebook.stat().st_mtime_ns
    page.menu("File", "Save Notebook")
    page.wait_for("File > Save Notebook to write the notebook", lambda: notebook.stat().st_mtime_ns != before, 60)
    saved = page.wait_for("the saved notebook to parse", lambda: _read(notebook), 30)
    cells = [c for c in saved["cells"] if c["cell_type"] == "code"]
    assert len(cells) == n_code_cells, f"saved {len(cells)} code cells, the page showed {n_code_cells}"
    errors = [f"code cell {i + 1} ({c['source'].splitlines()[0][:50]!r}...): {o['ename']}: {o['evalue']}"
              for i, c in enumerate(cells) for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, f"the lab must run top to bottom, but cells raised: {errors}"
    not_run = [i + 1 for i, c in enumerate(cells) if c["execution_count"] is None]
    assert not not_run, f"Run All Cells left code cells {not_run} unexecuted"
    return saved


def assert_stub_and_figures(page: NotebookPage) -> None:
    """The stub's "(not attempted)" line and at least one decoded matplotlib PNG are on the page."""
    outputs = page.driver.execute_script(OUTPUTS_JS)
    stub_lines = [line for o in outputs for line in o["text"].splitlines() if line.endswith("(not attempted)")]
    assert any(re.fullmatch(r"· Exercise 1\.1 .+: 0/\d+ points \(not attempted\)", line) for line in stub_lines), (
        f"no '· Exercise 1.1 ... (not attempted)' line on the page; not-attempted lines: {stub_lines}")
    stub = page.driver.find_element(By.XPATH, "//div[contains(@class,'jp-OutputArea-output')]"
                                              "[contains(., '· Exercise 1.1 ') and contains(., '(not attempted)')]")
    page.scroll_to(stub, "center")
    page.screenshot("2-exercise-stub")
    static_pngs = sum(o["pngs"] for o in outputs if not o["widgets"])
    assert static_pngs >= 1, "no matplotlib figure rendered as a PNG image the browser decoded"


def exercise_calculator(page: NotebookPage) -> list[str]:
    """Choose the 7B preset, then move the ZeRO stage slider 3 -> 2 with the keyboard; each change
    must come back from the kernel as a new 'per rank' line, smaller then larger."""
    driver = page.driver
    shape = page.wait_for("the calculator's 'shape' dropdown", lambda: control(driver, "dropdown", "shape"), WIDGET)
    stage = control(driver, "slider", "ZeRO stage")
    assert stage is not None, "the calculator's 'ZeRO stage' slider did not render"
    page.scroll_to(shape)
    first = page.wait_for("the calculator's 'per rank' line", lambda: driver.execute_script(CALCULATOR_JS), WIDGET)
    widget_pngs = sum(o["pngs"] for o in driver.execute_script(OUTPUTS_JS) if o["widgets"])
    assert widget_pngs >= 1, "the calculator's plot did not render as a PNG image"
    page.screenshot("3-calculator-before")

    def answer_after(change: str, old: str) -> str:
        """The calculator's line once the kernel has redrawn it for `change` and gone idle."""
        return page.wait_for(f"the calculator to answer {change}", lambda: (
            (line := driver.execute_script(CALCULATOR_JS)) and line != old and page.state()["kernel"] == "idle"
            and line), WIDGET)

    Select(shape.find_element(By.TAG_NAME, "select")).select_by_visible_text("7B")
    smaller = answer_after("choosing the 7B preset", first)
    assert per_rank_gib(smaller) < per_rank_gib(first), (
        f"a 7B model should need less memory per rank than 70B: {first!r} -> {smaller!r}")

    readout = stage.find_element(By.CSS_SELECTOR, ".widget-readout")
    assert readout.text == "3", f"the ZeRO stage slider starts at {readout.text!r}, expected 3"
    stage.find_element(By.CSS_SELECTOR, ".noUi-handle").send_keys(Keys.ARROW_LEFT)
    page.wait_for("the ZeRO stage slider to move to 2", lambda: readout.text == "2", WIDGET)
    larger = answer_after("ZeRO stage 3 -> 2", smaller)
    assert per_rank_gib(larger) > per_rank_gib(smaller), (
        f"ZeRO-2 keeps the parameters unsharded, so per-rank memory should grow: {smaller!r} -> {larger!r}")
    page.scroll_to(shape)
    page.screenshot("4-calculator-after")
    return [first, smaller, larger]


def _read(path: Path):
    """The notebook file's JSON, or None while it is still being written."""
    try:
        nb = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return nb if any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code") else None


WRONG_LAB = "12_fault_tolerance.ipynb"
WRONG_EXERCISE = "12.1"
FORGOT_THE_DATA_ORDER = {'self.order.load_state_dict(state["data"])': "pass  # the data order is not restored"}
RESULT_LINE = re.compile(r"^(?P<mark>[✓✗·]) (?:Exercise|Question) (?P<id>Q?\d+\.\d+) ", re.MULTILINE)


def test_a_wrong_answer_reaches_its_check_in_run_all_and_grades_the_same(jupyter, browser, shots, tmp_path):
    lab = wrong_lab(WRONG_LAB, WRONG_EXERCISE, FORGOT_THE_DATA_ORDER)
    nbformat.write(lab, jupyter.root_dir / WRONG_LAB)
    graded_copy = tmp_path / "student" / WRONG_LAB
    graded_copy.parent.mkdir()
    nbformat.write(lab, graded_copy)
    page = NotebookPage(browser, shots)
    with page.screenshot_on_failure():
        page.open(f"{jupyter.url}/lab/tree/{WRONG_LAB}?token={jupyter.token}", timeout=LOAD)
        cells = page.run_all(timeout=RUN_ALL)["prompts"]
        page.screenshot("5-wrong-answer-after-run-all")
        assert_no_cell_raised(page, jupyter.root_dir / WRONG_LAB, len(cells))
        texts = [o["text"] for o in page.driver.execute_script(OUTPUTS_JS)]
        shown = {m["id"]: m["mark"] for text in texts for m in RESULT_LINE.finditer(text)}
        assert shown.get(WRONG_EXERCISE) == "✗", f"no '✗ Exercise {WRONG_EXERCISE}' line on the page: {shown}"
        tracebacks = [t[:300] for t in texts if "Traceback" in t or "NotImplementedError" in t]
        assert not tracebacks, f"a traceback is on the page (a widget's callback included): {tracebacks}"
        unfinished = [line for t in texts for line in t.splitlines() if "finish exercise 12.4" in line]
        assert "· finish exercise 12.4 to see this" in unfinished, (
            f"the Young/Daly widget of the unfinished exercise 12.4 should say to finish it: {unfinished}")
    grade = grade_notebook(graded_copy, timeout=600)
    graded = {e["id"]: {"passed": "✓", "failed": "✗", "not attempted": "·"}.get(e["status"], "-")
              for e in grade.exercises}
    assert graded == shown, f"distlab grade {graded} differs from what the page showed {shown}"
    assert grade.cell_errors == [] and grade.error is None, (grade.cell_errors, grade.error)
    print(f"browser test, wrong answer: {len(cells)} code cells ran; page and grader agree on {shown}")


CONSOLE = "console.ipynb"
CONSOLE_CELLS = [
    "%load_ext distlab",
    "%%ranks 2 --threads 1\n"
    "x = torch.ones(2) * (rank + 1)\n"
    "print('before', x.tolist())\n"
    "dist.all_reduce(x)\n"
    "print('after', x.tolist())",
    "%%ranks\n"
    "import time\n"
    "from distlab.runtime.progress import progress\n"
    "for step in progress(range(30), desc='steps'):\n"
    "    time.sleep(0.1)\n"
    "print('rank', rank, 'still has x =', x.tolist())",
]
BAR_JS = """
const bars = [...document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output .widget-hprogress')];
return bars.map(bar => bar.closest('.widget-hbox').innerText.replace(/\\s+/g, ' ').trim());
"""


def test_a_ranks_cell_shows_per_rank_output_and_a_live_bar_in_jupyterlab(jupyter, browser, shots):
    """The console in a person's JupyterLab: %%ranks cells on warm ranks keep their names from cell to cell,
    the ranks' output is grouped with a collapsible block per rank, and a loop on the ranks is a live bar."""
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in CONSOLE_CELLS]
    nbformat.write(notebook, jupyter.root_dir / CONSOLE)
    page = NotebookPage(browser, shots)
    driver = page.driver
    with page.screenshot_on_failure():
        page.open(f"{jupyter.url}/lab/tree/{CONSOLE}?token={jupyter.token}", timeout=LOAD)
        page.menu("Run", "Run All Cells")
        live = page.wait_for("the ranks' progress bar", lambda: driver.execute_script(BAR_JS), RUN_ALL)
        page.scroll_to(driver.find_element(By.CSS_SELECTOR, ".widget-hprogress"), "center")
        page.screenshot("6-ranks-cell-live-bar")
        cells = page.wait_until_drained(RUN_ALL)["prompts"]
        assert all(re.fullmatch(r"\[\d+\]:", prompt) for prompt in cells), f"not every cell ran: {cells}"
        texts = [o["text"] for o in driver.execute_script(OUTPUTS_JS)]
        assert ["[rank 0] before [1.0, 1.0]", "[rank 1] before [2.0, 2.0]", "[ranks 0, 1] after [3.0, 3.0]"] == (
            texts[1].splitlines()[:3]), f"the first %%ranks cell shows {texts[1]!r}"
        assert "[rank 0] rank 0 still has x = [3.0, 3.0]" in texts[2] and (
            "[rank 1] rank 1 still has x = [3.0, 3.0]" in texts[2]), f"x did not persist: {texts[2]!r}"
        [bar] = driver.execute_script(BAR_JS)
        assert re.search(r"steps: 100%.*30/30 \[[\d:]+<[\d:]+, +[\d.]+it/s\]", bar), f"the bar reads {bar!r}"
        rank_blocks = driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output details summary")
        assert [b.text for b in rank_blocks] == ["rank 0 · 2 lines", "rank 1 · 2 lines"], (  # the first cell's:
            [b.text for b in rank_blocks])  # the second's lines are rank by rank already
        page.scroll_to(rank_blocks[1], "center")
        rank_blocks[1].click()  # rank 1's whole output, opened as a learner would
        opened = page.wait_for("rank 1's block to open", lambda: rank_blocks[1].find_element(
            By.XPATH, "..").find_element(By.TAG_NAME, "pre").text, WIDGET)
        assert opened.splitlines() == ["before [2.0, 2.0]", "after [3.0, 3.0]"], opened
        page.screenshot("7-ranks-cells-per-rank-and-bar")
    print(f"browser test, %%ranks: the bar first read {live[0]!r}; screenshots in {shots}")
