"""What a trace costs: saving one against the run it records (target ≤ 5 %), and what profiling adds.

The run is a 4-rank 1F1B pipeline of the course GPT training ``--steps`` steps of ``m`` micro-batches on
warm ranks (thousands of spans, point-to-point ops and counter samples): the kind of run a student saves.
For each of ``--repeats`` rounds we time the run (``Ranks.run``, wall clock in the notebook), then
``run.save_trace(path)`` (building the Trace Event Format dict, flows and checks included, and writing the
JSON); the overhead is the median save over the median run. The same run with ``profile=True``
(torch.profiler in every rank, merged into the trace) is timed once per round for information: profiling
is the expensive, opt-in part, and the target is not its.

    python benchmarks/bench_trace.py [--steps 10] [--microbatches 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import distlab
from distlab import pipeline_parallel as pp
from distlab.model import GPTConfig
from distlab.results import save

TARGET = 0.05


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    cfg = GPTConfig(n_layer=4)
    job = dict(schedule="1f1b", cfg=cfg, m=args.microbatches, steps=args.steps, return_state=False,
               track_memory=True)
    runs, saves, profiled, profiled_saves = [], [], [], []
    with distlab.Ranks(4) as ranks, tempfile.TemporaryDirectory() as tmp:
        ranks.run(pp.pipeline_worker, kwargs=dict(job, steps=1), show_output=False)  # warm-up
        for i in range(args.repeats):
            start = time.perf_counter()
            run = ranks.run(pp.pipeline_worker, kwargs=job, show_output=False)
            runs.append(time.perf_counter() - start)
            start = time.perf_counter()
            path = run.save_trace(Path(tmp) / "run.json")
            saves.append(time.perf_counter() - start)
            size, events = path.stat().st_size, len(run.trace()["traceEvents"])
            start = time.perf_counter()
            prof = ranks.run(pp.pipeline_worker, kwargs=job, show_output=False, profile=True)
            profiled.append(time.perf_counter() - start)
            start = time.perf_counter()
            prof_path = prof.save_trace(Path(tmp) / "profiled.json")
            profiled_saves.append(time.perf_counter() - start)
            prof_size = prof_path.stat().st_size
            print(f"round {i + 1}: run {runs[-1]:.3f} s  save_trace {saves[-1] * 1e3:.1f} ms "
                  f"({events:,} events, {size / 1e6:.2f} MB)  profiled run {profiled[-1]:.3f} s  "
                  f"its save {profiled_saves[-1] * 1e3:.1f} ms ({prof_size / 1e6:.2f} MB)", flush=True)
    med = {name: statistics.median(v) for name, v in
           [("run_s", runs), ("save_s", saves), ("profiled_run_s", profiled), ("profiled_save_s", profiled_saves)]}
    overhead = med["save_s"] / med["run_s"]
    lines = [
        f"4-rank 1F1B pipeline, {args.steps} steps of m={args.microbatches}, warm ranks; medians of "
        f"{args.repeats} rounds",
        f"{'run (Ranks.run)':<40}{med['run_s']:>10.3f} s",
        f"{'run.save_trace':<40}{med['save_s'] * 1e3:>10.1f} ms   {events:,} events, {size / 1e6:.2f} MB",
        f"{'overhead of saving the trace':<40}{overhead:>10.1%}   target ≤ {TARGET:.0%} → "
        f"{'met' if overhead <= TARGET else 'MISSED'}",
        f"{'the same run with profile=True':<40}{med['profiled_run_s']:>10.3f} s   "
        f"({med['profiled_run_s'] / med['run_s']:.2f}× the run; opt-in, not under the target)",
        f"{'its save_trace (profiles merged)':<40}{med['profiled_save_s'] * 1e3:>10.1f} ms   "
        f"{prof_size / 1e6:.2f} MB",
    ]
    summary = "\n".join(lines)
    print("\n" + summary)
    save("trace", dict(med, overhead=overhead, target=TARGET, events=events, bytes=size, profiled_bytes=prof_size,
                       steps=args.steps, microbatches=args.microbatches, repeats=args.repeats), summary, ranks=4)
    return med


if __name__ == "__main__":
    main()
