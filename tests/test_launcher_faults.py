"""The launcher's failure promises under the faults a real notebook produces (issue: blame the right rank,
interrupt-proof cleanup, process trees, warm-job isolation, children of ranks, resources, bad arguments).

Every test that starts ranks also proves that none outlives it (the ``no_leftover_ranks`` fixture). Timeouts
are short but the assertions never depend on how fast a loaded machine is: they check what was reported.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.runtime import diagnose, reaper
from distlab.runtime import group as rank_group
from distlab.runtime.interrupts import interrupts_deferred

from processes import alive

pytestmark = [pytest.mark.timeout(480), pytest.mark.usefixtures("no_leftover_ranks")]  # hang guards, not speed limits
FAST = dict(collective_timeout=2)  # for jobs that are meant to hang: they fail after 2 s
PATIENT = dict(collective_timeout=15)  # for jobs that must succeed on a loaded machine
BOTH = dict(collective_timeout=4)  # a group whose first job hangs and whose next job must succeed


# ---------------------------------------------------------------- blame the right rank, name the real cause

def test_a_p2p_deadlock_is_a_deadlock_not_a_closed_connection():
    def both_receive_first():
        dist.recv(torch.empty(4), 1 - dist.get_rank())

    with pytest.raises(distlab.CollectiveTimeout) as info:
        distlab.launch(both_receive_first, 2, **FAST)
    error = info.value
    assert error.kind == "deadlock" and set(error.waiting) == {0, 1}
    assert str(error).startswith("every rank waits to receive (rank 0 waits for rank 1, rank 1 waits for rank 0) "
                                 "and none is sending"), str(error)
    assert "GLHF" not in str(error).splitlines()[0]
    assert error.hint == "start each send before the matching receive (dist.isend), then wait on both."
    assert "rank 0 was blocked at" in str(error) and "dist.recv(torch.empty(4), 1 - dist.get_rank())" in str(error)


def test_sends_to_the_wrong_neighbour_are_named():
    def send_left_receive_from_left():
        rank, n = dist.get_rank(), dist.get_world_size()
        outgoing = dist.isend(torch.ones(4), (rank - 1) % n)  # should go right
        dist.recv(torch.empty(4), (rank - 1) % n)
        outgoing.wait()

    with pytest.raises(distlab.CollectiveTimeout) as info:
        distlab.launch(send_left_receive_from_left, 3, **FAST)
    first = str(info.value).splitlines()[0]
    assert info.value.kind == "deadlock"
    assert "check each send's destination against the receiver's source" in first, first
    assert "send to (rank + 1) % N and receive from (rank - 1) % N" in info.value.hint


def test_one_rank_of_eight_that_never_joins_is_a_missing_call():
    def seven_of_eight():
        if dist.get_rank() != 7:
            dist.all_reduce(torch.ones(3))

    with pytest.raises(distlab.CollectiveTimeout) as info:
        distlab.launch(seven_of_eight, 8, **FAST)
    error = info.value
    assert error.kind == "missing" and 7 not in error.waiting and error.waiting, str(error)
    assert "rank(s) 7 finished their job without calling it" in str(error).splitlines()[0]


def test_a_slow_peer_is_waited_for_not_blamed():
    def slow_rank_one():
        if dist.get_rank() == 1:
            time.sleep(6)  # a long step, three collective timeouts long: rank 0 waits in all_reduce meanwhile
        t = torch.ones(3)
        dist.all_reduce(t)
        return t.sum().item()

    assert list(distlab.launch(slow_rank_one, 2, **FAST)) == [6.0, 6.0]


def test_a_peer_that_never_stops_computing_is_reported_as_such(monkeypatch):
    monkeypatch.setattr(rank_group, "SLOW_RANK_PATIENCE", 3.0)

    def endless_rank_one():
        if dist.get_rank() == 1:
            time.sleep(60)  # stands for an endless loop before the collective
        dist.all_reduce(torch.ones(3))

    with pytest.raises(distlab.CollectiveTimeout) as info:
        distlab.launch(endless_rank_one, 2, collective_timeout=0.5)
    first = str(info.value).splitlines()[0]
    assert info.value.kind == "slow", str(info.value)
    assert first.startswith("rank 0 waited 3 s in all_reduce while rank(s) 1 kept computing"), first
    assert "rank 0 was blocked at" in str(info.value) and "in endless_rank_one" in str(info.value)


@pytest.mark.parametrize("shape, dtype, described", [
    ((3, 5), (torch.float32, torch.float32), "all_reduce(5 elements, float32)"),
    ((3, 3), (torch.float32, torch.float64), "all_reduce(3 elements, float64)"),
])
def test_collectives_that_differ_in_size_or_dtype_fail_clearly_before_gloo_aborts(shape, dtype, described):
    def mismatched(shape, dtype):
        rank = dist.get_rank()
        dist.all_reduce(torch.ones(3))  # a first, matching call
        dist.all_reduce(torch.ones(shape[rank], dtype=dtype[rank]))

    with pytest.raises(distlab.RankFailed) as info:
        distlab.launch(mismatched, 2, args=(shape, dtype), **FAST)
    text = str(info.value)
    assert info.value.exc_type == "CollectiveMismatch", text
    assert "collective call #2 on the default group differs between ranks" in text and described in text
    assert "dist.all_reduce(torch.ones(shape[rank], dtype=dtype[rank]))" in text  # the user's line


def test_a_gloo_abort_shows_gloos_line_and_the_users_call_not_a_fault_dump(capfd):
    def mismatch_on_a_subgroup():  # subgroups are not fingerprinted: gloo itself aborts
        group = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(3 if dist.get_rank() == 0 else 7), group=group)

    with pytest.raises(distlab.RankCrashed) as info:
        distlab.launch(mismatch_on_a_subgroup, 2, **FAST)
    printed = capfd.readouterr().err
    assert "Extension modules" not in printed and "most recent call first" not in printed
    text = str(info.value)
    assert info.value.rank == 0 and "SIGABRT" in text, text
    assert "Received data size doesn't match expected size" in text, text
    assert "in mismatch_on_a_subgroup: dist.all_reduce(torch.ones(3 if" in text, text


def test_abort_details_are_read_from_a_fault_dump():
    user = Path(__file__).resolve()
    gloo = ("[enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 8 vs 4. "
            "Received data size doesn't match expected size.")
    stderr = textwrap.dedent(f"""\
        terminate called after throwing an instance of 'gloo::EnforceNotMet'
          what():  {gloo}
        Fatal Python error: Aborted

        Thread 0x00007f (most recent call first):
          File "{os.path.dirname(threading.__file__)}/threading.py", line 982 in run

        Thread 0x00008f (most recent call first):
          File "{os.path.dirname(torch.__file__)}/distributed/distributed_c10d.py", line 3252 in all_reduce
          File "{os.path.dirname(diagnose.__file__)}/comm.py", line 175 in counted
          File "{user}", line 1 in my_job
          File "{os.path.dirname(diagnose.__file__)}/rank.py", line 99 in _run_job

        Extension modules: numpy, torch._C (total: 2)
        """)
    cause, frame = diagnose.abort_details(stderr)
    assert cause.startswith("[enforce fail at pair.cc:456]") and "Received data size" in cause
    assert frame.startswith(f'File "{user}", line 1, in my_job')
    assert diagnose.without_fault_dump(stderr).splitlines() == stderr.splitlines()[:2]


def test_a_return_value_that_cannot_be_rebuilt_names_the_rank_and_keeps_warm_ranks():
    class Unbuildable:
        def __reduce__(self):
            return (int, ("not a number",))

    def returns_unbuildable():
        return Unbuildable() if dist.get_rank() == 1 else 0

    with distlab.Ranks(2, **PATIENT) as ranks:
        before = list(ranks.run(os.getpid))
        with pytest.raises(distlab.ReturnValueError, match=r"^rank 1's return value could not be rebuilt here "
                                                           r"\(ValueError: invalid literal"):
            ranks.run(returns_unbuildable)
        assert list(ranks.run(os.getpid)) == before  # the ranks were healthy: no restart


def test_classification_of_rank_reports():
    base = {"exc_type": "RuntimeError", "frames": [], "hidden_frames": 0, "peer": -1}
    assert diagnose.classify(dict(base, in_op=None, message="bad shard")) == "raised"
    assert diagnose.classify(dict(base, in_op="recv", message="pair.cc:553] Connection closed by peer")) == "peer_gone"
    assert diagnose.classify(dict(base, in_op="recv", message="Timed out waiting 2000ms for recv")) == "timeout"
    assert diagnose.classify(dict(base, in_op="all_reduce", message="Received data size mismatch")) == "op_error"


def test_unmatched_communication_is_found_in_the_ledgers():
    balanced = [{"collectives": {"world": 2}, "sent": {1: 16}, "received": {1: 8}},
                {"collectives": {"world": 2}, "sent": {0: 8}, "received": {0: 16}}]
    assert diagnose.unmatched_communication(balanced) == []
    unbalanced = [{"collectives": {"world": 3, "0,1": 1}, "sent": {1: 16}, "received": {}},
                  {"collectives": {"world": 2}, "sent": {}, "received": {}}]
    assert diagnose.unmatched_communication(unbalanced) == [
        "collective calls on the group of ranks 0,1 differ (rank 0: 1, rank 1: 0)",
        "collective calls on the default group differ (rank 0: 3, rank 1: 2)",
        "rank 0 sent 16 bytes to rank 1 that it never received"]


# ---------------------------------------------------------------- warm jobs are isolated

def test_an_async_op_left_unmatched_fails_its_own_job_not_the_next():
    def unmatched_async():
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1), async_op=True)  # never waited, never matched
        return dist.get_rank()

    def rank_sum():
        t = torch.tensor([100.0 * dist.get_rank()])
        dist.all_reduce(t)
        return t.item()

    with distlab.Ranks(2, **BOTH) as ranks:
        with pytest.raises(distlab.CollectiveTimeout) as info:
            ranks.run(unmatched_async)
        text = str(info.value)
        assert info.value.kind == "missing"
        assert text.startswith("rank 0 timed out after 4 s waiting in wait(all_reduce)")
        assert "rank 0 was blocked at the end of its job, which returned with this async op in flight" in text
        assert list(ranks.run(rank_sum)) == [100.0, 100.0]


def test_async_ops_matched_but_not_waited_are_drained():
    def fire_and_forget():
        t = torch.ones(3)
        dist.all_reduce(t, async_op=True)
        return dist.get_rank()

    with distlab.Ranks(2, **PATIENT) as ranks:
        pids = list(ranks.run(os.getpid))
        assert list(ranks.run(fire_and_forget)) == [0, 1]
        assert list(ranks.run(os.getpid)) == pids  # nothing was left over: the same group serves on


def test_a_send_nobody_received_is_reported_and_the_next_job_starts_clean():
    def stray_send():
        if dist.get_rank() == 0:
            dist.send(torch.full((4,), 7.0), 1)  # rank 1 never receives it

    def exchange():
        rank = dist.get_rank()
        received = torch.zeros(4)
        if rank == 0:
            dist.send(torch.full((4,), 1.0), 1)
        else:
            dist.recv(received, 0)
        return received.sum().item()

    with distlab.Ranks(2, **BOTH) as ranks:
        with pytest.raises(distlab.LaunchError) as info:
            ranks.run(stray_send)
        assert isinstance(info.value, (distlab.UnmatchedCommunication, distlab.CollectiveTimeout)), info.value
        if isinstance(info.value, distlab.UnmatchedCommunication):
            assert "rank 0 sent 16 bytes to rank 1 that it never received" in str(info.value)
        assert list(ranks.run(exchange)) == [0.0, 4.0]  # not the stray 28.0


def test_process_state_does_not_leak_between_warm_jobs():
    def change_everything():
        import random

        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        torch.set_num_threads(1 + torch.get_num_threads())
        os.environ["DISTLAB_LEAK"] = "1"
        random.seed(123)
        sys.stdout = sys.stderr

    def observe():
        import random

        return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads(),
                "DISTLAB_LEAK" in os.environ, random.random(), sys.stdout is sys.__stdout__ or sys.stdout.fileno() == 1)

    with distlab.Ranks(2, **PATIENT) as ranks:
        fresh = ranks.run(observe)
        ranks.run(change_everything)
        assert ranks.run(observe) == fresh
        assert fresh[0][:4] == (torch.float32, True, fresh[0][2], False)


def test_repeated_failures_then_jobs_never_surface_a_broken_pipe():
    with distlab.Ranks(3, **PATIENT) as ranks:
        for attempt in range(4):
            with pytest.raises(distlab.RankFailed):
                ranks.run(lambda: 1 / 0 if dist.get_rank() == attempt % 3 else dist.barrier())
            assert list(ranks.run(dist.get_rank)) == [0, 1, 2]


# ---------------------------------------------------------------- children of ranks

def test_dataloader_workers_and_a_pool_run_inside_ranks():
    def with_workers():
        from multiprocessing import get_context

        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2)
        total = sum(batch[0].sum().item() for batch in loader)
        with get_context("fork").Pool(2) as pool:
            squares = pool.map(abs, [-1, -2, -3])
        return total, squares

    assert list(distlab.launch(with_workers, 2, **PATIENT)) == [(28.0, [1, 2, 3])] * 2


def test_a_rank_s_children_die_with_the_launch(tmp_path):
    def start_child_then_fail(path):
        child = subprocess.Popen(["sleep", "300"])
        with open(os.path.join(path, f"child{dist.get_rank()}"), "w") as f:
            f.write(str(child.pid))
        dist.barrier()
        raise RuntimeError("failing with a child alive")

    with pytest.raises(distlab.RankFailed, match="failing with a child alive"):
        distlab.launch(start_child_then_fail, 2, args=(str(tmp_path),), **PATIENT)
    assert not _survivors(tmp_path, "child")


# ---------------------------------------------------------------- interrupts and the parent's death

@pytest.fixture
def scripts():
    """Launching processes a test starts; killed at teardown whatever the test's outcome (their reaper then
    ends their ranks), so a failed assertion never leaves ranks behind for the next test."""
    started = []
    yield lambda *args, **kwargs: started.append(subprocess.Popen(*args, **kwargs)) or started[-1]
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    while _SCRIPT_TEMPS:
        shutil.rmtree(_SCRIPT_TEMPS.pop(), ignore_errors=True)


# The scripts' own temporary folders, made short: the forkserver's socket lives inside one, and pytest's
# tmp_path under a fresh machine's $TMPDIR is longer than a Unix socket's path may be.
_SCRIPT_TEMPS: list[str] = []


def _script(tmp_path: Path, body: str) -> list[str]:
    """A launching process that records every rank's pid under ``tmp_path``, with a temporary folder of its own."""
    _SCRIPT_TEMPS.append(tempfile.mkdtemp(prefix="dl-"))
    code = textwrap.dedent(f"""
        import os, subprocess, sys, time, tempfile
        os.environ["TMPDIR"] = {_SCRIPT_TEMPS[-1]!r}
        tempfile.tempdir = None
        import torch.distributed as dist, distlab
        def mark(kind="rank", pid=None):
            open(os.path.join({str(tmp_path)!r}, f"{{kind}}{{pid or os.getpid()}}"), "w").close()
    """) + textwrap.dedent(body)
    return [sys.executable, "-c", code]


def _survivors(tmp_path: Path, prefix: str = "rank") -> list[int]:
    pids = []
    for p in tmp_path.glob(f"{prefix}*"):
        text = p.read_text().strip()
        pids.append(int(text) if text else int(p.name[len(prefix):]))
    deadline = time.monotonic() + 30  # the reaper needs a moment of CPU on a loaded machine
    while time.monotonic() < deadline:
        left = [pid for pid in pids if psutil.pid_exists(pid) and alive(psutil.Process(pid))]
        if not left:
            return []
        time.sleep(0.1)
    return left


def _wait_for(tmp_path: Path, count: int, prefix: str = "rank") -> None:
    deadline = time.monotonic() + 240  # a fresh interpreter imports torch twice (itself and its forkserver)
    while len(list(tmp_path.glob(f"{prefix}*"))) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(tmp_path.glob(f"{prefix}*"))) >= count, "the ranks never started"


@pytest.mark.parametrize("how", ["launch", "warm"])
def test_two_interrupts_in_a_row_still_end_every_rank_and_never_return_stale_values(tmp_path, how, scripts):
    proc = scripts(_script(tmp_path, f"""
        def work():
            mark()
            time.sleep(60)
        ranks = distlab.Ranks(3)
        print("launching", flush=True)
        try:
            ranks.run(work) if {how == "warm"!r} else distlab.launch(work, 3)
        except KeyboardInterrupt as error:
            print(type(error).__name__, flush=True)
        if {how == "warm"!r}:
            print("next", list(ranks.run(dist.get_rank)), flush=True)
            ranks.close()
        print("temp files", [f for f in os.listdir(os.environ["TMPDIR"]) if f.startswith("distlab-")], flush=True)
    """), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "launching"
    _wait_for(tmp_path, 3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # the user pressed stop twice
    out, err = proc.communicate(timeout=180)  # a loaded machine exits a torch process slowly
    assert "LaunchInterrupted" in out, out + err
    if how == "warm":
        assert "next [0, 1, 2]" in out, out + err
    assert "temp files []" in out, out + err
    assert not _survivors(tmp_path)


def test_an_interrupt_during_a_rank_start_arrives_once_the_rank_is_recorded():
    """The step from fork to "the launcher knows this pid" is never cut: an interrupt inside it waits for its end.
    (Cut, the forkserver has forked a rank that no close() and no reaper would ever end.)"""
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # Python runs a signal handler at the next bytecode: the press has been seen
            steps.append("recorded")
    assert steps == ["recorded"]


def test_the_reaper_kills_a_rank_that_does_not_yet_lead_a_group_but_never_a_stranger():
    """A launcher killed right after forking a rank: that rank has not yet called setpgid, so the reaper's
    killpg finds no group, and the rank is killed by its pid, as a child of the reaper's own forkserver. A pid
    that is not (a process of this test's) is left alone."""
    ctx = rank_group.forkserver_context()
    lifeline_end, lifeline = ctx.Pipe(duplex=False)
    watcher = ctx.Process(target=reaper.main, args=(lifeline_end,), daemon=True)
    watcher.start()
    lifeline_end.close()
    rank_like = ctx.Process(target=time.sleep, args=(120,))  # a forkserver child that never leads a group
    rank_like.start()
    stranger = subprocess.Popen(["sleep", "120"])
    try:
        lifeline.send(rank_like.pid)
        lifeline.send(stranger.pid)
        lifeline.close()  # the launcher is gone: end-of-file without the closing None
        rank_like.join(timeout=60)
        watcher.join(timeout=60)
        assert rank_like.exitcode == -signal.SIGKILL, rank_like.exitcode
        assert stranger.poll() is None, "the reaper killed a process that is not a rank"
    finally:
        stranger.kill()
        stranger.wait(timeout=30)
        rank_like.kill()


@pytest.mark.parametrize("spin", ["gil", "sleep"])
def test_kill_9_of_the_launcher_ends_ranks_even_while_they_hold_the_gil(tmp_path, spin, scripts):
    proc = scripts(_script(tmp_path, f"""
        def work():
            mark()
            mark("child", subprocess.Popen(["sleep", "300"]).pid)
            if {spin == "gil"!r}:
                sum(range(3 * 10**10))  # pure Python: never releases the GIL
            time.sleep(300)
        distlab.launch(work, 2)
    """))
    _wait_for(tmp_path, 2)
    _wait_for(tmp_path, 2, "child")
    proc.kill()  # no chance to clean up: the reaper must
    proc.wait(timeout=60)
    assert not _survivors(tmp_path), "ranks outlived their launcher"
    assert not _survivors(tmp_path, "child"), "a rank's child outlived the launcher"
    temp, deadline = _SCRIPT_TEMPS[-1], time.monotonic() + 60  # the reaper removes the group's output folder last
    while (left := [f for f in os.listdir(temp) if f.startswith("distlab-")]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"the ranks' output folder outlived their launcher: {left}"


def test_a_script_that_leaves_warm_ranks_open_still_exits_and_ends_them(tmp_path, scripts):
    proc = scripts(_script(tmp_path, """
        def work():
            mark()
        ranks = distlab.Ranks(2)
        ranks.run(work)
        print("done", flush=True)
    """), stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=180)  # would hang: multiprocessing joins non-daemonic children at exit
    assert out.strip() == "done" and proc.returncode == 0
    assert not _survivors(tmp_path)


# ---------------------------------------------------------------- resources and bad arguments

def test_a_temporary_folder_too_long_for_the_forkservers_socket_is_named_in_one_line(tmp_path):
    deep = tmp_path.joinpath(*["a" * 20] * 5)
    deep.mkdir(parents=True)
    done = subprocess.run([sys.executable, "-c", "import distlab; distlab.launch(lambda: 1, 2)"],
                          env={**os.environ, "TMPDIR": str(deep)}, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("OSError: the temporary folder") and str(deep) in last and "export TMPDIR=/tmp" in last, \
        done.stderr[-2000:]
    assert "AF_UNIX path too long" not in done.stderr


def test_failed_launches_release_their_fds_and_threads():
    me = psutil.Process()
    kept = []
    for _ in range(3):  # warm up: the forkserver and resource tracker start once
        try:
            distlab.launch(lambda: 1 / 0, 2, **FAST)
        except distlab.RankFailed as error:
            kept.append(error)
    fds, threads = me.num_fds(), me.num_threads()
    for _ in range(15):
        try:
            distlab.launch(lambda: 1 / 0, 2, **FAST)
        except distlab.RankFailed as error:
            kept.append(error)  # the exceptions stay alive, as in a notebook's Out/last_traceback
    assert me.num_fds() <= fds + 4, (fds, me.num_fds())
    assert me.num_threads() <= threads + 2, (threads, me.num_threads())


@pytest.mark.parametrize("kwargs, message", [
    (dict(timeout=0), "timeout must be None or a positive number of seconds, got 0"),
    (dict(timeout=-1.5), "timeout must be None or a positive number"),
    (dict(timeout=float("nan")), "timeout must be None or a positive number"),
    (dict(collective_timeout=0), "collective_timeout must be a positive number of seconds, got 0"),
    (dict(collective_timeout=True), "collective_timeout must be a positive number"),
    (dict(threads=0), "threads must be None or a positive integer"),
    (dict(args=5),
     r"args must be a tuple of positional arguments, got int 5 \(for one argument write args=\(value,\)\)"),
    (dict(kwargs=[1]), "kwargs must be a dict"),
])
def test_nonsense_arguments_are_refused_before_any_process_starts(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        distlab.launch(lambda *a: None, 2, **kwargs)
    with pytest.raises((ValueError, TypeError)):
        distlab.Ranks(2, **{k: v for k, v in kwargs.items() if k in ("collective_timeout", "threads")}).run(
            lambda *a: None, **{k: v for k, v in kwargs.items() if k in ("args", "kwargs", "timeout")})
