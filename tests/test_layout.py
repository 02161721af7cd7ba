"""The package's layering, checked on its source: runtime below shared course code below topics below grading
below tooling. A module may import its own layer and the layers below it, never one above; no import runs in a
circle, not even through an import placed inside a function; inside grading, the contract is the ground floor and
no lab's checker imports another's. And the course (notebooks, chapters, tests) names modules where they live.

Read from the AST (every import statement, function-local ones included), so it holds for code that is
never executed in a test too.
"""

import ast
import functools
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import nbformat
import pytest

import distlab
from distlab.data_parallel import MOVED_TO_WORKLOAD

PACKAGE = Path(distlab.__file__).resolve().parent
REPO = PACKAGE.parents[1]
LAYERS = ["runtime", "shared", "topic", "grading", "tooling"]
SHARED = {"model", "reference", "memory", "flops", "claims", "results", "workload"}
TOOLING = {"__init__", "__main__", "cli", "doctor", "notebooks", "torchrun", "mutants"}


def layer_of(module: str) -> str:
    """The layer of a dotted module name inside distlab (``distlab.zero.flat`` -> "topic")."""
    parts = module.split(".")[1:]
    if not parts:
        return "tooling"  # `import distlab`: the package's front door, which imports everything
    if parts[0] in MOVED_TOPLEVEL:
        return layer_of(distlab.MOVED_MODULES[f"distlab.{parts[0]}"])
    if parts[0] == "runtime":
        return "runtime"
    if parts[0] == "grading":
        return "grading"
    if parts[0] in SHARED:
        return "shared"
    if parts[0] in TOOLING:
        return "tooling"
    return "topic"


MOVED_TOPLEVEL = {name.split(".")[1] for name in distlab.MOVED_MODULES}


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).with_suffix("")
        found.append((".".join(("distlab", *relative.parts)), path))
    return found


def imports_of(module: str, path: Path) -> list[tuple[int, str]]:
    """Every distlab module ``module`` imports, with the line, relative imports resolved."""
    return [(line, target) for line, target, _ in import_sites(module, path)]


@functools.cache
def import_sites(module: str, path: Path) -> list[tuple[int, str, bool]]:
    """Every distlab module ``module`` imports: the line, the module, and whether the import sits in a function
    (read once per module: the layer test and the import graph share it)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, in_function) for alias in node.names
                         if alias.name.split(".")[0] == "distlab")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] == "distlab":
                for alias in node.names:  # `from distlab import workload` imports the module distlab.workload
                    candidate = f"{base}.{alias.name}"
                    found.append((node.lineno, candidate if _is_module(candidate) else base, in_function))
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the part before the last dot is a module, not a package
        return False


def test_the_layers_are_the_ones_contributing_describes():
    names = {module for module, _ in modules()}
    assert {"distlab.runtime.launch", "distlab.runtime.rank", "distlab.runtime.comm"} <= names
    assert {f"distlab.{name}" for name in SHARED} <= names
    assert any(layer_of(name) == "topic" for name in names) and any(layer_of(name) == "grading" for name in names)


@pytest.mark.parametrize("module,path", modules(), ids=[m for m, _ in modules()])
def test_no_module_imports_a_layer_above_its_own(module, path):
    own = LAYERS.index(layer_of(module))
    wrong = [f"line {line}: {target} ({layer_of(target)})" for line, target in imports_of(module, path)
             if LAYERS.index(layer_of(target)) > own]
    assert not wrong, (f"{module} is {layer_of(module)} code and may import only "
                       f"{', '.join(LAYERS[: own + 1])}; it imports " + "; ".join(wrong))


def test_the_runtime_imports_nothing_of_distlab_outside_it():
    outside = [f"{module} line {line}: {target}" for module, path in modules() if layer_of(module) == "runtime"
               for line, target in imports_of(module, path) if not target.startswith("distlab.runtime")]
    assert not outside, outside


def test_the_checker_finds_a_violation():
    """The walk above must be able to fail: a runtime module that imports a topic is caught."""
    source = "from distlab.zero import flat\nfrom distlab import grading\nimport distlab.runtime.comm\n"
    path = PACKAGE / "runtime" / "__layout_probe__.py"
    try:
        path.write_text(source, encoding="utf-8")
        targets = [target for _, target in imports_of("distlab.runtime.__layout_probe__", path)]
    finally:
        path.unlink()
    assert [layer_of(t) for t in targets] == ["topic", "grading", "runtime"], targets


# ---------------------------------------------------------------- no circles, and grading's own floors

def _name(module: str) -> str:
    """``distlab.zero.__init__`` -> ``distlab.zero``: a package is imported by its own name."""
    return module.removesuffix(".__init__")


@functools.cache
def import_graph() -> dict[str, dict[str, list[tuple[int, bool]]]]:
    """module -> each distlab module it imports -> the (line, in a function) of every such import (read once)."""
    graph: dict[str, dict[str, list[tuple[int, bool]]]] = {}
    for module, path in modules():
        edges = graph.setdefault(_name(module), {})
        for line, target, local in import_sites(module, path):
            edges.setdefault(target, []).append((line, local))
    return graph


def circles(graph) -> list[list[str]]:
    """The groups of modules that import each other in a loop (strongly connected components of two or more)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def hidden_circles(graph) -> list[str]:
    """Imports placed inside a function whose module imports the importer back at module level, directly or not:
    moved to the top, each would make ``import distlab`` fail."""
    top = {node: {t for t, sites in edges.items() if any(not local for _, local in sites)}
           for node, edges in graph.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo += top.get(node, ())
        return False

    return [f"{module} line {line} imports {target} inside a function, and {target} imports {module} back"
            for module, edges in graph.items() for target, sites in edges.items()
            for line, local in sites if local and reaches(target, module)]


LAB_CHECKER = re.compile(r"distlab\.grading\.lab\d\d$")


def lab_to_lab(graph) -> list[str]:
    return sorted({f"{module} line {line} imports {target}" for module, edges in graph.items()
                   if LAB_CHECKER.match(module) for target, sites in edges.items()
                   if LAB_CHECKER.match(target) and target != module for line, _ in sites})


def test_no_import_runs_in_a_circle():
    """Function-local imports included: a circle they close is a circle all the same."""
    graph = import_graph()
    found = circles(graph)
    assert not found, "modules that import each other in a loop: " + "; ".join(
        " -> ".join(f"{m} (line {graph[m][n][0][0]})" for m, n in zip(group, group[1:] + group[:1]) if n in graph[m])
        or ", ".join(group) for group in found)


def test_no_function_local_import_hides_a_circle():
    found = hidden_circles(import_graph())
    assert not found, found


def test_no_lab_checker_imports_another():
    """What several checkers share lives in grading/harness.py or grading/training_cases.py: a lab's checker that
    imported another's would change how it grades whenever the other lab's checker is edited."""
    found = lab_to_lab(import_graph())
    assert not found, found


def test_the_grading_contract_is_the_ground_floor():
    """grading/contract.py imports nothing of distlab, so every part of grading can stand on it."""
    graph = import_graph()
    assert "distlab.grading.contract" in graph and not graph["distlab.grading.contract"]


def test_the_checks_above_can_fail():
    """Each check finds what it looks for: a circle, one hidden in a function, a lab importing another."""
    graph = {"distlab.a": {"distlab.b": [(3, False)]}, "distlab.b": {"distlab.a": [(9, True)]},
             "distlab.grading.lab05": {"distlab.grading.lab03": [(7, False)], "distlab.grading.harness": [(8, False)]}}
    assert circles(graph) == [["distlab.a", "distlab.b"]]
    assert hidden_circles(graph) == ["distlab.b line 9 imports distlab.a inside a function, and distlab.a imports "
                                     "distlab.b back"]
    assert lab_to_lab(graph) == ["distlab.grading.lab05 line 7 imports distlab.grading.lab03"]
    path = PACKAGE / "runtime" / "__layout_probe_local__.py"
    try:
        path.write_text("import distlab.runtime.comm\n\ndef f():\n    from distlab.runtime import rank\n",
                        encoding="utf-8")
        sites = import_sites.__wrapped__("distlab.runtime.__layout_probe_local__", path)
    finally:
        path.unlink()
    assert sites == [(1, "distlab.runtime.comm", False), (4, "distlab.runtime.rank", True)], sites


# ---------------------------------------------------------------- old paths: working, warning, unused by the course

@pytest.mark.parametrize("old,new", sorted(distlab.MOVED_MODULES.items()))
def test_old_module_paths_are_the_moved_modules_and_say_so(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported afresh, as in a new kernel
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} moved to {re.escape(new)}"):
        moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert importlib.import_module(new).__spec__.name == new


@pytest.mark.parametrize("name", MOVED_TO_WORKLOAD)
def test_names_that_left_data_parallel_still_import_and_say_so(name):
    from distlab import data_parallel, workload

    with pytest.warns(DeprecationWarning, match=rf"distlab\.workload\.{name}"):
        assert getattr(data_parallel, name) is getattr(workload, name)


_OLD_MODULE = re.compile(r"\bdistlab\.(" + "|".join(old.split(".", 1)[1] for old in distlab.MOVED_MODULES) + r")\b")
_FROM = re.compile(r"\bfrom (distlab|distlab\.data_parallel) import (\([^)]*\)|[^\n]*)")
_ATTRIBUTE = re.compile(r"\bdata_parallel\.(" + "|".join(MOVED_TO_WORKLOAD) + r")\b")


def old_paths_in(text: str) -> list[str]:
    """The old module paths and moved names ``text`` uses: an old path itself, ``from distlab import`` an old
    module's last name, ``from distlab.data_parallel import`` a name that moved, ``data_parallel.<that name>``."""
    found = [m[0] for m in _OLD_MODULE.finditer(text)] + [m[0] for m in _ATTRIBUTE.finditer(text)]
    for match in _FROM.finditer(text):
        names = [n.strip().split(" as ")[0] for n in match[2].strip("()").replace("\n", " ").split(",")]
        moved = {n for n in names if f"distlab.{n}" in distlab.MOVED_MODULES} if match[1] == "distlab" \
            else set(names) & set(MOVED_TO_WORKLOAD)
        found += [f"from {match[1]} import {n}" for n in sorted(moved)]
    return found


def _course_texts():
    """Each solution notebook (its cells and what they print), chapter and test, and the README."""
    for path in sorted((REPO / "solutions").glob("*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        printed = [output.get("text", "") for cell in cells for output in cell.get("outputs", [])]
        yield path, "\n".join([cell.source for cell in cells] + printed)
    for path in [*sorted((REPO / "course").rglob("*.md")), REPO / "README.md", *sorted((REPO / "tests").rglob("*.py"))]:
        yield path, path.read_text(encoding="utf-8")


def test_notebooks_chapters_and_tests_name_modules_where_they_live():
    """The old paths work for a term (above); the course itself teaches the new ones, so that whoever greps for
    the file a notebook imports finds it."""
    found = {str(path.relative_to(REPO)): old for path, text in _course_texts() if (old := old_paths_in(text))}
    assert not found, found


def test_the_old_path_scan_finds_them():
    old, new = sorted(distlab.MOVED_MODULES.items())[0]
    package, _, leaf = new.rpartition(".")
    name = MOVED_TO_WORKLOAD[0]
    text = (f"from {old} import x\nfrom distlab import results, {leaf}\n{old}.y\nfrom {package} import {leaf}\n"
            f"from distlab.data_parallel import (OverlappedDDP,\n    {name})\ndata_parallel.{name}()\n")
    assert old_paths_in(text) == [old, old, f"data_parallel.{name}", f"from distlab import {leaf}",
                                  f"from distlab.data_parallel import {name}"]


def _calls(name: str):
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == name:
                yield f"{path.relative_to(PACKAGE)}:{node.lineno}", node


def test_every_fully_shard_names_a_mesh_on_the_ranks_own_device():
    """Without ``mesh=``, fully_shard builds its mesh on the machine's accelerator: gloo ranks on a one-GPU machine
    then each claim cuda:<rank>, and ranks 1 and up fail with "invalid device ordinal" (lab 12 on an H100,
    benchmarks/results/gpu.txt). Meshes are built on ``distlab.device().type``, never on a named device type."""
    unnamed = [where for where, call in _calls("fully_shard") if not any(k.arg == "mesh" for k in call.keywords)]
    assert not unnamed, f"fully_shard without mesh= at {unnamed}"
    fixed = [where for where, call in _calls("init_device_mesh")
             if call.args and isinstance(call.args[0], ast.Constant)]
    assert not fixed, f"init_device_mesh on a fixed device type at {fixed}"
    assert len(list(_calls("fully_shard"))) >= 4  # the scan sees the library's calls
