"""Report stage: one self-contained HTML page (and its JSON) summarising a pipeline run.

Counts per stage, QA rates per check and category, the drafter's loss curve and the acceptance
length per category. The page has no external assets, so ``snakemake --report`` can embed it.
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

from dflash.io import atomic_path, read_json, write_json
from dflash.validate import EXAMPLES_PER_REASON


def summarize(config: dict, manifest: Path, qa_summary: Path, gates: Path, checkpoint: Path, eval_file: Path,
              durability: dict | None = None, pilot: Path | None = None, plan: Path | None = None,
              generated: list[Path] = ()) -> dict:
    qa = read_json(qa_summary)
    train_log = [json.loads(line) for line in (Path(checkpoint) / "train_log.jsonl").read_text().splitlines() if line]
    evaluation = read_json(eval_file)
    return {
        "run": config["run"],
        "prompts": read_json(manifest),
        "validate": {k: qa[k] for k in ("records", "kept", "rejected", "reject_rate", "checks", "categories")},
        "gates": read_json(gates)["gates"],
        "tokenized": {**qa["tokenized"], "trainable_by_category": qa["trainable_tokens"]["by_category"]},
        "train": {
            "steps": train_log[-1]["step"] if train_log else 0,
            "first_loss": train_log[0]["loss"] if train_log else None,
            "final_loss": train_log[-1]["loss"] if train_log else None,
            "curve": [[e["step"], e["loss"]] for e in train_log],
        },
        "eval": {k: evaluation[k] for k in ("overall", "per_category", "untrained") if k in evaluation},
        "durability": _durability(durability) if durability is not None else None,
        "pilot": read_json(pilot) if pilot else None,
        "plan": read_json(plan) if plan else None,
        "generation": _generation(config, [read_json(p) for p in generated]) if generated else None,
    }


def _generation(config: dict, summaries: list[dict]) -> dict:
    """What generation took and cost over its jobs' summaries (as generate.budget counts it)."""
    from dflash.budget import spend

    return {**spend(summaries, config), "requests": sum(s["requests"] for s in summaries),
            "job_seconds": round(sum(s["seconds"] for s in summaries), 2), "budget": config["generate"]["budget"]}


DURABILITY_LINES = 20  # files at risk named on the page; the count covers all


def _durability(found: dict) -> dict:
    """What ``storage.safe_to_destroy`` found when the report was written, for the page."""
    from datetime import datetime, timezone

    from dflash.storage import destroy_verdict

    lines, verdict = destroy_verdict(found, "this run")
    return {"storage": found["prefix"], "safe": found["safe"], "files_at_risk": len(found["files"]),
            "bytes_at_risk": found["bytes"], "incomplete": len(found["incomplete"]), "verdict": verdict,
            "at_risk": lines[:DURABILITY_LINES],
            "checked_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


STYLE = """body{font-family:sans-serif;margin:2em;max-width:70em} table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right} th{background:#f3f3f3} td:first-child{text-align:left}
pre{background:#f7f7f7;padding:6px;white-space:pre-wrap;word-break:break-all;max-height:20em;overflow:auto}
.plots svg{margin:0 1em 1em 0}"""


def _page(title: str, body: str) -> str:
    plain = re.sub("<[^>]+>", "", title)
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{plain}</title><style>{STYLE}</style>'
            f"</head><body>\n<h1>{title}</h1>\n{body}\n</body></html>\n")


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


def _check_rates(qa: dict) -> str:
    """Checks x categories: the share of each category's completions a check hit."""
    cats = sorted(qa["categories"])
    return _table(["check", "action", "hits", "rate"] + cats, [
        [code, c["action"], c["total"], f"{c['total'] / qa['records']:.1%}" if qa["records"] else "-"]
        + [f"{c['by_category'].get(cat, 0) / n:.1%}" if (n := qa["categories"][cat].get("records")) else "-"
           for cat in cats]
        for code, c in qa["checks"].items() if c["action"] != "off"
    ])


def _bars_svg(title: str, labels: list, series: dict[str, list[float]], unit: str = "",
              width: int = 320, height: int = 160) -> str:
    """Grouped bars: one group per label, one bar per series (colours in order)."""
    pad, colours = 28, ["#1f77b4", "#bbbbbb"]
    top = max((v for values in series.values() for v in values), default=0) or 1
    group = (width - 2 * pad) / max(1, len(labels))
    bar = group / len(series)
    bars = "".join(
        f'<rect x="{pad + i * group + j * bar:.1f}" y="{height - pad - (height - 2 * pad) * v / top:.1f}" '
        f'width="{bar - 2:.1f}" height="{(height - 2 * pad) * v / top:.1f}" fill="{colours[j % 2]}">'
        f"<title>{html.escape(f'{name} {labels[i]}: {v:g}')}</title></rect>"
        for j, (name, values) in enumerate(series.items()) for i, v in enumerate(values))
    step = max(1, len(labels) // 8)
    ticks = "".join(f'<text x="{pad + i * group:.1f}" y="{height - pad + 12}" font-size="9">'
                    f"{html.escape(str(labels[i]))}</text>" for i in range(0, len(labels), step))
    legend = "".join(f'<text x="{width - pad - 120}" y="{14 + 11 * (j + 1)}" font-size="9" fill="{colours[j % 2]}">'
                     f"{html.escape(name)}</text>" for j, name in enumerate(series) if len(series) > 1)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
            f'<rect width="100%" height="100%" fill="white"/><text x="{pad}" y="14" font-size="12">'
            f"{html.escape(title)}</text>{bars}{ticks}{legend}"
            f'<text x="{width - pad - 50}" y="{height - 4}" font-size="9">{html.escape(unit)}</text>'
            f'<text x="2" y="{pad}" font-size="9">{top:g}</text></svg>')


def _histogram_svg(title: str, bins: list[int], counts: list[int]) -> str:
    """Counts over fixed length bins (labelled by their lower edge)."""
    return _bars_svg(title, bins[:len(counts)], {"records": counts}, unit="tokens")


def _example_html(code: str, ex: dict) -> str:
    parts = [f"<p><code>{html.escape(ex['id'])}</code> ({html.escape(ex['category'])}): "
             f"{html.escape(str(ex['detail']))}</p><pre>{html.escape(ex['excerpt'])}</pre>"]
    if "offered_tools" in ex:
        offered = json.dumps(ex["offered_tools"], ensure_ascii=False, indent=1)
        parts.append(f"<p>offered tools</p><pre>{html.escape(offered)}</pre>"
                     f"<p>parsed calls</p><pre>{html.escape(json.dumps(ex['calls'], ensure_ascii=False))}</pre>")
    return "".join(parts)


def _share(n: int, of: int | None) -> str:
    return f"{n} of {of} ({n / of:.1%})" if of else str(n)


def render_qa_html(qa: dict) -> str:
    """The QA page: overall counts, rates per check and category, length plots, examples."""
    counts = _table(["category", "completions", "kept", "rejected", "reject rate", "median trainable tokens"], [
        [cat, c.get("records", 0), c.get("kept", 0), c.get("rejected", 0), f"{c['reject_rate']:.1%}",
         qa["trainable_tokens"]["by_category"].get(cat, {}).get("median", "-")]
        for cat, c in qa["categories"].items()
    ] + [["all", qa["records"], qa["kept"], qa["rejected"], f"{qa['reject_rate']:.1%}",
          qa["trainable_tokens"]["median"]]])
    plots = "".join(
        _histogram_svg(f"{cat}: output tokens (n={k['output_tokens']['n']}, mean {k['output_tokens']['mean']}, "
                       f"max {k['output_tokens']['max']})", qa["length_bins"], k["output_tokens"]["histogram"])
        for cat, k in qa["lengths"].items() if k.get("output_tokens", {}).get("n"))
    tok = qa["tokenized"]
    tokenization = _table(["rows", "tokens", "trainable tokens", "from ids", "from text", "decode differs from text",
                           "re-tokenized text differs from ids (sample)", "prompt boundary unstable", "truncated",
                           "dropped (no anchor)"], [[
        tok.get("rows", 0), tok.get("tokens", 0), tok.get("trainable_tokens", 0), tok.get("from_ids", 0),
        tok.get("from_text", 0), tok.get("text_mismatch", 0), _share(tok.get("retokenize_differs", 0), tok.get("retokenize_checked")),
        _share(tok.get("boundary_unstable", 0), tok.get("boundary_checked")), tok.get("truncated", 0),
        tok.get("dropped_no_anchor", 0)]])
    trainable_plots = "".join(
        _histogram_svg(f"{cat}: trainable tokens per row (n={c['rows']}, median {c['median']})", qa["length_bins"],
                       c["histogram"])
        for cat, c in qa["trainable_tokens"]["by_category"].items() if c.get("histogram"))
    examples = "".join(
        f"<h3>{html.escape(code)} ({qa['checks'][code]['total']} hits, {qa['checks'][code]['action']})</h3>"
        + "".join(_example_html(code, ex) for ex in found)
        for code, found in qa["examples"].items())
    return _page("Completion quality", f"""
<p>{qa['records']} completions in {qa['shards']} shards: {qa['kept']} kept, {qa['rejected']} rejected.</p>
{counts}
<h2>Checks: share of each category's completions hit</h2>{_check_rates(qa)}
<h2>Output length per category</h2><div class="plots">{plots or "<p>no completions</p>"}</div>
<h2>Tokenization</h2>
<p>Rows are the target's own token ids where the records have them; "re-tokenized text differs" is how
often tokenizing the text again would not give those ids (what rows from text would get wrong).</p>
{tokenization}<div class="plots">{trainable_plots}</div>
<h2>Examples per reason</h2>
<p>Up to {EXAMPLES_PER_REASON} per reason code, with the text around the problem.</p>
{examples or "<p>no check hit any completion</p>"}
""")


def write_qa_page(qa_summary: Path, html_path: Path) -> None:
    with atomic_path(html_path) as tmp:
        tmp.write_text(render_qa_html(read_json(qa_summary)), encoding="utf-8")


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
    checks = _check_rates(v)
    per_cat = _table(["category", "completions", "kept", "rejected", "trainable tokens"], [
        [cat, c.get("records", 0), c.get("kept", 0), c.get("rejected", 0),
         t["trainable_by_category"].get(cat, {}).get("total", 0)] for cat, c in v["categories"].items()
    ])
    gates = _table(["gate", "threshold", "measured", "verdict"], [
        [g["gate"], g["threshold"], round(g["value"], 4), "pass" if g["passed"] else "FAIL"] for g in s["gates"]])
    rows = [(cat, e) for cat, e in [*sorted(ev.get("per_category", {}).items()), ("overall", ev.get("overall", {}))]
            if e]
    untrained = ev.get("untrained", {})

    def plain(cat: str) -> float | None:
        e = untrained.get("overall") if cat == "overall" else untrained.get("per_category", {}).get(cat)
        return (e or {}).get("acceptance_length")

    acceptance = _table(["category", "acceptance length", "untrained drafter", "prompts", "tokens",
                         "target forwards", "plain decoding forwards", "forwards saved"], [
        [cat, f"{e['acceptance_length']:.3f}", f"{plain(cat):.3f}" if plain(cat) else "-", e["prompts"], e["tokens"],
         e["target_forwards"], e.get("plain_forwards", e["tokens"]),
         f"{e['tokens'] - e['target_forwards']} ({(e['tokens'] - e['target_forwards']) / max(1, e['tokens']):.1%})"]
        for cat, e in rows
    ]) + _bars_svg("acceptance length per category", [cat for cat, _ in rows],
                   {"trained": [e["acceptance_length"] for _, e in rows],
                    **({"untrained": [plain(cat) or 0 for cat, _ in rows]} if untrained else {})})
    loss = (f"<p>loss {tr['first_loss']:.3f} &rarr; {tr['final_loss']:.3f}</p>" if tr["curve"] else "") + _loss_svg(tr["curve"])
    return _page(f"dflash-pipeline run <code>{html.escape(s['run'])}</code>", f"""{_durability_html(s.get("durability"))}
<h2>Counts per stage</h2>{stages}
<h2>Validation: checks per category</h2>
<p>Share of each category's completions the check hit (details and examples: qa.html).</p>{checks}
<h2>Quality gates</h2>{gates}
<h2>Per category</h2>{per_cat}
<h2>Drafter training loss</h2>{loss}
<h2>Acceptance length on held-out prompts</h2>
<p>Mean tokens accepted per target forward (greedy speculative decoding; 1.0 = no speed-up).</p>{acceptance}
{_generation_html(s.get("generation"), s.get("plan"))}
{_plan_html(s.get("pilot"), s.get("plan"))}
""")


def _generation_html(g: dict | None, plan: dict | None) -> str:
    """Generation's spend, and its output tokens against the plan's forecast."""
    if not g:
        return ""
    forecast = ""
    if plan and "error" not in plan and g["output_tokens"]:
        forecast = (f" (forecast {plan['output_tokens']:,.0f} from {plan['output_tokens_from']}: "
                    f"{plan['output_tokens'] / g['output_tokens'] - 1:+.1%})")
    cost = f", {g['cost']:,.2f} $" if g["cost"] is not None else ""
    limits = ", ".join(f"{k} {v}" for k, v in g["budget"].items() if k.startswith("max_") and v is not None)
    return (f"<h2>Generation</h2><p>{g['requests']:,} requests, {g['output_tokens']:,} output tokens{forecast}; "
            f"{g['wall_hours'] * 3600:,.1f} s while any generate job ran ({g['job_seconds']:,.1f} s of job time), "
            f"{g['node_hours']:.4g} node-hours{cost}" + (f"; budget: {html.escape(limits)}" if limits else "")
            + "</p>")


def _plan_html(pilot: dict | None, plan: dict | None) -> str:
    """The pilot's findings and the forecast made from them, as `dflash plan` prints them."""
    from dflash.pilot import pilot_lines
    from dflash.plan import plan_lines

    lines = (pilot_lines(pilot) if pilot and pilot["records"] else []) + (plan_lines(plan) if plan else [])
    return (f"<h2>Pilot and plan</h2><p>What the pilot measured before the full generation, and the forecast "
            f"from it (results/pilot/summary.json, results/plan.json).</p><pre>{html.escape(chr(10).join(lines))}</pre>"
            if lines else "")


def _durability_html(d: dict | None) -> str:
    """Can the machine go? A line at the top: the verdict of `snakemake safe_to_destroy` when the
    report was written (the report's own files are uploaded just after)."""
    if not d:
        return ""
    colour = "#e6f4ea" if d["safe"] else "#fdecea"
    where = f"outputs in <code>{html.escape(d['storage'])}</code>" if d["storage"] else "outputs on this machine only"
    listed = (f"<details><summary>at risk (the first {len(d['at_risk'])})</summary><pre>"
              f"{html.escape(chr(10).join(d['at_risk']))}</pre></details>" if d["at_risk"] else "")
    return (f'<p style="background:{colour};padding:6px">Machine: {where}. {html.escape(d["verdict"])} '
            f'(checked {html.escape(d["checked_at"])}; <code>snakemake safe_to_destroy</code> checks again)</p>{listed}')


def write_report(config: dict, manifest: Path, qa_summary: Path, gates: Path, checkpoint: Path, eval_file: Path,
                 html_path: Path, json_path: Path, durability: dict | None = None, pilot: Path | None = None,
                 plan: Path | None = None, generated: list[Path] = ()) -> dict:
    """The summary page and its JSON; ``durability``: what ``storage.safe_to_destroy`` found;
    ``pilot``, ``plan``: their JSON files; ``generated``: the generate jobs' summaries."""
    summary = summarize(config, manifest, qa_summary, gates, checkpoint, eval_file, durability, pilot, plan, generated)
    write_json(json_path, summary)
    with atomic_path(html_path) as tmp:
        tmp.write_text(render_html(summary), encoding="utf-8")
    return summary
