"""GPU evidence in one command: every CUDA path of the course, run on this machine's GPUs within a time budget.

Most people who run distlab have no GPU, and the machines that have one are lent for minutes. So the GPU
evidence comes from this one script (`make gpu-check`), which runs, in this order (the cheap figures first,
so a short budget still leaves numbers):

* **environment** — device names, driver, torch, CUDA, cuDNN and NCCL versions, and the world size the
  labs run at: one NCCL rank per GPU (NCCL refuses two ranks on one device, so a one-GPU box runs world 1).
* **lab09-fp8** — ``torch._scaled_mm`` FP8 GEMMs against bf16 through :func:`distlab.fp8.matmul_throughput`:
  TFLOP/s of each, the ratio, and the H100 datasheet's 2×.
* **lab01-memory** — the CUDA caching allocator's bytes (``torch.cuda.memory_allocated``) of AdamW training
  state, fp32 and mixed precision, against :func:`distlab.memory.bytes_per_param`; one block's activations
  against :func:`distlab.memory.activation_bytes_per_layer`.
* **lab04-memory** — ZeRO stages 0-3 at the world size, fp32 and bf16: counted bytes per parameter against
  the formula, and ``torch.cuda.max_memory_allocated`` of a step against the formula's model states.
* **lab03-mfu** — lab 03's GPT under overlapped DDP on NCCL ranks: tokens/s and MFU against the fp32 matmul
  peak measured here (:func:`distlab.flops.measure_matmul_peak`, :func:`distlab.flops.mfu`).
* **lab12-checkpoint** — async checkpoints of GPU state (:mod:`distlab.fault_tolerance.checkpoint`): the
  training stall of async against sync saves, and an async checkpoint read back bit for bit.
* **labs** — each lab's launchable entry point (labs 02-09 and 11) on NCCL ranks at the world size.
* **tests** — every test in ``tests/`` that a CUDA skip marker guards, found by reading the test files,
  run by pytest in a subprocess: passed, failed and skipped, each skip with its reason.
* **notebook-NN** — solution notebooks with a GPU path (01, 03, 09 and 12 by default) executed through
  :func:`distlab.notebooks.execute` with ``DISTLAB_BACKEND=auto``, and which cells' outputs show CUDA or NCCL.

Each part runs in its own process (a CUDA error in one cannot poison the others) and is timed. The
budget (``--budget-seconds``, 8 minutes by default) bounds the whole run: a part still running when it is
spent is ended, no further part starts, and one line says what was left out. The results are written
after every part, so whatever was measured is kept even if the run is cut short.

    python benchmarks/gpu_check.py                          # everything, 8 minutes at most
    python benchmarks/gpu_check.py --parts tests,notebooks --notebooks 09
    python benchmarks/gpu_check.py --out /tmp/evidence --budget-seconds 300

Writes ``gpu.json`` and ``gpu.txt`` (in ``benchmarks/results`` unless ``--out``). Exit status 1 when a GPU
path failed (a part raised, a correctness check failed, a test failed, a notebook cell raised); a missed
speed target is reported but is no failure. Without a CUDA GPU it prints one line, writes result files that
say nothing was measured (keeping any GPU evidence already saved there) and exits 0.
"""

from __future__ import annotations

import argparse
import ast
import copy
import gc
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import torch

import distlab
from distlab import collectives, context_parallel, data_parallel, moe, pipeline_parallel, results, tensor_parallel, zero
from distlab.fault_tolerance import checkpoint_path, read_checkpoint, resumable_train
from distlab.fault_tolerance.stall import stall_summary, timed_training
from distlab.flops import PEAK_FLOPS, format_flops, measure_matmul_peak, mfu
from distlab.fp8 import distributed as fp8_distributed
from distlab.fp8 import matmul_throughput, scaled_mm_support
from distlab.memory import (
    ActivationMeter,
    MiB,
    activation_bytes_per_layer,
    bytes_per_param,
    model_memory,
    model_state_bytes,
)
from distlab.model import GPT, GPTConfig, flops_per_token, synthetic_batch
from distlab.parallel3d import grid

REPO = Path(__file__).resolve().parents[1]
TOPIC = "gpu"
SELF_TEST = "test_gpu_check.py"
DEFAULT_BUDGET = 480.0
MIN_PART_SECONDS = 20.0  # a part started with less than this left would only be cut off
GRACE_SECONDS = 15.0  # after SIGINT, how long a part may take to close its ranks and kernel
NO_GPU = "no CUDA GPU: nothing measured"
REHEARSAL = "rehearsal on a machine without a CUDA GPU: not GPU evidence"
DEFAULT_NOTEBOOKS = ("01", "03", "09", "12")
NOTEBOOK_STACK = ("nbformat", "nbclient", "jupyter_client", "ipykernel")

FP8_SIZES_CUDA = (4096, 8192)
FP8_SIZES_CPU = (256,)  # a rehearsal's CPU has no FP8 units: the size only has to run
SPEED_TARGET = 1.3  # FP8 / bf16 GEMM throughput: benchmarks/bench_fp8.py's target on FP8 tensor cores
STALL_TARGET = 0.3  # async / sync checkpoint stall: benchmarks/bench_checkpoint.py's target
STATE_TOLERANCE = 0.02  # lab 04's claim: every stage within 2% of the formula
# Big enough that the allocator's 512-byte rounding is noise (17M parameters, 270 MB of fp32 AdamW state).
MEMORY_CFG = GPTConfig(vocab_size=8192, seq_len=256, n_layer=4, n_head=8, d_model=512)
MEMORY_BATCH = 4
ZERO_CFG = GPTConfig(vocab_size=4096, seq_len=128, n_layer=4, n_head=8, d_model=512)
DDP_CFG = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256)  # bench_ddp.py's model
CKPT_CFG = GPTConfig(vocab_size=256, seq_len=64, n_layer=6, n_head=4, d_model=384)  # bench_checkpoint.py's
RELOAD_CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16)  # the CUDA test's

CUDA_MENTION = re.compile(r"\b(?:cuda(?::\d+)?|nccl)\b", re.IGNORECASE)
GLOO_FALLBACK = "running gloo ranks on the CPU"  # distlab's line when a notebook asks for more ranks than GPUs
SUMMARY_KEYS = ("loss_first", "loss_last", "losses", "device", "forward_error", "grad_error", "step_time_s")
VERBOSE_LINE = re.compile(r"^(?P<id>\S+::\S+) (?P<outcome>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


# ---------------------------------------------------------------- pure helpers (unit-tested on any machine)

def world_size_for(gpus: int) -> tuple[int, str]:
    """The world size the labs run at on ``gpus`` GPUs, and why: one NCCL rank per GPU, a power of two.

    NCCL refuses two ranks on one device, so one GPU means world size 1. The labs' shapes (heads,
    experts, pipeline stages) split over powers of two, so a 6-GPU box runs 4 ranks.
    """
    if gpus < 1:
        return 1, "no CUDA GPU: one gloo rank on the CPU (a rehearsal)"
    world = 1 << (gpus.bit_length() - 1)
    if gpus == 1:
        return 1, "one GPU: NCCL needs one GPU per rank (it refuses two ranks on one device), so world size 1"
    if world == gpus:
        return world, f"{gpus} GPUs: one NCCL rank per GPU"
    return world, f"{gpus} GPUs: {world} NCCL ranks, the largest power of two the labs' shapes split over"


def grid_shape(world: int) -> tuple[int, int, int]:
    """A dp × pp × tp grid for lab 11 on ``world`` ranks: factors of two go to tp, then pp (each up to
    lab 11's 4 heads and 4 layers), the rest to dp."""
    tp = pp = 1
    rest = world
    while rest % 2 == 0 and tp < 4:
        tp, rest = tp * 2, rest // 2
    while rest % 2 == 0 and pp < 4:
        pp, rest = pp * 2, rest // 2
    return rest, pp, tp


class _StandInCuda:
    """``torch.cuda`` as a machine with ``gpus`` GPUs would answer, for judging a skip marker's condition."""

    def __init__(self, gpus: int):
        self.gpus = gpus

    def is_available(self) -> bool:
        return self.gpus > 0

    def device_count(self) -> int:
        return self.gpus


def _skips_only_without_gpus(condition: ast.expr) -> bool:
    """Whether a ``skipif`` condition skips on a machine without GPUs and runs on one with many.

    The condition is evaluated with a stand-in ``torch.cuda`` (no builtins, no other names): ``not
    torch.cuda.is_available()`` and ``torch.cuda.device_count() < 2`` qualify, ``torch.cuda.is_available()``
    (skip where there *is* a GPU) does not. A condition that needs anything else counts when it mentions cuda.
    """
    code = compile(ast.Expression(condition), "<skipif>", "eval")
    try:
        verdicts = [bool(eval(code, {"__builtins__": {}, "torch": type("torch", (), {"cuda": _StandInCuda(n)})}))
                    for n in (0, 64)]
    except Exception:  # a name the stand-in lacks: the text decides
        return "cuda" in ast.unparse(condition).lower()
    return verdicts == [True, False]


def _skipif_reason(node: ast.expr) -> str | None:
    """The reason of ``pytest.mark.skipif(<a condition on torch.cuda>, reason=...)``, else None."""
    if not isinstance(node, ast.Call) or ast.unparse(node.func).split(".")[-1] != "skipif":
        return None
    condition = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "condition"), None)
    if condition is None or "cuda" not in ast.unparse(condition).lower() or not _skips_only_without_gpus(condition):
        return None
    reason = next((k.value for k in node.keywords if k.arg == "reason"), None)
    if isinstance(reason, ast.Constant) and isinstance(reason.value, str):
        return reason.value
    return f"skipif({ast.unparse(condition)})"


def _marker_reason(node: ast.expr, named: dict[str, str]) -> str | None:
    """A CUDA skip marker's reason in a decorator or ``pytestmark`` value: a call, a name bound to one, a list."""
    if isinstance(node, ast.Name):
        return named.get(node.id)
    if isinstance(node, (ast.List, ast.Tuple)):
        return next((r for r in (_marker_reason(e, named) for e in node.elts) if r), None)
    return _skipif_reason(node)


def _tests_in(body: list[ast.stmt], prefix: str, inherited: str | None, named: dict[str, str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            reason = inherited or next((r for r in (_marker_reason(d, named) for d in node.decorator_list) if r),
                                       None)
            if reason:
                found[f"{prefix}::{node.name}"] = reason
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            marks = [_marker_reason(d, named) for d in node.decorator_list]
            marks += [_marker_reason(n.value, named) for n in node.body if isinstance(n, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
            reason = inherited or next((r for r in marks if r), None)
            found.update(_tests_in(node.body, f"{prefix}::{node.name}", reason, named))
    return found


def cuda_test_ids(source: str, path: str) -> dict[str, str]:
    """Node ids of the tests in one test file that a CUDA skip marker guards, each with the marker's reason.

    Read from the source, not collected by pytest: on a machine without a GPU the markers' conditions
    are all true, and on one with a GPU all false, so only the source says which tests need CUDA.
    A marker counts when it is a ``skipif`` whose condition on ``torch.cuda`` skips without GPUs and runs
    with them (``not torch.cuda.is_available()``, ``torch.cuda.device_count() < 2``), on the test, its class,
    a module-level name the test is decorated with, or the module's ``pytestmark``. Tests that skip
    themselves inside their body are not selected.
    """
    tree = ast.parse(source)
    named: dict[str, str] = {}
    module_reason = None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "pytestmark":
                    module_reason = _marker_reason(node.value, named)
                elif isinstance(target, ast.Name):
                    reason = _skipif_reason(node.value)
                    if reason:
                        named[target.id] = reason
    return _tests_in(tree.body, path, module_reason, named)


def select_cuda_tests(repo: Path = REPO) -> dict[str, str]:
    """Every CUDA-guarded test in ``tests/`` and ``tests/grading/`` (node id → skip reason), in file order.

    This script's own tests are never selected: they run this script, which would run them again.
    """
    selected: dict[str, str] = {}
    for folder in (repo / "tests", repo / "tests" / "grading"):
        for path in sorted(folder.glob("test_*.py")):
            if path.name == SELF_TEST:
                continue
            selected.update(cuda_test_ids(path.read_text(encoding="utf-8"), path.relative_to(repo).as_posix()))
    return selected


def _node_id(classname: str, name: str, files: list[str]) -> str:
    """pytest's node id from a JUnit ``classname`` (``tests.test_x.TestY``) and ``name``."""
    modules = {f.removesuffix(".py").replace("/", "."): f for f in files}
    for module in sorted(modules, key=len, reverse=True):
        if classname == module or classname.startswith(module + "."):
            classes = classname[len(module) + 1:].split(".") if classname != module else []
            return "::".join([modules[module], *classes, name])
    return f"{classname}::{name}"


def _first_line(text: str | None, limit: int = 300) -> str:
    line = next((s.strip() for s in (text or "").splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[:limit - 1] + "…"


def parse_junit(xml_text: str, files: list[str]) -> list[dict]:
    """Each test case of a pytest JUnit report: node id, outcome (passed, failed, error, skipped) and reason."""
    cases = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        node = _node_id(case.get("classname", ""), case.get("name", ""), files)
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = _first_line(child.get("message") or child.text)
                break
        cases.append({"id": node, "outcome": outcome, "reason": reason})
    return cases


def parse_verbose(lines: list[str]) -> list[dict]:
    """Outcomes from ``pytest -v`` lines, for a run cut off before it wrote its JUnit report (no reasons)."""
    cases = []
    for line in lines:
        match = VERBOSE_LINE.match(line.strip())
        if match:
            outcome = match["outcome"].lower()
            outcome = {"xfail": "skipped", "xpass": "passed"}.get(outcome, outcome)
            cases.append({"id": match["id"], "outcome": outcome, "reason": ""})
    return cases


def _output_texts(cell: dict) -> list[str]:
    texts = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            texts.append(out.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            texts.append(out.get("data", {}).get("text/plain", ""))
        elif kind == "error":
            texts.append(f"{out.get('ename', '')}: {out.get('evalue', '')}")
    return ["".join(t) if isinstance(t, list) else str(t) for t in texts]


def scan_notebook(notebook: dict) -> dict:
    """Which code cells of an executed notebook show CUDA or NCCL in their outputs, fell back to gloo, or raised.

    The evidence is the outputs themselves (``cuda:0``, ``backend nccl``): distlab picks NCCL only where
    there is a GPU per rank, and says so in one line (``GLOO_FALLBACK``) when a notebook asks for more ranks
    than GPUs; that line mentions NCCL without running on it, so it is reported apart.
    """
    cuda_cells, fallback, errors, code, executed = [], [], [], 0, 0
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        code += 1
        executed += cell.get("execution_count") is not None
        texts = _output_texts(cell)
        hits = [_first_line(line, 160) for text in texts for line in text.splitlines()
                if CUDA_MENTION.search(line) and GLOO_FALLBACK not in line]
        if hits:
            cuda_cells.append({"cell": index, "lines": hits[:3]})
        if any(GLOO_FALLBACK in text for text in texts):
            fallback.append(index)
        errors += [{"cell": index, "error": _first_line(f"{o.get('ename', '')}: {o.get('evalue', '')}")}
                   for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    return {"code_cells": code, "executed": executed, "cuda_cells": cuda_cells, "gloo_fallback_cells": fallback,
            "errors": errors}


# ---------------------------------------------------------------- what a part reports

@dataclass
class Report:
    """What one part found: summary lines, figures, correctness checks (a failed one fails the run) and
    speed targets (reported, never a failure: a shared or throttled GPU misses them honestly)."""

    lines: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)

    def line(self, text: str) -> None:
        self.lines.append(text)
        print(f"  {text}", flush=True)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        if not ok:
            self.line(f"CHECK FAILED: {name}: {detail}")

    def target(self, name: str, met: bool, detail: str) -> None:
        self.targets.append({"name": name, "met": bool(met), "detail": detail})
        self.line(f"{name}: {detail} -> {'met' if met else 'MISSED'}")


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _backend() -> str:
    """NCCL where there are GPUs; gloo only in a rehearsal without one, so the plumbing still runs."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _world() -> int:
    return world_size_for(torch.cuda.device_count() if torch.cuda.is_available() else 0)[0]


def _require_cuda(what: str) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU")
    return torch.device("cuda", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the parts (each runs in its own process)

def part_lab09_fp8(report: Report) -> None:
    """FP8 GEMMs through torch._scaled_mm against bf16, with the library's own timer (matmul_throughput)."""
    device = _device()
    support = scaled_mm_support(device)
    report.figures.update(path=support.path, reason=support.reason, rows=[])
    report.line(f"FP8 path: {support.reason}")
    sizes = FP8_SIZES_CUDA if device.type == "cuda" else FP8_SIZES_CPU
    for size in sizes:
        row = matmul_throughput(size, size, size, device, min_seconds=0.3)
        rate = row["flops_per_second"]
        if device.type == "cuda" and "fp8" in rate and size == sizes[-1]:
            rate["fp8_with_cast"] = matmul_throughput(size, size, size, device, min_seconds=0.3,
                                                      include_quantize=True)["flops_per_second"]["fp8"]
        report.figures["rows"].append(row)
        cells = ", ".join(f"{name} {format_flops(value)}/s" for name, value in rate.items())
        ratio = f"; fp8/bf16 {rate['fp8'] / rate['bf16']:.2f}×" if "fp8" in rate else ""
        report.line(f"{size}×{size}×{size}: {cells}{ratio}")
    datasheet = PEAK_FLOPS["H100 SXM fp8"] / PEAK_FLOPS["H100 SXM bf16"]
    largest = report.figures["rows"][-1]["flops_per_second"]
    report.figures.update(datasheet_ratio=datasheet, bf16_flops=largest["bf16"], fp8_flops=largest.get("fp8"))
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= (8, 9):
            report.check("FP8 tensor cores used (compute capability ≥ 8.9)", support.tensorwise, support.reason)
        else:
            report.line(f"compute capability {capability[0]}.{capability[1]}: no FP8 tensor cores, no FP8 ratio")
    if "fp8" in largest:
        ratio = largest["fp8"] / largest["bf16"]
        report.figures["ratio"] = ratio
        report.target(f"FP8/bf16 GEMM throughput at {sizes[-1]}³ (H100 datasheet {datasheet:.2f}×)",
                      ratio >= SPEED_TARGET, f"{ratio:.2f}× (target ≥ {SPEED_TARGET})")


def _fp32_training_state(cfg: GPTConfig, device: torch.device, x: torch.Tensor, y: torch.Tensor):
    """Lab 01's fp32 AdamW step: what stays allocated is weights, gradients and Adam's two moments."""
    model = GPT(cfg, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(x, y)[1].backward()
    opt.step()
    return (model, opt), model.num_params(), sum(model_state_bytes(model, opt).values())


def _mixed_training_state(cfg: GPTConfig, device: torch.device, x: torch.Tensor, y: torch.Tensor):
    """Lab 01's mixed-precision step (its cell 9): bf16 weights and gradients, fp32 master weights and moments."""
    master = GPT(cfg, seed=0).to(device)
    work = copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    work(x, y)[1].backward()
    for p_master, p_work in zip(master.parameters(), work.parameters()):
        p_master.grad = p_work.grad.float()
    opt.step()
    for p_master, p_work in zip(master.parameters(), work.parameters()):
        p_master.grad = None
        p_work.data.copy_(p_master.data)
    counted = sum(model_state_bytes(work).values()) + sum(model_state_bytes(master, opt).values())
    return (master, work, opt), master.num_params(), counted


def _state_addresses(held) -> set[int]:
    """Storage addresses of every parameter, gradient and optimizer tensor in a build's objects."""
    addresses = set()
    for thing in held:
        if isinstance(thing, torch.nn.Module):
            tensors = [t for p in thing.parameters() for t in (p, p.grad) if t is not None]
        else:
            tensors = [v for state in thing.state.values() for v in state.values() if torch.is_tensor(v)]
        addresses |= {t.untyped_storage().data_ptr() for t in tensors if t.is_cuda}
    return addresses


def _active_blocks(snapshot: dict) -> dict[int, dict]:
    """The allocator's live blocks by address (``torch.cuda.memory._snapshot()``), each with its frames."""
    blocks = {}
    for segment in snapshot["segments"]:
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                blocks[block.get("address", address)] = block
            address += block["size"]
    return blocks


def _where_allocated(block: dict) -> str:
    """The innermost Python line outside torch that allocated a block, and the innermost line inside it."""
    frames = [f for f in block.get("frames", []) if f.get("filename", "").endswith(".py")]
    if not frames:
        return "no Python frame (allocated by a library: cuBLAS/cuDNN workspace or the like)"

    def show(frame):
        return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"

    outside = next((f for f in frames if "/torch/" not in f["filename"]), None)
    return show(frames[0]) + (f" (from {show(outside)})" if outside and outside is not frames[0] else "")


def _new_blocks(before: dict, after: dict, state: set[int]) -> tuple[dict, list[dict]]:
    """What a build left alive: its state tensors' blocks (count, bytes held, bytes asked for) and every other
    new block, largest first, with the line that allocated it."""
    new = {address: block for address, block in after.items() if address not in before}
    held = [block for address, block in new.items() if address in state]
    others = sorted((block for address, block in new.items() if address not in state), key=lambda b: -b["size"])
    state_blocks = {"blocks": len(held), "bytes": sum(b["size"] for b in held),
                    "requested": sum(b.get("requested_size", b["size"]) for b in held)}
    return state_blocks, [{"bytes": b["size"], "requested": b.get("requested_size", b["size"]),
                           "where": _where_allocated(b)} for b in others]


def part_lab01_memory(report: Report) -> None:
    """Lab 01 on the GPU: the caching allocator's bytes of training state against 16 bytes/parameter.

    On a CPU lab 01 counts tensor storages; here the allocator is asked, which also sees what a count
    cannot (rounding to 512-byte blocks, anything left alive). Each build runs once untimed first, so the
    cuBLAS workspaces (one per thread and stream: forward and backward differ) exist before the baseline.
    The first run on an H100 found the allocator 1.6% (fp32) and 2.5% (mixed) above the formula with no
    block beyond the state's: so the allocator's snapshot is read, block by block, for the bytes each state
    tensor asked for against the bytes its block holds (the caching allocator rounds and keeps unsplit
    remainders), and for any other block the build left alive, with the line that allocated it.
    """
    device = _require_cuda("lab 01's allocator statistics (torch.cuda.memory_allocated)")
    cfg = MEMORY_CFG
    x, y = (t.to(device) for t in synthetic_batch(cfg, MEMORY_BATCH, step=0))
    for build in (_fp32_training_state, _mixed_training_state):
        build(cfg, device, x, y)
    report.figures["config"] = dict(cfg.__dict__)
    for precision, build in (("fp32", _fp32_training_state), ("mixed", _mixed_training_state)):
        gc.collect()  # nothing of the last build may be freed during this one's measurement
        _sync(device)
        torch.cuda.empty_cache()
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
        try:
            before = _active_blocks(torch.cuda.memory._snapshot())
            base = torch.cuda.memory_allocated(device)
            held, n_params, counted = build(cfg, device, x, y)
            _sync(device)
            measured = torch.cuda.memory_allocated(device) - base
            state_blocks, extra = _new_blocks(before, _active_blocks(torch.cuda.memory._snapshot()),
                                              _state_addresses(held))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        per = bytes_per_param(0, 1, precision).total
        formula = n_params * per
        del held
        extra_bytes = sum(b["bytes"] for b in extra)
        rounding = state_blocks["bytes"] - state_blocks["requested"]
        ratio, state_ratio = measured / formula, state_blocks["requested"] / formula
        report.figures[precision] = {"allocated_bytes": measured, "counted_bytes": counted, "formula_bytes": formula,
                                     "bytes_per_param": measured / n_params, "ratio": ratio, "n_params": n_params,
                                     "state_blocks": state_blocks, "state_ratio": state_ratio,
                                     "block_rounding_bytes": rounding, "other_blocks": extra}
        report.line(f"{precision} AdamW after one step, {n_params:,} parameters: torch.cuda.memory_allocated "
                    f"{measured / MiB:.2f} MiB = {measured / n_params:.4f} B/param ({ratio:.4f}× the formula's "
                    f"{per:g} B/param = {formula / MiB:.2f} MiB)")
        report.line(f"  of it: {state_blocks['blocks']} blocks of state tensors asked for "
                    f"{state_blocks['requested'] / MiB:.2f} MiB ({state_ratio:.4f}× the formula; counted tensors "
                    f"{counted / MiB:.2f} MiB) and hold {state_blocks['bytes'] / MiB:.2f} MiB (the allocator's "
                    f"rounding: {rounding / MiB:.2f} MiB); {len(extra)} other block(s) {extra_bytes / MiB:.2f} MiB")
        for block in extra[:4]:
            report.line(f"    {block['bytes'] / MiB:.2f} MiB ({block['requested']:,} B asked) from {block['where']}")
        report.check(f"{precision} state tensors on the device match bytes_per_param within 2%",
                     abs(state_ratio - 1) <= 0.02, f"asked/formula = {state_ratio:.4f}")
        report.check(f"{precision}: the allocator's new blocks account for every allocated byte",
                     state_blocks["bytes"] + extra_bytes == measured,
                     f"allocated {measured:,} B; state blocks {state_blocks['bytes']:,} B + other blocks "
                     f"{extra_bytes:,} B")
    gc.collect()
    _sync(device)
    torch.cuda.empty_cache()
    model = GPT(cfg, seed=0).to(device)
    s, b, h, a = cfg.seq_len, MEMORY_BATCH, cfg.d_model, cfg.n_head
    h_in = torch.randn(b, s, h, device=device, requires_grad=True)
    base = torch.cuda.memory_allocated(device)
    with ActivationMeter(model) as meter:
        out = model.blocks[0](h_in)
    _sync(device)
    allocated = torch.cuda.memory_allocated(device) - base
    full = activation_bytes_per_layer(s, b, h, a, bytes_per_value=4)
    fused = activation_bytes_per_layer(s, b, h, a, bytes_per_value=4, flash_attention=True)
    report.figures["activations"] = {"allocated_bytes": allocated, "saved_bytes": meter.bytes, "output_bytes":
                                     out.numel() * out.element_size(), "formula_bytes": full,
                                     "formula_fused_attention_bytes": fused}
    report.line(f"one block's forward, fp32, s={s} b={b} h={h} a={a}: allocator +{allocated / MiB:.2f} MiB (saved "
                f"tensors and the output), saved for backward {meter.bytes / MiB:.2f} MiB; formula "
                f"s·b·h·(34+5as/h) {full / MiB:.2f} MiB ({meter.bytes / full:.3f}×), without the s² term "
                f"{fused / MiB:.2f} MiB ({meter.bytes / fused:.3f}×)")


def part_lab04_memory(report: Report) -> None:
    """ZeRO stages 0-3 on NCCL ranks: counted bytes per parameter against the formula (lab 04's claim),
    and the allocator's peak of one step against the formula's model states."""
    world, backend = _world(), _backend()
    cfg, batch = ZERO_CFG, 4 * _world()
    rows = []
    with distlab.Ranks(world, backend=backend) as ranks:
        for precision, dtype in (("fp32", None), ("mixed", "bf16")):
            for stage in range(4):
                run = ranks.run(zero.train_worker, show_output=False, kwargs=dict(
                    stage=stage, cfg=cfg, steps=1, batch_size=batch, optimizer="adamw", lr=1e-3, dtype=dtype,
                    measure_state=True, measure_peak=True, return_state=False))
                n_params = run[0]["n_params"]
                per = bytes_per_param(stage, world, precision).total
                counted = [sum(r["state_bytes"].values()) / n_params for r in run]
                error = max(abs(c / per - 1) for c in counted)
                peak, how = run[0]["peak_memory"]
                states = model_memory(n_params, world, stage, precision).states
                with_acts = model_memory(n_params, world, stage, precision, n_layer=cfg.n_layer, seq_len=cfg.seq_len,
                                         micro_batch=batch // world, d_model=cfg.d_model, n_head=cfg.n_head,
                                         bytes_per_value=4 if dtype is None else 2).total
                rows.append({"precision": precision, "stage": stage, "bytes_per_param": counted[0], "formula": per,
                             "error": error, "peak_bytes": peak, "peak_how": how, "formula_states_bytes": states,
                             "formula_with_activations_bytes": with_acts, "n_params": n_params})
                report.line(f"{precision:>5} stage {stage}: {counted[0]:6.3f} B/param counted ({per:6.3f} formula, "
                            f"{error:.2%} off); peak {peak / MiB:7.2f} MiB = {peak / states:.2f}× the formula's "
                            f"states, {peak / with_acts:.2f}× states + activations ({how})")
                report.check(f"{precision} stage {stage} counted state within {STATE_TOLERANCE:.0%} of the formula",
                             error <= STATE_TOLERANCE, f"{error:.2%} off")
                report.check(f"{precision} stage {stage} peak holds at least the formula's model states",
                             peak >= 0.98 * states, f"peak {peak:,} B, states {states:,.0f} B")
    report.figures.update(world_size=world, backend=backend, config=dict(cfg.__dict__), batch_size=batch, rows=rows)


def part_lab03_mfu(report: Report) -> None:
    """Lab 03's GPT under overlapped DDP: tokens/s and MFU against this device's measured fp32 matmul peak
    (the model trains in fp32, and torch's default keeps fp32 matmuls off TF32)."""
    device, world, backend = _device(), _world(), _backend()
    sizes = (1024, 2048, 4096, 8192) if device.type == "cuda" else (256, 512, 1024)
    peak = measure_matmul_peak(sizes=sizes, dtype=torch.float32, device=device, min_seconds=0.2)
    fpt = flops_per_token(DDP_CFG)
    report.line(f"matmul peak: {peak}; float32 matmul precision '{torch.get_float32_matmul_precision()}'")
    runs = []
    steps, warmup = 20, 3
    with distlab.Ranks(world, backend=backend) as ranks:
        for per_rank in (4, 64):
            batch = per_rank * world
            run = ranks.run(data_parallel.train_worker, show_output=False, kwargs=dict(
                variant="overlapped", cfg=DDP_CFG, steps=steps, warmup=warmup, batch_size=batch, optimizer="adamw",
                lr=1e-3, bucket_cap_bytes=4 * 2**20, return_state=False))
            step = statistics.median(max(r["step_times"][i] for r in run) for i in range(steps))
            tokens = batch * DDP_CFG.seq_len / step
            value = mfu(fpt, tokens, peak.flops * world)
            runs.append({"batch_size": batch, "step_seconds": step, "tokens_per_second": tokens, "mfu": value,
                         "loss_first": run[0]["losses"][0], "loss_last": run[0]["losses"][-1]})
            report.line(f"global batch {batch}×{DDP_CFG.seq_len} tokens on {world} {backend} rank(s): "
                        f"{step * 1e3:.2f} ms/step, {tokens:,.0f} tokens/s, MFU {value:.2%} "
                        f"(model {format_flops(fpt)}/token)")
            if device.type == "cuda":  # a CPU's "peak" from a few small matmuls is no ceiling for a model's
                report.check(f"MFU at batch {batch} is a fraction of the peak", 0 < value <= 1, f"{value:.4f}")
    report.figures.update(world_size=world, backend=backend, config=dict(DDP_CFG.__dict__), flops_per_token=fpt,
                          peak_flops=peak.flops, peak=str(peak), peak_by_size=peak.by_size, runs=runs)


def part_lab12_checkpoint(report: Report) -> None:
    """Async checkpoints of GPU state: the stall against sync saves (bench_checkpoint's method, the
    library's timed_training), then an async checkpoint read back and compared with the GPU's weights."""
    world, backend = _world(), _backend()
    # A save every few steps on a GPU comes due while the last is still writing (the first H100 run: steps of
    # 17-26 ms, a 373 ms background write, a save every 2 steps), and the async stall then measures that wait.
    # So saves are spaced by more steps on a GPU, and the report says whether they still overlapped.
    steps, save_every = (80, 40) if torch.cuda.is_available() else (8, 2)
    root = Path(tempfile.mkdtemp(prefix="gpu-check-ckpt-"))
    modes = ["none", "sync", "async"]
    runs: dict[str, list] = {mode: [] for mode in modes}
    try:
        with distlab.Ranks(world, backend=backend) as ranks:
            for rep in range(2):
                for mode in modes[rep % 3:] + modes[:rep % 3]:
                    run = ranks.run(timed_training, args=(str(root / f"{mode}-{rep}"), mode), show_output=False,
                                    kwargs=dict(steps=steps, save_every=save_every, cfg=CKPT_CFG,
                                                batch_size=4 * world))
                    runs[mode].append([dict(r) for r in run])
            summary = stall_summary(runs)
            state_mib = runs["sync"][0][0]["state_bytes"] / MiB
            report.line(f"GPT d_model={CKPT_CFG.d_model} n_layer={CKPT_CFG.n_layer}: {state_mib:.1f} MiB of weights "
                        f"and AdamW state per rank on {world} {backend} rank(s)")
            for mode in modes:
                s = summary[mode]
                report.line(f"{mode:>5}: blocked {s['blocked'] * 1e3:7.1f} ms/save, step {s['step'] * 1e3:6.1f} ms"
                            + (f", background write {s['background'] * 1e3:.0f} ms" if mode == "async" else ""))
            interval = save_every * summary["async"]["step"]
            overlapped = summary["async"]["background"] > interval
            report.line(f"a save every {save_every} steps ({interval * 1e3:.0f} ms of async-run steps) against a "
                        f"{summary['async']['background'] * 1e3:.0f} ms background write: " +
                        ("each async save came due while the previous was writing, so its stall includes that wait"
                         if overlapped else "each write finished before the next save was due"))
            ratio = summary.get("ratio", float("nan"))
            report.target("async/sync checkpoint stall", ratio <= STALL_TARGET, f"{ratio:.2f} (target ≤ "
                          f"{STALL_TARGET})")
            reload_root = root / "reload"
            trained = ranks.run(resumable_train, args=(str(reload_root), 4, 2), show_output=False, kwargs=dict(
                cfg=RELOAD_CFG, batch_size=4 * world, n_items=max(10, 8 * world), async_save=True))[0]
        saved = read_checkpoint(checkpoint_path(reload_root, 4))
        differ = [name for name, value in trained["weights"].items()
                  if not torch.equal(saved[f"train.model.{name}"], value)]
        report.check("an async checkpoint of GPU state reads back bit for bit", not differ,
                     f"{len(trained['weights']) - len(differ)} of {len(trained['weights'])} tensors equal")
        report.line(f"async checkpoint of step 4 read back: {len(trained['weights']) - len(differ)} of "
                    f"{len(trained['weights'])} weight tensors equal the ranks' own ({_device().type})")
        report.figures.update(world_size=world, backend=backend, config=dict(CKPT_CFG.__dict__), state_mib=state_mib,
                              modes=summary, ratio=ratio, reload_differs=differ, steps=steps, save_every=save_every,
                              saves_overlapped=overlapped)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def lab_entries(world: int) -> list[tuple[str, object, dict]]:
    """Each lab's launchable entry point, with arguments whose shapes split over ``world`` ranks."""
    heads = max(4, world)
    dp, pp, tp = grid_shape(world)
    return [
        ("02 collectives: hello_world", collectives.hello_world, {}),
        ("03 DDP: data_parallel.train", data_parallel.train, dict(steps=3, warmup=1)),
        ("04 ZeRO-3 bf16: zero.train", zero.train, dict(steps=3, warmup=1, stage=3, dtype="bf16", measure_peak=True)),
        ("05 tensor parallel: tensor_parallel.train", tensor_parallel.train,
         dict(steps=3, warmup=1, n_head=heads, d_model=32 * heads)),
        ("06 pipeline: pipeline_parallel.train", pipeline_parallel.train, dict(steps=3, warmup=1, microbatches=4)),
        ("07 ring attention: context_parallel.verify", context_parallel.verify, {}),
        ("08 MoE: moe.train", moe.train, dict(steps=3, num_experts=max(8, world))),
        ("09 FP8 all-gather: fp8.distributed.demo", fp8_distributed.demo, dict(rows=512, cols=256)),
        (f"11 3D grid dp={dp} pp={pp} tp={tp}: parallel3d.grid.train", grid.train, dict(dp=dp, pp=pp, tp=tp, steps=2)),
    ]


def _where() -> tuple[str, str]:
    """Inside a rank: the device it computes on and its backend."""
    return str(distlab.device()), torch.distributed.get_backend()


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


def _summary_of(value) -> str:
    """One short line from a lab entry point's return value: its losses, errors or equality checks."""
    if isinstance(value, dict):
        found = [f"{key} {_short(item)}" for key, item in value.items() if key in SUMMARY_KEYS]
        found += [f"{key}: codes_equal {item['codes_equal']}" for key, item in value.items()
                  if isinstance(item, dict) and "codes_equal" in item]
        if found:
            return ", ".join(found)
    return _first_line(repr(value), 120)


def part_labs(report: Report) -> None:
    """Every lab's entry point on NCCL ranks at the world size; labs 01 (memory formulas), 10 (a CPU data
    pipeline) and 12 (the checkpoint part) are measured elsewhere or have no GPU path."""
    world, backend = _world(), _backend()
    rows = []
    with distlab.Ranks(world, backend=backend) as ranks:
        where = list(ranks.run(_where, show_output=False))
        report.line(f"{world} rank(s) compute on {', '.join(d for d, _ in where)} ({where[0][1]})")
        for label, fn, kwargs in lab_entries(world):
            started = time.perf_counter()
            try:
                value = ranks.run(fn, kwargs=kwargs, show_output=False)[0]
                ok, detail = True, _summary_of(value)
            except Exception as error:  # one lab failing is recorded; the next still runs
                ok, detail = False, f"{type(error).__name__}: {_first_line(str(error))}"
            seconds = time.perf_counter() - started
            rows.append({"lab": label, "ok": ok, "seconds": seconds, "detail": detail})
            report.line(f"{label}: {'ok' if ok else 'FAILED'} in {seconds:.1f} s — {detail}")
            report.check(f"{label} runs at world size {world}", ok, detail)
    report.figures.update(world_size=world, backend=backend, devices=where, rows=rows)


def torchrun_workers(world: int, ckpt_dir: str) -> list[tuple[str, str, list[str]]]:
    """Every topic's torchrun worker (course/cluster.md), as (its step lines' tag, target, arguments) at ``world``
    ranks: the cluster path's own entry points, with shapes that split over ``world``."""
    dp, pp, tp = grid_shape(world)
    heads = max(4, world)
    return [
        ("ddp", "distlab.data_parallel:train", ["steps=4"]),
        ("zero-3", "distlab.zero:train", ["steps=4", "stage=3"]),
        (f"tp-{world}", "distlab.tensor_parallel:train", ["steps=4", f"n_head={heads}", f"d_model={32 * heads}"]),
        (f"pp-{world}", "distlab.pipeline_parallel:train", ["steps=4", "microbatches=4"]),
        (f"cp-{world} ring", "distlab.context_parallel:train", ["steps=4"]),
        (f"moe-{world}", "distlab.moe:train", ["steps=4", f"num_experts={max(8, world)}"]),
        ("fp8 dp", "distlab.fp8:train", ["steps=4"]),
        (f"3d dp{dp}·pp{pp}·tp{tp}", "distlab.parallel3d.grid:train", [f"dp={dp}", f"pp={pp}", f"tp={tp}", "steps=4"]),
        (f"resumable dp-{world}", "distlab.fault_tolerance:train", ["steps=6", "save_every=3", f"ckpt_dir={ckpt_dir}"]),
    ]


def worker_lines(output: list[str], tag: str) -> tuple[str | None, str | None]:
    """Rank 0's last per-step line and its summary line for the worker tagged ``tag`` (``[tag] step k/n …``,
    ``[tag] done: …``), as a cluster user watches them."""
    steps = [line for line in output if line.startswith(f"[{tag}] step ")]
    done = [line for line in output if line.startswith(f"[{tag}] done: ")]
    return (steps[-1] if steps else None), (done[-1] if done else None)


def part_workers(report: Report) -> None:
    """Each topic's ``train`` under ``torchrun --standalone`` on NCCL ranks (issue 29: the cluster path on GPUs),
    with rank 0's last step line and summary quoted; a worker that fails is recorded and the next still runs."""
    world, backend = _world(), _backend()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-workers-") as tmp:
        for tag, target, arguments in torchrun_workers(world, str(Path(tmp) / "checkpoints")):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   "-m", "distlab.torchrun", target, *arguments, "--backend", backend]
            child = run_child(cmd, 240, env=_child_env())
            step, done = worker_lines(child.output, tag)
            ok = child.returncode == 0 and step is not None and done is not None
            detail = f"{step}\n    {done}" if ok else f"status {child.returncode}: {' | '.join(child.output[-3:])}"
            rows.append({"target": target, "ok": ok, "seconds": child.seconds, "step_line": step, "done_line": done})
            report.line(f"torchrun {target} on {world} {backend} rank(s): {'ok' if ok else 'FAILED'} in "
                        f"{child.seconds:.0f} s — {detail}")
            report.check(f"{target} under torchrun on {backend}", ok, detail)
    report.figures.update(world_size=world, backend=backend, rows=rows)


CHILD_PARTS = {"lab09-fp8": part_lab09_fp8, "lab01-memory": part_lab01_memory, "lab04-memory": part_lab04_memory,
               "lab03-mfu": part_lab03_mfu, "lab12-checkpoint": part_lab12_checkpoint, "labs": part_labs,
               "workers": part_workers}
PARTS = ["environment", *CHILD_PARTS, "tests", "notebooks"]


def run_part_here(name: str, out_file: Path) -> int:
    """The child's side of a part: run it, write what it found as JSON, whatever happened."""
    report = Report()
    error = None
    try:
        CHILD_PARTS[name](report)
    except Exception as exc:  # recorded for the parent; the other parts run in their own processes
        error = f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exc().splitlines(True)[-8:])}"
        print(error, file=sys.stderr, flush=True)
    status = "failed" if error or not all(c["ok"] for c in report.checks) else "ok"
    out_file.write_text(json.dumps({"status": status, "error": error, "lines": report.lines,
                                    "figures": report.figures, "checks": report.checks, "targets": report.targets},
                                   default=str), encoding="utf-8")
    return 0


def run_notebook_here(path: Path, out_file: Path, cell_timeout: int) -> int:
    """The child's side of a notebook: execute it (errors kept as outputs) and write the scan as JSON."""
    from distlab import notebooks  # noqa: PLC0415  nbformat, nbclient and ipykernel are optional on a GPU image

    error, scan = None, {}
    try:
        executed = notebooks.execute(path, cell_timeout=cell_timeout, allow_errors=True,
                                     env={"DISTLAB_BACKEND": "auto"})
        scan = scan_notebook(executed)
    except Exception as exc:  # a cell timeout or a kernel that would not start
        error = f"{type(exc).__name__}: {_first_line(str(exc))}"
    status = "failed" if error or scan.get("errors") else "ok"
    out_file.write_text(json.dumps({"status": status, "error": error, "figures": scan}), encoding="utf-8")
    return 0


# ---------------------------------------------------------------- running parts under the budget

@dataclass
class ChildRun:
    returncode: int | None
    output: list[str]
    seconds: float
    timed_out: bool


def _end_process_group(proc: subprocess.Popen) -> None:
    """End a part that ran out of time without leaving ranks behind.

    SIGINT first, to the part's whole group: pytest writes its report, a notebook's client shuts its
    kernel down, and distlab's launcher closes its ranks (its reaper ignores SIGINT). A part still alive
    after the grace period gets SIGKILL alone, so that its reaper sees the lifeline close and kills the
    ranks (they live in process groups of their own); then SIGKILL ends whatever is left of the group.
    """
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    time.sleep(2)  # the reaper's turn: it kills the ranks once the launcher is gone
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_child(cmd: list[str], timeout: float, *, env: dict | None = None, echo: str = "") -> ChildRun:
    """Run ``cmd`` from the repository root in a session of its own, echoing its output, for at most ``timeout`` s."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1, start_new_session=True)
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if echo:
                print(f"{echo}{line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        _end_process_group(proc)
    reader.join(timeout=5)
    return ChildRun(proc.returncode, lines, time.monotonic() - started, timed_out)


def _child_env() -> dict[str, str]:
    """The parts' environment: unbuffered output, and distlab importable from this checkout even without
    ``pip install -e .`` (a lent GPU machine's own Python)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    lib = str(REPO / "lib")
    if lib not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (lib, env.get("PYTHONPATH")) if p)
    return env


def _from_child_file(out_file: Path, child: ChildRun, name: str) -> dict:
    if child.timed_out:
        return {"status": "stopped", "error": f"budget ran out while {name} ran ({child.seconds:.0f} s)",
                "output_tail": child.output[-20:]}
    if out_file.exists():
        return json.loads(out_file.read_text(encoding="utf-8"))
    return {"status": "failed", "error": f"{name} ended with status {child.returncode} before writing its results",
            "output_tail": child.output[-20:]}


def run_lab_part(name: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out_file = Path(tmp) / "part.json"
        child = run_child([sys.executable, str(Path(__file__).resolve()), "--child", name, "--child-out",
                           str(out_file)], timeout, env=_child_env(), echo="  | ")
        return _from_child_file(out_file, child, name)


def run_tests_part(timeout: float) -> dict:
    """Every CUDA-guarded test, in one pytest run; a run cut off by the budget keeps the outcomes it printed."""
    selected = select_cuda_tests()
    files = sorted({node.split("::")[0] for node in selected})
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}", *selected]
        child = run_child(cmd, timeout, env=_child_env(), echo="  | ")
        cases = parse_junit(xml.read_text(encoding="utf-8"), files) if xml.exists() else parse_verbose(child.output)
    counts = {outcome: sum(c["outcome"] == outcome for c in cases) for outcome in ("passed", "failed", "error",
                                                                                   "skipped")}
    lines = [f"{len(selected)} CUDA-guarded tests in {len(files)} files ({len(cases)} with their parameters): " +
             ", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n)]
    lines += [f"{c['outcome'].upper()} {c['id']}" + (f" — {c['reason']}" if c["reason"] else "")
              for c in cases if c["outcome"] != "passed"]
    status = "failed" if counts["failed"] or counts["error"] else "ok"
    error = None
    if child.timed_out:
        status, error = "stopped", f"budget ran out while pytest ran ({child.seconds:.0f} s); outcomes so far kept"
    elif not cases:
        status, error = "failed", f"pytest ended with status {child.returncode} and reported no test"
    return {"status": status, "error": error, "lines": lines, "output_tail": child.output[-20:] if error else [],
            "figures": {"selected": selected, "results": cases, "counts": counts, "returncode": child.returncode}}


def run_notebook_part(path: Path, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out_file = Path(tmp) / "notebook.json"
        cell_timeout = int(max(30, min(600, timeout)))
        child = run_child([sys.executable, str(Path(__file__).resolve()), "--child", "notebook", "--notebook",
                           str(path), "--child-out", str(out_file), "--cell-timeout", str(cell_timeout)], timeout,
                          env=_child_env(), echo="  | ")
        result = _from_child_file(out_file, child, path.name)
    scan = result.get("figures") or {}
    if scan:
        cells = ", ".join(str(c["cell"]) for c in scan["cuda_cells"]) or "none"
        result["lines"] = [f"{scan['executed']} of {scan['code_cells']} code cells ran; outputs showing CUDA/NCCL "
                           f"in cells: {cells}"]
        result["lines"] += [f"  cell {c['cell']}: {c['lines'][0]}" for c in scan["cuda_cells"]]
        if scan["gloo_fallback_cells"]:
            result["lines"].append("gloo ranks on the CPU (more ranks than GPUs) in cells: "
                                   + ", ".join(map(str, scan["gloo_fallback_cells"])))
        result["lines"] += [f"ERROR in cell {e['cell']}: {e['error']}" for e in scan["errors"]]
    return result


def environment() -> dict:
    """What the figures were measured on: devices, driver, and the versions of everything between."""
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    env["devices"] = []
    for index in range(env["gpus"]):
        props = torch.cuda.get_device_properties(index)
        env["devices"].append({"index": index, "name": props.name, "capability": f"{props.major}.{props.minor}",
                               "memory_gib": round(props.total_memory / 2**30, 1),
                               "multiprocessors": props.multi_processor_count})
    try:
        env["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # a build without cuDNN
        env["cudnn"] = None
    try:
        nccl = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # a build without NCCL
        env["nccl"] = None
    env["driver"] = _driver_version()
    getter = getattr(torch._C, "_cuda_getDriverVersion", None)
    env["cuda_driver_api"] = getter() if getter and env["gpus"] else None
    env["world_size"], env["world_size_reason"] = world_size_for(env["gpus"])
    env["distlab_backend_env_read"] = any("DISTLAB_BACKEND" in p.read_text(encoding="utf-8")
                                          for p in (REPO / "lib" / "distlab").rglob("*.py"))
    return env


def _driver_version() -> str | None:
    """The NVIDIA driver release (580.159.04): nvidia-smi where it is installed, else NVML's Python binding."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        import pynvml  # noqa: PLC0415  optional (nvidia-ml-py): asked only where nvidia-smi is missing

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML either: say so rather than guess
        return None


# ---------------------------------------------------------------- the report

def header(env: dict) -> str:
    devices = env.get("devices") or []
    names = ", ".join(sorted({f"{d['name']} (compute capability {d['capability']}, {d['memory_gib']} GiB)"
                              for d in devices})) or "no CUDA GPU"
    return (f"GPU check on {env.get('gpus', 0)}× {names}; driver {env.get('driver') or 'unknown'}, torch "
            f"{env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, NCCL {env.get('nccl')}\n"
            f"world size {env.get('world_size')}: {env.get('world_size_reason')}")


def summarize(data: dict) -> str:
    lines = [f"status: {data['status']}"]
    if data.get("environment"):
        lines.insert(0, header(data["environment"]))
    for name, part in data.get("parts", {}).items():
        seconds = f" in {part['seconds']:.1f} s" if part.get("seconds") is not None else ""
        run = f" (run {part['run']})" if len(data.get("runs", [])) > 1 and part.get("run") else ""
        lines.append(f"[{name}] {part['status']}{seconds}{run}" + (f": {part['error'].splitlines()[0]}"
                                                             if part.get("error") else ""))
        lines += [f"  {line}" for line in part.get("lines", [])]
    if any(name.startswith("notebook-") for name in data.get("parts", {})):
        read = data.get("environment", {}).get("distlab_backend_env_read")
        lines.append("notebooks ran with DISTLAB_BACKEND=auto in the kernel's environment; " +
                     ("lib/distlab reads it" if read else "nothing in lib/distlab reads it, so each launch used its "
                      "own backend argument ('auto' unless the notebook names one)"))
    if len(data.get("runs", [])) > 1:
        lines += [f"run {n}: {run['date']}: {run['command']}" for n, run in enumerate(data["runs"], 1)]
    if data.get("stopped"):
        lines.append(data["stopped"])
    if "spent_seconds" in data:
        lines.append(f"time: {data['spent_seconds']:.0f} s of a {data['budget_seconds']:.0f} s budget; "
                     f"failed: {', '.join(data.get('failed', [])) or 'nothing'}")
    return "\n".join(lines)


def existing_gpu_evidence(out: Path) -> str | None:
    """A one-line description of GPU results already saved in ``out``, which a run without a GPU must keep."""
    try:
        saved = results.load(TOPIC, out)
    except (FileNotFoundError, ValueError):
        return None
    if not saved.get("gpu"):
        return None
    machine = saved.get("machine", {})
    return f"{', '.join(machine.get('gpus', [])) or 'a GPU'}, {machine.get('date', '?')}"


def plan(parts: list[str], notebooks: list[str]) -> tuple[list[str], list[Path]]:
    """The steps to run, in order, and the notebooks the ``notebooks`` part executes."""
    paths = []
    for prefix in notebooks:
        found = sorted((REPO / "solutions").glob(f"{prefix}_*.ipynb"))
        if not found:
            raise SystemExit(f"gpu-check: no solution notebook solutions/{prefix}_*.ipynb")
        paths += found
    steps = [p for p in PARTS[1:] if p in parts and p != "notebooks"]
    if "notebooks" in parts:
        steps += [f"notebook-{p.name.split('_')[0]}" for p in paths]
    return steps, paths


def rerun_hint(steps: list[str]) -> str:
    parts = [s for s in steps if not s.startswith("notebook-")]
    books = [s.removeprefix("notebook-") for s in steps if s.startswith("notebook-")]
    if books:
        parts.append("notebooks")
    return f"--parts {','.join(parts)}" + (f" --notebooks {','.join(books)}" if books else "")


def merge_into(data: dict, out: Path) -> None:
    """Keep the parts of the GPU evidence saved in ``out`` that this run does not redo (``--merge``).

    A lent machine's minutes rarely cover a second full run: after a fix, only the parts it touched are
    rerun, and the file keeps the rest, each part saying which run measured it. Evidence from another
    device is never mixed in.
    """
    try:
        saved = results.load(TOPIC, out)
    except (FileNotFoundError, ValueError):
        raise SystemExit(f"gpu-check: --merge needs GPU evidence in {out / (TOPIC + '.json')}; there is none")
    if not saved.get("gpu"):
        raise SystemExit(f"gpu-check: {out / (TOPIC + '.json')} holds no GPU evidence to merge into")
    names = sorted(d["name"] for d in saved.get("environment", {}).get("devices", []))
    if names != sorted(d["name"] for d in data["environment"]["devices"]):
        raise SystemExit(f"gpu-check: the saved evidence was measured on {', '.join(names) or 'no GPU'}, not on "
                         f"this machine's GPUs: run every part instead of --merge")
    earlier = saved.get("runs") or [{"date": saved.get("machine", {}).get("date", "?"),
                                     "command": saved.get("command", "?")}]
    data["runs"] = earlier + data["runs"]
    merged = {name: dict(part, run=part.get("run", 1)) for name, part in saved["parts"].items()
              if name != "environment"} | data["parts"]

    def in_run_order(name: str) -> tuple[int, str]:
        return PARTS.index("notebooks" if name.startswith("notebook-") else name), name

    data["parts"] = {name: merged[name] for name in sorted(merged, key=in_run_order)}


def run_all(args, out: Path, rehearse: bool) -> int:
    started = time.monotonic()
    deadline = started + args.budget_seconds
    steps, notebook_paths = plan(args.parts, args.notebooks)
    notebook_by_step = {f"notebook-{p.name.split('_')[0]}": p for p in notebook_paths}
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    data = {"status": "in progress", "gpu": not rehearse, "budget_seconds": args.budget_seconds, "parts": {},
            "command": command, "stopped": None,
            "runs": [{"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command}]}
    part_started = time.monotonic()
    data["environment"] = environment()
    data["parts"]["environment"] = {"status": "ok", "seconds": time.monotonic() - part_started,
                                    "figures": data["environment"], "lines": []}
    data["world_size"] = data["environment"]["world_size"]
    print(header(data["environment"]), flush=True)
    if args.merge:
        merge_into(data, out)
    missing_stack = [m for m in NOTEBOOK_STACK if importlib.util.find_spec(m) is None]

    def save(status: str) -> None:
        data["status"] = status
        data["spent_seconds"] = time.monotonic() - started
        data["failed"] = [name for name, part in data["parts"].items() if part["status"] == "failed"]
        results.save(TOPIC, data, summarize(data), directory=out)

    for index, step in enumerate(steps):
        remaining = deadline - time.monotonic()
        if remaining < MIN_PART_SECONDS:
            data["stopped"] = (f"gpu-check: budget spent: {remaining:.0f} s of {args.budget_seconds:.0f} s left, too "
                               f"little to start {step}; did not run {', '.join(steps[index:])}; measured so far is "
                               f"kept (rerun the rest: {rerun_hint(steps[index:])})")
            print(data["stopped"], flush=True)
            break
        print(f"[{step}] starting ({remaining:.0f} s of budget left)", flush=True)
        part_started = time.monotonic()
        if step == "tests":
            part = run_tests_part(remaining)
        elif step in notebook_by_step:
            if missing_stack:
                part = {"status": "skipped", "error": f"the notebook runner needs {', '.join(missing_stack)}, not "
                                                      f"installed for {sys.executable} (see CONTRIBUTING.md)"}
            else:
                part = run_notebook_part(notebook_by_step[step], remaining)
        else:
            part = run_lab_part(step, remaining)
        part["seconds"] = time.monotonic() - part_started
        part["run"] = len(data["runs"])
        data["parts"][step] = part
        print(f"[{step}] {part['status']} in {part['seconds']:.1f} s"
              + (f": {part['error'].splitlines()[0]}" if part.get("error") else ""), flush=True)
        if part["status"] == "stopped":
            data["stopped"] = (f"gpu-check: the {args.budget_seconds:.0f} s budget ran out during {step}: stopped it "
                               f"and did not run {', '.join(steps[index + 1:]) or 'anything else'}; measured so far "
                               f"is kept (rerun: {rerun_hint(steps[index:])})")
            print(data["stopped"], flush=True)
            save("in progress")
            break
        save("in progress")
    data["exit_status"] = 1 if any(part["status"] == "failed" for part in data["parts"].values()) else 0
    save(REHEARSAL if rehearse else ("measured" if not data["stopped"] else "measured in part: budget spent"))
    print()
    print(summarize(data))
    print(f"wrote {out / (TOPIC + '.txt')} and {TOPIC}.json", flush=True)
    return data["exit_status"]


def no_gpu(out: Path) -> int:
    """Say there is nothing to measure, in one line, and leave result files that say so (never over GPU evidence)."""
    kept = existing_gpu_evidence(out)
    build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
    if kept:
        print(f"gpu-check: {NO_GPU} ({build}); kept the GPU evidence in {out / 'gpu.json'} ({kept})")
        return 0
    data = {"status": NO_GPU, "gpu": False, "parts": {}, "torch": torch.__version__, "cuda_build": torch.version.cuda}
    summary = (f"GPU check: {NO_GPU}\n{build}, torch.cuda.is_available() is False.\n"
               f"Run `make gpu-check` on a machine with a CUDA GPU (CONTRIBUTING.md, \"GPU evidence\").")
    results.save(TOPIC, data, summary, directory=out)
    print(f"gpu-check: {NO_GPU} ({build}); wrote {out / 'gpu.txt'} and gpu.json")
    return 0


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=results.RESULTS_DIR, help="where gpu.json and gpu.txt go "
                                                                         "(default: benchmarks/results)")
    p.add_argument("--budget-seconds", type=float, default=DEFAULT_BUDGET, help="the whole run's time budget "
                                                                                "(default: 480)")
    p.add_argument("--parts", default=",".join(PARTS[1:]), help=f"comma-separated, of: {', '.join(PARTS[1:])} "
                                                                f"(default: all; the environment always runs)")
    p.add_argument("--notebooks", default=",".join(DEFAULT_NOTEBOOKS), help="solution notebooks for the notebooks "
                                                                            "part, by number (default: 01,03,09,12)")
    p.add_argument("--merge", action="store_true", help="keep the parts of the GPU evidence in --out that this run "
                                                        "does not redo (a rerun of what failed or was cut off)")
    p.add_argument("--rehearse", action="store_true", help="run the parts even without a GPU (CPU, gloo ranks): "
                                                           "tries the plumbing; the CUDA-only parts fail")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--notebook", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--cell-timeout", type=int, default=600, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS[1:])}")
    args.notebooks = [s.strip() for s in args.notebooks.split(",") if s.strip()]
    if args.budget_seconds <= 0:
        p.error("--budget-seconds must be positive")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.child == "notebook":
        return run_notebook_here(args.notebook, args.child_out, args.cell_timeout)
    if args.child:
        return run_part_here(args.child, args.child_out)
    if not torch.cuda.is_available() and not args.rehearse:
        return no_gpu(args.out)
    rehearse = not torch.cuda.is_available()
    if rehearse and existing_gpu_evidence(args.out):
        raise SystemExit(f"gpu-check: {args.out} holds GPU evidence; rehearse with --out elsewhere")
    return run_all(args, args.out, rehearse)


if __name__ == "__main__":
    sys.exit(main())
