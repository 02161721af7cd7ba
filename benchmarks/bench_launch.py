"""Launch cost: distlab cold and warm against torch.multiprocessing.spawn, measured side by side.

Each cold measurement runs in a fresh interpreter (nothing launched before), so
it pays what a notebook pays on its first launch. The job is the same in every
case: join a 4-rank gloo group and all-reduce one tensor. Rounds interleave
the variants so machine noise hits them alike; we report medians.

The job imports no course code, so the forkserver preloads only what every rank
needs; course modules that ask for more (``distlab.runtime.group.preload``) make
a notebook's first launch wait for those imports too.

    python benchmarks/bench_launch.py [--ranks 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

SPAWN = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist, torch.multiprocessing as mp

    def job(rank, world_size, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        dist.all_reduce(torch.ones(1))
        dist.destroy_process_group()

    if __name__ == "__main__":
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        start = time.perf_counter()
        mp.spawn(job, args=({n}, port), nprocs={n})
        print(time.perf_counter() - start)
""")

DISTLAB = textwrap.dedent("""
    import time, torch, torch.distributed as dist, distlab

    def job():
        dist.all_reduce(torch.ones(1))

    start = time.perf_counter()
    distlab.launch(job, {n})
    cold = time.perf_counter() - start
    start = time.perf_counter()
    distlab.launch(job, {n})
    second = time.perf_counter() - start
    ranks = distlab.Ranks({n}).start()
    ranks.run(job)
    warm = []
    for _ in range(20):
        start = time.perf_counter()
        ranks.run(job)
        warm.append(time.perf_counter() - start)
    ranks.close()
    print(cold, second, sorted(warm)[len(warm) // 2])
""")


def run_script(source: str) -> list[float]:
    """Run a script file in a fresh interpreter (spawn needs an importable main); return its numbers."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "job.py")
        with open(path, "w") as f:
            f.write(source)
        env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        out = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=300, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return [float(x) for x in out.stdout.split()]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    spawn, cold, second, warm = [], [], [], []
    for i in range(args.repeats):
        spawn += run_script(SPAWN.format(n=args.ranks))
        c, s, w = run_script(DISTLAB.format(n=args.ranks))
        cold.append(c), second.append(s), warm.append(w)
        print(f"round {i + 1}: mp.spawn {spawn[-1]:.3f} s  distlab cold {c:.3f} s  "
              f"second {s:.3f} s  warm {w * 1e3:.1f} ms", flush=True)
    med = {name: statistics.median(v) for name, v in
           [("mp.spawn", spawn), ("distlab cold", cold), ("distlab second", second), ("distlab warm", warm)]}
    print(f"\n{args.ranks}-rank gloo launch of a trivial job, medians of {args.repeats} rounds")
    print(f"{'variant':<36}{'median':>10}{'÷ mp.spawn':>12}")
    labels = {"mp.spawn": "torch.multiprocessing.spawn",
              "distlab cold": "distlab.launch, first in a process",
              "distlab second": "distlab.launch, later (fresh ranks)",
              "distlab warm": "distlab.Ranks.run (warm ranks)"}
    for key, label in labels.items():
        print(f"{label:<36}{med[key]:>9.3f}s{med[key] / med['mp.spawn']:>12.3f}")
    cold_met = med["distlab cold"] <= 0.45 * med["mp.spawn"]
    print(f"\ntarget: cold ≤ 0.45 × mp.spawn → {'met' if cold_met else 'MISSED'}; "
          f"warm ≤ 10 ms → {'met' if med['distlab warm'] <= 0.010 else 'MISSED'}")
    return med


if __name__ == "__main__":
    main()
