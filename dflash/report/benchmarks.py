"""Job time and peak memory per stage from Snakemake's ``benchmark:`` TSVs.

Standard library only: ``bench/stage_costs.py`` runs it with any Python, the venv's or not.
"""
from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path


def stage_costs(benchmarks: str | Path) -> dict[str, dict]:
    """``{stage: {jobs, seconds, max_rss_bytes}}``, the costliest stage first, over
    ``benchmarks/<stage>/*.tsv`` and ``benchmarks/<stage>.tsv``; empty without any."""
    root = Path(benchmarks)
    seconds, rss, jobs = defaultdict(float), defaultdict(float), defaultdict(int)
    for tsv in sorted(root.rglob("*.tsv")):
        stage = tsv.parent.name if tsv.parent != root else tsv.stem
        with open(tsv, newline="") as f:
            row = next(csv.DictReader(f, delimiter="\t"), None)
        if row is None or row.get("s") in (None, "", "NA"):
            raise ValueError(f"{tsv}: no benchmark row (Snakemake writes a header and a row with s, max_rss, ...); "
                             f"delete the file and run its job again")
        seconds[stage] += float(row["s"])
        # Snakemake writes max_rss in MiB, NA when the job ended before it was sampled
        mib = float(row["max_rss"]) if row.get("max_rss") not in (None, "", "NA", "-") else 0.0
        rss[stage] = max(rss[stage], mib * 2**20)
        jobs[stage] += 1
    return {stage: {"jobs": jobs[stage], "seconds": round(s, 2), "max_rss_bytes": round(rss[stage])}
            for stage, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def stage_cost_lines(costs: dict[str, dict]) -> list[str]:
    """The stage costs as a terminal table."""
    total = sum(c["seconds"] for c in costs.values())
    lines = [f"{'stage':<10} {'jobs':>4} {'seconds':>9} {'share':>6} {'max RSS MiB':>11}"]
    lines += [f"{stage:<10} {c['jobs']:>4} {c['seconds']:>9.1f} {c['seconds'] / (total or 1):>6.1%} "
              f"{c['max_rss_bytes'] / 2**20:>11.0f}" for stage, c in costs.items()]
    return lines + [f"{'total':<10} {sum(c['jobs'] for c in costs.values()):>4} {total:>9.1f}"]
