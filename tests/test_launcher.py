"""The launcher on real gloo ranks: results, output, accounting, and every way a launch can go wrong."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.runtime.comm import WIRE_BYTES

from processes import alive

pytestmark = [pytest.mark.timeout(480), pytest.mark.usefixtures("no_leftover_ranks")]  # hang guards, not speed limits
FAST = dict(collective_timeout=3)


def test_values_come_back_in_rank_order_with_args_and_closures():
    offset = 100  # captured by value: the function is shipped with cloudpickle

    def work(scale, *, bias):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return (dist.get_rank(), dist.get_world_size(), t.item() * scale + bias + offset)

    run = distlab.launch(work, 4, args=(2,), kwargs={"bias": 1}, **FAST)
    assert list(run) == [(r, 4, 6 * 2 + 1 + 100) for r in range(4)]
    assert run.backend == "gloo" and run.world_size == 4


def test_output_is_grouped_by_rank_in_rank_order(capfd):
    def chatty():
        import time as t

        t.sleep(0.05 * (3 - dist.get_rank()))  # rank 3 prints first
        print(f"hello from {dist.get_rank()}")
        print(f"warning from {dist.get_rank()}", file=sys.stderr)

    run = distlab.launch(chatty, 4, **FAST)
    out, err = capfd.readouterr()
    assert out.splitlines() == [f"[rank {r}] hello from {r}" for r in range(4)]
    assert err.splitlines() == [f"[rank {r}] warning from {r}" for r in range(4)]
    assert run.stdout == [f"hello from {r}\n" for r in range(4)]


def test_world_size_one_runs():
    assert list(distlab.launch(lambda: dist.get_world_size(), 1, **FAST)) == [1]


def test_distlab_backend_sets_the_backend_of_launches_that_name_none(monkeypatch):
    monkeypatch.setenv("DISTLAB_BACKEND", "gloo")
    assert distlab.launch(lambda: dist.get_backend(), 2, **FAST) == ["gloo", "gloo"]
    monkeypatch.setenv("DISTLAB_BACKEND", "nccl")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend='nccl' needs one CUDA GPU per rank"):
            distlab.launch(lambda: None, 2)
    monkeypatch.setenv("DISTLAB_BACKEND", "mpi")
    with pytest.raises(ValueError, match="DISTLAB_BACKEND must be 'auto', 'gloo' or 'nccl', got 'mpi'"):
        distlab.launch(lambda: None, 2)


@pytest.mark.parametrize("world_size", [0, -2, 2.5, "4", 1000])
def test_bad_world_size_is_refused_before_any_process_starts(world_size):
    with pytest.raises(ValueError, match="world_size"):
        distlab.launch(lambda: None, world_size)


def test_nccl_without_gpus_is_refused_clearly():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    with pytest.raises(ValueError, match=r"backend='nccl' needs one CUDA GPU per rank.*gloo"):
        distlab.launch(lambda: None, 2, backend="nccl")
    with pytest.raises(ValueError, match="backend must be"):
        distlab.launch(lambda: None, 2, backend="mpi")


def _stamp(path) -> None:
    """Inside a rank: record when the interesting moment happened (the clock is shared by every process)."""
    with open(path, "w") as f:
        f.write(repr(time.time()))


def _seconds_since(path) -> float:
    return time.time() - float(open(path).read())


# The moment a rank fails is stamped, and the launch must end long before the 60 s collective timeout: it
# never waits for the timeout. Generous bounds, measured from the failure, hold on a loaded machine.
PATIENT = dict(collective_timeout=60)


def test_a_rank_that_raises_names_the_rank_and_shows_its_traceback(tmp_path):
    def work(stamp):
        if dist.get_rank() == 2:
            _stamp(stamp)
            raise ValueError("bad shard on rank two")
        dist.all_reduce(torch.ones(3))

    with pytest.raises(distlab.RankFailed) as info:
        distlab.launch(work, 4, args=(str(tmp_path / "t"),), **PATIENT)
    assert _seconds_since(tmp_path / "t") < 30
    error = info.value
    assert error.rank == 2 and error.exc_type == "ValueError" and error.failed_ranks == [2]
    text = str(error)
    assert text.startswith("rank 2 raised ValueError: bad shard on rank two")
    assert "Traceback of rank 2" in text and 'raise ValueError("bad shard on rank two")' in text
    assert re.search(r"rank 0: (waiting in all_reduce|raised|still running)", text)  # whereabouts reported
    assert "distributed_c10d.py" not in text  # torch internals are summarised, not dumped


def test_same_error_on_every_rank_is_reported_once():
    def work():
        raise NotImplementedError("Exercise 9.9: replace this line with your solution")

    with pytest.raises(distlab.RankFailed) as info:
        distlab.launch(work, 3, **FAST)
    assert info.value.failed_ranks == [0, 1, 2]
    assert str(info.value).startswith("ranks 0-2 raised NotImplementedError: Exercise 9.9")


@pytest.mark.parametrize("how, expected", [("exit", "exit code 7"), ("segfault", "SIGSEGV")])
def test_a_rank_that_dies_hard_ends_the_launch(how, expected, tmp_path):
    def work(how, stamp):
        if dist.get_rank() == 1:
            _stamp(stamp)
            if how == "exit":
                os._exit(7)
            import ctypes

            ctypes.string_at(0)  # segmentation fault
        dist.all_reduce(torch.ones(3))

    with pytest.raises(distlab.RankCrashed) as info:
        distlab.launch(work, 4, args=(how, str(tmp_path / "t")), **PATIENT)
    assert _seconds_since(tmp_path / "t") < 30
    assert info.value.rank == 1
    assert "rank 1 exited without finishing its job" in str(info.value) and expected in str(info.value)


def test_a_mismatched_collective_times_out_and_says_who_waited_where(tmp_path):
    def work(stamp):
        if dist.get_rank() == 0:
            _stamp(stamp)
            dist.all_reduce(torch.ones(3))  # the others never join
        return dist.get_rank()

    with pytest.raises(distlab.CollectiveTimeout) as info:
        distlab.launch(work, 3, args=(str(tmp_path / "t"),), **FAST)
    assert _seconds_since(tmp_path / "t") < 3 + 30
    text = str(info.value)
    assert text.startswith("rank 0 timed out after 3 s waiting in all_reduce")
    assert "rank 1: finished its job" in text and "rank 2: finished its job" in text
    assert info.value.waiting == {0: "all_reduce"}


def test_the_job_timeout_stops_a_rank_that_never_communicates(tmp_path):
    def work(stamp):
        if dist.get_rank() == 1:
            _stamp(stamp)
            time.sleep(60)

    with pytest.raises(distlab.LaunchTimeout, match=r"(?s)timeout=1 s.*rank 1: still running"):
        distlab.launch(work, 2, args=(str(tmp_path / "t"),), timeout=1, **FAST)
    assert _seconds_since(tmp_path / "t") < 1 + 30


def test_next_launch_works_after_every_kind_of_failure():
    with pytest.raises(distlab.RankFailed):
        distlab.launch(lambda: 1 / 0, 2, **FAST)
    assert list(distlab.launch(lambda: dist.get_rank(), 2, **FAST)) == [0, 1]


def test_warm_ranks_survive_a_clean_failure_and_restart_after_a_dirty_one():
    def pid():
        return os.getpid()

    def one_raises_while_others_wait():
        if dist.get_rank() == 1:
            raise ValueError("rank 1 gives up")
        dist.all_reduce(torch.ones(2))

    with distlab.Ranks(3, collective_timeout=3) as ranks:
        first = list(ranks.run(pid))
        assert list(ranks.run(pid)) == first  # the same processes served both jobs
        with pytest.raises(distlab.RankFailed) as clean:
            ranks.run(lambda: 1 / 0)  # every rank raises outside any communication
        assert clean.value.group_intact and list(ranks.run(pid)) == first
        with pytest.raises(distlab.RankFailed) as dirty:
            ranks.run(one_raises_while_others_wait)  # ranks 0 and 2 are left inside all_reduce
        assert not dirty.value.group_intact
        after = list(ranks.run(pid))
        assert set(after).isdisjoint(first)  # a failure mid-communication costs the group; a new one serves
        assert ranks.run(lambda: torch.rand(1).item()) == ranks.run(lambda: torch.rand(1).item())


def test_warm_launches_share_one_group_until_shutdown():
    first = list(distlab.launch(os.getpid, 2, warm=True))
    assert list(distlab.launch(os.getpid, 2, warm=True)) == first
    distlab.shutdown()
    assert list(distlab.launch(os.getpid, 2, warm=True)) != first
    distlab.shutdown()


def test_communication_accounting_matches_what_was_sent():
    def work():
        rank, n = dist.get_rank(), dist.get_world_size()
        dist.all_reduce(torch.ones(1000))  # 4000 bytes
        out = torch.empty(4 * n)
        dist.all_gather_into_tensor(out, torch.ones(4))  # gathered output: 16·n bytes
        if rank == 0:
            dist.send(torch.ones(10, dtype=torch.float64), 1)
        elif rank == 1:
            dist.recv(torch.empty(10, dtype=torch.float64), 0)
        handle = dist.all_reduce(torch.ones(250), async_op=True)
        handle.wait()

    run = distlab.launch(work, 4, **FAST)
    for log in run.comm:
        assert log.ops["all_reduce"].calls == 2
        assert log.ops["all_reduce"].payload_bytes == 4000 + 1000
        assert log.ops["all_reduce"].wire_bytes == pytest.approx(2 * 3 / 4 * 5000)
        assert log.ops["all_gather_into_tensor"].payload_bytes == 64
    assert run.comm[0].ops["send"].wire_bytes == 80 and "send" not in run.comm[1].ops
    assert run.comm[1].ops["recv"].payload_bytes == 80 and run.comm[1].ops["recv"].wire_bytes == 0
    assert set(WIRE_BYTES) >= {"all_reduce", "reduce_scatter_tensor", "all_to_all_single", "isend"}
    assert "all_reduce" in run.comm_table()


def test_timeline_records_user_spans_and_async_collectives():
    def work():
        with distlab.span("compute"):
            sum(i * i for i in range(20000))
        handle = dist.all_reduce(torch.ones(10), async_op=True)
        with distlab.span("more compute"):
            sum(i * i for i in range(20000))
        handle.wait()

    run = distlab.launch(work, 2, **FAST)
    for rank in range(2):
        labels = [s.label for s in run.spans if s.rank == rank]
        assert labels[0] == "compute" and "all_reduce" in labels and "more compute" in labels
        comm_span = next(s for s in run.spans if s.rank == rank and s.kind == "comm")
        assert 0 <= comm_span.start <= comm_span.end


@pytest.mark.parametrize("when", ["starting", "running"])
def test_interrupting_a_launch_stops_every_rank(tmp_path, when):
    script = textwrap.dedent(f"""
        import os, time, distlab
        def work():
            open(os.path.join({str(tmp_path)!r}, f"rank{{os.getpid()}}"), "w").close()
            time.sleep(60)
        print("launching", flush=True)
        try:
            distlab.launch(work, 3)
        except KeyboardInterrupt as error:
            print(type(error).__name__, error, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _interrupt(proc, tmp_path, when)
    finally:
        if proc.poll() is None:
            proc.kill()


def _interrupt(proc, tmp_path, when):
    assert proc.stdout.readline().strip() == "launching"
    time.sleep(0.3)  # inside launch(): ranks take over a second to start on this machine
    deadline = time.monotonic() + 240
    while when == "running" and len(list(tmp_path.glob("rank*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)  # a loaded machine exits a torch process slowly
    assert "LaunchInterrupted launch interrupted: all 3 ranks were stopped" in out, err
    pids = [int(p.name[4:]) for p in tmp_path.glob("rank*")]
    assert not [pid for pid in pids if psutil.pid_exists(pid) and alive(psutil.Process(pid))]


def test_the_same_worker_runs_under_torchrun(tmp_path):
    (tmp_path / "worker.py").write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        def total(scale=1):
            t = torch.ones(2) * (dist.get_rank() + 1) * scale
            dist.all_reduce(t)
            return t.sum().item()
    """))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    result = subprocess.run([torchrun, "--nproc-per-node=2", "-m", "distlab.torchrun", "worker:total", "scale=3"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=90,
                            env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[rank 0] 18.0", "[rank 1] 18.0"]


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@needs_two_gpus
def test_auto_backend_uses_nccl_with_one_gpu_per_rank():
    def work():
        device = distlab.device()
        t = torch.ones(4, device=device) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return dist.get_backend(), str(device), t.sum().item()

    run = distlab.launch(work, 2, **FAST)
    assert list(run) == [("nccl", "cuda:0", 12.0), ("nccl", "cuda:1", 12.0)]
    assert run.comm[0].ops["all_reduce"].payload_bytes == 16


@needs_two_gpus
def test_a_failing_nccl_rank_ends_the_launch():
    def work():
        if dist.get_rank() == 1:
            raise ValueError("boom on GPU rank 1")
        dist.all_reduce(torch.ones(4, device=distlab.device()))

    with pytest.raises(distlab.RankFailed, match="rank 1 raised ValueError"):
        distlab.launch(work, 2, **FAST)


def test_auto_backend_with_fewer_gpus_than_ranks_runs_gloo_and_says_so_once(monkeypatch, capsys):
    import torch

    from distlab.runtime import launch as launcher
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(launcher, "_SAID_CPU_FALLBACK", set())
    assert launcher.resolve_backend("auto", 4) == "gloo"
    assert launcher.resolve_backend("auto", 4) == "gloo"
    assert capsys.readouterr().err == ("distlab: 4 ranks but 1 GPU(s): running gloo ranks on the CPU "
                                       "(NCCL needs one GPU per rank)\n")
    assert launcher.resolve_backend("auto", 1) == "nccl"
