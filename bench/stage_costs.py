"""Wall time and peak memory per stage of a finished pipeline run, from Snakemake's benchmark TSVs.

Usage: python bench/stage_costs.py [results/benchmarks]
"""
import csv
import sys
from collections import defaultdict
from pathlib import Path


def main(root: str = "results/benchmarks") -> None:
    seconds, rss, jobs = defaultdict(float), defaultdict(float), defaultdict(int)
    files = sorted(Path(root).rglob("*.tsv"))
    if not files:
        sys.exit(f"no benchmark TSVs under {root}: run the pipeline first")
    for tsv in files:
        stage = tsv.parent.name if tsv.parent != Path(root) else tsv.stem
        with open(tsv) as f:
            row = next(csv.DictReader(f, delimiter="\t"))
        seconds[stage] += float(row["s"])
        rss[stage] = max(rss[stage], float(row["max_rss"]) if row["max_rss"] not in ("", "NA", "-") else 0.0)
        jobs[stage] += 1
    total = sum(seconds.values())
    print(f"{'stage':<10} {'jobs':>4} {'seconds':>9} {'share':>6} {'max RSS MB':>11}")
    for stage, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"{stage:<10} {jobs[stage]:>4} {s:>9.1f} {s / total:>6.1%} {rss[stage]:>11.0f}")
    print(f"{'total':<10} {sum(jobs.values()):>4} {total:>9.1f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
