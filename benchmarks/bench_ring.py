"""Lab 02 benchmark: ring (plain and pipelined) and tree all-reduce from sends, against gloo's built-in.

All run on the same warm group of gloo ranks, at message sizes from 4 KiB to
16 MiB. Repeats are interleaved (each round times every size with every
implementation, the order of the implementations rotating from round to round)
so that drift of a shared machine hits all alike; each cell is the median over
the rounds of the slowest rank's time. It prints, per size, time and bus bandwidth
(nccl-tests convention, 2(N-1)/N * M / t) of

* ``ring``: :func:`distlab.collectives.ring_all_reduce`, pipelined in segments,
* ``plain``: the same ring with one message per step (exercise 2.1),
* ``tree``: :func:`distlab.collectives.tree_all_reduce`, recursive doubling (exercise 2.4),
* ``gloo``: ``dist.all_reduce``;

the time ratios to gloo by size; the α–β fit of gloo, and one joint fit of the
plain ring and the tree (both are built from the same sends); the tree/ring
crossover the model predicts against the one measured; and the target: the
pipelined ring reaches at least 0.8x gloo's bus bandwidth at the large sizes.
It first checks that every implementation is correct and sends the bytes of its
cost model. Results: ``benchmarks/results/ring.json`` and ``ring.txt``.

    python benchmarks/bench_ring.py               # about a minute on 2 cores
    python benchmarks/bench_ring.py --quick       # a smoke run, saves nothing

Exit status 1 when an implementation is wrong, or when the target is missed on a
machine with at least one core per rank (on fewer cores the figure is reported but
not faithful: the ranks take turns on the cores).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import distlab
from distlab import collectives as coll
from distlab import results
from distlab.runtime import comm

KiB, MiB = coll.KiB, coll.MiB
TARGET = 0.8  # pipelined ring bus bandwidth / gloo's, at the large sizes
LARGE = 4 * MiB  # "large": this size and up


def implementations(segment_bytes: int) -> dict:
    return {"ring": functools.partial(coll.ring_all_reduce, segment_bytes=segment_bytes),
            "plain": functools.partial(coll.ring_all_reduce, segment_bytes=None),
            "tree": coll.tree_all_reduce, "gloo": coll.builtin_all_reduce}


def _verify(impls: dict, numel: int):
    """On each rank: each implementation's result against dist.all_reduce, and the bytes it sent."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(numel, generator=gen)
    expected = x.clone()
    dist.all_reduce(expected)
    out = {}
    for name, fn in impls.items():
        if name == "gloo":
            continue
        before = comm.snapshot()
        got = fn(x.clone())
        out[name] = (coll.first_mismatch(expected, got), comm.since(before).total(ops=("send", "isend")))
    return out


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds per size and implementation (>= 5)")
    p.add_argument("--min-size", type=int, default=4 * KiB)
    # 64 MiB over 4 ranks is 16 MiB chunks, 4 segments of 4 MiB each: the largest sizes are the ones where the
    # reference ring really pipelines (below a segment per chunk it sends whole chunks, like the plain ring)
    p.add_argument("--max-size", type=int, default=64 * MiB)
    p.add_argument("--segment-kib", type=int, default=coll.SEGMENT_BYTES // KiB,
                   help="segment size of the pipelined ring")
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank (default 1, see below)")
    p.add_argument("--quick", action="store_true", help="3 rounds, 3 sizes: a smoke test; nothing is saved")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    n = args.world_size
    sizes, size = [], args.min_size
    while size <= args.max_size:
        sizes.append(size)
        size *= 4
    reps = args.reps
    if args.quick:
        sizes, reps = [sizes[0], sizes[len(sizes) // 2], sizes[-1]], 3
    impls = implementations(args.segment_kib * KiB)
    cpus = results.machine()["cpus"]
    threads = f"{args.threads} thread{'s' if args.threads > 1 else ''} each"
    out = [f"{n} gloo ranks ({threads}) on {cpus} CPU cores, {len(sizes)} sizes, {reps} interleaved rounds, "
           f"pipelined ring segments of {args.segment_kib} KiB; torch {torch.__version__}"]
    print(out[0], flush=True)
    started = time.perf_counter()
    # One compute thread per rank, as gloo reduces on one: the ring adds each received chunk with torch,
    # and with cores // N intra-op threads per rank every add wakes a team of OpenMP workers that then
    # spin on the cores gloo's I/O threads need. Timed on 16 cores (4 ranks, runs alternated on one
    # machine), the plain ring reached 0.64x gloo's bus bandwidth at 4 MiB and up with 4 threads per
    # rank and 0.87-0.90x with one, while gloo's own times hardly moved. (--threads to see it.)
    with distlab.Ranks(n, backend="gloo", collective_timeout=60, threads=args.threads) as ranks:
        numel = MiB // 4 + 3  # not divisible by N
        checks = ranks.run(_verify, args=(impls, numel), show_output=False)
        model = {"ring": coll.ring_all_reduce_bytes(4 * numel, n), "plain": coll.ring_all_reduce_bytes(4 * numel, n),
                 "tree": coll.tree_all_reduce_bytes(4 * numel, n)}
        for name in model:
            for r, per_rank in enumerate(checks):
                miss, sent = per_rank[name]
                slack = 2 * 4 if name != "tree" else 0
                if miss is not None or (sent > model[name] + slack if name == "tree"
                                        else abs(sent - model[name]) > slack):
                    print(f"{name} all-reduce is wrong on rank {r}: mismatch {miss}, sent {sent:.0f} bytes "
                          f"(model {model[name]:.0f})")
                    return 1
        out.append(f"check: ring, plain ring and tree == dist.all_reduce on {numel} floats; bytes per rank "
                   f"as their cost models (ring {model['ring']:.0f}, tree at most {model['tree']:.0f})")
        print(out[-1], flush=True)
        times: dict[tuple[str, int], list[float]] = {(name, s): [] for name in impls for s in sizes}
        names = list(impls)
        for round_ in range(reps):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for row in coll.bandwidth_sweep({name: impls[name] for name in order}, sizes, ranks=ranks, reps=1,
                                            warmup=1):
                times[(row["name"], row["bytes"])] += row["times"]
    rows = []
    for s in sizes:
        for name in impls:
            median = statistics.median(times[(name, s)])
            rows.append({"name": name, "bytes": s, "world_size": n, "times": times[(name, s)],
                         "median_s": median, "busbw": coll.bus_bandwidth(s, median, n)})
    out += ["", coll.format_sweep(rows, baseline="gloo"), ""]
    gloo_alpha, gloo_beta = coll.fit_alpha_beta(sizes, [coll.median_time(rows, "gloo", s) for s in sizes], n)
    joint = [r for r in rows if r["name"] in ("plain", "tree")]
    alpha, beta = coll.fit_alpha_beta([r["bytes"] for r in joint], [r["median_s"] for r in joint], n,
                                      algorithm=["ring" if r["name"] == "plain" else "tree" for r in joint])
    predicted = coll.crossover_bytes(n, alpha, beta)
    measured = {large: coll.measured_crossover(rows, "tree", large) for large in ("plain", "ring")}
    out.append(f"alpha-beta fit, gloo (ring model): alpha = {gloo_alpha * 1e6:.0f} us, "
               f"beta = {gloo_beta / 1e9:.3f} GB/s")
    out.append(f"alpha-beta fit, plain ring + tree together: alpha = {alpha * 1e6:.0f} us, "
               f"beta = {beta / 1e9:.3f} GB/s")
    out.append(f"tree/ring crossover: the model predicts {_size(predicted)}; measured "
               f"{_size(measured['plain'])} against the plain ring, "
               f"{_size(measured['ring'])} against the pipelined one")
    ratios = {name: {s: coll.median_time(rows, name, s) / coll.median_time(rows, "gloo", s) for s in sizes}
              for name in ("ring", "plain", "tree")}
    out.append("time / gloo's by size: " + "; ".join(
        f"{coll.human_bytes(s)} ring {ratios['ring'][s]:.2f}, tree {ratios['tree'][s]:.2f}" for s in sizes))
    large = [s for s in sizes if s >= LARGE] or sizes[-1:]
    busbw_ratio = statistics.median(1 / ratios["ring"][s] for s in large)
    plain_ratio = statistics.median(1 / ratios["plain"][s] for s in large)
    faithful = cpus >= n
    met = busbw_ratio >= TARGET
    out.append(f"pipelined ring bus bandwidth / gloo's at {coll.human_bytes(large[0])} and up: {busbw_ratio:.2f} "
               f"(plain ring {plain_ratio:.2f}; "
               f"median over all sizes {statistics.median(1 / r for r in ratios['ring'].values()):.2f}); "
               f"target >= {TARGET}: {'met' if met else 'MISSED'}")
    if not faithful:
        out.append(f"note: {n} ranks on {cpus} cores take turns on the CPU, so latencies include waiting for a "
                   f"core; these figures are not faithful for a machine with a core per rank")
    out.append(f"({time.perf_counter() - started:.0f} s)")
    print("\n".join(out[2:]))
    if not args.quick:
        data = {"world_size": n, "sizes": sizes, "segment_bytes": args.segment_kib * KiB, "rows": rows,
                "ratios_to_gloo": {k: {str(s): v for s, v in d.items()} for k, d in ratios.items()},
                "fit_gloo": {"alpha_s": gloo_alpha, "beta_Bps": gloo_beta},
                "fit_joint": {"alpha_s": alpha, "beta_Bps": beta},
                "crossover_predicted_bytes": None if math.isinf(predicted) else predicted,
                "crossover_measured_bytes": measured, "busbw_ratio_large": busbw_ratio,
                "busbw_ratio_large_plain": plain_ratio, "target": TARGET, "faithful": faithful,
                "cpus_per_rank": cpus / n, "threads_per_rank": args.threads}
        # not the GPUs a box may also have
        data["ran_on"] = f"{len(os.sched_getaffinity(0))} CPU cores (gloo ranks, {threads})"
        path = results.save("ring", data, "\n".join(out[:-1]), ranks=n, threads_per_rank=args.threads)
        print(f"saved {path}")
    return 0 if (met or not faithful) else 1


def _size(nbytes: float | None) -> str:
    if nbytes is None or math.isinf(nbytes):
        return "none (the order never flips)"
    return coll.human_bytes(nbytes)


if __name__ == "__main__":
    sys.exit(main())
