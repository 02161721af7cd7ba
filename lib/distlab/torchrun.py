"""Run a distlab worker function under torchrun, on one node or many.

    torchrun --nproc-per-node=4 -m distlab.torchrun distlab.data_parallel:train steps=20
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        -m distlab.torchrun distlab.data_parallel:train steps=100

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; this module initialises the
process group the way ``distlab.launch`` does (NCCL with one GPU per local
rank when there are GPUs, else gloo), turns on communication accounting, calls
the function with the ``key=value`` arguments, and prints every rank's return
value on rank 0 in rank order.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from distlab.runtime import comm


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


def main(argv: list[str] | None = None) -> int:
    args, kwargs = parse_arguments(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit("RANK/WORLD_SIZE are not set: start this module with torchrun "
                 "(from a notebook, use distlab.launch instead)")
    module_name, function_name = args.target.split(":")
    fn = getattr(importlib.import_module(module_name), function_name)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    if use_nccl:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_nccl else "gloo", timeout=timedelta(seconds=args.timeout))
    comm.install()
    try:
        value = fn(**kwargs)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        if dist.get_rank() == 0:
            for rank, item in enumerate(gathered):
                print(f"[rank {rank}] {item!r}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
