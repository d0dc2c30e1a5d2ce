"""Validate stage: completion shard -> validated + rejected shards and a per-shard QA report.

Each check is a small function with a stable reason code; the config sets every code to
``reject``, ``flag`` or ``off``. Nothing is deleted silently: a rejected record goes to
``rejected/`` with ``qa.reasons``, and every check counts its hits per category.
"""
from __future__ import annotations

import logging
import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable

from dflash.io import iter_jsonl, write_json, write_jsonl_zst
from dflash.toolcalls import parse_tool_calls

log = logging.getLogger(__name__)

ACTIONS = ("reject", "flag", "off")
TAGS = re.compile(r"</?think>|</?tool_call>|</?tool_response>|<\|[a-z_]+\|>")
SUBSTANCE = re.compile(r"\w+|[^\w\s]")


def substance_tokens(text: str) -> int:
    """Words and punctuation marks outside the tags: a tokenizer-free measure of real content."""
    return len(SUBSTANCE.findall(TAGS.sub(" ", text)))


def _thinking(rec: dict) -> bool:
    return bool(rec.get("generation", {}).get("enable_thinking", rec.get("reasoning") is not None))


# Each check returns True when the record has the problem. ``ctx`` holds parsed parts and config.
CHECKS: dict[str, Callable[[dict, dict], bool]] = {
    "abort_or_error": lambda rec, ctx: rec["finish_reason"] in ("abort", "error") or bool(rec.get("error")),
    "finish_length": lambda rec, ctx: rec["finish_reason"] == "length",
    "no_think_close": lambda rec, ctx: _thinking(rec) and "</think>" not in rec["text"],
    "empty_reasoning": lambda rec, ctx: _thinking(rec) and not (rec.get("reasoning") or "").strip(),
    "empty_answer": lambda rec, ctx: not TAGS.sub("", rec.get("content") or "").strip() and not ctx["tool_calls"],
    "trivial": lambda rec, ctx: substance_tokens(rec.get("text") or "") < ctx["trivial_min_tokens"],
}


def judge(rec: dict, cfg: dict) -> tuple[list[str], list[str], list[dict]]:
    """(reasons that reject, flags that do not, parsed tool calls) for one completion record."""
    ctx = {"tool_calls": parse_tool_calls(rec.get("content") or ""), "trivial_min_tokens": cfg["trivial_min_tokens"]}
    reasons, flags = [], []
    for code, check in CHECKS.items():
        action = cfg["checks"].get(code, "reject")
        if action != "off" and check(rec, ctx):
            (reasons if action == "reject" else flags).append(code)
    return reasons, flags, ctx["tool_calls"]


def _stats(values: list[int]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean": round(statistics.fmean(values), 1), "median": statistics.median(values),
            "min": min(values), "max": max(values)}


def validate_shard(completions_path: Path, validated_path: Path, rejected_path: Path, qa_path: Path,
                   cfg: dict) -> dict:
    """Judge every record of a completion shard; in == kept + rejected, always."""
    unknown = set(cfg["checks"]) - set(CHECKS)
    if unknown:
        raise ValueError(f"validate.checks: unknown check(s) {sorted(unknown)}; known: {sorted(CHECKS)}")
    kept, rejected = [], []
    hits: dict[str, Counter] = defaultdict(Counter)
    per_cat: dict[str, Counter] = defaultdict(Counter)
    out_tokens: dict[str, list[int]] = defaultdict(list)
    for rec in iter_jsonl(completions_path):
        reasons, flags, calls = judge(rec, cfg)
        cat = rec["category"]
        per_cat[cat]["records"] += 1
        for code in reasons + flags:
            hits[code][cat] += 1
        qa = {"flags": flags, "tool_calls": calls}
        if reasons:
            rejected.append({**rec, "qa": {**qa, "reasons": reasons}})
            per_cat[cat]["rejected"] += 1
        else:
            kept.append({**rec, "qa": qa})
            per_cat[cat]["kept"] += 1
            out_tokens[cat].append(rec["usage"]["completion_tokens"])
    write_jsonl_zst(validated_path, kept)
    write_jsonl_zst(rejected_path, rejected)
    total = len(kept) + len(rejected)
    report = {
        "shard": Path(completions_path).name,
        "records": total,
        "kept": len(kept),
        "rejected": len(rejected),
        "reject_rate": round(len(rejected) / total, 4) if total else 0.0,
        "checks": {code: {"action": cfg["checks"].get(code, "reject"), "total": sum(hits[code].values()),
                          "by_category": dict(hits[code])} for code in CHECKS},
        "categories": {cat: dict(c) for cat, c in sorted(per_cat.items())},
        "kept_output_tokens": {cat: _stats(v) for cat, v in sorted(out_tokens.items())},
    }
    write_json(qa_path, report)
    log.info("validate %s: %d records, %d kept, %d rejected (%s)", report["shard"], total, len(kept), len(rejected),
             ", ".join(f"{c}={n['total']}" for c, n in report["checks"].items() if n["total"]) or "no hits")
    return report
