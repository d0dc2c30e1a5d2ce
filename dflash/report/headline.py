"""The run's lead facts, the same for the summary page and the console at a run's end: records
kept, trainable tokens, acceptance trained vs untrained, gates, what generation cost, time per
stage. Each fact is a figure, what it means and whether it needs a look."""
from __future__ import annotations

import textwrap
from pathlib import Path

from dflash.core.units import human_bytes, human_duration, percent
from dflash.core.vocabulary import TOOL_CATEGORY
from dflash.plan.pilot import loop_abort_text
from dflash.report.charts import fmt


def gate_value(gate: str, v) -> str:
    """Bytes in human units, rates and shares as percentages."""
    if v is None:
        return "-"
    if gate.endswith("_bytes"):
        return human_bytes(v)
    return percent(v) if ("rate" in gate or "share" in gate) else fmt(v)


# as the README's "What good looks like on a real run" reports them, with sources
GOOD_ACCEPTANCE = ("DFlash drafters of 8B to 35B Qwen targets trained on tens of thousands of samples or more "
                   "are reported at about 3.5 to 9.5 (README: What good looks like on a real run)")


def _acceptance_fact(s: dict) -> tuple[str, str] | None:
    ev = s["eval"].get("overall")
    if not ev:
        return None
    trained = ev["acceptance_length"]
    plain = (s["eval"].get("untrained") or {}).get("overall", {}).get("acceptance_length")
    saved = (ev["tokens"] - ev["target_forwards"]) / max(1, ev["tokens"])
    main = f"{trained:.2f} trained vs {plain:.2f} untrained" if plain else f"{trained:.2f}"
    note = (f"On {ev['prompts']:,} held-out prompts each target forward pass yielded {trained:.2f} tokens with the "
            f"trained drafter ({f'{plain:.2f} with an untrained one; ' if plain else ''}1.00 = no speed-up): "
            f"{percent(saved)} fewer target forwards than plain decoding.\n")
    if s.get("demo_target"):
        note += (f"The target here is the tiny demo model and the drafter trained {s['train']['steps']:,} steps on "
                 f"{s['tokenized']['rows']:,} rows: this shows the stages work end to end, not what a drafter can do. "
                 f"On a real run: {GOOD_ACCEPTANCE}.")
    else:
        note += (f"For scale: {GOOD_ACCEPTANCE}; near 1.00 the drafter learned little (check the chat template, "
                 f"thinking mode and target layers).")
    return main, note


def _kept_fact(v: dict) -> tuple[str, str, bool]:
    share = percent(v["kept"] / v["records"]) if v["records"] else "-"
    main = f"{v['kept']:,} of {v['records']:,} completions kept ({share})"
    cats = {c: k for c, k in v["categories"].items() if k.get("records")}
    if not cats:
        return main, "no completions", False
    worst, w = max(cats.items(), key=lambda kv: kv[1]["reject_rate"])
    reasons = sorted(((code, c["by_category"].get(worst, 0)) for code, c in v["checks"].items()
                      if c["action"] == "reject" and c["by_category"].get(worst)), key=lambda x: -x[1])
    note = (f"Most rejected: {worst}, {percent(w['reject_rate'])} of {w['records']}"
            + (" (" + ", ".join(f"{code} {n}" for code, n in reasons[:3])
               + (f" and {len(reasons) - 3} more checks" if len(reasons) > 3 else "") + ")" if reasons else "") + ".")
    # the share the min_tool_call_share gate measures: kept tool records that make a valid call
    tool = v["categories"].get(TOOL_CATEGORY, {})
    calling, kept = tool.get("kept_calling_tool", 0), tool.get("kept", 0)
    if kept:
        note += (f" Kept {TOOL_CATEGORY} records that call a tool: {calling} of {kept}." if calling else
                 f" None of the {kept} kept {TOOL_CATEGORY} records calls a tool (dflash check tools shows them).")
    return main, note, not (kept and not calling)


def _gates_fact(gates: list[dict]) -> tuple[str, str, bool]:
    failed = [g for g in gates if not g["passed"]]
    if not gates:
        return "none configured", "config gates sets them", True
    if failed:
        return (f"{len(failed)} of {len(gates)} FAILED", "; ".join(g.get("message", g["gate"]) for g in failed)
                + ". Passed: " + (", ".join(g["gate"] for g in gates if g["passed"]) or "none") + ".", False)
    return f"all {len(gates)} passed", ", ".join(f"{g['gate']} ({gate_value(g['gate'], g['value'])}, limit "
                                                f"{gate_value(g['gate'], g['threshold'])})" for g in gates), True


def _generation_fact(g: dict | None) -> tuple[str, str] | None:
    if not g:
        return None
    cost = (f"${g['cost']:,.2f}" if g["cost"] is not None
            else "no price (set generate.budget.profile and its plan.profiles gpu_hour_price)")
    main = f"{human_duration(g['wall_hours'] * 3600)} wall, " + (cost if g["cost"] is not None else "cost unknown")
    return main, (f"{g['requests']:,} requests, {g['output_tokens']:,} output tokens, {g['node_hours']:.3g} "
                  f"node-hours" + ("" if g["cost"] is not None else f"; {cost}") + "." + loop_abort_saving(g))


def loop_abort_saving(g: dict) -> str:
    """The looping generations cut early and what generating their remaining tokens would have
    cost at the run's own rate (node-hours per output token)."""
    a = g.get("loop_aborts")
    if not a or not a["records"]:
        return ""
    per_token = g["node_hours"] / max(1, g["output_tokens"])
    cost = f", ${a['tokens_saved'] * per_token * g['cost'] / g['node_hours']:,.2f}" if g["cost"] and g["node_hours"] else ""
    return (f" Loop aborts: {loop_abort_text(a, g['output_tokens'])}; about "
            f"{a['tokens_saved'] * per_token:.3g} node-hours{cost} at this run's rate.")


def _time_fact(stages: dict | None) -> tuple[str, str] | None:
    if not stages:
        return None
    total = sum(c["seconds"] for c in stages.values())
    top = ", ".join(f"{stage} {human_duration(c['seconds'])}" for stage, c in list(stages.items())[:4])
    return f"{human_duration(total)} of job time", f"Costliest stages: {top}."


def headline(s: dict) -> list[tuple[str, str, str, bool]]:
    """The page's and the console's lead: (label, figure, what it means, ok) per fact."""
    t = s["tokenized"]
    facts = [("kept", *_kept_fact(s["validate"])),
             ("trainable tokens", f"{t['trainable_tokens']:,} in {t['rows']:,} rows",
              f"The target's own output tokens the drafter learns from, of {t['tokens']:,} tokens in all "
              f"(prompts and tool results are context only).", True)]
    if acc := _acceptance_fact(s):
        facts.append(("acceptance length", *acc, True))
    facts.append(("gates", *_gates_fact(s["gates"])))
    if gen := _generation_fact(s.get("generation")):
        facts.append(("generation", *gen, True))
    if tm := _time_fact(s.get("stages")):
        facts.append(("time", *tm, True))
    return facts


def _about_line(s: dict) -> str:
    a = s.get("about")
    return f"run {s['run']}" + (f" ({a['date']}, config {a['config_digest']}, commit {a['commit']})" if a else "")


CONSOLE_WIDTH = 100


def headline_lines(summary: dict, report: str | Path | None = None) -> list[str]:
    """The headline as short plain-text lines for a terminal (the end of a run), with whether the
    machine may go when the report looked; ``report``: the page's path, named last."""
    lines = [_about_line(summary)]
    if d := summary.get("durability"):
        lines += textwrap.wrap(f"machine: {d['verdict']}", CONSOLE_WIDTH, subsequent_indent="  ")
    for label, main, note, ok in headline(summary):
        lines.append(f"{label}: {main}" + ("" if ok else "  <-- look here"))
        if label != "trainable tokens":
            lines += [wrapped for part in note.split("\n")
                      for wrapped in textwrap.wrap(part, CONSOLE_WIDTH, initial_indent="  ", subsequent_indent="  ")]
    return lines + ([f"report: {report}"] if report else [])
