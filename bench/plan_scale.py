"""Snakemake dry runs (``snakemake -n``) of the real run's plan at its scale, plain vs launch.

The real run of config/qwen3.6-27b.yaml has 913,786 prompts: 1,828 shards at prompts.shard_size
500, 183 at 5,000. For each shard count and SLURM profile this times the dry run in two generation
modes: "plain" (generate.server.url set, launch null: a server the user runs) and "launch"
(generate.server.launch as in the config: each started server and its <= shards_per_server
generate jobs form one group job). Target: launch within 1.5x of plain.

Each configuration gets a synthetic workdir: a stand-in model folder (config.json only), empty
prompt source files, and the prompts checkpoint's output written after them. Its shard files are
empty placeholders: a dry run reads only manifest.json to know the shards. ``.snakemake`` is
deleted before every timed run, so each starts with no metadata and no locks. Within a round the
two modes run back to back, the first one alternating between rounds, and the ratio is taken per
round: this machine is shared and its load drifts.

Usage:
    .venv/bin/python bench/plan_scale.py --rounds 5 [--shards 1828 183]
        [--profiles slurm-b200 slurm-rtxpro6000] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]  # this interpreter's: a checkout need not have .venv
REAL_CONFIG = ROOT / "config/qwen3.6-27b.yaml"
PROMPTS = 913_786
MODES = ("plain", "launch")


def shard_size(shards: int) -> int:
    """The roundest prompts.shard_size that cuts PROMPTS into ``shards`` shards (1828 -> 500,
    183 -> 5000), as a user would write it."""
    low = -(-PROMPTS // shards)
    high = -(-PROMPTS // (shards - 1)) - 1 if shards > 1 else PROMPTS
    return max(range(low, high + 1), key=lambda s: len(str(s)) - len(str(s).rstrip("0")))


def build_workdir(work: Path, shards: int, mode: str) -> None:
    (work / "model").mkdir(parents=True)
    (work / "model/config.json").write_text(
        json.dumps({"model_type": "qwen3_5", "num_hidden_layers": 64, "hidden_size": 5120}))
    config = yaml.safe_load(REAL_CONFIG.read_text())
    # Sources and model first: the prompts checkpoint's output must be newer than its inputs.
    for source in config["prompts"]["sources"]:
        source["path"] = str(work / "sources" / Path(source["path"]).name)
        Path(source["path"]).parent.mkdir(exist_ok=True)
        Path(source["path"]).touch()
    size = shard_size(shards)
    config["output_dir"] = str(work / "results")
    config["target"]["path"] = str(work / "model")
    config["prompts"]["shard_size"] = size
    server = config["generate"]["server"]
    if mode == "plain":
        server["url"], server["launch"] = "http://127.0.0.1:30000/v1", None
    else:
        server["url"] = None
    (work / "real.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    prompts = work / "results/prompts"
    prompts.mkdir(parents=True)
    records = [size] * (shards - 1) + [PROMPTS - size * (shards - 1)]
    entries = [{"name": f"shard-{i:05d}.jsonl.zst", "records": n} for i, n in enumerate(records)]
    for entry in entries:
        (prompts / entry["name"]).touch()
    (prompts / "heldout.jsonl.zst").touch()
    (prompts / "manifest.json").write_text(json.dumps({"prompts": PROMPTS, "heldout": 0, "shards": entries}))


def dry_run(work: Path, profile: str, log: Path) -> float:
    """Wall seconds of one ``snakemake -n``; its full output (what a user sees) goes to ``log``."""
    shutil.rmtree(work / ".snakemake", ignore_errors=True)
    command = [*SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-n", "--profile", str(ROOT / "profiles" / profile),
               "--configfile", str(work / "real.yaml")]
    env = {**os.environ, "DFLASH_SITE": str(ROOT / "profiles/site.yaml")}
    with open(log, "w") as out:
        t0 = time.perf_counter()
        done = subprocess.run(command, check=False, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - t0
    if done.returncode:
        print(f"{' '.join(command)} (cwd {work}) exited {done.returncode}:", file=sys.stderr)
        print("\n".join(log.read_text().splitlines()[-40:]), file=sys.stderr)
        sys.exit(1)
    return seconds


def job_stats(output: str) -> dict[str, int]:
    """The rows of the dry run's "Job stats" table: rule -> job count (with "total")."""
    table = output.split("Job stats:\n", 1)[1].split("\n\n", 1)[0]
    return {rule: int(count) for rule, count in re.findall(r"^(\w+)\s+(\d+)$", table, re.MULTILINE)}


def describe(stats: dict[str, int]) -> str:
    return ", ".join(f"{rule} {n}" for rule, n in stats.items() if rule != "total") + f" (total {stats['total']})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shards", type=int, nargs="+", default=[1828, 183])
    ap.add_argument("--profiles", nargs="+", default=["slurm-b200", "slurm-rtxpro6000"])
    ap.add_argument("--keep", type=Path, help="build the workdirs here and keep them (default: a temp dir, removed)")
    args = ap.parse_args()

    version = subprocess.run([*SNAKEMAKE, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    print(f"machine: {os.cpu_count()} cores, snakemake {version}, {args.rounds} rounds", flush=True)
    base = args.keep or Path(tempfile.mkdtemp(prefix="plan-scale-"))
    base.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = []
    try:
        for shards in args.shards:
            works = {mode: base / f"{shards}-{mode}" for mode in MODES}
            for mode, work in works.items():
                shutil.rmtree(work, ignore_errors=True)
                build_workdir(work, shards, mode)
            for profile in args.profiles:
                times = {mode: [] for mode in MODES}
                for round_ in range(args.rounds):
                    for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                        seconds = dry_run(works[mode], profile, works[mode] / f"{profile}.log")
                        times[mode].append(seconds)
                        print(f"{shards} shards  {profile}  round {round_ + 1}  {mode:6}  {seconds:6.2f} s", flush=True)
                outputs = {mode: (works[mode] / f"{profile}.log").read_text() for mode in MODES}
                stats = {mode: job_stats(outputs[mode]) for mode in MODES}
                groups = len(re.findall(r"^\[[^]]*\] Group job ", outputs["launch"], re.MULTILINE))
                ratios = [launch / plain for plain, launch in zip(times["plain"], times["launch"])]
                rows.append([str(shards), profile, f"{statistics.median(times['plain']):.2f}",
                             f"{statistics.median(times['launch']):.2f}", f"{statistics.median(ratios):.2f}",
                             describe(stats["plain"]), describe(stats["launch"]), str(groups)])
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s\n")
    header = ["shards", "profile", "plain s (median)", "launch s (median)",
              "launch/plain (median of per-round ratios)", "jobs (plain)", "jobs (launch)", "group jobs"]
    print(f"| {' | '.join(header)} |\n|{' --- |' * len(header)}")
    for row in rows:
        print(f"| {' | '.join(row)} |")


if __name__ == "__main__":
    main()
