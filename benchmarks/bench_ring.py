"""Lab 02 benchmark: the student-style ring all-reduce (``distlab.collectives``) against gloo's built-in.

Both run on the same warm group of gloo ranks, at message sizes from 4 KiB to
16 MiB. Repeats are interleaved (each round times every size with both
implementations, in alternating order) so that drift of a shared machine hits
both alike; each cell is the median over the rounds of the slowest rank's time.
Prints time and bus bandwidth (nccl-tests convention, 2(N-1)/N * M / t, in
GB/s) per size, the ring / gloo time ratio, the alpha-beta fit of each, and
checks first that the ring is correct and sends 2(N-1)/N * M bytes per rank.

    python benchmarks/bench_ring.py               # about 30 s on 2 cores
    python benchmarks/bench_ring.py --quick       # a smoke run

Exit status 1 when the ring gives a wrong result or sends the wrong number of bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distlab  # noqa: E402
from distlab import collectives as coll  # noqa: E402

KiB, MiB = coll.KiB, coll.MiB


def _verify(numel: int):
    """On each rank: the ring's result against dist.all_reduce, and the bytes it sent."""
    from distlab import comm

    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(numel, generator=gen)
    expected = x.clone()
    ring = coll.ring_all_reduce(x.clone())
    sent = comm.current_log().total(ops=("send", "isend"))
    dist.all_reduce(expected)
    return coll.first_mismatch(expected, ring), sent


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds per size and implementation (>= 5)")
    p.add_argument("--min-size", type=int, default=4 * KiB)
    p.add_argument("--max-size", type=int, default=16 * MiB)
    p.add_argument("--quick", action="store_true", help="3 rounds, 3 sizes: a smoke test, not a measurement")
    p.add_argument("--json", help="also write the results to this file")
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
    impls = {"ring": coll.ring_all_reduce, "gloo": coll.builtin_all_reduce}
    print(f"{n} gloo ranks, {len(sizes)} sizes, {reps} interleaved rounds; torch {torch.__version__}")
    started = time.perf_counter()
    with distlab.Ranks(n, backend="gloo", collective_timeout=60) as ranks:
        numel = MiB // 4 + 3  # not divisible by N
        checks = ranks.run(_verify, args=(numel,), show_output=False)
        expected_bytes = coll.ring_all_reduce_bytes(4 * numel, n)
        bad = [(r, miss, sent) for r, (miss, sent) in enumerate(checks)
               if miss is not None or abs(sent - expected_bytes) > 2 * 4]
        if bad:
            print(f"ring all-reduce is wrong: {bad} (expected {expected_bytes:.0f} bytes per rank)")
            return 1
        print(f"check: ring == dist.all_reduce on {numel} floats; bytes per rank "
              f"{[int(sent) for _, sent in checks]} vs 2(N-1)/N*M = {expected_bytes:.0f}")
        times: dict[tuple[str, int], list[float]] = {(name, s): [] for name in impls for s in sizes}
        for round_ in range(reps):
            order = list(impls.items()) if round_ % 2 == 0 else list(reversed(impls.items()))
            for row in coll.bandwidth_sweep(dict(order), sizes, ranks=ranks, reps=1, warmup=1):
                times[(row["name"], row["bytes"])] += row["times"]
    rows = []
    for s in sizes:
        for name in impls:
            median = statistics.median(times[(name, s)])
            rows.append({"name": name, "bytes": s, "world_size": n, "times": times[(name, s)],
                         "median_s": median, "busbw": coll.bus_bandwidth(s, median, n)})
    print()
    print(coll.format_sweep(rows, baseline="gloo"))
    fits = {}
    for name in impls:
        mine = [r for r in rows if r["name"] == name]
        alpha, beta = coll.fit_alpha_beta([r["bytes"] for r in mine], [r["median_s"] for r in mine], n)
        fits[name] = {"alpha_s": alpha, "beta_Bps": beta}
        print(f"{name}: alpha-beta fit  alpha = {alpha * 1e6:.0f} us, beta = {beta / 1e9:.3f} GB/s")
    ratios = [next(r for r in rows if r["name"] == "ring" and r["bytes"] == s)["median_s"]
              / next(r for r in rows if r["name"] == "gloo" and r["bytes"] == s)["median_s"] for s in sizes]
    print(f"ring/gloo time ratio: median over sizes {statistics.median(ratios):.2f}, "
          f"at {sizes[-1] // KiB} KiB {ratios[-1]:.2f}  ({time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"world_size": n, "rows": rows, "fits": fits, "ratios": dict(zip(sizes, ratios))}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
