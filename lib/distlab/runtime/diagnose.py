"""Why a launch failed, in words a student can act on: root-cause classification and report text.

A failing job produces many symptoms at once: the rank that raised, peers that lost their connection
because of it, ranks still blocked in a collective. Which of them is the cause, and what each rank was
doing, is decided here from a :class:`RankStates` (plain data the rank group copied out of its pipes,
shared status array and capture files) by pure functions. Process handling stays in
:mod:`~distlab.runtime.group`, so every report can be read, and tested, without starting a rank.
"""

from __future__ import annotations

import linecache
import re
import signal
from dataclasses import dataclass
from typing import Mapping

from distlab.runtime.errors import (
    CollectiveTimeout,
    LaunchError,
    LaunchInterrupted,
    LaunchTimeout,
    RankCrashed,
    RankFailed,
    ReturnValueError,
    UnmatchedCommunication,
)
from distlab.runtime.frames import is_library_frame


@dataclass(frozen=True)
class RankStates:
    """What the launcher knew of every rank at one moment."""

    world_size: int
    collective_timeout: float  # seconds all running ranks may sit blocked before it is a deadlock
    patience: float  # seconds a rank may wait for a peer that is still computing
    pending: frozenset[int]  # ranks that have not reported on the job
    errors: Mapping[int, dict]  # rank -> its account of what it raised (rank.describe_error, plus "in_flight")
    crashed: Mapping[int, int | None]  # rank -> exit code, for ranks that ended without a report
    in_op: Mapping[int, tuple[str, float, int]]  # rank -> (op, seconds inside it, peer) for ranks inside an op
    sending_to: Mapping[int, int]  # rank -> the peer of its oldest isend still in flight, per the status array
    stderr: Mapping[int, str]  # crashed rank -> its stderr


# ---------------------------------------------------------------- root causes

_PEER_GONE = re.compile(r"connection closed by peer|connection reset|broken pipe|econnreset|epipe|"
                        r"socket closed|communicator was aborted|remote worker crash", re.IGNORECASE)


def classify(info: dict) -> str:
    """raised (outside any op: the user's error), timeout, peer_gone (a consequence) or op_error."""
    if not info.get("in_op"):
        return "raised"
    message = info["message"]
    if _PEER_GONE.search(message):
        return "peer_gone"
    if _looks_like_timeout(message):
        return "timeout"
    return "op_error"


def has_root_cause(errors: Mapping[int, dict], crashed: Mapping[int, int | None]) -> bool:
    """A crash or an error that is not merely a lost connection: the other ranks' reports need not be awaited."""
    return bool(crashed) or any(classify(info) != "peer_gone" for info in errors.values())


def group_intact(errors, crashed, pending, ledgers) -> bool:
    """Every rank reported, each failure was raised outside any op with nothing in flight, and the ledgers balance."""
    return (not pending and not crashed
            and all(not info.get("in_op") and not info.get("in_flight") for info in errors.values())
            and not unmatched_communication(ledgers))


def unmatched_communication(ledgers: list[dict]) -> list[str]:
    """What the ranks' ledgers say was left unmatched: collective counts per group, p2p bytes per pair."""
    problems = []
    n = len(ledgers)
    keys = sorted({key for ledger in ledgers for key in ledger.get("collectives", {})})
    for key in keys:
        members = range(n) if key == "world" else [int(x) for x in key.split(",")]
        counts = {r: ledgers[r].get("collectives", {}).get(key, 0) for r in members}
        if len(set(counts.values())) > 1:
            group = "the default group" if key == "world" else f"the group of ranks {key}"
            problems.append(f"collective calls on {group} differ ("
                            + ", ".join(f"rank {r}: {c}" for r, c in counts.items()) + ")")
    for dst in range(n):
        received = ledgers[dst].get("received", {})
        if -1 in received:  # receives from any source: only the total can be checked
            sent = sum(ledgers[src].get("sent", {}).get(dst, 0) for src in range(n))
            if sent != sum(received.values()):
                problems.append(f"{sent} bytes were sent to rank {dst}, which received {sum(received.values())}")
            continue
        for src in range(n):
            sent, got = ledgers[src].get("sent", {}).get(dst, 0), received.get(src, 0)
            if sent > got:
                problems.append(f"rank {src} sent {sent - got} bytes to rank {dst} that it never received")
            elif got > sent:
                problems.append(f"rank {dst} received {got - sent} bytes from rank {src} that it never sent")
    return problems


def stuck_ranks(in_op: Mapping[int, tuple[str, float, int]], pending, quiet_for: float, collective_timeout: float,
                patience: float) -> dict[int, tuple[str, float, int]]:
    """The blocked ranks the watchdog ends: all of them when every running rank has been blocked for
    ``collective_timeout`` (nobody left to unblock them), or those that waited ``patience`` for a
    peer still computing.

    A rank that finished may have just completed the collective its blocked peer is still
    inside: on a loaded machine the peer can need a while to be scheduled and return. So the
    running ranks are judged only once ``collective_timeout`` has also passed since the last
    rank finished (``quiet_for``), never at the moment a peer is released.
    """
    blocked = {r: in_op[r] for r in pending if r in in_op}
    if not blocked:
        return {}
    if len(blocked) == len(pending):
        if all(secs > collective_timeout for _, secs, _ in blocked.values()) and quiet_for > collective_timeout:
            return blocked
        return {}
    return {r: b for r, b in blocked.items() if b[1] > patience}


# ---------------------------------------------------------------- reports

def failure(states: RankStates, ledgers: list[dict]) -> LaunchError:
    """The error that names the root cause among the ranks' errors and crashes."""
    intact = group_intact(states.errors, states.crashed, states.pending, ledgers)
    error = _root_cause(states, intact)
    if isinstance(error, RankFailed):
        error.group_intact = intact
    return error


def _root_cause(states: RankStates, intact: bool = False) -> LaunchError:
    errors, crashed = states.errors, states.crashed
    kinds = {r: classify(info) for r, info in errors.items()}
    raised = sorted(r for r in errors if kinds[r] == "raised")
    if raised:  # an error in the user's own code is the root cause of whatever followed
        return _rank_failed(states, raised, intact)
    if crashed:
        r = min(crashed)
        return RankCrashed(_crash_message(states, r), r, crashed[r])
    op_errors = sorted(r for r in errors if kinds[r] == "op_error")
    if op_errors:
        return _rank_failed(states, op_errors)
    if any(kind == "timeout" for kind in kinds.values()):
        waiting = {r: (info["in_op"], info.get("peer", -1), kinds[r] == "timeout") for r, info in errors.items()}
        return timeout_report(states, {}, waiting)
    return _rank_failed(states, sorted(errors))


def _rank_failed(states: RankStates, candidates: list[int], intact: bool = False) -> RankFailed:
    """``intact``: the other ranks are clean and a warm group keeps them (and a ``%%ranks`` cell's names)."""
    errors = states.errors
    first = candidates[0]
    info = errors[first]
    same = [r for r in sorted(errors) if errors[r]["exc_type"] == info["exc_type"]
            and errors[r]["message"] == info["message"]]
    who = f"rank {first}" if len(same) == 1 else f"ranks {ranks_text(same)}"
    where = f" in {_op_text(info['in_op'], info.get('peer', -1))}" if info["in_op"] else ""
    headline = f"{who} raised {info['exc_type']}{where}: {first_line(info['message'])}"
    context = _whereabouts(states, set(range(states.world_size)) - set(same),
                           heading="Other ranks" if intact else "Other ranks, all now stopped")
    return RankFailed("\n".join(filter(None, [headline, context])) + "\n\n" + _format_traceback(first, info),
                      first, info["exc_type"], same)


def timeout_report(states: RankStates, stuck: Mapping[int, tuple[str, float, int]],
                   waiting: Mapping[int, tuple[str, int, bool]] | None = None,
                   frames: Mapping[int, str] | None = None) -> CollectiveTimeout:
    """Why ranks waited: a point-to-point deadlock, mismatched collectives, a missing call or a slow rank.

    ``waiting`` holds ranks whose op failed ((op, peer, timed_out)); ``stuck`` ranks the
    watchdog found blocked past the timeout ((op, seconds, peer)); pending ranks are still
    blocked or computing. ``frames`` is the user's line each stuck rank was blocked at.
    """
    waiting = waiting or {}
    errors, crashed, pending = states.errors, states.crashed, states.pending
    blocked: dict[int, tuple[str, int]] = {r: (op, peer) for r, (op, peer, _) in waiting.items()}
    blocked.update({r: (states.in_op[r][0], states.in_op[r][2]) for r in pending if r in states.in_op})
    blocked.update({r: (op, peer) for r, (op, _, peer) in stuck.items()})
    timed_out = sorted(r for r, (_, _, out) in waiting.items() if out) or sorted(stuck)
    computing = sorted(r for r in pending if r not in blocked)
    finished = sorted(set(range(states.world_size)) - set(pending) - set(errors) - set(crashed))
    seconds = f"{states.collective_timeout:g} s"
    lead = timed_out[0] if timed_out else min(blocked)
    op, peer = blocked[lead]
    ops = {_base_op(o) for o, _ in blocked.values()}
    p2p = ops <= {"send", "isend", "recv", "irecv"}
    who = f"rank {lead}" if len(timed_out) <= 1 else f"ranks {ranks_text(timed_out)}"
    if p2p and not computing:
        kind = "deadlock"
        receiving = all(_base_op(o) in ("recv", "irecv") for o, _ in blocked.values())
        sending = all(_base_op(o) in ("send", "isend") for o, _ in blocked.values())
        pairs = ", ".join(f"rank {r} {_op_text(o, p, short=True)}" for r, (o, p) in sorted(blocked.items()))
        sends_elsewhere = {r: to for r, info in errors.items()
                           for kind_of_op, to in info.get("in_flight", ()) if kind_of_op == "isend" and to >= 0}
        sends_elsewhere.update({r: to for r, to in states.sending_to.items() if r in pending})
        sends_elsewhere = sorted(sends_elsewhere.items())
        hint = ("each rank must send to the rank that receives from it, in the same step: in a ring, send to "
                "(rank + 1) % N and receive from (rank - 1) % N.")
        if receiving and sends_elsewhere:
            went = ", ".join(f"rank {r} to rank {p}" for r, p in sends_elsewhere)
            headline = (f"every rank waits to receive ({pairs}) but the sends went elsewhere ({went}): the "
                        f"sends and receives do not pair up; check each send's destination against the "
                        f"receiver's source (timed out after {seconds}).")
        elif receiving and not finished:
            headline = (f"every rank waits to receive ({pairs}) and none is sending: a point-to-point deadlock "
                        f"(timed out after {seconds}).")
            hint = "start each send before the matching receive (dist.isend), then wait on both."
        elif sending and not finished:
            headline = (f"every rank waits in a send ({pairs}) and none is receiving: a point-to-point deadlock "
                        f"(timed out after {seconds}).")
            hint = ("a blocking dist.send waits for a receiver that is itself sending: post dist.isend and "
                    "dist.irecv, then wait on both.")
        else:
            done = f"; rank(s) {ranks_text(finished)} finished their job" if finished else ""
            headline = (f"a point-to-point op never completed ({pairs}{done}): no rank is sending or receiving "
                        f"what another waits for; check each send's destination against the receiver's "
                        f"source (timed out after {seconds}).")
    elif len(ops) > 1:
        kind = "mismatch"
        hint = "every rank must make the same collective calls in the same order."
        calls = ", ".join(f"rank {r} in {_op_text(o, p)}" for r, (o, p) in sorted(blocked.items()))
        headline = (f"mismatched collectives: {calls}; every rank must make the same collective calls in the "
                    f"same order (timed out after {seconds}).")
    elif computing:
        kind = "slow"
        hint = "look for a collective those ranks skip, or an endless loop before it."
        headline = (f"{who} waited {states.patience:g} s in {_op_text(op, peer)} while rank(s) "
                    f"{ranks_text(computing)} kept computing (not in any collective): either they never reach "
                    f"that call, or their work before it takes longer than {states.patience:g} s.")
    elif finished:
        kind = "missing"
        hint = "every rank must make the same collective calls in the same order."
        headline = (f"{who} timed out after {seconds} waiting in {_op_text(op, peer)}: rank(s) "
                    f"{ranks_text(finished)} finished their job without calling it (a missing collective call; "
                    f"every rank must make the same collective calls in the same order).")
    else:
        kind, hint = "hang", "check that every rank makes this call with the same arguments."
        headline = f"{who} timed out after {seconds} waiting in {_op_text(op, peer)}, which never completed."
    others = _whereabouts(states, set(range(states.world_size)),
                          heading="What each rank was doing, all now stopped", stuck=stuck)
    lines = "".join(f"\n  rank {r} was blocked at {frame}" for r, frame in sorted((frames or {}).items()))
    trace = ("\n\n" + _format_traceback(lead, errors[lead])) if lead in errors else lines
    return CollectiveTimeout(f"{headline}\n{others}{trace}", {r: o for r, (o, _) in sorted(blocked.items())},
                             kind, hint)


def interrupted(world_size: int, states: RankStates | None = None,
                frames: Mapping[int, str] | None = None) -> LaunchInterrupted:
    """The stop button ended a launch: with ``states``, what each rank was doing then, and the user's line each
    rank still running was at (``frames``), which finds an endless loop the watchdog cannot call a hang."""
    lines = [f"launch interrupted: all {world_size} ranks were stopped; the next launch starts fresh"]
    if states is not None:
        lines.append(_whereabouts(states, range(world_size), heading="When stopped"))
    lines += [f"  rank {r} was at {frame}" for r, frame in sorted((frames or {}).items())]
    return LaunchInterrupted("\n".join(lines))


def job_timeout(states: RankStates, timeout: float) -> LaunchTimeout:
    """The job ran past ``timeout``: what each rank was doing when it was stopped."""
    return LaunchTimeout(f"the job ran longer than timeout={timeout:g} s; all ranks were stopped.\n"
                         + _whereabouts(states, range(states.world_size), heading="When stopped"))


def return_value_error(unrebuilt: Mapping[int, BaseException]) -> ReturnValueError:
    """Ranks whose return values failed to unpickle here, with why."""
    return ReturnValueError("; ".join(
        f"rank {r}'s return value could not be rebuilt here ({type(why).__name__}: {first_line(str(why))})"
        for r, why in sorted(unrebuilt.items()))
        + ". Return plain values (numbers, lists, dicts, tensors) or objects of classes this process can import.")


def unmatched_error(problems: list[str]) -> UnmatchedCommunication:
    """The job returned, but :func:`unmatched_communication` found these problems in the ledgers."""
    return UnmatchedCommunication(
        "the job returned, but its communication did not match across ranks: " + "; ".join(problems)
        + ". Every send needs a matching receive and every collective a call on each rank of its group; "
          "the ranks were restarted so that the next job starts clean.")


def _crash_message(states: RankStates, r: int) -> str:
    how = describe_exit(states.crashed[r])
    stderr = states.stderr.get(r, "")
    during = f" in {_op_text(states.in_op[r][0], states.in_op[r][2])}" if r in states.in_op else ""
    cause, frame = abort_details(stderr)
    lines = [f"rank {r} exited without finishing its job ({how}){during}."]
    if frame:
        lines.append(f"  the call it was in: {frame}")
    if cause:
        lines.append(f"  cause: {cause}")
    lines.append(_whereabouts(states, set(range(states.world_size)) - {r}))
    if not cause:
        tail = without_fault_dump(stderr).strip().splitlines()[-8:]
        if tail:
            lines.append("its last stderr lines:\n  " + "\n  ".join(tail))
    return "\n".join(line for line in lines if line)


def _whereabouts(states: RankStates, ranks, heading: str = "Other ranks, all now stopped",
                 stuck: Mapping[int, tuple[str, float, int]] | None = None) -> str:
    """One line on what each of ``ranks`` was doing when the launch was ended."""
    stuck = stuck or {}
    parts = []
    for r in sorted(ranks):
        if r in states.crashed:
            parts.append(f"rank {r}: exited ({describe_exit(states.crashed[r])})")
        elif r in states.errors:
            info = states.errors[r]
            kind = classify(info)
            where = f" in {_op_text(info['in_op'], info.get('peer', -1))}" if info["in_op"] else ""
            if kind == "timeout":
                parts.append(f"rank {r}: timed out{where}")
            elif kind == "peer_gone":
                parts.append(f"rank {r}: lost its connection{where} when a peer stopped")
            else:
                parts.append(f"rank {r}: raised {info['exc_type']}{where}")
        elif r in stuck:
            op, secs, peer = stuck[r]
            parts.append(f"rank {r}: blocked {secs:.0f} s in {_op_text(op, peer)}")
        elif r in states.pending and r in states.in_op:
            op, secs, peer = states.in_op[r]
            parts.append(f"rank {r}: waiting in {_op_text(op, peer)} for {secs:.1f} s")
        elif r in states.pending:
            parts.append(f"rank {r}: still running (not in a collective)")
        else:
            parts.append(f"rank {r}: finished its job")
    return (f"{heading}: " + "; ".join(parts) + ".") if parts else ""


# ---------------------------------------------------------------- a rank's stderr and faulthandler dumps

_DUMP_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


def abort_details(stderr: str) -> tuple[str | None, str | None]:
    """From a crashed rank's stderr: the C++ error line (gloo's own words) and the user's call in the fault dump."""
    cause = None
    for line in stderr.splitlines():
        stripped = line.strip()
        if stripped.startswith("what():"):
            cause = stripped[len("what():"):].strip()
            break
        if stripped.startswith("Fatal Python error:") and cause is None:
            cause = stripped
    block = []
    for line in stderr.splitlines():
        if "(most recent call first)" in line:
            block = []
        match = _DUMP_FRAME.match(line)
        if match:
            block.append(match)
        if any(m["fn"] == "_run_job" for m in block) and not line.strip():
            break  # the thread that ran the job: its frames are complete
    for match in block:
        if is_library_frame(match["file"]):
            continue
        source = linecache.getline(match["file"], int(match["line"])).strip()
        return cause, f'File "{match["file"]}", line {match["line"]}, in {match["fn"]}' + (
            f": {source}" if source else "")
    return cause, None


def blocked_at(dump: str) -> str | None:
    """Where a blocked rank waits, from the faulthandler dump it wrote on request; None until the dump is complete.

    Empty when the dump names no line of the user's.
    """
    if "_drain_async_ops" in dump:
        return "the end of its job, which returned with this async op in flight (never waited on)"
    if "_run_job" in dump:
        return abort_details(dump)[1] or ""
    return None


def without_fault_dump(stderr: str) -> str:
    """A crashed rank's stderr minus faulthandler's thread dump (summarised in the error instead)."""
    kept, skipping = [], False
    for line in stderr.splitlines(keepends=True):
        if line.startswith("Fatal Python error:"):
            skipping = True
        if not skipping:
            kept.append(line)
        elif line.startswith("Extension modules:"):
            skipping = False
    return "".join(kept)


# ---------------------------------------------------------------- wording

def first_line(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0] if lines else ""


def _base_op(op: str) -> str:
    return op[5:-1] if op.startswith("wait(") else op


def _op_text(op: str, peer: int = -1, short: bool = False) -> str:
    """``recv from rank 1`` / ``waits for rank 1``, ``isend to rank 2`` / ``sends to rank 2``; collectives by name."""
    base = _base_op(op)
    if base in ("recv", "irecv"):
        source = f"rank {peer}" if peer >= 0 else "any rank"
        return f"waits for {source}" if short else f"{op} from {source}"
    if base in ("send", "isend") and peer >= 0:
        return f"sends to rank {peer}" if short else f"{op} to rank {peer}"
    return op


def _looks_like_timeout(message: str) -> bool:
    text = message.lower()
    return "timed out" in text or "timeout" in text


def describe_exit(code: int | None) -> str:
    """A process's exit code in words: ``exit code 1``, ``killed by signal SIGKILL``."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def ranks_text(ranks) -> str:
    """Ranks in words: a run of three or more as ``0-3``, else listed, ``0, 2``."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _format_traceback(rank: int, info: dict) -> str:
    """The rank's traceback, with source lines filled in from this kernel's cells."""
    out = [f"Traceback of rank {rank} (most recent call last):"]
    for filename, lineno, name, line in info["frames"]:
        out.append(f'  File "{filename}", line {lineno}, in {name}')
        line = line or linecache.getline(filename, lineno).strip()
        if line:
            out.append(f"    {line}")
    if info["hidden_frames"]:
        out.append(f"  ... {info['hidden_frames']} frame(s) inside torch and distlab not shown")
    out.append(f"{info['exc_type']}: {info['message']}".rstrip())
    return "\n".join(out)
