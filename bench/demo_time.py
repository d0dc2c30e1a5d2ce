"""The README's first quick-start command, timed as a new user meets it: a fresh clone of this
repository's HEAD, then `make demo` (venv, install, the whole pipeline on CPU, 2 cores).

Prints the wall time split into install and pipeline, the stages' own seconds (from the
`benchmark:` TSVs, as bench/stage_costs.py), and the verdicts against the targets: 5 minutes in
all, the pipeline under 3.5.
Measure on a quiet machine: anything else running shows up in the figure.

Usage: python bench/demo_time.py [--keep DIR] [--cores 2]
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stage_costs import main as stage_costs  # noqa: E402

TARGET_S = 300
PIPELINE_TARGET_S = 210


def run(cmd: list[str], cwd: Path, log) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="clone into this folder and keep it (default: a temp folder, removed)")
    ap.add_argument("--cores", type=int, default=2)
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()
    work = args.keep or Path(tempfile.mkdtemp(prefix="dflash-demo-"))
    if work.exists():
        shutil.rmtree(work)
    print(f"fresh clone of {repo} at {head} into {work}; Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")
    log_path = work.with_name(work.name + ".log")
    with open(log_path, "w") as log:
        clone = run(["git", "clone", "-q", str(repo), str(work)], repo, log)
        install = run(["make", "install"], work, log)
        pipeline = run(["make", "demo", f"CORES={args.cores}"], work, log)
        again = subprocess.run([".venv/bin/snakemake", "-n", "--cores", str(args.cores)], cwd=work,
                               capture_output=True, text=True, check=True).stdout
    total = clone + install + pipeline
    print(f"clone {clone:.1f} s, install {install:.1f} s, pipeline {pipeline:.1f} s: "
          f"total {total:.1f} s ({total / 60:.1f} min) (log: {log_path})")
    print(f"second dry run: {'Nothing to be done' if 'Nothing to be done' in again else 'WORK LEFT'}")
    stage_costs(str(work / "results" / "benchmarks"))
    steps = re.findall(r"(\d+) of (\d+) steps \(100%\) done", log_path.read_text())
    print(f"jobs: {steps[-1][0] if steps else '?'}; target {TARGET_S / 60:.0f} min in all: "
          f"{'met' if total <= TARGET_S else 'MISSED'}, pipeline under {PIPELINE_TARGET_S / 60:.1f} min: "
          f"{'met' if pipeline < PIPELINE_TARGET_S else 'MISSED'} (load average now {os.getloadavg()[0]:.2f})")
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
