"""Report stage: one self-contained HTML page (and its JSON) summarising a pipeline run.

Counts per stage, QA rates per check and category, the drafter's loss curve and the acceptance
length per category. The page has no external assets, so ``snakemake --report`` can embed it.
"""
from __future__ import annotations

import html
import json
from collections import Counter, defaultdict
from pathlib import Path

from dflash.io import atomic_path, read_json, write_json


def summarize(config: dict, manifest: Path, qa_files: list[Path], tokenized_indexes: list[Path],
              checkpoint: Path, eval_file: Path) -> dict:
    qa = [read_json(p) for p in qa_files]
    checks: dict[str, dict] = {}
    by_cat: dict[str, Counter] = defaultdict(Counter)
    for q in qa:
        for code, c in q["checks"].items():
            entry = checks.setdefault(code, {"action": c["action"], "total": 0, "by_category": Counter()})
            entry["total"] += c["total"]
            entry["by_category"].update(c["by_category"])
        for cat, counts in q["categories"].items():
            by_cat[cat].update(counts)
    records = sum(q["records"] for q in qa)
    tok_stats = [read_json(p)["stats"] for p in tokenized_indexes]
    trainable: dict[str, Counter] = defaultdict(Counter)
    for s in tok_stats:
        for cat, c in s["trainable_by_category"].items():
            trainable[cat].update(c)
    train_log = [json.loads(line) for line in (Path(checkpoint) / "train_log.jsonl").read_text().splitlines() if line]
    evaluation = read_json(eval_file)
    return {
        "run": config["run"],
        "prompts": read_json(manifest),
        "validate": {
            "records": records,
            "kept": sum(q["kept"] for q in qa),
            "rejected": sum(q["rejected"] for q in qa),
            "reject_rate": round(sum(q["rejected"] for q in qa) / records, 4) if records else 0.0,
            "checks": {code: {**c, "rate": round(c["total"] / records, 4) if records else 0.0,
                              "by_category": dict(c["by_category"])} for code, c in checks.items()},
            "categories": {cat: dict(c) for cat, c in sorted(by_cat.items())},
        },
        "tokenized": {
            "rows": sum(s["rows"] for s in tok_stats),
            "tokens": sum(s["tokens"] for s in tok_stats),
            "trainable_tokens": sum(s["trainable_tokens"] for s in tok_stats),
            "dropped_no_anchor": sum(s["dropped_no_anchor"] for s in tok_stats),
            "truncated": sum(s["truncated"] for s in tok_stats),
            "trainable_by_category": {cat: dict(c) for cat, c in sorted(trainable.items())},
        },
        "train": {
            "steps": train_log[-1]["step"] if train_log else 0,
            "first_loss": train_log[0]["loss"] if train_log else None,
            "final_loss": train_log[-1]["loss"] if train_log else None,
            "curve": [[e["step"], e["loss"]] for e in train_log],
        },
        "eval": {k: evaluation[k] for k in ("overall", "per_category") if k in evaluation},
    }


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _loss_svg(curve: list[list[float]], width: int = 560, height: int = 220) -> str:
    if len(curve) < 2:
        return "<p>no loss curve</p>"
    pad = 40
    xs, ys = [c[0] for c in curve], [c[1] for c in curve]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (width - 2 * pad) / ((x1 - x0) or 1)
    sy = (height - 2 * pad) / ((y1 - y0) or 1)
    points = " ".join(f"{pad + (x - x0) * sx:.1f},{height - pad - (y - y0) * sy:.1f}" for x, y in curve)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
            f'<rect width="100%" height="100%" fill="white"/>'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{points}"/>'
            f'<text x="{pad}" y="{pad - 10}" font-size="12">loss {y1:.3f}</text>'
            f'<text x="{pad}" y="{height - 8}" font-size="12">step {x0:g}</text>'
            f'<text x="{width - pad - 60}" y="{height - 8}" font-size="12">step {x1:g}</text>'
            f'<text x="{width - pad - 90}" y="{height - pad + 14}" font-size="12">loss {y0:.3f}</text></svg>')


def render_html(s: dict) -> str:
    p, v, t, tr, ev = s["prompts"], s["validate"], s["tokenized"], s["train"], s["eval"]
    stages = _table(["stage", "count"], [
        ["training prompts", p["prompts"]], ["prompt shards", len(p["shards"])], ["held-out prompts", p["heldout"]],
        ["duplicates dropped", p["dropped"].get("duplicate", 0)], ["completions", v["records"]],
        ["validated (kept)", v["kept"]], ["rejected", f"{v['rejected']} ({v['reject_rate']:.1%})"],
        ["tokenized rows", t["rows"]], ["tokens", t["tokens"]], ["trainable tokens", t["trainable_tokens"]],
        ["rows dropped (no anchor)", t["dropped_no_anchor"]], ["rows truncated", t["truncated"]],
        ["train steps", tr["steps"]],
    ])
    cats = sorted(v["categories"])
    checks = _table(["check", "action", "hits", "rate"] + cats, [
        [code, c["action"], c["total"], f"{c['rate']:.1%}"] + [c["by_category"].get(cat, 0) for cat in cats]
        for code, c in v["checks"].items()
    ])
    per_cat = _table(["category", "completions", "kept", "rejected", "trainable tokens"], [
        [cat, c.get("records", 0), c.get("kept", 0), c.get("rejected", 0),
         t["trainable_by_category"].get(cat, {}).get("tokens", 0)] for cat, c in v["categories"].items()
    ])
    acceptance = _table(["category", "acceptance length", "prompts", "tokens", "target forwards"], [
        [cat, f"{e['acceptance_length']:.3f}", e["prompts"], e["tokens"], e["target_forwards"]]
        for cat, e in [*sorted(ev.get("per_category", {}).items()), ("overall", ev.get("overall", {}))] if e
    ])
    loss = (f"<p>loss {tr['first_loss']:.3f} &rarr; {tr['final_loss']:.3f}</p>" if tr["curve"] else "") + _loss_svg(tr["curve"])
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>dflash-pipeline: {html.escape(s['run'])}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:60em}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}} th{{background:#f3f3f3}} td:first-child{{text-align:left}}</style>
</head><body>
<h1>dflash-pipeline run <code>{html.escape(s['run'])}</code></h1>
<h2>Counts per stage</h2>{stages}
<h2>Validation: checks per category</h2>{checks}
<h2>Per category</h2>{per_cat}
<h2>Drafter training loss</h2>{loss}
<h2>Acceptance length on held-out prompts</h2>
<p>Mean tokens accepted per target forward (greedy speculative decoding; 1.0 = no speed-up).</p>{acceptance}
</body></html>
"""


def write_report(config: dict, manifest: Path, qa_files: list[Path], tokenized_indexes: list[Path],
                 checkpoint: Path, eval_file: Path, html_path: Path, json_path: Path) -> dict:
    summary = summarize(config, manifest, qa_files, tokenized_indexes, checkpoint, eval_file)
    write_json(json_path, summary)
    with atomic_path(html_path) as tmp:
        tmp.write_text(render_html(summary), encoding="utf-8")
    return summary
