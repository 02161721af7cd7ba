"""benchmarks/gpu_check.py (`make gpu-check`) on a machine without a GPU: its one-line answer and result files,
and the pure helpers that decide what runs on a GPU machine (which tests need CUDA, how results are read)."""

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up while the class is built
_spec.loader.exec_module(gpu_check)

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would measure it")


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


# ---------------------------------------------------------------- the self-test: no GPU here

@no_gpu
def test_without_a_gpu_it_says_so_in_one_line_writes_the_files_and_exits_0(tmp_path):
    result = _run("--out", tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA GPU: nothing measured"), result.stdout
    data = json.loads((tmp_path / "gpu.json").read_text(encoding="utf-8"))
    assert data["status"] == "no CUDA GPU: nothing measured" and data["gpu"] is False and data["parts"] == {}
    assert data["machine"]["torch"] == torch.__version__ and "gpus" not in data["machine"]
    assert (tmp_path / "gpu.txt").read_text(encoding="utf-8").startswith("GPU check: no CUDA GPU: nothing measured")


@no_gpu
def test_without_a_gpu_saved_gpu_evidence_is_kept(tmp_path):
    machine = {"gpus": ["NVIDIA H100"], "date": "2026-11-01"}
    evidence = json.dumps({"gpu": True, "status": "measured", "machine": machine})
    (tmp_path / "gpu.json").write_text(evidence, encoding="utf-8")
    (tmp_path / "gpu.txt").write_text("GPU check on 1× NVIDIA H100\n", encoding="utf-8")
    result = _run("--out", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and "kept the GPU evidence" in result.stdout
    assert "NVIDIA H100, 2026-11-01" in result.stdout
    assert (tmp_path / "gpu.json").read_text(encoding="utf-8") == evidence
    assert _run("--rehearse", "--out", tmp_path).returncode != 0  # a rehearsal may not overwrite it either


@no_gpu
def test_a_rehearsal_runs_the_cuda_tests_part_and_records_each_skip_with_its_reason(tmp_path):
    result = _run("--rehearse", "--parts", "tests", "--out", tmp_path, "--budget-seconds", 240, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text(encoding="utf-8"))
    assert data["status"] == gpu_check.REHEARSAL and data["gpu"] is False
    tests = data["parts"]["tests"]
    assert tests["status"] == "ok" and tests["seconds"] > 0
    cases = tests["figures"]["results"]
    assert cases and all(c["outcome"] == "skipped" and "CUDA GPU" in c["reason"] for c in cases)
    assert "SKIPPED tests/test_launcher.py::test_auto_backend_uses_nccl_with_one_gpu_per_rank — needs 2 CUDA GPUs" \
        in (tmp_path / "gpu.txt").read_text(encoding="utf-8")


def test_unknown_parts_and_a_bad_budget_are_refused():
    with pytest.raises(SystemExit):
        gpu_check.parse(["--parts", "tests,bogus"])
    with pytest.raises(SystemExit):
        gpu_check.parse(["--budget-seconds", "0"])
    args = gpu_check.parse(["--parts", "tests, notebooks", "--notebooks", "09"])
    assert args.parts == ["tests", "notebooks"] and args.notebooks == ["09"] and args.budget_seconds == 480


# ---------------------------------------------------------------- which tests need CUDA

def test_cuda_skip_markers_are_found_on_tests_classes_names_and_the_module():
    source = textwrap.dedent('''
        import pytest, torch
        needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
        slow = pytest.mark.skipif(sys.platform == "win32", reason="not on Windows")

        @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
        def test_direct(): ...

        @needs_two
        def test_named(): ...

        @slow
        def test_windows_only_marker(): ...

        @pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
        def test_only_without_a_gpu(): ...

        def test_skips_inside_its_body():
            if torch.cuda.is_available():
                pytest.skip("this machine has GPUs")

        def helper_not_a_test(): ...

        @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
        class TestOnGpu:
            def test_method(self): ...

        class TestMixed:
            @needs_two
            def test_two(self): ...

            def test_cpu(self): ...
        ''')
    assert gpu_check.cuda_test_ids(source, "tests/test_x.py") == {
        "tests/test_x.py::test_direct": "needs a CUDA GPU",
        "tests/test_x.py::test_named": "needs 2 CUDA GPUs",
        "tests/test_x.py::TestOnGpu::test_method": "needs a CUDA GPU",
        "tests/test_x.py::TestMixed::test_two": "needs 2 CUDA GPUs",
    }
    module = 'import pytest, torch\npytestmark = [pytest.mark.timeout(9), pytest.mark.skipif(\n' \
             '    not torch.cuda.is_available(), reason="needs a CUDA GPU")]\ndef test_a(): ...\ndef test_b(): ...\n'
    assert gpu_check.cuda_test_ids(module, "t.py") == {"t.py::test_a": "needs a CUDA GPU",
                                                         "t.py::test_b": "needs a CUDA GPU"}


def test_the_repositorys_cuda_tests_are_selected_and_only_those():
    selected = gpu_check.select_cuda_tests(REPO)
    for node in ("tests/test_fp8_cuda.py::test_matmul_throughput_on_cuda",
                 "tests/test_fault_tolerance_cuda.py::test_async_checkpoints_of_gpu_state_reload_exactly_and_resume_"
                 "under_nccl", "tests/test_zero.py::test_one_gpu_runs_every_stage_with_nccl_cuda_memory_and_bf16",
                 "tests/test_ddp.py::test_one_nccl_rank_on_a_gpu_trains_like_the_cpu_reference"):
        assert selected[node] == "needs a CUDA GPU"
    assert selected["tests/test_launcher.py::test_auto_backend_uses_nccl_with_one_gpu_per_rank"] == "needs 2 CUDA GPUs"
    assert "tests/test_launcher.py::test_nccl_without_gpus_is_refused_clearly" not in selected  # a CPU-only test
    assert all("CUDA" in reason for reason in selected.values())
    assert not any(node.startswith(("tests/test_memory.py", "tests/test_gpu_check.py")) for node in selected)


# ---------------------------------------------------------------- reading pytest's results

def test_junit_reports_become_node_ids_outcomes_and_reasons():
    xml = '''<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
      <testcase classname="tests.test_fp8_cuda" name="test_ok[tensorwise]" time="0.1"/>
      <testcase classname="tests.test_zero" name="test_bad"><failure message="AssertionError: 3 != 4">long
        traceback</failure></testcase>
      <testcase classname="tests.test_zero" name="test_setup"><error message="fixture 'x' not found"/></testcase>
      <testcase classname="tests.test_launcher.TestTwo" name="test_two"><skipped type="pytest.skip"
        message="needs 2 CUDA GPUs">tests/test_launcher.py:293: needs 2 CUDA GPUs</skipped></testcase>
      <testcase classname="tests.grading.test_g" name="test_h"/>
    </testsuite></testsuites>'''
    files = ["tests/test_fp8_cuda.py", "tests/test_zero.py", "tests/test_launcher.py", "tests/grading/test_g.py"]
    assert gpu_check.parse_junit(xml, files) == [
        {"id": "tests/test_fp8_cuda.py::test_ok[tensorwise]", "outcome": "passed", "reason": ""},
        {"id": "tests/test_zero.py::test_bad", "outcome": "failed", "reason": "AssertionError: 3 != 4"},
        {"id": "tests/test_zero.py::test_setup", "outcome": "error", "reason": "fixture 'x' not found"},
        {"id": "tests/test_launcher.py::TestTwo::test_two", "outcome": "skipped", "reason": "needs 2 CUDA GPUs"},
        {"id": "tests/grading/test_g.py::test_h", "outcome": "passed", "reason": ""},
    ]


def test_verbose_lines_of_a_cut_off_run_keep_their_outcomes():
    lines = ["collecting ... collected 3 items", "",
             "tests/test_a.py::test_one PASSED                                         [ 33%]",
             "tests/test_a.py::test_two[x] SKIPPED (needs a CUDA GPU)                  [ 66%]",
             "tests/test_b.py::test_three FAILED                                       [100%]",
             "FAILED tests/test_b.py::test_three - AssertionError"]
    assert gpu_check.parse_verbose(lines) == [
        {"id": "tests/test_a.py::test_one", "outcome": "passed", "reason": ""},
        {"id": "tests/test_a.py::test_two[x]", "outcome": "skipped", "reason": ""},
        {"id": "tests/test_b.py::test_three", "outcome": "failed", "reason": ""},
    ]


# ---------------------------------------------------------------- reading an executed notebook

def test_a_notebook_scan_finds_cuda_cells_gloo_fallbacks_and_errors():
    notebook = {"cells": [
        {"cell_type": "markdown", "source": "NCCL and CUDA, in prose"},
        {"cell_type": "code", "execution_count": 1, "outputs": [
            {"output_type": "stream", "name": "stdout", "text": ["device: cuda:0; 16-bit training: bf16\n", "ok\n"]}]},
        {"cell_type": "code", "execution_count": 2, "outputs": [
            {"output_type": "stream", "name": "stderr",
             "text": "distlab: 4 ranks but 1 GPU(s): running gloo ranks on the CPU (NCCL needs one GPU per rank)\n"}]},
        {"cell_type": "code", "execution_count": 3, "outputs": [
            {"output_type": "execute_result", "data": {"text/plain": "('nccl', 'cuda:0', 12.0)"}}]},
        {"cell_type": "code", "execution_count": 4, "outputs": [
            {"output_type": "error", "ename": "RuntimeError", "evalue": "CUDA out of memory", "traceback": []}]},
        {"cell_type": "code", "execution_count": None, "outputs": []},
        {"cell_type": "code", "execution_count": 5, "outputs": [
            {"output_type": "stream", "name": "stdout", "text": "barracuda is not a device\n"}]},
    ]}
    scan = gpu_check.scan_notebook(notebook)
    assert scan["code_cells"] == 6 and scan["executed"] == 5
    assert scan["cuda_cells"] == [{"cell": 1, "lines": ["device: cuda:0; 16-bit training: bf16"]},
                                  {"cell": 3, "lines": ["('nccl', 'cuda:0', 12.0)"]},
                                  {"cell": 4, "lines": ["RuntimeError: CUDA out of memory"]}]
    assert scan["gloo_fallback_cells"] == [2]
    assert scan["errors"] == [{"cell": 4, "error": "RuntimeError: CUDA out of memory"}]


# ---------------------------------------------------------------- world size, planning, the budget

def test_world_size_is_one_nccl_rank_per_gpu_in_powers_of_two():
    assert gpu_check.world_size_for(1)[0] == 1 and "refuses two ranks on one device" in gpu_check.world_size_for(1)[1]
    assert [gpu_check.world_size_for(n)[0] for n in (0, 2, 3, 4, 6, 8, 16)] == [1, 2, 2, 4, 4, 8, 16]
    assert [gpu_check.grid_shape(n) for n in (1, 2, 4, 8, 16, 32, 64)] == [
        (1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 2, 4), (1, 4, 4), (2, 4, 4), (4, 4, 4)]


def test_the_plan_orders_parts_and_names_the_rerun():
    steps, paths = gpu_check.plan(["notebooks", "tests", "lab09-fp8", "environment"], ["09", "01"])
    assert steps == ["lab09-fp8", "tests", "notebook-09", "notebook-01"]
    assert [p.name for p in paths] == ["09_fp8.ipynb", "01_memory_math.ipynb"]
    assert gpu_check.rerun_hint(steps[1:]) == "--parts tests,notebooks --notebooks 09,01"
    with pytest.raises(SystemExit, match="no solution notebook"):
        gpu_check.plan(["notebooks"], ["99"])


def test_a_part_that_outlives_its_time_is_ended_and_keeps_its_output():
    code = "import time; print('started', flush=True); time.sleep(120)"
    run = gpu_check.run_child([sys.executable, "-c", code], 2)
    assert run.timed_out and run.output[0] == "started" and run.seconds < 30
    done = gpu_check.run_child([sys.executable, "-c", "print('done')"], 60)
    assert not done.timed_out and done.returncode == 0 and done.output == ["done"]


# ---------------------------------------------------------------- reading the allocator's history (lab 01's part)

def test_a_builds_blocks_are_split_into_state_with_its_rounding_and_others_with_their_lines():
    frame = {"filename": "/x/lib/python3.12/site-packages/torch/optim/adamw.py", "line": 90, "name": "_init_group"}
    ours = {"filename": "/repo/benchmarks/gpu_check.py", "line": 7, "name": "_fp32_training_state"}

    def snapshot(*blocks):
        return {"segments": [{"address": 1000, "blocks": [dict(b) for b in blocks]}]}

    before = gpu_check._active_blocks(snapshot({"size": 512, "state": "active_allocated"}))
    after = gpu_check._active_blocks(snapshot(
        {"size": 512, "state": "active_allocated"},  # at 1000: alive before the build
        {"size": 2048, "state": "active_allocated", "requested_size": 2000},  # at 1512: a state tensor
        {"size": 4096, "state": "inactive"},  # at 3560: freed
        {"size": 8192, "state": "active_allocated", "requested_size": 8000, "frames": [frame, ours]},  # at 7656
        {"size": 1024, "state": "active_allocated"}))  # at 15848: no Python frame
    assert sorted(after) == [1000, 1512, 7656, 15848]
    state_blocks, extra = gpu_check._new_blocks(before, after, state={1512})
    assert state_blocks == {"blocks": 1, "bytes": 2048, "requested": 2000}
    assert [(b["bytes"], b["requested"]) for b in extra] == [(8192, 8000), (1024, 1024)]
    assert extra[0]["where"] == "adamw.py:90 _init_group (from gpu_check.py:7 _fp32_training_state)"
    assert extra[1]["where"].startswith("no Python frame")


# ---------------------------------------------------------------- --merge: a rerun keeps the other parts

def _evidence(devices, parts):
    return {"gpu": True, "command": "gpu_check.py --out x", "environment": {"devices": devices}, "parts": parts,
            "machine": {"date": "2026-11-27"}}


def test_a_merged_rerun_keeps_the_parts_it_does_not_redo_and_says_which_run_measured_each(tmp_path):
    h100 = [{"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.2}]
    saved = {"environment": {"status": "ok"}, "lab01-memory": {"status": "failed", "lines": ["old"]},
             "labs": {"status": "ok", "lines": ["kept"]}}
    (tmp_path / "gpu.json").write_text(json.dumps(_evidence(h100, saved)), encoding="utf-8")
    data = {"environment": {"devices": h100}, "parts": {"environment": {"status": "ok"}},
            "runs": [{"date": "later", "command": "gpu_check.py --merge --parts lab01-memory"}]}
    gpu_check.merge_into(data, tmp_path)
    assert [run["command"] for run in data["runs"]] == ["gpu_check.py --out x",
                                                        "gpu_check.py --merge --parts lab01-memory"]
    assert data["parts"]["labs"] == {"status": "ok", "lines": ["kept"], "run": 1}
    assert data["parts"]["environment"] == {"status": "ok"}  # this run's own
    data["parts"]["lab01-memory"] = {"status": "ok", "lines": ["new"], "run": 2, "seconds": 3.0}
    text = gpu_check.summarize(dict(data, status="measured"))
    assert "[labs] ok (run 1)" in text and "[lab01-memory] ok in 3.0 s (run 2)" in text and "old" not in text
    assert "run 2: later: gpu_check.py --merge --parts lab01-memory" in text


def test_merge_refuses_evidence_from_another_device_or_none(tmp_path):
    data = {"environment": {"devices": [{"name": "NVIDIA H100 80GB HBM3"}]}, "parts": {}, "runs": [{}]}
    with pytest.raises(SystemExit, match="needs GPU evidence"):
        gpu_check.merge_into(data, tmp_path)
    (tmp_path / "gpu.json").write_text(json.dumps(_evidence([{"name": "Tesla T4"}], {})), encoding="utf-8")
    with pytest.raises(SystemExit, match="measured on Tesla T4"):
        gpu_check.merge_into(data, tmp_path)


def test_the_workers_part_quotes_rank_0s_last_step_and_summary_of_every_topic():
    output = ["[ddp] step 1/2  loss 5.1  100 tokens/s  MFU 1.00%  10.0 ms", "[rank 0] {...}",
              "[ddp] step 2/2  loss 4.9  120 tokens/s  MFU 1.20%  9.0 ms", "[ddp] done: 2 steps, loss 5.1 → 4.9"]
    assert gpu_check.worker_lines(output, "ddp") == (output[2], output[3])
    assert gpu_check.worker_lines(output, "zero-3") == (None, None)
    targets = [target for _, target, _ in gpu_check.torchrun_workers(8, "/tmp/ckpt")]
    # one per topic with a torchrun worker: the chapter's targets
    chapter = (REPO / "course" / "cluster.md").read_text()
    assert len(set(targets)) == 9 and all(t.split(":")[0] in chapter or t in chapter for t in targets), targets
