"""The package's layering, checked on its source: runtime below shared course code below topics below grading
below tooling. A module may import its own layer and the layers below it, never one above.

Read from the AST (every import statement, function-local ones included), so it holds for code that is
never executed in a test too.
"""

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

import distlab

PACKAGE = Path(distlab.__file__).resolve().parent
LAYERS = ["runtime", "shared", "topic", "grading", "tooling"]
SHARED = {"model", "reference", "memory", "flops", "claims", "results"}
TOOLING = {"__init__", "__main__", "cli", "doctor", "notebooks", "torchrun"}


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
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "distlab"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "distlab":
                continue
            for alias in node.names:  # `from distlab import comm` imports the module distlab.comm
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if _is_module(candidate) else base))
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


@pytest.mark.parametrize("old,new", sorted(distlab.MOVED_MODULES.items()))
def test_old_module_paths_are_the_moved_modules(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    assert importlib.import_module(new).__spec__.name == new


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
