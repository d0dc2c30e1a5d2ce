"""The report's two self-contained HTML pages on a pipeline run.

``summary.html`` leads with the answer (records kept, trainable tokens, acceptance trained vs
untrained, gates, what generation cost, time per stage), then the detail: counts per stage, QA
rates per check and category, the loss curve, acceptance per category, the pilot and the plan.
``qa.html`` holds the QA detail. The pages link to each other and name the run's date, config
digest and pipeline commit. They have no external assets (inline SVG), so ``snakemake --report``
can embed them.
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

from dflash.core.io import atomic_path, read_json
from dflash.core.units import human_bytes, human_duration, percent
from dflash.core.vocabulary import EXAMPLES_PER_REASON
from dflash.plan.pilot import pilot_lines
from dflash.plan.stage import plan_lines
from dflash.report.charts import bars_svg, fmt, histogram_svg, loss_svg
from dflash.report.headline import gate_value, headline, loop_abort_saving

SUMMARY_PAGE, QA_PAGE = "summary.html", "qa.html"  # side by side in report/, linked by these names


STYLE = """body{font-family:sans-serif;margin:2em;max-width:75em;color:#222}
table{border-collapse:collapse;margin:1em 0} td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3} td:first-child,th:first-child{text-align:left}
td.text,th.text{text-align:left} td{white-space:nowrap} td.text{white-space:normal}
pre{background:#f7f7f7;padding:6px;white-space:pre-wrap;word-break:break-all;max-height:20em;overflow:auto}
.plots{display:flex;flex-wrap:wrap;gap:1em;margin:1em 0} .plots svg{border:1px solid #eee}
.about{color:#555;font-size:90%;margin-top:-.5em} .about a{font-weight:bold}
.headline{border:2px solid #1f77b4;border-radius:6px;padding:.8em 1.2em;background:#f6faff;margin:1em 0}
.fact{display:grid;grid-template-columns:10em 1fr;gap:0 1em;padding:.45em 0;border-bottom:1px solid #dde8f3}
.fact:last-of-type{border-bottom:none} .fact .label{color:#555;padding-top:.2em}
.fact .main{font-size:130%;font-weight:bold} .fact .note{grid-column:2;color:#333;font-size:92%}
.fact.bad .main{color:#c0392b} .bar{background:#1f77b4;height:.9em;min-width:1px} td.barcell{width:14em}"""


def _page(title: str, body: str, about: dict | None, run: str | None, other: tuple[str, str]) -> str:
    """A page with its provenance line and a link to the other page (``other``: file, words)."""
    plain = re.sub("<[^>]+>", "", title)
    facts = [f"run <code>{html.escape(run)}</code>"] if run else []
    if about:
        facts += [f"written {html.escape(about['date'])}",
                  f'config <code title="first 12 hex digits of the SHA-256 of the config as canonical JSON (keys '
                  f'sorted)">{html.escape(about["config_digest"])}</code> (SHA-256 of its canonical JSON)',
                  f"pipeline commit <code>{html.escape(about['commit'])}</code>"]
    facts.append(f'<a href="{other[0]}">{html.escape(other[1])} &rarr;</a>')
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{plain}</title><style>{STYLE}</style>'
            f'</head><body>\n<h1>{title}</h1>\n<p class="about">{" &middot; ".join(facts)}</p>\n{body}\n'
            f"</body></html>\n")


def _table(headers: list[str], rows: list[list], raw: tuple[int, ...] = (),
           classes: dict[int, str] | None = None) -> str:
    """``raw``: column numbers whose cells are HTML already; ``classes``: a CSS class per column number."""
    classes = classes or {}

    def cell(tag: str, i: int, c) -> str:
        attr = f' class="{classes[i]}"' if i in classes else ""
        return f"<{tag}{attr}>{c if i in raw and tag == 'td' else html.escape(str(c))}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(cell("td", i, c) for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _check_rates(qa: dict) -> str:
    """Checks x categories: the share of each category's completions a check hit, the most hits
    first; the checks that hit nothing named in a line below."""
    cats = sorted(qa["categories"])
    on = [(code, c) for code, c in qa["checks"].items() if c["action"] != "off"]
    hit = sorted(((code, c) for code, c in on if c["total"]), key=lambda kv: -kv[1]["total"])
    silent = [code for code, c in on if not c["total"]]
    return (_table(["check", "action", "hits", "rate"] + cats, [
        [code, c["action"], f"{c['total']:,}", f"{c['total'] / qa['records']:.1%}" if qa["records"] else "-"]
        + [f"{c['by_category'].get(cat, 0) / n:.1%}" if (n := qa["categories"][cat].get("records")) else "-"
           for cat in cats]
        for code, c in hit
    ]) if hit else "<p>No check hit any completion.</p>") + (
        f"<p>No hits: {html.escape(', '.join(silent))}.</p>" if silent and hit else "")


def _example_html(code: str, ex: dict) -> str:
    parts = [f"<p><code>{html.escape(ex['id'])}</code> ({html.escape(ex['category'])}): "
             f"{html.escape(str(ex['detail']))}</p><pre>{html.escape(ex['excerpt'])}</pre>"]
    if "offered_tools" in ex:
        offered = json.dumps(ex["offered_tools"], ensure_ascii=False, indent=1)
        parts.append(f"<p>offered tools</p><pre>{html.escape(offered)}</pre>"
                     f"<p>parsed calls</p><pre>{html.escape(json.dumps(ex['calls'], ensure_ascii=False))}</pre>")
    return "".join(parts)


def _share(n: int, of: int | None) -> str:
    return f"{n:,} of {of:,} ({n / of:.1%})" if of else f"{n:,}"


def render_qa_html(qa: dict, about: dict | None = None, run: str | None = None) -> str:
    """The QA page: overall counts, rates per check and category, length plots, examples."""
    counts = _table(["category", "completions", "kept", "kept calling a tool", "rejected", "reject rate",
                     "median trainable tokens"], [
        [cat, fmt(c.get("records", 0)), fmt(c.get("kept", 0)), fmt(c.get("kept_calling_tool", 0)),
         fmt(c.get("rejected", 0)), percent(c["reject_rate"]),
         fmt(qa["trainable_tokens"]["by_category"].get(cat, {}).get("median"))]
        for cat, c in qa["categories"].items()
    ] + [["all", fmt(qa["records"]), fmt(qa["kept"]),
          fmt(sum(c.get("kept_calling_tool", 0) for c in qa["categories"].values())), fmt(qa["rejected"]),
          percent(qa["reject_rate"]), fmt(qa["trainable_tokens"]["median"])]])
    plots = "".join(
        histogram_svg(f"{cat}: output tokens (n={k['output_tokens']['n']}, mean {fmt(k['output_tokens']['mean'])}, "
                       f"max {fmt(k['output_tokens']['max'])})", qa["length_bins"], k["output_tokens"]["histogram"],
                       "output tokens per completion")
        for cat, k in qa["lengths"].items() if k.get("output_tokens", {}).get("n"))
    tok = qa["tokenized"]
    tokenization = _table(["rows", "tokens", "trainable tokens", "from ids", "from text", "decode differs from text",
                           "re-tokenized text differs from ids (sample)", "prompt boundary unstable", "truncated",
                           "dropped (no anchor)"], [[
        fmt(tok.get("rows", 0)), fmt(tok.get("tokens", 0)), fmt(tok.get("trainable_tokens", 0)),
        fmt(tok.get("from_ids", 0)), fmt(tok.get("from_text", 0)), fmt(tok.get("text_mismatch", 0)),
        _share(tok.get("retokenize_differs", 0), tok.get("retokenize_checked")),
        _share(tok.get("boundary_unstable", 0), tok.get("boundary_checked")), fmt(tok.get("truncated", 0)),
        fmt(tok.get("dropped_no_anchor", 0))]])
    trainable_plots = "".join(
        histogram_svg(f"{cat}: trainable tokens per row (n={c['rows']}, median {fmt(c['median'])})",
                       qa["length_bins"], c["histogram"], "trainable tokens per row")
        for cat, c in qa["trainable_tokens"]["by_category"].items() if c.get("histogram"))
    examples = "".join(
        f"<h3>{html.escape(code)} ({qa['checks'][code]['total']} hit{'s' * (qa['checks'][code]['total'] != 1)}, "
        f"{qa['checks'][code]['action']})</h3>"
        + "".join(_example_html(code, ex) for ex in found)
        for code, found in qa["examples"].items())
    return _page("Completion quality", f"""
<p>{qa['records']:,} completions in {qa['shards']} shards: {qa['kept']:,} kept, {qa['rejected']:,} rejected
({percent(qa['reject_rate'])}).</p>
{counts}
<h2>Checks: share of each category's completions hit</h2>{_check_rates(qa)}
<h2>Output length per category</h2>
<p>Completions per length range (tokens the target generated), up to the range holding the longest.</p>
<div class="plots">{plots or "<p>no completions</p>"}</div>
<h2>Tokenization</h2>
<p>Rows are the target's own token ids where the records have them; "re-tokenized text differs" is how
often tokenizing the text again would not give those ids (what rows from text would get wrong).</p>
{tokenization}<div class="plots">{trainable_plots}</div>
<h2>Examples per reason</h2>
<p>Up to {EXAMPLES_PER_REASON} per reason code, with the text around the problem.</p>
{examples or "<p>no check hit any completion</p>"}
""", about, run, (SUMMARY_PAGE, "run summary"))


def write_qa_page(qa_summary: Path, html_path: Path, about: dict | None = None, run: str | None = None) -> None:
    """``about``: :func:`dflash.report.stage.provenance`; ``run``: the run's name."""
    with atomic_path(html_path) as tmp:
        tmp.write_text(render_qa_html(read_json(qa_summary), about, run), encoding="utf-8")


def _headline_html(s: dict) -> str:
    """The answer first: one row per fact (a figure, then what it means), the time per stage below."""
    def fact(label: str, main: str, note: str, ok: bool) -> str:
        lines = "<br>".join(html.escape(line) for line in note.split("\n"))
        return (f'<div class="fact{"" if ok else " bad"}"><div class="label">{html.escape(label)}</div>'
                f'<div class="main">{html.escape(main)}</div><div class="note">{lines}</div></div>')

    facts = "".join(fact(*f) for f in headline(s))
    return f'<div class="headline">{facts}{_stages_html(s.get("stages"))}</div>'


def _stages_html(stages: dict | None) -> str:
    """Job time and peak memory per stage (Snakemake's benchmark files)."""
    if not stages:
        return ""
    total = sum(c["seconds"] for c in stages.values()) or 1
    return _table(["stage", "jobs", "job time", "share", "", "peak memory"], [
        [stage, c["jobs"], human_duration(c["seconds"]), percent(c["seconds"] / total),
         f'<div class="bar" style="width:{100 * c["seconds"] / total:.1f}%"></div>',
         human_bytes(c["max_rss_bytes"]) if c["max_rss_bytes"] else "-"]
        for stage, c in stages.items()
    ], raw=(4,), classes={4: "barcell"})


def _serving_html(commands: dict | None) -> str:
    if not commands:
        return "<p>-</p>"
    lines = [("vLLM", commands["vllm"]), ("vLLM's CPU build", commands["vllm_cpu"]), ("SGLang (GPU)", commands["sglang"])]
    return ("<p>The checkpoint is what both engines read; no conversion (docs/serving.md; "
            "<code>dflash serve-command &lt;checkpoint&gt;</code> prints these).</p>"
            + "".join(f"<p>{name}:</p><pre>{html.escape(line)}</pre>" for name, line in lines if line)
            + "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in commands["notes"]) + "</ul>")


def render_html(s: dict) -> str:
    p, v, t, tr, ev = s["prompts"], s["validate"], s["tokenized"], s["train"], s["eval"]
    stages = _table(["stage", "count"], [[name, fmt(n) if isinstance(n, (int, float)) else n] for name, n in [
        ["training prompts", p["prompts"]], ["prompt shards", len(p["shards"])], ["held-out prompts", p["heldout"]],
        ["duplicates dropped", p["dropped"].get("duplicate", 0)], ["completions", v["records"]],
        ["validated (kept)", v["kept"]], ["rejected", f"{v['rejected']:,} ({percent(v['reject_rate'])})"],
        ["tokenized rows", t["rows"]], ["tokens", t["tokens"]], ["trainable tokens", t["trainable_tokens"]],
        ["rows dropped (no anchor)", t["dropped_no_anchor"]], ["rows truncated", t["truncated"]],
        ["train steps", tr["steps"]],
    ]])
    checks = _check_rates(v)
    per_cat = _table(["category", "completions", "kept", "kept calling a tool", "rejected", "trainable tokens"], [
        [cat, fmt(c.get("records", 0)), fmt(c.get("kept", 0)), fmt(c.get("kept_calling_tool", 0)),
         fmt(c.get("rejected", 0)), fmt(t["trainable_by_category"].get(cat, {}).get("total", 0))]
        for cat, c in v["categories"].items()
    ])
    gates = _table(["gate", "limit", "measured", "verdict", "what it measured"], [
        [g["gate"], gate_value(g["gate"], g["threshold"]), gate_value(g["gate"], g["value"]),
         "pass" if g["passed"] else "FAIL", g.get("message", "").removeprefix(f"gate {g['gate']}: ")]
        for g in s["gates"]], classes={4: "text"})
    rows = [(cat, e) for cat, e in [*sorted(ev.get("per_category", {}).items()), ("overall", ev.get("overall", {}))]
            if e]
    untrained = ev.get("untrained", {})

    def plain(cat: str) -> float | None:
        e = untrained.get("overall") if cat == "overall" else untrained.get("per_category", {}).get(cat)
        return (e or {}).get("acceptance_length")

    def per_step(e: dict) -> str:  # eval files written before the per-step figure have none
        return f"{e['acceptance_length_per_step']:.3f}" if "acceptance_length_per_step" in e else "-"

    acceptance = _table(["category", "acceptance length", "untrained drafter", "per verify step (vLLM's figure)",
                         "prompts", "tokens", "target forwards", "plain decoding forwards", "forwards saved"], [
        [cat, f"{e['acceptance_length']:.3f}", f"{plain(cat):.3f}" if plain(cat) else "-", per_step(e),
         fmt(e["prompts"]),
         fmt(e["tokens"]), fmt(e["target_forwards"]), fmt(e.get("plain_forwards", e["tokens"])),
         f"{e['tokens'] - e['target_forwards']:,} ({(e['tokens'] - e['target_forwards']) / max(1, e['tokens']):.1%})"]
        for cat, e in rows
    ]) + '<div class="plots">' + bars_svg(
        "acceptance length per category", [cat for cat, _ in rows],
        {"trained": [e["acceptance_length"] for _, e in rows],
         **({"untrained": [plain(cat) for cat, _ in rows]} if untrained else {})},
        "held-out prompts of each category", "tokens per target forward", baseline=(1.0, "1.0 = no speed-up"),
        height=290) + "</div>"
    positions = _positions_html(rows, ev.get("thinking_off"))
    loss = loss_svg(tr["curve"])
    engine = " through vLLM (eval.engine: vllm)" if ev.get("engine") == "vllm" else ""
    serving = _serving_html(s.get("serving"))
    return _page(f"dflash-pipeline run <code>{html.escape(s['run'])}</code>", f"""{_durability_html(s.get("durability"))}
{_headline_html(s)}
<h2>Counts per stage</h2>{stages}
<h2>Validation: checks per category</h2>
<p>Share of each category's completions the check hit (details and examples:
<a href="{QA_PAGE}">{QA_PAGE}</a>).</p>{checks}
<h2>Quality gates</h2>{gates}
<h2>Per category</h2>{per_cat}
<h2>Drafter training loss</h2><div class="plots">{loss}</div>{_curves_html(s.get("curves"))}
{_features_html(s.get("features"))}
<h2>Acceptance length on held-out prompts</h2>
<p>Greedy speculative decoding of the held-out prompts{engine}. <b>Acceptance length</b>: tokens per target
forward, the prefill included (1.0 = no speed-up): what the drafter saves. <b>Per verify step</b>: 1 + accepted
draft tokens per verify step, the prefill left out: the "mean acceptance length" vLLM reports and the papers' tau;
compare published figures with this one.</p>{acceptance}
{positions}
<h2>Serving it</h2>{serving}
{_generation_html(s.get("generation"), s.get("plan"))}
{_plan_html(s.get("pilot"), s.get("plan"))}
""", s.get("about"), None, (QA_PAGE, "completion quality (QA)"))


def _curves_html(c: dict | None) -> str:
    """Where the live curves are: loss, lr, grad norm, tokens/s, accuracy per block position, and
    the held-out acceptance."""
    if not c:
        return ""
    places = ([f"TensorBoard: <code>tensorboard --logdir {html.escape(c['tensorboard'])}</code>"] if c["tensorboard"]
              else []) + ([f"W&amp;B project <code>{html.escape(c['wandb'])}</code>"] if c["wandb"] else []) + (
              [f"MLflow at <code>{html.escape(c['mlflow'])}</code>"] if c["mlflow"] else [])
    if not places:
        return ""
    return (f"<p>Live curves (loss, lr, gradient norm, tokens/s, accuracy per block position, held-out "
            f"acceptance): {'; '.join(places)}.</p>")


def _features_html(f: dict | None) -> str:
    """The target's features the drafter read, per layer: what the feature guards checked."""
    if not f:
        return ""
    table = _table(["target layer", "RMS (lowest shard)", "RMS (highest shard)", "largest |value|",
                    "smallest spread across tokens"],
                   [[s["layer"], f"{s['rms_min']:.4g}", f"{s['rms_max']:.4g}", f"{s['max_abs']:.4g}",
                     f"{s['spread_min']:.4g}"] for s in f["layers"]])
    return (f"<h2>Target features</h2><p>The hidden states the drafter trained on, over {fmt(f['shards'])} shard(s) "
            f"and {fmt(f['tokens'])} tokens: training stops on NaN, all-zero or constant features, or a shard whose "
            f"RMS is off the first shard's by more than <code>train.feature_rms_range</code>.</p>{table}")


def _positions_html(rows: list[tuple[str, dict]], thinking_off: dict | None) -> str:
    """Per category: how often each draft position is accepted and how many drafted tokens each
    verify step accepts; thinking off beside thinking on (eval files before these figures: none)."""
    rows = [(cat, e) for cat, e in rows if "acceptance_rate_per_position" in e]
    if not rows:
        return ""

    def off(cat: str) -> dict:
        return ((thinking_off or {}).get("overall") if cat == "overall"
                else (thinking_off or {}).get("per_category", {}).get(cat)) or {}

    table = ""
    if thinking_off:
        table = _table(["category", "thinking on: acceptance length", "thinking off", "on: per verify step", "off",
                        "off / on"], [
            [cat, f"{e['acceptance_length']:.3f}", f"{off(cat)['acceptance_length']:.3f}" if off(cat) else "-",
             f"{e['acceptance_length_per_step']:.3f}",
             f"{off(cat)['acceptance_length_per_step']:.3f}" if off(cat) else "-",
             f"{off(cat)['acceptance_length'] / e['acceptance_length']:.2f}" if off(cat) else "-"]
            for cat, e in rows])
    charts = []
    for cat, e in rows:
        rates = e["acceptance_rate_per_position"]
        series = {"thinking on": rates}
        if off(cat).get("acceptance_rate_per_position"):
            series["thinking off"] = (off(cat)["acceptance_rate_per_position"] + [None] * len(rates))[:len(rates)]
        charts.append(bars_svg(f"{cat}: acceptance rate per draft position", [str(k + 1) for k in range(len(rates))],
                               series, "draft position k (accepted / drafted at k)", "acceptance rate"))
        histogram = e["accepted_length_histogram"]
        charts.append(bars_svg(f"{cat}: draft tokens accepted per verify step (n={fmt(sum(histogram))})",
                               [str(n) for n in range(len(histogram))], {"verify steps": histogram},
                               "draft tokens accepted (n + 1 tokens yielded)", "verify steps"))
    off_note = ("<b>Thinking off</b>: the trained drafter on the same held-out prompts rendered with "
                "<code>enable_thinking: false</code>; drafters trained on thinking traces are known to accept less there."
                if thinking_off else "Thinking off was not decoded (<code>eval.thinking_off: false</code>).")
    return f"""<h2>Acceptance per draft position</h2>
<p><b>Acceptance rate at position k</b>: of the verify steps that drafted a k-th token, the share that accepted it
(it and every drafted token before it matched the target's greedy ones). <b>Histogram</b>: verify steps by the
number of drafted tokens they accepted (thinking on). {off_note}</p>{table}<div class="plots">{"".join(charts)}</div>"""


def _generation_html(g: dict | None, plan: dict | None) -> str:
    """Generation's spend, and its output tokens against the plan's forecast."""
    if not g:
        return ""
    forecast = ""
    if plan and "error" not in plan and g["output_tokens"]:
        forecast = (f" (forecast {plan['output_tokens']:,.0f} from {plan['output_tokens_from']}: "
                    f"{plan['output_tokens'] / g['output_tokens'] - 1:+.1%})")
    cost = f", ${g['cost']:,.2f}" if g["cost"] is not None else ""
    limits = ", ".join(f"{k} {v}" for k, v in g["budget"].items() if k.startswith("max_") and v is not None)
    return (f"<h2>Generation</h2><p>{g['requests']:,} requests, {g['output_tokens']:,} output tokens{forecast}; "
            f"{human_duration(g['wall_hours'] * 3600)} while any generate job ran ({human_duration(g['job_seconds'])} of job "
            f"time), {g['node_hours']:.3g} node-hours{cost}" + (f"; budget: {html.escape(limits)}" if limits else "")
            + "." + html.escape(loop_abort_saving(g)) + "</p>")


def _plan_html(pilot: dict | None, plan: dict | None) -> str:
    """The pilot's findings and the forecast made from them, as `dflash plan` prints them."""
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
