"""How close the pilot's forecast comes to the run it forecasts: the shipped demo, on CPU.

Runs the demo (config.yaml as shipped: the pilot samples 20 prompts of each category) in a fresh
folder, then compares what results/plan.json forecast from the pilot with what the whole run then
measured: total output tokens (every completion record's usage) and generation time (the
generate jobs' own seconds, the pilot's included: model loading is no generation). The
generation rate is the pilot's (one job, one thread); the full run's jobs run --cores at a time,
each on one thread, so their own seconds add up to the forecast's serial time. And training: the
pilot's training burst (pilot.train_steps on its rows, its set-up and seconds per step) against
the train job's wall time (its benchmark file: the process start and imports included, which
the forecast leaves out) for the demo's train.steps.

`--results DIR` compares the same figures for a run already finished (its results folder) instead
of running the demo: a run with a pilot (tests/test_bench.py checks the bench so on a small run).

Usage:
    .venv/bin/python bench/forecast_accuracy.py [--cores 2] [--keep DIR | --results DIR]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash.core.io import iter_jsonl, read_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", type=int, default=2)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--keep", type=Path, help="run here and keep it (default: a temporary folder)")
    where.add_argument("--results", type=Path, help="a finished run's results folder: compare it, run nothing")
    a = ap.parse_args()
    if a.results:
        compare(a.results, None)
        return
    work = a.keep or Path(tempfile.mkdtemp(prefix="forecast-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", "data"):
        src, dst = ROOT / name, work / name
        if not dst.exists():
            (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(work),
                    "--cores", str(a.cores), "-q"], check=True)
    compare(work / "results", f"run wall time {time.time() - t0:.0f} s on {a.cores} cores")
    if not a.keep:
        shutil.rmtree(work)


def compare(res: Path, ran: str | None) -> None:
    """Print the forecast of ``res``/plan.json against what the run measured (``ran``: how the
    demo's run went, when this bench ran it)."""
    pilot, plan = read_json(res / "pilot" / "summary.json"), read_json(res / "plan.json")
    pilot_run = read_json(res / "pilot" / "generate.json")
    shards = [read_json(p) for p in sorted((res / "completions").glob("shard-*.summary.json"))]
    tokens = sum(r["usage"]["completion_tokens"] for p in sorted((res / "completions").glob("shard-*.jsonl.zst"))
                 for r in iter_jsonl(p) if r["usage"])
    seconds = pilot_run["seconds"] + sum(s["seconds"] for s in shards)
    local = plan["generation"]["local"]["forecast"][0]
    low, high = plan["output_tokens_range"]
    print(f"{res}: {plan['prompts']} training prompts, pilot {pilot['prompts']} ({pilot['records']} records)"
          + (f", {ran}" if ran else ""))
    print(f"output tokens: forecast {plan['output_tokens']:,.0f} (95% {low:,.0f} to {high:,.0f}), measured {tokens:,} "
          f"-> error {plan['output_tokens'] / tokens - 1:+.1%}")
    print(f"generation time: forecast {local['hours'] * 3600:,.1f} s at the pilot's "
          f"{pilot['throughput']['output_tokens_per_s']:,.1f} tok/s, measured {seconds:,.1f} s over "
          f"{len(shards)} shards + pilot -> error {local['hours'] * 3600 / seconds - 1:+.1%}")
    training = plan["gpu_stages"]["kinds"]["local"]["training"]
    run = next(iter((res / "checkpoints").glob("*/trainer_state.json")))
    job = float((res / "benchmarks" / "train" / f"{run.parent.name}.tsv").read_text().splitlines()[1].split()[0])
    forecast = training["spread"][0]["hours"] * 3600  # on this one machine
    print(f"training: forecast {forecast:,.1f} s ({training['setup_seconds']:.1f} s set-up + {read_json(run)['steps']} "
          f"steps x {training['seconds_per_step']:.3g} s, {training['from']}), measured {job:,.1f} s (the train job; "
          f"{read_json(run)['seconds']:,.1f} s in its loop) -> error {forecast / job - 1:+.1%}")
    print(json.dumps({"tokens_error": plan["output_tokens"] / tokens - 1,
                      "time_error": local["hours"] * 3600 / seconds - 1, "training_error": forecast / job - 1}))


if __name__ == "__main__":
    main()
