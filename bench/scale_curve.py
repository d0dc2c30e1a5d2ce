"""The scale table and the data curve from ``train_equal_steps.py --json-out`` files.

Each file is one invocation: one target (hybrid, ``qwen3`` on the hybrid's completions or
``qwen3-own`` on its own: train_equal_steps.target_label), one data size (rows), every
trainer and seed it ran. This groups them by target and rows and prints, per trainer, the mean
over seeds of the acceptance length overall and per category, with the spread (lowest to highest
seed) overall; then ours (and each variant of ours a sweep ran, "ours (...)") against the best
of speculators' runs (overall, in percent, and the category where ours is furthest behind).
``--chart-dir``: one SVG per target, acceptance length (overall, mean over seeds) against rows, a
bar per trainer (a sweep's variants are screens of a point, not a curve: the table has them;
``--also-chart NAME`` draws that variant too, the one a sweep made the defaults, since a file's
``dflash-pipeline`` is the schema's defaults on the day it ran).

Usage: .venv/bin/python bench/scale_curve.py RUN.json [RUN.json ...] [--chart-dir DIR] [--also-chart NAME ...]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean

from dflash.report.charts import bars_svg

OURS = "dflash-pipeline"


def grouped(files: list[Path]) -> dict[tuple[str, int], dict[str, list[dict]]]:
    """(target, rows) -> trainer -> its runs (one a seed). The files of one point must share their
    data (``data``: a digest of the rows and held-out prompts; the scale data set's prompts draw on
    the machine's own text, so a build elsewhere may differ); where its trainers ran at several peak
    lrs, each one's name says its own (a variant's label names what it sets, its lr too)."""
    points: dict[tuple[str, int], list[tuple[Path, dict]]] = defaultdict(list)
    for path in files:
        point = json.loads(path.read_text())
        points[point["target"], point["rows"]].append((path, point))
    out: dict[tuple[str, int], dict[str, list[dict]]] = {}
    for key, entries in points.items():
        if len({point.get("data") for _, point in entries}) > 1:
            sys.exit(f"{', '.join(str(path) for path, _ in entries)}: not the same data at the {key[1]:,}-row point "
                     f"of the {key[0]} target (their 'data' digests differ): bench every point on one build")
        several_lrs = len({run["lr"] for _, point in entries for run in point["runs"]
                           if not is_variant(run["trainer"])}) > 1
        trainers: dict[str, list[dict]] = defaultdict(list)
        for path, point in entries:
            for run in point["runs"]:
                name = f"{run['trainer']}, lr {run['lr']:g}" if several_lrs else run["trainer"]
                if any(r["seed"] == run["seed"] for r in trainers[name]):
                    sys.exit(f"{path}: {name} seed {run['seed']} at the {key[1]:,}-row point is in another file too")
                trainers[name].append(run)
        out[key] = trainers
    return out


def is_variant(trainer: str) -> bool:
    return trainer.startswith("ours (")


def figures(runs: list[dict], categories: list[str]) -> dict:
    overall = [r["overall"]["acceptance_length"] for r in runs]
    return {"overall": mean(overall), "low": min(overall), "high": max(overall), "seeds": len(runs),
            **{c: mean(r["per_category"][c]["acceptance_length"] for r in runs) for c in categories}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--chart-dir", type=Path)
    ap.add_argument("--also-chart", action="append", default=[], metavar="NAME",
                    help="a variant of ours to draw in the charts too (\"ours (min_lr_ratio 0.3)\"); repeatable")
    a = ap.parse_args()
    points = grouped(a.files)
    curves: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for (target, rows), trainers in sorted(points.items()):
        categories = sorted(next(iter(trainers.values()))[0]["per_category"])
        table = {name: figures(runs, categories) for name, runs in trainers.items()}
        print(f"\n{target} target, {rows:,} rows (acceptance length, mean of seeds; spread: lowest to highest seed)")
        print(f"| trainer | seeds | overall | spread | {' | '.join(categories)} |")
        print("| --- " * (len(categories) + 4) + "|")
        for name, f in table.items():
            if not is_variant(name) or name in a.also_chart:
                curves[target][name][rows] = f["overall"]
            print(f"| {name} | {f['seeds']} | {f['overall']:.3f} | {f['low']:.3f} to {f['high']:.3f} | "
                  + " | ".join(f"{f[c]:.3f}" for c in categories) + " |")
        # ours against speculators (its sweep's variants, "ours (...)", are no competitor)
        others = {name: f for name, f in table.items() if not (is_variant(name) or name.startswith(OURS))}
        for name, ours in table.items() if others else ():
            if name in others:
                continue
            best_name, best = max(others.items(), key=lambda item: item[1]["overall"])
            behind = min(categories, key=lambda c: ours[c] - best[c])
            print(f"{name} - best other ({best_name}): {ours['overall'] - best['overall']:+.3f} "
                  f"({(ours['overall'] / best['overall'] - 1) * 100:+.1f}%) overall; furthest behind in "
                  f"{behind}: {ours[behind] - best[behind]:+.3f}")
    if a.chart_dir:
        a.chart_dir.mkdir(parents=True, exist_ok=True)
        for target, trainers in curves.items():
            sizes = sorted({rows for by_rows in trainers.values() for rows in by_rows})
            svg = bars_svg(f"{target} target: acceptance length by rows trained on (<= 2 epochs, mean of seeds)",
                           [f"{rows:,} rows" for rows in sizes],
                           {name: [by_rows.get(rows) for rows in sizes] for name, by_rows in trainers.items()},
                           "rows of the data set", "tokens per target forward", baseline=(1.0, "1.0 = no speed-up"),
                           height=320)
            (a.chart_dir / f"curve-{target}.svg").write_text(svg)
            print(f"chart: {a.chart_dir / f'curve-{target}.svg'}")


if __name__ == "__main__":
    main()
