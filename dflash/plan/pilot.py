"""Pilot: a small stratified sample of every source and category, generated, validated and
tokenized with the run's real settings before the full generation (docs/design.md: the story's risky
tool prompts came last, and 87% trivial answers were found only after the data set was built).
What it measures (output lengths per category, reject reasons, throughput, the gates' verdicts)
is what ``dflash plan`` forecasts from; the full run's generate jobs reuse its records.
"""
from __future__ import annotations

import hashlib
import logging
import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from dflash.core.io import iter_jsonl, read_json, write_json, write_jsonl_zst
from dflash.core.workflow import to_console
from dflash.validate.gates import evaluate_gates, qa_summary

log = logging.getLogger(__name__)


def sample_prompts(prompts_dir: Path, share: float, min_per_category: int) -> tuple[list[dict], list[dict]]:
    """The pilot's prompts: of each (source, category) stratum of the training prompts,
    ``max(min_per_category, ceil(share x size))`` of them (all, when it holds fewer), the ones
    whose ids hash lowest: a fixed pick that favours nothing, spread over the shards (the prompts
    stage orders by id, so the lowest ids themselves would all sit in the first shards, and their
    generate jobs, which take the pilot's records, would finish early while the others ran on).
    Adopted generations (``chat_completions`` sources) are left out: nothing is generated for
    them. Returns the prompts (in shard order) and the strata with their sizes. Two passes over
    the shards, the first keeping ids only: a real run's prompts do not fit in memory twice."""
    prompts_dir = Path(prompts_dir)
    shards = [prompts_dir / s["name"] for s in read_json(prompts_dir / "manifest.json")["shards"]]
    strata: dict[tuple[str, str], list[str]] = defaultdict(list)
    for shard in shards:
        for rec in iter_jsonl(shard):
            if "imported" not in rec.get("meta", {}):
                strata[rec["source"], rec["category"]].append(rec["id"])
    chosen: set[str] = set()
    table = []
    for (source, category), ids in sorted(strata.items()):
        n = min(len(ids), max(min_per_category, math.ceil(share * len(ids))))
        chosen.update(sorted(ids, key=lambda i: hashlib.sha256(i.encode()).digest())[:n])
        table.append({"source": source, "category": category, "prompts": len(ids), "sampled": n})
    picked = [rec for shard in shards for rec in iter_jsonl(shard) if rec["id"] in chosen]
    return picked, table


def write_pilot_prompts(prompts_dir: Path, prompts_out: Path, selection_out: Path, cfg: dict) -> list[dict]:
    picked, table = sample_prompts(prompts_dir, cfg["share"], cfg["min_per_category"])
    write_jsonl_zst(prompts_out, picked)
    write_json(selection_out, {"share": cfg["share"], "min_per_category": cfg["min_per_category"], "strata": table})
    log.info("pilot: %d prompts from %d strata (%s)", len(picked), len(table),
             ", ".join(f"{t['source']}/{t['category']} {t['sampled']} of {t['prompts']}" for t in table))
    return table


def toggle_problem(output_dir: str | Path, enabled: bool) -> str | None:
    """Why ``pilot.enabled`` may not be what it is: the pilot was made (or skipped) the other way
    and generate jobs finished with it, so Snakemake would re-run every one of them; None if fine."""
    made = Path(output_dir) / "pilot" / "generate.json"
    if not made.exists():
        return None
    skipped = bool(read_json(made).get("skipped"))
    finished = len(list((Path(output_dir) / "completions").glob("shard-*.summary.json")))
    if skipped != enabled or not finished:
        return None
    return (f"pilot.enabled is {str(enabled).lower()}, but this run's pilot was {'skipped' if skipped else 'made'} and "
            f"{finished} generate job(s) finished after it: the change would re-run every one of them. Set "
            f"pilot.enabled back to {str(not enabled).lower()} (or delete {made.parent} to accept the re-run)")


def write_skipped_pilot(completions: Path, summary: Path) -> None:
    """A pilot that did not run (pilot.enabled false): no records, nothing measured."""
    write_jsonl_zst(completions, [])
    write_json(summary, {"shard": "pilot", "prompts": 0, "records": 0, "requests": 0, "output_tokens": 0,
                         "seconds": 0.0, "skipped": True})


def _rank(ordered: list[int], q: float) -> int:
    """The nearest-rank percentile (a value the sample holds)."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0


def _lengths(values: list[int]) -> dict:
    ordered = sorted(values)
    return {"n": len(values), "mean": round(statistics.fmean(values), 2) if values else 0.0,
            "sd": round(statistics.stdev(values), 2) if len(values) > 1 else 0.0,
            "p50": _rank(ordered, 0.5), "p90": _rank(ordered, 0.9),
            "max": ordered[-1] if ordered else 0}


def _output_tokens(records: list[dict]) -> int:
    return sum(r["usage"]["completion_tokens"] for r in records if r["usage"])


def _per_prompt(records: list[dict]) -> dict[str, int]:
    totals: Counter = Counter()
    for r in records:
        totals[r["prompt_id"]] += r["usage"]["completion_tokens"] if r["usage"] else 0
    return dict(totals)


def pilot_gpus(config: dict) -> int | None:
    """The GPUs the pilot's generation ran on, for its rate per GPU: the started server's, one for
    the in-process target, unknown for a server the user runs."""
    launch = config["generate"]["server"]["launch"]
    return launch["gpus"] if launch else (1 if config["generate"]["backend"] == "transformers" else None)


def pilot_job(config: dict, selection: Path, generated: Path, completions: Path, qa: Path, index: Path,
              burst: Path | None, out_path: Path) -> dict:
    """The pilot rule's job: what the pilot measured, written, and shown on the console as well as
    in the log: it is worth seeing before the full run."""
    summary = summarize_pilot(selection, generated, completions, qa, index, config["gates"], pilot_gpus(config),
                              burst or None)
    to_console("\n".join(pilot_lines(summary)))
    write_json(out_path, summary)
    return summary


def summarize_pilot(selection: Path, generated: Path, completions: Path, qa: Path, index: Path, gates: dict,
                    gpus: int | None, burst: Path | None = None) -> dict:
    """What the pilot measured: per category the prompts it stands for, output tokens per record
    (mean, sd, percentiles, share cut at max_tokens), rejects per reason; the throughput seen (per
    GPU when ``gpus`` is known); bytes per record; tokens per tokenized row; the gates' verdicts;
    the training burst's step rate (``burst``, dflash.plan.burst)."""
    table = read_json(selection)["strata"]
    gen = read_json(generated)
    summary = qa_summary([qa], [index])
    records = list(iter_jsonl(completions))
    by_category: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        by_category[rec["category"]].append(rec)
    population = Counter()
    for t in table:
        population[t["category"]] += t["prompts"]
    categories = {}
    for cat, recs in sorted(by_category.items()):
        counts = summary["categories"].get(cat, {})
        categories[cat] = {
            "prompts": population[cat], "sampled": len({r["prompt_id"] for r in recs}), "records": len(recs),
            "output_tokens": _lengths([r["usage"]["completion_tokens"] for r in recs if r["usage"]]),
            # what the plan scales by the category's prompts (a replayed conversation has several records)
            "output_tokens_per_prompt": _lengths(list(_per_prompt(recs).values())),
            "cut_at_max_tokens": sum(r["finish_reason"] == "length" for r in recs) / len(recs),
            "reject_rate": counts.get("reject_rate", 0.0),
            "rejected_by_reason": {code: c["by_category"][cat] for code, c in summary["checks"].items()
                                   if c["action"] == "reject" and c["by_category"].get(cat)},
        }
    seconds = gen["seconds"] or 1e-9
    tokens = summary["tokenized"]
    trivial = summary["checks"].get("trivial", {"total": 0})["total"]
    return {
        "prompts": len({r["prompt_id"] for r in records}), "records": len(records),
        "strata": table, "categories": categories,
        "reject_rate": summary["reject_rate"],
        "rejected_by_reason": {code: c["total"] for code, c in summary["checks"].items()
                               if c["action"] == "reject" and c["total"]},
        "trivial_share": trivial / len(records) if records else 0.0,
        "throughput": {"output_tokens": gen["output_tokens"], "requests": gen["requests"], "seconds": gen["seconds"],
                       "output_tokens_per_s": round(gen["output_tokens"] / seconds, 2),
                       "requests_per_s": round(gen["requests"] / seconds, 3), "gpus": gpus,
                       "output_tokens_per_s_per_gpu": round(gen["output_tokens"] / seconds / gpus, 2) if gpus else None},
        "bytes_per_output_token": round(Path(completions).stat().st_size / max(1, _output_tokens(records)), 3),
        "records_per_prompt": round(len(records) / max(1, len({r["prompt_id"] for r in records})), 4),
        "tokens_per_row": round(tokens.get("tokens", 0) / max(1, tokens.get("rows", 0)), 1),
        # the answer's tokens of a row, which the drafter's blocks anchor on (the training forecast)
        "supervised_per_row": round(tokens.get("trainable_tokens", 0) / max(1, tokens.get("rows", 0)), 1),
        "rows_per_record": round(tokens.get("rows", 0) / max(1, len(records)), 4),
        "gates": evaluate_gates(summary, gates),
        "loop_aborts": gen.get("loop_aborts") or NO_LOOP_ABORTS,
        "train_burst": read_json(burst) if burst else None,
    }


def pilot_lines(p: dict) -> list[str]:
    """The pilot's findings for a terminal: a line per category, the throughput, the gates."""
    t = p["throughput"]
    per_gpu = f", {t['output_tokens_per_s_per_gpu']:,.0f} per GPU" if t["output_tokens_per_s_per_gpu"] else ""
    lines = [f"pilot: {p['prompts']} prompts, {p['records']} records, {p['reject_rate']:.1%} rejected, "
             f"{p['trivial_share']:.1%} trivial; {t['output_tokens_per_s']:,.1f} output tokens/s{per_gpu}, "
             f"{t['requests_per_s']:.2f} requests/s"]
    for cat, c in p["categories"].items():
        o = c["output_tokens"]
        lines.append(f"  {cat}: {c['sampled']} of {c['prompts']} prompts; output tokens mean {o['mean']:.0f} "
                     f"(sd {o['sd']:.0f}, p90 {o['p90']}, max {o['max']}), {c['cut_at_max_tokens']:.0%} cut at "
                     f"max_tokens, {c['reject_rate']:.0%} rejected"
                     + (f" ({', '.join(f'{k} {v}' for k, v in c['rejected_by_reason'].items())})"
                        if c["rejected_by_reason"] else ""))
    if (a := p.get("loop_aborts", NO_LOOP_ABORTS))["records"]:
        lines.append(f"  loop aborts: {loop_abort_text(a, t['output_tokens'])}")
    if (b := p.get("train_burst")) and "skipped" in b:
        lines.append(f"  training burst on {b['kind']}: none ({b['skipped']})")
    elif b:
        lines.append(f"  training burst on {b['kind']}: {b['steps']} steps, {b['seconds_per_step']:.3g} s per step "
                     f"(hidden states {b['hidden_states']}), {b['setup_seconds']:.0f} s set-up")
    lines += [f"  {'pass' if g['passed'] else 'FAIL'}: {g['message']}" for g in p["gates"]]
    return lines


NO_LOOP_ABORTS = {"records": 0, "tokens_received": 0, "tokens_saved": 0}


def loop_abort_text(aborts: dict, output_tokens: int) -> str:
    """Generations cut once looping and the tokens not generated, against the output tokens."""
    share = aborts["tokens_saved"] / max(1, output_tokens + aborts["tokens_saved"])
    return (f"{aborts['records']:,} looping generation{'s' * (aborts['records'] != 1)} cut after "
            f"{aborts['tokens_received']:,} tokens, {aborts['tokens_saved']:,} tokens not generated "
            f"({share:.1%} of what generation would have produced)")
