"""Solutions → labs, and executing notebooks.

``solutions/NN_slug.ipynb`` is the source of truth. A lab is the same notebook
with every ``# BEGIN SOLUTION N.k`` … ``# END SOLUTION`` block replaced by a
stub that raises ``NotImplementedError("Exercise N.k: …")`` and all outputs
cleared. :func:`execute` runs a notebook top to bottom (``distlab notebooks
execute`` stores the solutions' outputs that way). Grading a class of student
notebooks is :mod:`distlab.grading.classroom`; the kernels both run on are
:mod:`distlab.runtime.kernels`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import nbformat

from distlab.grading import STUB_MESSAGE
from distlab.grading.cells import SKIP_TAG, skippable_cells
from distlab.runtime.kernels import kernel_manager_class, notebook_client

REPO_ROOT = Path(__file__).resolve().parents[2]
SOLUTION_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<id>\d+\.\d+)[^\n]*\n(?P<body>.*?)^[ \t]*# END SOLUTION[^\n]*(?:\n|\Z)",
    re.MULTILINE | re.DOTALL,
)
# A one-line answer: ``q4_1 = 1.5  # SOLUTION Q4.1`` becomes ``q4_1 = ...  # your answer``.
SOLUTION_LINE = re.compile(
    r"^(?P<head>[ \t]*[\w.\[\]'\"]+[ \t]*=[ \t]*)(?P<value>[^\n]*?)"
    r"[ \t]*#[ \t]*SOLUTION[ \t]+(?P<id>Q?\d+\.\d+)[ \t]*$",
    re.MULTILINE,
)
_MARKER = re.compile(r"#\s*(BEGIN SOLUTION|END SOLUTION|SOLUTION\b)")
# nbval's cell markers are test plumbing: solutions keep them, students never see them.
_NBVAL_LINE = re.compile(r"^[ \t]*#[ \t]*NBVAL_[A-Z_]+\b[^\n]*(?:\n|\Z)", re.MULTILINE)


# Where the course is published. The Colab and Kaggle badges and the install cell at the top of every
# lab point here: a fork that publishes its own copy changes these two lines and runs `make labs`.
COURSE_REPOSITORY = "github.com/distlab-course/distlab"
COURSE_BRANCH = "main"

# The kernel every notebook names: the one `make install` registers (`python -m ipykernel install --name python3`),
# under the display name ipykernel gives it. JupyterLab rewrites a notebook's kernelspec to the running kernel's
# when it opens the notebook, so one that stored another display name (nbformat's "Python 3") opened as modified.
# `distlab notebooks execute` and `tag` store it in solutions, `distlab labs` in labs; `labs --check` reports drift.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


class NotebookError(ValueError):
    """A solution notebook that cannot be turned into a lab (unbalanced markers…)."""


# ---------------------------------------------------------------- solutions → labs

def strip_solutions(source: str, where: str = "") -> str:
    """Replace each solution block with a stub at the block's indentation."""
    def stub(match: re.Match) -> str:
        message = STUB_MESSAGE.format(id=match["id"])
        return f'{match["indent"]}raise NotImplementedError("{message}")\n'

    stripped = SOLUTION_BLOCK.sub(stub, source)
    stripped = SOLUTION_LINE.sub(lambda m: f"{m['head']}...  # your answer", stripped)
    leftover = _MARKER.search(stripped)
    if leftover:
        line = stripped[: leftover.start()].count("\n") + 1
        raise NotebookError(f"{where}: unmatched '{leftover.group(0)}' marker at line {line} of the cell")
    return stripped


def set_kernelspec(notebook: nbformat.NotebookNode) -> bool:
    """Store :data:`KERNELSPEC` as the notebook's kernelspec; return whether that changed it."""
    if notebook.metadata.get("kernelspec") == KERNELSPEC:
        return False
    notebook.metadata["kernelspec"] = dict(KERNELSPEC)
    return True


def stale_kernelspecs(paths: list[Path]) -> list[Path]:
    """The notebooks among ``paths`` whose kernelspec is not :data:`KERNELSPEC`."""
    return [p for p in paths if nbformat.read(p, as_version=4).metadata.get("kernelspec") != KERNELSPEC]


def make_lab(solution: nbformat.NotebookNode, where: str = "") -> nbformat.NotebookNode:
    lab = nbformat.from_dict(json.loads(json.dumps(solution)))
    set_kernelspec(lab)
    for index, cell in enumerate(lab.cells):
        if cell.cell_type != "code":
            continue
        cell.source = _NBVAL_LINE.sub("", strip_solutions(cell.source, f"{where} cell {index}"))
        cell.outputs = []
        cell.execution_count = None
    return lab


def hosted_cells(lab_name: str) -> list[nbformat.NotebookNode]:
    """Badges that open ``labs/<lab_name>`` on Colab or Kaggle, and the cell that installs distlab there.

    A hosted runtime starts with torch but without distlab or the course's files, so the first code
    cell fetches the repository and installs it, pinned to the platform's torch (its CUDA build must
    stay). Anywhere else (``make lab``, conda, the grader, CI) the cell does nothing, so the same lab
    runs everywhere unchanged.
    """
    blob = f"{COURSE_REPOSITORY}/blob/{COURSE_BRANCH}/labs/{lab_name}"
    badges = nbformat.v4.new_markdown_cell(
        f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"(https://colab.research.google.com/github/{blob.removeprefix('github.com/')}) "
        f"[![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)]"
        f"(https://kaggle.com/kernels/welcome?src=https://{blob}) · on Kaggle turn on *Internet* and, "
        f"for NCCL ranks, the *GPU T4 ×2* accelerator; distlab uses every GPU it sees.")
    install = nbformat.v4.new_code_cell(
        "# Colab / Kaggle only: fetch the course and install distlab beside the platform's own torch\n"
        "import importlib.util, os, subprocess, sys\n"
        "hosted = \"google.colab\" in sys.modules or \"KAGGLE_KERNEL_RUN_TYPE\" in os.environ\n"
        "if hosted and importlib.util.find_spec(\"distlab\") is None:\n"
        "    import torch\n"
        "    with open(\"keep-torch.txt\", \"w\") as pin:  # pip must keep the platform's CUDA build of torch\n"
        "        pin.write(f\"torch=={torch.__version__}\\n\")\n"
        f"    subprocess.run([\"git\", \"clone\", \"--quiet\", \"--depth=1\", \"--branch={COURSE_BRANCH}\",\n"
        f"                    \"https://{COURSE_REPOSITORY}\", \"distlab-course\"], check=True)\n"
        "    subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", \"--quiet\", \"-c\", \"keep-torch.txt\",\n"
        "                    \"-e\", \"distlab-course\"], check=True)\n"
        "    sys.path.insert(0, \"distlab-course/lib\")  # new processes see the install; this kernel needs the path")
    badges.id, install.id = "open-hosted", "install-hosted"  # fixed ids: `make labs` writes the same bytes twice
    return [badges, install]


def exercise_ids(notebook: nbformat.NotebookNode) -> list[str]:
    """Ids of every solution block and one-line answer, in notebook order."""
    return [m["id"] for cell in notebook.cells if cell.cell_type == "code"
            for pattern in (SOLUTION_BLOCK, SOLUTION_LINE) for m in pattern.finditer(cell.source)]


def build_labs(solutions_dir: Path, labs_dir: Path, check_only: bool = False) -> list[Path]:
    """Write (or, with ``check_only``, compare) every lab; return the labs that were out of date."""
    stale = []
    labs_dir.mkdir(parents=True, exist_ok=True)
    for solution_path in sorted(solutions_dir.glob("[0-9][0-9]_*.ipynb")):
        solution = nbformat.read(solution_path, as_version=4)
        lab = make_lab(solution, solution_path.name)
        after_title = int(bool(lab.cells) and lab.cells[0].cell_type == "markdown"
                          and lab.cells[0].source.startswith("# "))
        lab.cells[after_title:after_title] = hosted_cells(solution_path.name)
        text = nbformat.writes(lab) + "\n"
        lab_path = labs_dir / solution_path.name
        if not lab_path.exists() or lab_path.read_text(encoding="utf-8") != text:
            stale.append(lab_path)
            if not check_only:
                lab_path.write_text(text, encoding="utf-8")
    orphans = {p.name for p in labs_dir.glob("*.ipynb")} - {p.name for p in solutions_dir.glob("*.ipynb")}
    stale += [labs_dir / name for name in sorted(orphans)]
    if not check_only:
        for name in orphans:
            (labs_dir / name).unlink()
    return stale


# ---------------------------------------------------------------- executing notebooks

def execute(path: Path, cell_timeout: int = 600, allow_errors: bool = False,
            env: dict[str, str] | None = None) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel, in its own folder; return it with outputs.

    Raises on the first cell error unless ``allow_errors``; ``env`` adds variables to the kernel's.
    """
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="distlab-exec-") as workdir:
        client = notebook_client(notebook, path, kernel_manager_class(workdir), allow_errors,
                                 lambda cell: cell_timeout)
        client.execute(env=dict(os.environ, **(env or {})))
    set_kernelspec(notebook)
    return notebook


def tag_grader_skips(notebook: nbformat.NotebookNode) -> list[int]:
    """Tag ``grader-skips`` exactly on the code cells no check needs (the grader then leaves them out, see
    :mod:`distlab.grading.cells`); return the indices whose tags changed."""
    skippable = set(skippable_cells(notebook))
    changed = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        tags = list(cell.metadata.get("tags", []))
        want = index in skippable
        if want != (SKIP_TAG in tags):
            tags = tags + [SKIP_TAG] if want else [t for t in tags if t != SKIP_TAG]
            if tags:
                cell.metadata["tags"] = tags
            else:
                cell.metadata.pop("tags", None)
            changed.append(index)
    return changed
