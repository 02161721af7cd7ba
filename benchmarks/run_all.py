"""Run every benchmark in this folder, one after another (`make bench`).

At a terminal a bar counts the scripts (rate, ETA) and stays below their output, which is relayed line by line
above it: a script's stdout and stderr come through a pipe, so it runs as it would into a log file, without bars of
its own (one bar for the whole run, as the launcher draws one for a job). Into a log file or under CI there is no
bar and the output passes through in order.
"""

import os
import pathlib
import subprocess
import sys

from distlab.runtime.progress import progress

HERE = pathlib.Path(__file__).parent


def run_all(scripts: list[pathlib.Path]) -> list[str]:
    """Run ``scripts`` one after another, each's output relayed above the bar; the names of those that failed."""
    failed = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each line as the script prints it, not a pipe's buffer later
    bar = progress(scripts, desc="benchmarks", unit="script")
    for script in bar:
        bar.write(f"\n=== {script.name}")
        with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace", env=env) as child:
            for line in child.stdout:
                bar.write(line.rstrip("\n"))
        if child.returncode:
            failed.append(script.name)
    bar.close()
    return failed


if __name__ == "__main__":
    failed = run_all(sorted(HERE.glob("bench_*.py")))
    sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
