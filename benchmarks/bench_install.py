"""What ``make install`` downloads on each platform, and how long the install took here.

    python benchmarks/bench_install.py [--time-install]

Downloads: for each platform a student installs on, the wheels ``make install`` would fetch — torch as
``tools/install_torch.py`` chooses it there (PyPI's CUDA build on Linux with an NVIDIA GPU, the CPU-only wheel
from PyTorch's index without one, PyPI's wheel on macOS) with what it requires, and every package pinned in
``requirements.lock`` — each wheel's size read from the package index (PyPI's JSON simple API, PEP 691/700;
requirements followed through each wheel's metadata file, PEP 658), for Python 3.12. Nothing is downloaded but
the metadata. PyTorch's CPU index is asked when it can be reached; otherwise the size of the CPU wheel is read
from a local copy of it, if pip's configuration has one (the figure then names the file).

``--time-install``: ``make install`` from a fresh clone of this checkout, timed (this machine's caches and
mirror: the download time a student sees on top of it is the download size over their bandwidth).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from install_torch import CPU_INDEX, reachable  # noqa: E402  a script beside the Makefile, not a package

import distlab.results as results  # noqa: E402

PYPI = "https://pypi.org/simple"
TORCH = "torch==2.13.0"
PYTHON = "312"
MB = 1e6


def _python_markers(system: str, machine: str) -> dict:
    return {"platform_system": system, "sys_platform": {"Linux": "linux", "Darwin": "darwin"}[system],
            "platform_machine": machine, "python_version": f"{PYTHON[0]}.{PYTHON[1:]}",
            "python_full_version": f"{PYTHON[0]}.{PYTHON[1:]}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "os_name": "posix"}


PLATFORMS = {  # name: (markers, wheel platform tag test, torch's index or None for PyPI)
    "Linux x86-64, NVIDIA GPU (WSL 2 with one too)": (
        _python_markers("Linux", "x86_64"), lambda tag: tag.startswith("manylinux") and tag.endswith("x86_64"), None),
    "Linux x86-64, no NVIDIA GPU": (
        _python_markers("Linux", "x86_64"), lambda tag: tag.startswith("manylinux") and tag.endswith("x86_64"),
        CPU_INDEX),
    "macOS, Apple silicon": (
        _python_markers("Darwin", "arm64"), lambda tag: tag.startswith("macosx") and tag.endswith(("arm64",
                                                                                                   "universal2")),
        None),
}


@functools.lru_cache(maxsize=None)
def index_files(index: str, name: str) -> tuple:
    request = urllib.request.Request(f"{index}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return tuple(json.load(response)["files"])


def _fits(filename: str, platform_ok) -> bool:
    _, _, _, tags = parse_wheel_filename(filename)
    return any(tag.interpreter in (f"cp{PYTHON}", "py3", "py2.py3") and tag.abi in (f"cp{PYTHON}", "abi3", "none")
               and (tag.platform == "any" or platform_ok(tag.platform)) for tag in tags)


def best_wheel(index: str, name: str, spec: SpecifierSet, platform_ok) -> dict | None:
    """The newest wheel of ``name`` that ``spec`` allows and this Python and platform can install (None: none)."""
    best = None
    try:
        entries = index_files(index, name)
    except urllib.error.HTTPError:  # the index has no such project
        return None
    for entry in entries:
        filename = entry["filename"]
        if not filename.endswith(".whl") or entry.get("yanked"):
            continue
        version = parse_wheel_filename(filename)[1]
        if (version.is_prerelease or version not in spec or not _fits(filename, platform_ok)
                or (best and version <= best["version"])):
            continue
        best = {"version": version, "filename": filename, "size": entry.get("size"), "url": entry["url"],
                "siblings": [e["url"] for e in entries if e["filename"].endswith(".whl")
                             and parse_wheel_filename(e["filename"])[1] == version]}
    return best


def _metadata(wheel: dict) -> str:
    """The wheel's metadata file (PEP 658); where the index has none for it, another wheel's of the same release
    (a release's requirements are the same in every wheel: markers tell platforms apart); "" if none has one."""
    for url in [wheel["url"], *wheel["siblings"]]:
        try:
            with urllib.request.urlopen(url + ".metadata", timeout=60) as response:
                return response.read().decode()
        except urllib.error.HTTPError:
            continue
    return ""  # counted, not followed


def _requirements(wheel: dict, extras: set[str], markers: dict) -> list[Requirement]:
    metadata = _metadata(wheel)
    found = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is None or any(requirement.marker.evaluate({**markers, "extra": extra})
                                                 for extra in extras | {""}):
                found.append(requirement)
    return found


def torch_closure(index: str, markers: dict, platform_ok) -> dict[str, dict]:
    """torch and everything it requires here, each at the newest version all the requirements on it allow
    (walked until no pick changes: a simple resolver, enough for torch's exact pins)."""
    specs: dict[str, SpecifierSet] = {"torch": SpecifierSet(TORCH.removeprefix("torch"))}
    extras: dict[str, set[str]] = {"torch": set()}
    while True:
        picks, todo, seen = {}, ["torch"], set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            wheel = best_wheel(index, name, specs[name], platform_ok)
            if wheel is None and index != PYPI:
                wheel = best_wheel(PYPI, name, specs[name], platform_ok)
            if wheel is None:
                raise SystemExit(f"no wheel of {name}{specs[name]} for Python 3.{PYTHON[1:]} on this platform")
            picks[name] = wheel
            for requirement in _requirements(wheel, extras[name], markers):
                dependency = canonicalize_name(requirement.name)
                specs[dependency] = specs.get(dependency, SpecifierSet()) & requirement.specifier
                extras.setdefault(dependency, set()).update(requirement.extras)
                todo.append(dependency)
        if all(pick["version"] in specs[name] for name, pick in picks.items()):
            return picks


def locked(markers: dict) -> dict[str, SpecifierSet]:
    """Every package ``requirements.lock`` pins for this platform (torch is outside the lock)."""
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(markers):
                pins[canonicalize_name(requirement.name)] = requirement.specifier
    return pins


def local_cpu_wheel() -> Path | None:
    """A CPU wheel of the pinned torch that pip's configuration finds on this machine (``find-links``)."""
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in config.splitlines():
        if "find-links" in line:
            folder = Path(line.split("=", 1)[1].strip().strip("'\""))
            for wheel in sorted(folder.glob(f"torch-{TORCH.split('==')[1]}+cpu-*.whl")):
                return wheel
    return None


def platform_downloads() -> list[dict]:
    rows = []
    cpu_index_answers = reachable(CPU_INDEX)
    for name, (markers, platform_ok, torch_index) in PLATFORMS.items():
        note = ""
        if torch_index and not cpu_index_answers:
            wheel = local_cpu_wheel()
            if wheel is None:
                rows.append({"platform": name, "note": f"{CPU_INDEX} unreachable and no local copy: not measured"})
                continue
            pypi_closure = torch_closure(PYPI, markers, platform_ok)
            small = {n: w for n, w in pypi_closure.items() if not n.startswith(("nvidia", "cuda", "triton"))}
            small["torch"] = {"version": TORCH.split("==")[1] + "+cpu", "filename": wheel.name,
                              "size": wheel.stat().st_size}
            closure = small
            note = f"torch's size read from a local copy of {wheel.name} ({CPU_INDEX} unreachable from here)"
        else:
            closure = torch_closure(torch_index or PYPI, markers, platform_ok)
        torch_bytes = sum(w["size"] for w in closure.values())
        lock_bytes, missing = 0, []
        for package, spec in locked(markers).items():
            if package in closure:
                continue
            wheel = best_wheel(PYPI, package, spec, platform_ok)
            if wheel is None or wheel["size"] is None:
                missing.append(package)  # an sdist-only package, or none for this platform
            else:
                lock_bytes += wheel["size"]
        rows.append({"platform": name, "torch_wheel_mb": round(closure["torch"]["size"] / MB, 1),
                     "torch_and_requirements_mb": round(torch_bytes / MB, 1), "torch_packages": len(closure),
                     "lock_mb": round(lock_bytes / MB, 1), "total_mb": round((torch_bytes + lock_bytes) / MB, 1),
                     "not_sized": missing, "note": note})
    return rows


def time_install() -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-install-") as scratch:
        clone = Path(scratch) / "distlab"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        (Path(scratch) / "shared").symlink_to(REPO.parent / "shared")
        start = time.perf_counter()
        subprocess.run(["make", "-C", str(clone), "install"], check=True, capture_output=True)
        seconds = time.perf_counter() - start
        size = sum(p.stat().st_size for p in (clone / ".venv").rglob("*") if p.is_file() and not p.is_symlink())
    return {"seconds": round(seconds, 1), "venv_mb": round(size / MB)}


def summary(rows: list[dict], install: dict | None) -> str:
    lines = [f"What `make install` downloads for Python 3.{PYTHON[1:]}, from the package indexes' file sizes "
             "(nothing downloaded but metadata):",
             f"{'platform':46} {'torch wheel':>12} {'torch + its requirements':>25} {'the lock':>9} {'in all':>9}"]
    for row in rows:
        if "total_mb" not in row:
            lines.append(f"{row['platform']:46} {row['note']}")
            continue
        lines.append(f"{row['platform']:46} {row['torch_wheel_mb']:>9,.0f} MB "
                     f"{row['torch_and_requirements_mb']:>15,.0f} MB ({row['torch_packages']:>2} wheels) "
                     f"{row['lock_mb']:>6,.0f} MB {row['total_mb']:>6,.0f} MB")
        if row["note"]:
            lines.append(f"{'':46} ({row['note']})")
    for row in rows:
        if "total_mb" in row:
            minutes = row["total_mb"] * 8 / 100 / 60
            lines.append(f"at 100 Mbit/s: {row['platform']}: the downloads take about {minutes:.1f} min")
    if install:
        lines.append(f"make install from a fresh clone here (wheels from this machine's caches and mirror): "
                     f"{install['seconds']:.0f} s; the .venv holds {install['venv_mb']:,} MB")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-install", action="store_true", help="also time make install in a fresh clone")
    args = parser.parse_args()
    rows = platform_downloads()
    install = time_install() if args.time_install else None
    text = summary(rows, install)
    print(text)
    results.save("install", {"platforms": rows, "install": install}, text)


if __name__ == "__main__":
    main()
