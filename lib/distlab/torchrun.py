"""Run a distlab worker function under torchrun, on one node or many; and the command lines that do it.

    torchrun --nproc-per-node=4 -m distlab.torchrun distlab.data_parallel:train steps=20
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        -m distlab.torchrun distlab.data_parallel:train steps=100

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; this module initialises the
process group the way ``distlab.launch`` does (NCCL with one GPU per local
rank when there are GPUs, else gloo; ``--backend`` to choose), turns on
communication accounting, calls the function with the ``key=value`` arguments,
and prints every rank's return value on rank 0 in rank order (``--json FILE``
also writes them there). A function that takes ``log_every`` gets ``log_every=1``
unless told otherwise: rank 0 prints one line per step (loss, tokens/s, MFU) and
a summary, which is what one watches on a cluster.

Bad arguments — a keyword the function does not take, or a ``ValueError`` it raises
before its first collective (a degree that does not divide the world size, TP
larger than the number of heads), or NCCL asked for on a machine without GPUs —
are one line on rank 0 and exit status 2 on every rank: each rank finds the same
fault before it waits for another, so none hangs.

:func:`torchrun_command` and :func:`slurm_script` write the launch lines for a job;
:func:`plan_main` (``distlab plan``) prints them for the 3D layout the planner chooses.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import json
import os
import shlex
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from distlab.model import GPTConfig
from distlab.parallel3d.planner import ModelShape, h100_cluster, plan
from distlab.runtime import comm

BAD_ARGUMENTS = 2  # the exit status of a job started with arguments that cannot work


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string


def parse_arguments(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m distlab.torchrun", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="module:function to run on every rank")
    p.add_argument("kwargs", nargs="*", metavar="key=value", help="keyword arguments (Python literals)")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout in seconds")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="auto: NCCL when this node has a GPU for every local rank, else gloo")
    p.add_argument("--json", metavar="FILE", help="rank 0 writes every rank's return value to FILE (JSON)")
    args = p.parse_args(argv)
    if ":" not in args.target:
        p.error(f"target must look like module:function, got {args.target!r}")
    kwargs = {}
    for item in args.kwargs:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            p.error(f"arguments must look like key=value, got {item!r}")
        kwargs[key] = _value(text)
    return args, kwargs


def _refuse(message: str) -> int:
    """Bad arguments: one line on rank 0 (every rank finds the same fault), exit status 2 everywhere."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return BAD_ARGUMENTS


def choose_backend(asked: str, local_rank: int) -> str:
    """``nccl`` when asked (or, for ``auto``, when this node has a GPU for ``local_rank``), else ``gloo``."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if asked == "nccl" and gpus <= local_rank:
        raise ValueError(f"--backend nccl needs a GPU per local rank; this node has {gpus} GPU(s) for local rank "
                         f"{local_rank}: use --backend gloo or fewer --nproc-per-node")
    if asked == "auto":
        return "nccl" if gpus > local_rank else "gloo"
    return asked


def attempt_store(timeout: timedelta):
    """On one node under torchrun's agent: the agent's store, this attempt's keys under their own prefix.

    The agent keeps one store across restarts, and a restarted rank that reads the key a dead rank of the
    previous attempt wrote connects to a port nobody listens on any more (gloo: "connectFullMesh failed …
    Connection refused"; pytorch/pytorch#167288). One agent numbers its attempts
    (``TORCHELASTIC_RESTART_COUNT``) the same for every rank it starts; on several nodes only the agent
    whose rank failed counts a restart, so the numbers disagree and torch's own store is used as it is
    (None).
    """
    one_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]
    if not one_node or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"distlab/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _collectives_so_far() -> int:
    return sum(counts.calls for counts in comm.snapshot().ops.values())


def main(argv: list[str] | None = None) -> int:
    args, kwargs = parse_arguments(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit("RANK/WORLD_SIZE are not set: start this module with torchrun "
                 "(from a notebook, use distlab.launch instead)")
    module_name, function_name = args.target.split(":")
    fn = getattr(importlib.import_module(module_name), function_name)
    parameters = inspect.signature(fn).parameters
    if "log_every" in parameters and "log_every" not in kwargs:
        kwargs["log_every"] = 1  # under torchrun a job prints its steps; a notebook's call stays quiet
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as error:
        return _refuse(f"{args.target}: {error}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    try:
        backend = choose_backend(args.backend, local_rank)
    except ValueError as error:
        return _refuse(str(error))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=args.timeout)
    store = attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    comm.install()
    try:
        try:
            value = fn(**kwargs)
        except ValueError as error:
            if _collectives_so_far():
                raise  # the ranks already talked: not an argument check, a bug to see in full
            return _refuse(str(error).splitlines()[0])
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        if dist.get_rank() == 0:
            for rank, item in enumerate(gathered):
                print(f"[rank {rank}] {item!r}", flush=True)
            if args.json:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump(gathered, f, default=str)
        dist.barrier()  # leave together: a rank tearing gloo down while a peer still writes can abort it
    finally:
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- launch lines for a cluster

def _arguments(kwargs: dict) -> list[str]:
    return [f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}" for key, value in kwargs.items()]


def torchrun_command(target: str, kwargs: dict | None = None, nnodes: int = 1, nproc_per_node: int = 1,
                     rdzv_endpoint: str | None = None, node_rank: str | int | None = None, max_restarts: int = 0,
                     rdzv_id: str | None = None, python: str | None = None) -> list[str]:
    """The torchrun argv that runs ``target`` with ``kwargs`` on ``nnodes × nproc_per_node`` ranks.

    One node: ``--standalone`` (torchrun picks a free port). Several: a c10d rendezvous at
    ``rdzv_endpoint`` (``HOST:PORT`` of the first node), the same line on every node; ``node_rank``
    pins each node's place (else the rendezvous assigns it). ``python`` runs torchrun as
    ``python -m torch.distributed.run`` (the same program) with that interpreter.
    """
    head = [python, "-m", "torch.distributed.run"] if python else ["torchrun"]
    line = head + [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and rdzv_endpoint is None:
        line.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError(f"{nnodes} nodes need a rendezvous endpoint (HOST:PORT of the first node)")
        line += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if rdzv_id is not None:
            line.append(f"--rdzv-id={rdzv_id}")
        if node_rank is not None:
            line.append(f"--node-rank={node_rank}")
    if max_restarts:
        line.append(f"--max-restarts={max_restarts}")
    return line + ["-m", "distlab.torchrun", target] + _arguments(kwargs or {})


# Each with why: what a real cluster needs that a laptop does not (course/cluster.md explains them).
CLUSTER_ENVIRONMENT = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed/timed-out NCCL op aborts the process: torchrun restarts
    "NCCL_DEBUG": "WARN",  # NCCL says which transport and interface it chose, and why it failed
    "OMP_NUM_THREADS": "8",  # torchrun defaults to 1 thread per rank; data loading and CPU ops need more
}


def slurm_script(target: str, kwargs: dict | None = None, nodes: int = 2, gpus_per_node: int = 8,
                 job_name: str = "distlab", time_limit: str = "01:00:00", port: int = 29500, max_restarts: int = 3,
                 cpus_per_task: int = 64, socket_ifname: str | None = None, setup: str = "") -> str:
    """A SLURM batch script: one task per node (``srun``), each a torchrun agent for its node's GPUs,
    all meeting at a c10d rendezvous on the job's first node; ``--max-restarts`` restarts the group
    (from its last checkpoint) after a rank dies. ``setup``: shell lines run first (a venv, modules).
    """
    env = dict(CLUSTER_ENVIRONMENT)
    if socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = socket_ifname
    line = torchrun_command(target, kwargs, nodes, gpus_per_node, rdzv_endpoint="$HEAD_NODE:$MASTER_PORT",
                            max_restarts=max_restarts, rdzv_id="$SLURM_JOB_ID")
    torchrun = " ".join(part if "$" in part else shlex.quote(part) for part in line)
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={job_name}",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --gpus-per-node={gpus_per_node}",
             f"#SBATCH --cpus-per-task={cpus_per_task}",
             f"#SBATCH --time={time_limit}",
             "set -euo pipefail",
             *([setup] if setup else []),
             'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             f"MASTER_PORT=${{MASTER_PORT:-{port}}}",
             *(f"export {key}={value}" for key, value in env.items()),
             f"srun --kill-on-bad-exit=1 {torchrun}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- distlab plan

GRID_TARGET = "distlab.parallel3d.grid:train"


def grid_arguments(layout, global_batch: int, cfg=None, steps: int = 100) -> dict:
    """The ``distlab.parallel3d.grid:train`` arguments for a planner ``Layout``."""
    kwargs = {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp, "microbatches": layout.m,
              "batch_size": global_batch, "zero": layout.zero, "steps": steps}
    if cfg is not None:
        kwargs.update(n_layer=cfg.n_layer, d_model=cfg.d_model, n_head=cfg.n_head, vocab_size=cfg.vocab_size,
                      seq_len=cfg.seq_len)
    return kwargs


def grid_config(model: ModelShape) -> GPTConfig:
    """The 3D worker's GPT for a planner model shape (a Llama-shaped preset: its sizes, untied head)."""
    return GPTConfig(vocab_size=model.vocab_size, seq_len=model.seq_len, n_layer=model.n_layer, n_head=model.n_head,
                     d_model=model.d_model, tied_embeddings=False)


def launch_plan(model: ModelShape, cfg: GPTConfig, gpus: int, batch: int, gpus_per_node: int = 8,
                tp: int | None = None, pp: int | None = None, steps: int = 100,
                endpoint: str = "$HEAD_NODE:29500") -> str | None:
    """The planner's best layout that the 3D worker can run, and the torchrun and SLURM lines that run it.

    The worker runs DP × PP × TP with 1F1B (v = 1), DDP or ZeRO-1 over DP and no recomputation, so only such
    layouts are considered. ``None`` (after saying why on stderr) when none fits; ``distlab plan`` and lab 11's
    planner widget print the same text.
    """
    cluster = dataclasses.replace(h100_cluster(gpus), gpus_per_node=gpus_per_node)
    choices = dict(cp=(1,), zero=(0, 1), v=(1,), checkpointing=(False,))
    if tp:
        choices["tp"] = (tp,)
    result = plan(model, cluster, batch, **choices)
    feasible = [e for e in result.feasible if pp is None or e.layout.pp == pp]
    if not feasible:
        print(f"error: no feasible layout{f' with PP {pp}' if pp else ''} that the 3D worker runs (DP x PP x TP, "
              f"ZeRO 0/1, no recomputation); the planner's table:\n" + result.table(), file=sys.stderr)
        return None
    best = feasible[0]
    nodes = gpus // gpus_per_node
    kwargs = grid_arguments(best.layout, batch, cfg, steps)
    line = torchrun_command(GRID_TARGET, kwargs, nodes, gpus_per_node, rdzv_endpoint=endpoint if nodes > 1 else None)
    return "\n".join([
        f"{model.name} on {cluster.name} ({nodes} nodes of {gpus_per_node}), {batch} sequences per step",
        f"layout: {best.summary()}",
        "torchrun, the same line on every node:",
        "  " + " ".join(part if "$" in part else shlex.quote(part) for part in line),
        "SLURM (sbatch this):",
        slurm_script(GRID_TARGET, kwargs, nodes=nodes, gpus_per_node=gpus_per_node).rstrip("\n")])


def plan_main(argv: list[str] | None = None) -> int:
    """``distlab plan``: the planner's best 3D layout, and the torchrun and SLURM lines that run it."""
    p = argparse.ArgumentParser(prog="distlab plan", description=plan_main.__doc__)
    p.add_argument("--model", default="lab", help="7B, 70B, 405B (Llama-shaped) or lab (the lab's GPT, sizes below)")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--batch", type=int, required=True, help="global batch in sequences")
    p.add_argument("--tp", type=int, help="keep only layouts with this TP degree")
    p.add_argument("--pp", type=int, help="keep only layouts with this PP degree")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--endpoint", default="$HEAD_NODE:29500", help="the rendezvous, HOST:PORT of the first node")
    for name, default in (("n-layer", 4), ("d-model", 64), ("n-head", 4), ("vocab-size", 256), ("seq-len", 32)):
        p.add_argument(f"--{name}", type=int, default=default, help="--model lab only")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = None
    if args.model == "lab":
        cfg = GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                        d_model=args.d_model, tied_embeddings=False)
        model = ModelShape.from_config(cfg)
    else:
        model = ModelShape.from_preset(args.model)
        cfg = grid_config(model)
    if args.gpus % args.gpus_per_node:
        p.error(f"--gpus {args.gpus} is not a whole number of nodes of {args.gpus_per_node}")
    lines = launch_plan(model, cfg, args.gpus, args.batch, gpus_per_node=args.gpus_per_node, tp=args.tp, pp=args.pp,
                        steps=args.steps, endpoint=args.endpoint)
    if lines is None:
        return BAD_ARGUMENTS
    print(lines)
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The process group is destroyed and every result written: leave without the interpreter's finalization, where
    # gloo's worker threads, torn down after Python, can still abort a finished rank ("terminate called without an
    # active exception": once in six runs of tests/test_cluster.py under load; pytorch/pytorch#179291 describes it).
    os._exit(status)
