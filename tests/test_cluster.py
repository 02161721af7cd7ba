"""The workers on a cluster, rehearsed on this machine: two torchrun agents as two nodes, restarts, and every
command of course/cluster.md.

Every launch here is a real torchrun: agents, a c10d rendezvous on a free port of 127.0.0.1, gloo ranks. Each
process is started in its own session and its whole group is killed when the test ends, whatever happened.
Launches are few and small (two cores): one two-agent launch runs every topic's worker in turn
(``tests/cluster_jobs.py``), and the 3D run of the chapter's rehearsal is the planner's printed line.
"""

import ast
import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import distlab
from cluster_jobs import SIZES
from distlab import fault_tolerance, moe, workload
from distlab.cli import main as distlab_main
from distlab.data.tokens import write_token_bin
from distlab.fault_tolerance import MetricsLog, list_checkpoints, read_checkpoint, verify_checkpoint
from distlab.flops import StepReport
from distlab.model import GPTConfig, synthetic_batch
from distlab.parallel3d import grid
from distlab.reference import train_reference
from distlab.torchrun import BAD_ARGUMENTS
from distlab.torchrun import main as torchrun_main

import processes

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CHAPTER = (REPO / "course" / "cluster.md").read_text(encoding="utf-8")
LAUNCH_TIMEOUT = 300  # seconds: a healthy launch takes a few (a lost node resumed: 26 s quiet, over 180 s once
#                       beside a CPU-heavy sweep); a hang is what this bounds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(**extra) -> dict:
    """This venv's ``torchrun`` and ``distlab`` first on PATH, the tests' driver importable."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    return env


@dataclasses.dataclass
class Launch:
    """One command started by :func:`started_together`: its process, its output, and the marker its processes carry."""

    proc: subprocess.Popen
    log: Path
    marker: str

    def kill(self) -> None:
        """SIGKILL every process this launch started (a torchrun agent and its workers: a node lost) at once, and
        again until none is left: an agent may start workers while its others die."""
        for _ in range(100):
            left = processes.started(self.marker)
            for process in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the command's own group, whatever its environment
            if not left:
                return
        raise AssertionError(f"processes of a launch outlive 100 SIGKILLs: {processes.started(self.marker)}")

    def output(self) -> str:
        return self.log.read_text()


@contextlib.contextmanager
def started_together(commands: list[list[str]], cwd: Path, env: dict | None = None):
    """Start every command at once (each in its own session, with a marker of its own); yield their :class:`Launch`.

    Every process a launch started is killed on the way out, whatever happened, so nothing outlives the test;
    they are found by their marker (``tests/processes.py``), since torchrun starts each worker in a session of
    its own.
    """
    launches = []
    try:
        for i, command in enumerate(commands):
            marker, log = processes.launch_marker(), cwd / f"launch{i}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen(command, cwd=cwd, env=dict(env or environment(), **{processes.MARKER: marker}),
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            launches.append(Launch(proc, log, marker))
        yield launches
    finally:
        for launch in launches:
            launch.kill()


def run_together(commands: list[list[str]], cwd: Path, env: dict | None = None) -> list[tuple[int, str]]:
    """Start every command at once, wait for all; ``(status, output)`` of each."""
    with started_together(commands, cwd, env) as launches:
        codes = [launch.proc.wait(timeout=LAUNCH_TIMEOUT) for launch in launches]
    return [(code, launch.output()) for code, launch in zip(codes, launches)]


def chapter_blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)\n```", CHAPTER, re.S)


# Each bash block of the chapter, found by a pattern; the test named beside it runs it.
CHAPTER_COMMANDS = {
    "distlab.tensor_parallel:train n_head=1": "test_bad_arguments_are_one_line_on_rank_0_and_status_2",
    r"\Adistlab plan --model lab[^\n]*\Z": "test_distlab_plan_prints_what_the_chapter_shows",
    "bash -n job.sbatch": "test_the_rehearsal_runs_the_planners_slurm_line_on_two_agents",
    "distlab plan --model 70B": "test_distlab_plan_prints_what_the_chapter_shows",
    "kill_rank=1 kill_step=5": "test_a_killed_rank_is_restarted_and_the_losses_continue_bit_for_bit",
    "--nproc-per-node=1": "test_a_killed_rank_is_restarted_and_the_losses_continue_bit_for_bit",
    "distlab.capstone:train": "test_the_capstone_worker_trains_under_torchrun_and_checkpoints",
    "--nnodes=1:2": "test_a_lost_node_shrinks_the_job_to_the_other_which_resumes_from_the_resharded_checkpoint",
}


def chapter_command(pattern: str) -> str:
    found = [block for block in chapter_blocks("bash") if re.search(pattern, block)]
    assert len(found) == 1, f"{len(found)} bash blocks of course/cluster.md match {pattern!r}"
    return found[0]


def chapter_output(start: str) -> str:
    found = [block for block in chapter_blocks("output") if block.startswith(start)]
    assert len(found) == 1, f"{len(found)} output blocks of course/cluster.md start with {start!r}"
    return found[0]


def test_every_command_of_the_chapter_is_run_by_a_test():
    for block in chapter_blocks("bash"):
        runners = {test for key, test in CHAPTER_COMMANDS.items() if re.search(key, block)}
        assert len(runners) == 1, f"no test (or several) runs this block of course/cluster.md:\n{block}"
        assert runners <= set(globals()), runners
    assert len(chapter_blocks("bash")) == len(CHAPTER_COMMANDS)


def test_the_readme_links_the_chapter():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Taking it to a cluster", 1)[1].split("\n## ", 1)[0]
    assert "(course/cluster.md)" in section


# ---------------------------------------------------------------- every worker across two agents

@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """``cluster_jobs:every_topic`` on two torchrun agents of two ranks each: the results and each agent's output."""
    cwd = tmp_path_factory.mktemp("two_nodes")
    port = free_port()
    agents = [[str(BIN / "torchrun"), "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes",
               "-m", "distlab.torchrun", "cluster_jobs:every_topic", "--json", str(cwd / "runs.json")]
              for node in (0, 1)]
    outcome = run_together(agents, cwd)
    for code, output in outcome:
        assert code == 0, output[-3000:]
    return json.loads((cwd / "runs.json").read_text()), [output for _, output in outcome]


def _cfg(sizes: dict, **extra) -> GPTConfig:
    return GPTConfig(**{k: sizes[k] for k in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len")}, **extra)


def _worst(a, b) -> float:
    assert len(a) == len(b) > 0, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_every_worker_across_two_agents_equals_one_process(two_nodes):
    runs, _ = two_nodes
    world = len(runs)
    assert world == 4

    def rank_mean(topic):  # data-parallel ranks report their own shard's loss; the batch's is their mean
        return [statistics.fmean(r[topic]["losses"][i] for r in runs) for i in range(len(runs[0][topic]["losses"]))]

    s = SIZES["ddp"]
    reference = workload.reference_run(_cfg(s), steps=s["steps"] + s["warmup"], batch_size=s["batch_size"] * world,
                                       optimizer="adamw", lr=1e-3)["losses"]
    assert _worst(rank_mean("ddp"), reference) < 1e-5
    assert _worst(rank_mean("zero3"), reference) < 1e-5  # the same job and sizes, ZeRO-3 over four ranks
    s = SIZES["pp"]
    cfg = _cfg(s, tied_embeddings=False)
    batches = [synthetic_batch(cfg, s["microbatches"] * s["rows"], k) for k in range(s["steps"] + s["warmup"])]
    assert _worst(runs[-1]["pp"]["losses"], train_reference(cfg, batches, lr=1e-3).losses) < 1e-5  # the last stage
    s = SIZES["3d"]
    reference = grid.reference_run(_cfg(s, tied_embeddings=False), s["batch_size"], s["steps"]).losses
    assert _worst(grid.replica_losses([r["3d"] for r in runs]), reference) < 1e-5
    for topic in ("tp", "cp"):  # every rank sees the whole batch: its heads (TP) or its tokens (CP)
        s = SIZES[topic]
        cfg = _cfg(s)
        batches = [synthetic_batch(cfg, s["batch_size"], k) for k in range(s["steps"] + s.get("warmup", 0))]
        reference = train_reference(cfg, batches, lr=1e-3).losses
        assert all(_worst(r[topic]["losses"], reference) < 1e-5 for r in runs), topic
    s = SIZES["moe"]
    config = moe.MoEConfig(num_experts=s["num_experts"], capacity_factor=None, balancing="bias")
    reference = moe.train_moe_reference(steps=s["steps"], cfg=_cfg(s), moe=config, batch_size=s["batch_size"] * world,
                                        world_size=world)["losses"]
    assert _worst(runs[0]["moe"]["losses"], reference) < 1e-5
    fp8 = runs[0]["fp8"]
    assert fp8["converted"] == 4 * SIZES["fp8"]["n_layer"] and all(map(torch.isfinite, torch.tensor(fp8["losses"])))


def test_the_3d_run_keeps_tp_inside_a_node_and_sends_pp_across(two_nodes):
    runs, outputs = two_nodes
    node = {r["3d"]["rank"]: r["3d"]["node"] for r in runs}
    assert sorted(node.values()) == [0, 0, 1, 1]  # two agents, two ranks each
    layout = grid.Grid(SIZES["3d"]["dp"], SIZES["3d"]["pp"], SIZES["3d"]["tp"])
    assert all(len({node[r] for r in group}) == 1 for group in layout.groups("tp"))
    assert all(len({node[r] for r in group}) == 2 for group in layout.groups("pp"))
    sent = grid.measured_bytes_per_axis([r["3d"] for r in runs])
    assert sent["tp"] > 0 and sent["pp"] > 0 and sent["dp"] == 0  # dp = 1: nothing to average
    printed = outputs[0] + outputs[1]
    assert re.search(r"tp: [\d,]+ bytes sent by rank 0 per step, groups inside one node", printed)
    assert re.search(r"pp: [\d,]+ bytes sent by rank 0 per step, groups cross a node boundary", printed)


def test_rank_0_prints_a_line_per_step_and_a_summary(two_nodes):
    runs, outputs = two_nodes
    rank0 = next(i for i, out in enumerate(outputs) if "[ddp] done:" in out)
    for tag, sizes in (("ddp", SIZES["ddp"]), ("zero-3", SIZES["zero3"]), ("pp-4", SIZES["pp"]),
                       ("tp-4", SIZES["tp"]), ("cp-4 ring", SIZES["cp"]), ("moe-4", SIZES["moe"]),
                       ("fp8 dp", SIZES["fp8"]), ("3d dp1·pp2·tp2", SIZES["3d"])):
        steps = sizes["steps"] + sizes.get("warmup", 0)
        lines = re.findall(rf"\[{re.escape(tag)}\] step (\d+)/{steps}  loss [\d.]+  [\d,]+ tokens/s  MFU [\d.]+%",
                           outputs[rank0])
        assert lines == [str(k) for k in range(1, steps + 1)], (tag, outputs[rank0][-2000:])
        assert re.search(rf"\[{re.escape(tag)}\] done: {steps} steps, .* MFU [\d.]+% of 4 × measured",
                         outputs[rank0]), tag
        assert f"[{tag}] step" not in outputs[1 - rank0]  # the other agent's ranks print no steps
    assert 0 < runs[0]["ddp"]["mfu"] < 1 and all(r["ddp"]["mfu"] is None for r in runs[1:])  # rank 0 measured


def test_the_capstone_worker_trains_under_torchrun_and_checkpoints(tmp_path):
    tokens = torch.randint(0, 500, (8192,), generator=torch.Generator().manual_seed(0))
    write_token_bin(tokens, tmp_path / "train.bin")
    (code, output), = run_together([["bash", "-c", chapter_command("distlab.capstone:train")]], tmp_path)
    assert code == 0, output[-3000:]
    steps = re.findall(r"\[capstone dp2·pp1·tp1\] step (\d+)/4  loss [\d.]+  [\d,]+ tokens/s", output)
    assert steps == ["1", "2", "3", "4"] and "[capstone dp2·pp1·tp1] done: 4 steps" in output, output[-3000:]
    assert [step for step, _ in list_checkpoints(tmp_path / "capstone_ckpt")] == [2, 4]
    results = [ast.literal_eval(line.split("] ", 1)[1]) for line in output.splitlines() if line.startswith("[rank ")]
    assert len(results) == 2 and results[0]["loss"] == results[1]["loss"]  # the global batch's loss, everywhere
    assert [r["steps"] for r in results] == [4, 4] and "losses" not in results[0]  # one short line per rank


# ---------------------------------------------------------------- arguments that cannot work

def test_bad_arguments_are_one_line_on_rank_0_and_status_2(tmp_path):
    (code, output), = run_together([["bash", "-c", chapter_command("distlab.tensor_parallel:train n_head=1")]],
                                   tmp_path)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [chapter_output("error:")], output[-2000:]  # one line, from rank 0 only
    # The first rank out exits 2 (torchrun's root cause); torchrun then stops the other with SIGTERM unless it
    # has exited 2 as well by then: which one depends on who is faster, never a hang.
    codes = [int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+) \(pid", output)]  # the agent's report
    root = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", output, re.DOTALL)
    assert code != 0 and root and root[1] == "2" and len(codes) == 2 and set(codes) <= {2, -15}, output[-2000:]


@pytest.mark.parametrize("argv,message", [
    (["--backend", "nccl", "distlab.data_parallel:train"], "--backend nccl needs a GPU per local rank"),
    (["distlab.data_parallel:train", "step=3"], "unexpected keyword argument 'step'"),
])
def test_what_is_wrong_before_the_process_group_exits_2(monkeypatch, capsys, argv, message):
    if "nccl" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: NCCL would start")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert torchrun_main(argv) == BAD_ARGUMENTS
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


# ---------------------------------------------------------------- the planner's launch lines

def _plan_output(block: str) -> str:
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:2] == ["distlab", "plan"], argv
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert distlab_main(argv[1:]) == 0
    return out.getvalue().rstrip("\n")


def test_distlab_plan_prints_what_the_chapter_shows(tmp_path):
    toy, big = chapter_output("lab GPT on"), chapter_output("70B on")
    printed = _plan_output(chapter_command(r"\Adistlab plan --model lab[^\n]*\Z"))
    assert printed == toy
    printed = _plan_output(chapter_command("distlab plan --model 70B"))
    assert printed.splitlines()[:4] == big.splitlines()
    assert "--nnodes=128 --nproc-per-node=8" in printed and "tp=8" in printed and "zero=1" in printed
    script = tmp_path / "job.sbatch"
    script.write_text(printed[printed.index("#!/bin/bash"):] + "\n")
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "#SBATCH --nodes=128" in printed and "srun --kill-on-bad-exit=1 torchrun" in printed


def test_the_rehearsal_runs_the_planners_slurm_line_on_two_agents(tmp_path):
    block = chapter_command("bash -n job.sbatch")
    (code, output), = run_together([["bash", "-e", "-c", block]], tmp_path, environment(MASTER_PORT=str(free_port())))
    assert code == 0, output[-3000:]
    cfg = GPTConfig(n_layer=4, d_model=64, n_head=4, vocab_size=256, seq_len=32, tied_embeddings=False)
    reference = grid.reference_run(cfg, batch_size=8, steps=2).losses
    printed = [float(x) for x in re.findall(r"\[3d dp1·pp2·tp2\] step \d/2  loss ([\d.]+)", output)]
    assert _worst(printed, reference) < 1e-4  # four printed decimals
    assert re.search(r"tp: [\d,]+ bytes .* inside one node", output)
    assert re.search(r"pp: [\d,]+ bytes .* cross a node boundary", output)


# ---------------------------------------------------------------- restarts

def _metrics(folder: Path) -> dict[int, dict[int, float]]:
    by_attempt: dict[int, dict[int, float]] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_attempt.setdefault(record["attempt"], {})[record["step"]] = record["loss"]
    return by_attempt


def _train_arguments(job: str) -> tuple[dict, GPTConfig]:
    """The ``key=value`` arguments of a ``distlab.fault_tolerance:train`` command, and the GPT they describe."""
    given = dict(arg.split("=", 1) for arg in shlex.split(job.replace("\\\n", " ")) if re.match(r"\w+=", arg))
    sizes = {**{k: v.default for k, v in inspect.signature(fault_tolerance.train).parameters.items()}, **given}
    return given, GPTConfig(**{k: int(sizes[k]) for k in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len")})


@pytest.fixture(scope="module")
def ranks2():
    yield distlab.Ranks.shared(2, backend="gloo", threads=1)  # one thread per rank, as torchrun's
    distlab.shutdown()


def test_a_killed_rank_is_restarted_and_the_losses_continue_bit_for_bit(tmp_path, ranks2):
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    killed.mkdir()
    job = chapter_command("kill_rank=1 kill_step=5")
    (code, output), = run_together([["bash", "-c", job]], killed, environment(OMP_NUM_THREADS="1"))
    assert code == 0, output[-3000:]
    # the uninterrupted run: the same job and sizes on two notebook ranks, to step 11
    sizes, cfg = _train_arguments(job)
    ranks2.run(fault_tolerance.resumable_train, args=(str(whole), 11, int(sizes["save_every"])),
               kwargs=dict(cfg=cfg, batch_size=int(sizes["batch_size"])), show_output=False)
    assert "attempt 1: resuming from step_00000003" in output and "exitcode: -9" in output  # SIGKILL
    attempts, reference = _metrics(killed / "ckpt"), _metrics(whole)[0]
    assert sorted(attempts) == [0, 1] and sorted(attempts[0]) == [0, 1, 2, 3, 4]
    assert sorted(attempts[1]) == list(range(3, 9))
    for attempt in attempts.values():
        for step, loss in attempt.items():
            assert loss == reference[step], f"step {step}: {loss!r} after the restart, {reference[step]!r} without"
    (code, output), = run_together([["bash", "-c", chapter_command("--nproc-per-node=1")]], killed)
    assert code == 0 and "attempt 0: resuming from step_00000009" in output, output[-3000:]
    resharded = {step: loss for step, loss in _metrics(killed / "ckpt")[0].items() if step >= 9}
    assert sorted(resharded) == [9, 10]
    assert _worst([resharded[9], resharded[10]], [reference[9], reference[10]]) < 1e-5


# ---------------------------------------------------------------- elastic: a node lost

def _hosts(launch: Launch, port: int) -> bool:
    """Whether a process of ``launch`` listens on ``port``: the agent that hosts the c10d rendezvous store."""
    for process in processes.started(launch.marker):
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in process.net_connections("tcp")):
                return True
    return False


def _wait_for_step(metrics: Path, step: int, launches: list[Launch]) -> None:
    """Until rank 0 has logged ``step`` of the first attempt (every agent still running), or fail with the logs."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while time.monotonic() < deadline:
        if metrics.is_file() and any(r["attempt"] == 0 and r["step"] >= step for r in MetricsLog(metrics).read()):
            return
        ended = [launch for launch in launches if launch.proc.poll() is not None]
        assert not ended, f"an agent ended before step {step}:\n" + "\n".join(e.output()[-3000:] for e in ended)
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {LAUNCH_TIMEOUT} s")


def test_a_lost_node_shrinks_the_job_to_the_other_which_resumes_from_the_resharded_checkpoint(tmp_path, ranks2):
    """The chapter's elastic line (``--nnodes=1:2``) on two agents of two ranks; one agent and its ranks are killed.

    The other agent's ranks fail in their next collective; the agent restarts (``--max-restarts``), waits at the
    rendezvous until the dead node's heartbeat expires, closes the round alone (one node is ``MIN``) and starts its
    two workers, which load the checkpoint the four wrote. What must be equal, and why: the job keeps its global
    batch (``batch_size``) and splits it over the ranks it has, so the two ranks train on the same sequences, in
    the same order (the data position is in the checkpoint), with the same optimizer state, as the four would have.
    Only the order of the arithmetic changes — the loss and the gradient are the mean of two per-rank means
    instead of four — so the losses after the shrink equal, bit for bit, those of a two-rank run started from the
    same checkpoint (the run below, on notebook ranks), and an uninterrupted four-rank run's only to rounding
    (checked on the steps both attempts trained). The state the two loaded equals the checkpoint tensor for tensor.
    The agent that hosts the c10d rendezvous store (the first to bind the port, on one machine where both match
    the endpoint) must survive: the other is the one killed.
    """
    job = chapter_command("--nnodes=1:2")
    sizes, cfg = _train_arguments(job)
    steps, save_every, ckpt = int(sizes["steps"]), int(sizes["save_every"]), tmp_path / sizes["ckpt_dir"]
    port = free_port()
    env = environment(HEAD_NODE="127.0.0.1", MASTER_PORT=str(port))
    with started_together([["bash", "-c", job]] * 2, tmp_path, env) as nodes:
        _wait_for_step(ckpt / "metrics.jsonl", 0, nodes)  # training: the rendezvous is done
        hosts = [_hosts(node, port) for node in nodes]
        assert sorted(hosts) == [False, True], hosts
        kept, lost = (nodes[0], nodes[1]) if hosts[0] else (nodes[1], nodes[0])
        _wait_for_step(ckpt / "metrics.jsonl", save_every, nodes)  # the first checkpoint is committed
        lost.kill()
        code = kept.proc.wait(timeout=LAUNCH_TIMEOUT)
        output = kept.output()
    assert code == 0 and lost.proc.wait() == -signal.SIGKILL, output[-3000:]
    printed = lost.output() + output
    # the workers' own lines: four ranks on two nodes first, then two on one
    assert "[resumable dp-2] attempt 0" not in printed, "the agents met in two rounds (one joined more than " \
        "last_call_timeout after the other): the first round trained on two ranks alone\n" + printed[-3000:]
    assert "[resumable dp-4] attempt 0: starting fresh" in printed, printed[-3000:]
    resumed = re.search(r"\[resumable dp-2\] attempt 1: resuming from (step_(\d{8})) \(written by 4 ranks, "
                        r"resharded to 2\)", output)
    assert resumed, output[-3000:]
    ends = [ast.literal_eval(line.split("] ", 1)[1]) for line in output.splitlines()
            if re.match(r"\[rank \d\] \{", line)]  # what each worker returned, printed by distlab.torchrun
    assert [(r["rank"], r["world_size"], r["attempt"]) for r in ends] == [(0, 2, 1), (1, 2, 1)], ends
    start = int(resumed[2])
    # the step it resumed from is the last checkpoint the four ranks committed
    by_four = [step for step, path in list_checkpoints(ckpt) if verify_checkpoint(path)["world_size"] == 4]
    assert by_four and start == max(by_four) == ends[0]["start"], (start, by_four)
    # what the two ranks loaded is the checkpoint, tensor for tensor
    loaded = torch.load(tmp_path / sizes["resumed_state"], weights_only=False)
    stored = read_checkpoint(ckpt / resumed[1])
    assert loaded.keys() == stored.keys() and loaded["train.step"] == start
    for key, value in stored.items():
        same = torch.equal(loaded[key], value) if isinstance(value, torch.Tensor) else loaded[key] == value
        assert same, f"{key} after loading differs from the checkpoint's"
    # after the shrink: a two-rank run from the same checkpoint, bit for bit
    reference = tmp_path / "from_the_checkpoint"
    shutil.copytree(ckpt / resumed[1], reference / resumed[1])
    ranks2.run(fault_tolerance.resumable_train, args=(str(reference), steps, save_every),
               kwargs=dict(cfg=cfg, batch_size=int(sizes["batch_size"])), show_output=False)
    attempts, two = _metrics(ckpt), _metrics(reference)[0]
    assert sorted(attempts) == [0, 1] and sorted(attempts[1]) == sorted(two) == list(range(start, steps))
    for step, loss in attempts[1].items():
        assert loss == two[step], f"step {step}: {loss!r} after the shrink, {two[step]!r} from the checkpoint on 2"
    both = sorted(set(attempts[0]) & set(attempts[1]))  # trained by the four before the kill, and again by the two
    if both:  # none when the kill came right after a checkpoint
        assert _worst([attempts[0][k] for k in both], [attempts[1][k] for k in both]) < 1e-5


def test_a_step_faster_than_the_peak_is_reported_unfaithful_not_explained():
    report = StepReport("ddp", 2, tokens_per_step=1000, flops_per_token=6e6, peak_flops=1e9, peak_name="stated",
                        devices=1, every=1)
    assert report.line(0, 5.0, 1.0).endswith("MFU 600.00%  1000.0 ms  (unfaithful: above 100% of the peak)")
    assert "unfaithful" not in report.line(1, 5.0, 10.0)  # 60%
