"""Progress bars: drawn for a person (terminal here; the notebook's widget in tests/test_magic.py and the browser
test), silent where nobody watches, and drawn by the launcher for loops that run inside ranks."""

import importlib.util
import re
import time
from pathlib import Path

import nbformat
import pytest

import distlab
from distlab.notebooks import execute
from distlab.runtime import output, progress


@pytest.fixture
def watched(monkeypatch):
    """A person at a terminal (pytest itself is headless)."""
    monkeypatch.setattr(progress, "audience", lambda: "terminal")


def test_headless_a_bar_draws_nothing_and_still_iterates_and_counts(capfd):
    assert output.audience() == "headless"  # pytest, as nbval and CI
    bar = progress.progress(range(5), desc="files")
    assert list(bar) == [0, 1, 2, 3, 4] and bar.n == 5 and bar.total == 5
    with progress.progress(total=3, desc="stage") as by_hand:
        by_hand.update(2)
        by_hand.set_postfix_str("dedup")
        by_hand.set_description("stage 2")
    assert by_hand.n == 2
    resumed = progress.progress(range(10, 40), initial=10, desc="steps")
    assert resumed.total == 40 and resumed.n == 10 and sum(1 for _ in resumed) == 30 and resumed.n == 40
    assert capfd.readouterr() == ("", "")


def test_at_a_terminal_the_bar_shows_count_rate_and_eta(watched, capfd):
    for _ in progress.progress(range(4), desc="files", unit="file"):
        time.sleep(0.01)
    err = capfd.readouterr().err.replace("\r", "\n")
    assert re.search(r"files: 100%\|.*\| 4/4 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+(file/s|s/file)\]", err), err
    for _ in progress.progress(range(3), desc="switched off", disable=True):
        pass
    assert capfd.readouterr().err == ""


def test_a_loop_inside_ranks_is_drawn_once_by_the_launcher(watched, capfd):
    def steps():
        import time

        import torch.distributed as dist

        from distlab.runtime.progress import progress

        for step in progress(range(12), desc="steps"):
            time.sleep(0.03 * (1 + dist.get_rank()))  # rank 1 is the slow one
        return step

    assert list(distlab.launch(steps, 2, threads=1)) == [11, 11]
    out, err = capfd.readouterr()
    drawn = err.replace("\r", "\n").splitlines()
    assert any(re.match(r"steps: 100%\|.*\| 12/12 ", line) for line in drawn), err
    assert out == "" and "[rank" not in err  # nothing of the bar in the ranks' own output


def test_headless_the_launcher_does_not_read_the_ranks_reports(monkeypatch, capfd):
    reads = []
    monkeypatch.setattr(progress.RankBars, "poll", lambda self, now=False: reads.append(self.watching))

    def steps():
        from distlab.runtime.progress import progress

        return sum(progress(range(3)))

    assert list(distlab.launch(steps, 2, threads=1)) == [3, 3]
    assert reads and not any(reads)  # polled from the watchdog loop, but not watching: nothing read or drawn
    assert capfd.readouterr() == ("", "")


def test_a_notebook_distlab_executes_holds_plain_rank_output_and_no_bar(tmp_path, monkeypatch):
    """``distlab notebooks execute`` (and ``distlab grade``, the same kernels) runs headless by its own flag."""
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)  # the kernel sees no pytest: only the runner's flag
    monkeypatch.delenv("CI", raising=False)
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("%load_ext distlab"), nbformat.v4.new_code_cell(
        "%%ranks 2 --threads 1\n"
        "from distlab.runtime.progress import progress\n"
        "for step in progress(range(3), desc='steps'):\n"
        "    pass\n"
        "print('done', step)")]
    nbformat.write(notebook, tmp_path / "console.ipynb")
    outputs = execute(tmp_path / "console.ipynb", cell_timeout=300).cells[1].outputs
    assert [(o.output_type, o.get("name"), o.get("text")) for o in outputs] == [
        ("stream", "stdout", "[ranks 0, 1] done 2\n")], outputs


def _run_all():
    """``benchmarks/run_all.py`` as a module (benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("run_all", Path(__file__).resolve().parents[1] / "benchmarks"
                                                  / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_all


def test_run_all_relays_the_scripts_output_above_one_bar_and_draws_none_headless(tmp_path, monkeypatch, capfd):
    # A script's own bars stay silent: its stderr is a pipe, not the terminal (one bar for the whole run)
    (tmp_path / "bench_a.py").write_text("import sys\nfor k in range(2):\n    print('a', k)\n"
                                         "print('stderr is a terminal:', sys.stderr.isatty(), file=sys.stderr)\n")
    (tmp_path / "bench_b.py").write_text("import sys\nprint('b fails')\nsys.exit(3)\n")
    run_all = _run_all()
    scripts = sorted(tmp_path.glob("bench_*.py"))
    relayed = "\n=== bench_a.py\na 0\na 1\nstderr is a terminal: False\n\n=== bench_b.py\nb fails\n"
    assert run_all(scripts) == ["bench_b.py"]
    assert capfd.readouterr() == (relayed, "")  # headless (pytest): the output in order, no bar
    monkeypatch.setattr(progress, "audience", lambda: "terminal")
    assert run_all(scripts) == ["bench_b.py"]
    out, err = capfd.readouterr()
    assert out == relayed
    assert re.search(r"benchmarks: 100%\|.*\| 2/2 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+(script/s|s/script)\]",
                     err.replace("\r", "\n")), err
