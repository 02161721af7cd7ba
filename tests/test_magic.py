"""The notebook as a distributed console: ``%%ranks`` cells in a real IPython kernel, and rank output grouped.

One kernel (this interpreter's ipykernel, driven through jupyter_client as nbval and JupyterLab drive it) serves
the module; each test says which ranks it wants. The kernel runs under a marker of its own
(:func:`processes.launch_marker`), so the last test can prove that killing it leaves no process behind.
"""

import os
import re
import sys
import threading
import time

import psutil
import pytest
import torch.distributed as dist

import distlab
from distlab.runtime import output

from processes import alive, launch_marker, started

pytestmark = pytest.mark.timeout(600)


# ---------------------------------------------------------------- rank output, grouped

def test_lines_every_rank_printed_alike_are_said_once_and_the_rest_rank_by_rank():
    texts = [f"before [{r}.0]\nafter  [6.0]\n" for r in range(4)]
    assert output.as_text(texts).splitlines() == [
        "[rank 0] before [0.0]", "[rank 1] before [1.0]", "[rank 2] before [2.0]", "[rank 3] before [3.0]",
        "[ranks 0-3] after  [6.0]"]
    assert output.as_text(["same\n", "same\n", "", ""]) == "[ranks 0, 1] same\n"  # only ranks that printed
    assert output.as_text(["x\nlast 0\n", "x\nlast 1\n", "x\nlast 1\n"]).splitlines() == [
        "[ranks 0-2] x", "[rank 0] last 0", "[ranks 1, 2] last 1"]
    assert output.as_text(["", ""]) == ""


def test_the_browser_form_has_the_grouped_text_and_a_block_per_rank_when_ranks_differ():
    page = output.as_html(["a\nb <0>\n", "a\nb <1>\n"], ["", "oops\n"])
    assert "[ranks 0, 1]</span> a" in page and "b &lt;1&gt;" in page  # escaped
    assert page.count("<details>") == 2 and "<summary>rank 1 · 3 lines</summary>" in page
    assert "<details>" not in output.as_html(["same\n", "same\n"], ["", ""])  # nothing to tell apart
    assert "<details>" not in output.as_html(["mine 0\n", "mine 1\n"], ["", ""])  # already rank by rank


def test_launch_groups_its_output_too(capfd):
    def work():
        print(f"rank {dist.get_rank()} starts")
        print("all agree")

    distlab.launch(work, 3, threads=1)
    out, _ = capfd.readouterr()
    assert out.splitlines() == ["[rank 0] rank 0 starts", "[rank 1] rank 1 starts", "[rank 2] rank 2 starts",
                                "[ranks 0-2] all agree"]


def test_the_audience_is_headless_under_pytest_and_ci(monkeypatch):
    assert output.audience() == "headless"  # pytest sets PYTEST_CURRENT_TEST, which nbval's kernels inherit
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    monkeypatch.setenv("CI", "true")
    assert output.audience() == "headless"
    monkeypatch.setenv("CI", "false")
    monkeypatch.setenv(output.HEADLESS_ENV, "1")
    assert output.audience() == "headless"


# ---------------------------------------------------------------- %%ranks in a real kernel

class Kernel:
    """An IPython kernel of this interpreter, and what each executed cell sent back."""

    def __init__(self, cwd, marker: str):
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpec

        class ThisPython(KernelManager):
            @property
            def kernel_spec(self):  # whatever kernelspec "python3" means on this machine, this venv's python
                return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                                  display_name="distlab test", language="python")

        self.manager = ThisPython()
        env = dict(os.environ, DISTLAB_TEST_LAUNCH=marker, DISTLAB_HEADLESS="1")
        self.manager.start_kernel(cwd=str(cwd), env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=180)

    def run(self, code: str, timeout: float = 240, interrupt_after: float | None = None) -> dict:
        """Execute ``code`` (pressing stop ``interrupt_after`` seconds in); its stdout, stderr, displays (mime
        bundles), result and error, with the wall time."""
        got = {"stdout": "", "stderr": "", "displays": [], "result": None, "error": None}

        def hook(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                got[content["name"]] += content["text"]
            elif kind == "display_data":
                got["displays"].append(content["data"])
            elif kind == "execute_result":
                got["result"] = content["data"]["text/plain"]
            elif kind == "error":
                got["error"] = (content["ename"], content["evalue"], "\n".join(content["traceback"]))

        stop = threading.Timer(interrupt_after, self.manager.interrupt_kernel) if interrupt_after else None
        start = time.monotonic()
        if stop is not None:
            stop.start()
        try:
            reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook, allow_stdin=False)
        finally:
            if stop is not None:
                stop.cancel()
        got["seconds"] = time.monotonic() - start
        if reply["content"]["status"] == "error" and got["error"] is None:  # a UsageError: a line on stderr
            got["error"] = (reply["content"]["ename"], reply["content"]["evalue"], got["stderr"])
        return got

    def ok(self, code: str) -> dict:
        got = self.run(code)
        assert got["error"] is None, f"{code!r} raised {got['error'][0]}: {got['error'][1]}\n{got['stderr']}"
        return got

    def fresh_ranks(self, options: str, cell: str) -> list[int]:
        """End the ranks there are, run ``cell`` on new ones started with ``%%ranks {options}``; their pids."""
        self.ok("%ranks reset")
        self.ok(f"%%ranks {options}\n{cell}")
        return self.pids()

    def pids(self) -> list[int]:
        status = self.ok("%ranks status")["stdout"]
        return [int(pid) for pid in re.findall(r"pid (\d+)", status)]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    marker = launch_marker()
    k = Kernel(tmp_path_factory.mktemp("kernel"), marker)
    try:
        k.ok("%load_ext distlab")
        yield k
    finally:
        k.client.stop_channels()
        # Killed, not asked to quit: the ranks must end even when the kernel cannot end them (the reaper's job)
        k.manager.shutdown_kernel(now=True)
        deadline = time.monotonic() + 30
        while started(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [(p.pid, p.name()) for p in started(marker) if alive(p)]
        assert not left, f"processes outlived the killed kernel: {left}"


def test_state_persists_across_cells_and_gather_returns_rank_ordered_values(kernel):
    kernel.ok("%ranks reset")
    first = kernel.ok("%%ranks 3 --threads 1\n"
                      "x = torch.ones(2) * (rank + 1)\n"
                      "print('before', x.tolist())\n"
                      "dist.all_reduce(x)\n"
                      "print('after', x.tolist())\n")
    assert first["stdout"].splitlines() == [
        "[rank 0] before [1.0, 1.0]", "[rank 1] before [2.0, 2.0]", "[rank 2] before [3.0, 3.0]",
        "[ranks 0-2] after [6.0, 6.0]"]
    pids = kernel.pids()
    second = kernel.ok("%%ranks --gather mine\n"
                       "mine = x.sum().item() * 10 + rank  # x from the cell before, on each rank\n"
                       "mine")
    assert second["stdout"].splitlines() == ["[rank 0] 120.0", "[rank 1] 121.0", "[rank 2] 122.0"]
    assert kernel.ok("mine")["result"] == "[120.0, 121.0, 122.0]"
    only = kernel.ok("%%ranks --only 1,2 --gather rank_again\nrank_again = rank")
    assert kernel.ok("rank_again")["result"] == "[1, 2]"  # the ranks that ran the cell, in rank order
    status = kernel.ok("%ranks status")["stdout"]
    assert kernel.pids() == pids and len(pids) == 3, status  # the same warm processes served every cell
    assert "rank 0: pid" in status and "names: mine, rank_again, x" in status, status
    assert only["stdout"] == ""


def test_a_raise_names_the_rank_and_the_cells_line_and_keeps_the_names(kernel):
    pids = kernel.fresh_ranks("2 --threads 1", "kept = rank * 7")
    got = kernel.run("%%ranks\n"
                     "value = kept + 1\n"
                     "if rank == 1:\n"
                     "    raise ValueError(f'no good on rank {rank}: {value}')\n")
    ename, evalue, _ = got["error"]
    assert ename == "RankFailed" and evalue.startswith("rank 1 raised ValueError: no good on rank 1: 8"), evalue
    assert "line 4, in <module>" in evalue and "raise ValueError(f'no good on rank {rank}: {value}')" in evalue
    assert "console.py" not in evalue  # the runtime's frame that ran the cell is not the learner's business
    assert kernel.ok("%%ranks\nprint(kept, value)")["stdout"] == "[rank 0] 0 1\n[rank 1] 7 8\n"
    assert kernel.pids() == pids  # the ranks were clean: kept, names and all


def test_a_hang_ends_the_cell_within_seconds_with_the_blame_and_leaves_no_rank(kernel):
    pids = kernel.fresh_ranks("2 --threads 1 --collective-timeout 2", "sent = False")
    got = kernel.run("%%ranks\n"
                     "if rank == 0:\n"
                     "    dist.recv(torch.zeros(1), src=1)  # rank 1 never sends\n")
    ename, evalue, _ = got["error"]
    assert ename == "CollectiveTimeout", (ename, evalue)
    assert "rank 0" in evalue and "recv from rank 1" in evalue and "rank(s) 1 finished their job" in evalue, evalue
    assert "line 3, in <module>: dist.recv(torch.zeros(1), src=1)" in evalue, evalue
    assert got["seconds"] < 60, f"the hang took {got['seconds']:.0f} s to end (watchdog at 2 s)"
    assert "the 2 ranks were ended" in got["stderr"], got["stderr"]
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and alive(psutil.Process(p)) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if psutil.pid_exists(p) and alive(psutil.Process(p))], "ranks outlived the hang"
    after = kernel.ok("%%ranks\nprint('sent' in dir())")  # the next cell works, on fresh ranks
    assert after["stdout"] == "[ranks 0, 1] False\n"
    assert set(kernel.pids()).isdisjoint(pids)


def test_reset_gives_a_fresh_group(kernel):
    pids = kernel.fresh_ranks("2 --threads 1", "z = 1")
    said = kernel.ok("%ranks reset")["stdout"]
    assert said.startswith("ended the 2 gloo ranks and the names they held"), said
    assert kernel.ok("%ranks status")["stdout"].startswith("no ranks are running")
    assert kernel.ok("%%ranks\nprint('z' in dir(), rank)")["stdout"] == "[rank 0] False 0\n[rank 1] False 1\n"
    assert set(kernel.pids()).isdisjoint(pids)


def test_the_stop_button_says_where_each_rank_was(kernel):
    kernel.fresh_ranks("2 --threads 1", "ready = True")
    got = kernel.run("%%ranks\n"
                     "print('looping', rank)\n"
                     "while rank == 1:\n"
                     "    pass\n"
                     "dist.barrier()\n", interrupt_after=3)  # rank 0 waits (not yet a hang: 10 s), rank 1 spins
    ename, evalue, _ = got["error"]
    assert ename == "LaunchInterrupted", (ename, evalue)
    assert "rank 0: waiting in barrier" in evalue and "rank 1: still running (not in a collective)" in evalue
    assert re.search(r'rank 1 was at File "[^"]+", line [34], in <module>: (while rank == 1:|pass)', evalue), evalue
    assert got["stdout"] == "[rank 0] looping 0\n[rank 1] looping 1\n"  # what they printed before the stop
    assert kernel.ok("%ranks status")["stdout"].startswith("no ranks are running")


def test_bad_arguments_are_one_line_errors_before_any_rank_starts(kernel):
    kernel.ok("%ranks reset")
    ename, evalue, _ = kernel.run("%%ranks 2 --only 0,5\npass")["error"]
    assert ename == "UsageError" and "ranks run from 0 to 1, not 5" in evalue, evalue
    ename, evalue, _ = kernel.run("%%ranks 2\nx = (\n")["error"]
    assert ename == "SyntaxError", evalue
    assert kernel.ok("%ranks status")["stdout"].startswith("no ranks are running")
    kernel.ok("%%ranks 2 --threads 1\npass")
    ename, evalue, _ = kernel.run("%%ranks 3\npass")["error"]
    assert ename == "UsageError" and "world_size 2 -> 3" in evalue and "%ranks reset" in evalue, evalue


def test_in_a_persons_notebook_the_output_is_html_and_a_loop_on_the_ranks_is_a_live_bar(kernel):
    kernel.ok("import os\nfor name in ('DISTLAB_HEADLESS', 'PYTEST_CURRENT_TEST', 'CI'):\n"
              "    os.environ.pop(name, None)")
    try:
        kernel.ok("%ranks reset\n")
        got = kernel.ok("%%ranks 2 --threads 1\n"
                        "import time\n"
                        "from distlab.runtime.progress import progress\n"
                        "for step in progress(range(8), desc='steps'):\n"
                        "    time.sleep(0.1)\n"
                        "print('same')\n"
                        "print('mine', rank)")
        bar, ranks = got["displays"]
        assert "application/vnd.jupyter.widget-view+json" in bar and "steps" in bar["text/plain"], bar
        assert got["stdout"] == ""
        assert ranks["text/plain"] == "[ranks 0, 1] same\n[rank 0] mine 0\n[rank 1] mine 1\n"
        assert ranks["text/html"].count("<details>") == 2 and "rank 1 · 2 lines" in ranks["text/html"]
    finally:
        kernel.ok("os.environ['DISTLAB_HEADLESS'] = '1'")
