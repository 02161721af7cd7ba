"""Run every benchmark in this folder, one after another (`make bench`)."""

import pathlib
import subprocess
import sys

here = pathlib.Path(__file__).parent
failed = []
for script in sorted(here.glob("bench_*.py")):
    print(f"\n=== {script.name}", flush=True)
    if subprocess.run([sys.executable, str(script)]).returncode:
        failed.append(script.name)
sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
