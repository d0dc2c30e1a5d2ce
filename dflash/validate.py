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
from itertools import accumulate, islice
from pathlib import Path
from typing import Callable

from dflash.io import iter_jsonl, write_json, write_jsonl_zst
from dflash.toolcalls import check_tool_calls

log = logging.getLogger(__name__)

ACTIONS = ("reject", "flag", "off")
TAGS = re.compile(r"</?think>|</?tool_call>|</?tool_response>|<\|[a-z_]+\|>")
SUBSTANCE = re.compile(r"\w+|[^\w\s]")
STRAY_THINK = re.compile(r"</?think>")
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def substance_tokens(text: str, limit: int | None = None) -> int:
    """Words and punctuation marks outside the tags: a tokenizer-free measure of real content,
    counted up to ``limit`` (enough to tell trivial from not without scanning a long text)."""
    return sum(1 for _ in islice(SUBSTANCE.finditer(TAGS.sub(" ", text)), limit))


def _thinking(rec: dict) -> bool:
    return bool(rec.get("generation", {}).get("enable_thinking", rec.get("reasoning") is not None))


def repetition_loop(text: str, min_repeats: int, min_chars: int) -> str | None:
    """Where the text loops, or None: identical lines or blocks of up to 8 lines repeated
    ``min_repeats`` times in a row over ``min_chars`` characters; a tail that is one span over and
    over (no line breaks needed); or one line making up half of the last 40. Lines that are alike
    but not identical (code, tables, numbered lists, data) never count."""
    lines = text.split("\n")
    counts = Counter(lines)
    repeated = any(n >= min_repeats and line.strip() for line, n in counts.items())
    ends = list(accumulate(len(ln) + 1 for ln in lines))  # ends[j]: chars up to the end of line j
    for k in range(1, 9 if repeated else 1):
        equal = 0  # how many lines in a row equal the line k before them
        for i in range(k, len(lines) + 1):
            if i < len(lines) and lines[i] == lines[i - k]:
                equal += 1
                continue
            first, last = i - equal - k, i - 1  # the stretch lines[first..last] has period k
            if (equal >= k * (min_repeats - 1) and ends[last] - (ends[first - 1] if first else 0) >= min_chars
                    and any(ln.strip() for ln in lines[first:first + k])):
                unit = "\n".join(lines[first:first + k])
                return f"{(equal + k) // k} x {unit[:60]!r} ({k} line{'s' * (k > 1)} in a row)"
            equal = 0
    tail = text[-4 * max(min_chars, 512):]
    probe = tail[-32:]
    previous = tail.rfind(probe, 0, len(tail) - 1) if len(probe) == 32 else -1
    if previous >= 0:
        period = len(tail) - 32 - previous
        run = max(period * (min_repeats - 1), min_chars - period)
        if run + period <= len(tail) and tail[-run:] == tail[-run - period:-period]:
            return f"the tail repeats {tail[-period:][:60]!r} (period {period} chars)"
    recent = [ln for ln in lines if ln.strip()][-40:]
    common = Counter(ln for ln in recent if len(ln.strip()) >= 8).most_common(1)
    if len(recent) >= 20 and common and common[0][1] * 2 >= len(recent):
        return f"{common[0][1]} of the last {len(recent)} lines are {common[0][0][:60]!r}"
    return None


def encoding_problem(text: str) -> str | None:
    if "\ufffd" in text:
        return f"U+FFFD (a replacement character) at {text.index(chr(0xFFFD))}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"not encodable as UTF-8 at {e.start} (a lone surrogate)"
    bad = CONTROL.search(text)
    return f"control character U+{ord(bad.group()):04X} at {bad.start()}" if bad else None


# Each check returns a detail (truthy) when the record has the problem. ``ctx`` holds the parsed
# parts and the config. The tool_* codes and text_after_tool_call come from check_tool_calls.
CHECKS: dict[str, Callable[[dict, dict], str | bool | None]] = {
    "abort_or_error": lambda rec, ctx: (rec["finish_reason"] in ("abort", "error") or rec.get("error"))
    and (rec.get("error") or rec["finish_reason"]),
    "finish_length": lambda rec, ctx: rec["finish_reason"] == "length"
    and f"stopped at {rec['usage']['completion_tokens']} tokens",
    "no_think_close": lambda rec, ctx: _thinking(rec) and "</think>" not in rec["text"],
    "empty_reasoning": lambda rec, ctx: _thinking(rec) and not (rec.get("reasoning") or "").strip(),
    "empty_answer": lambda rec, ctx: not TAGS.sub("", rec.get("content") or "").strip() and not ctx["tool_calls"],
    "trivial": lambda rec, ctx: (n := substance_tokens(rec.get("text") or "", ctx["cfg"]["trivial_min_tokens"]))
    < ctx["cfg"]["trivial_min_tokens"]
    and f"{n} words and marks",
    "repetition_loop": lambda rec, ctx: repetition_loop(rec.get("text") or "", **ctx["cfg"]["repetition"]),
    "stray_think": lambda rec, ctx: STRAY_THINK.search(rec.get("content") or "") and "think tag inside the answer",
    "encoding": lambda rec, ctx: encoding_problem(rec.get("text") or ""),
    **{code: (lambda rec, ctx, code=code: ctx["tool_problems"].get(code)) for code in (
        "tool_unclosed", "tool_bad_json", "tool_bad_xml", "tool_unknown_name", "tool_args_schema",
        "tool_missing_required", "tool_call_in_reasoning", "tool_without_tools", "text_after_tool_call")},
}


def judge(rec: dict, cfg: dict) -> tuple[list[str], list[str], list[dict], dict[str, str]]:
    """(reasons that reject, flags that do not, parsed tool calls, detail per hit) for one record."""
    calls, problems = check_tool_calls(rec.get("content") or "", rec.get("reasoning"), rec.get("tools"),
                                       cfg.get("tool_format", "auto"))
    ctx = {"tool_calls": calls, "tool_problems": problems, "cfg": cfg}
    reasons, flags, details = [], [], {}
    for code, check in CHECKS.items():
        action = cfg["checks"].get(code, "reject")
        if action == "off":
            continue
        hit = check(rec, ctx)
        if hit:
            (reasons if action == "reject" else flags).append(code)
            details[code] = hit if isinstance(hit, str) else code
    return reasons, flags, calls, details


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
        reasons, flags, calls, details = judge(rec, cfg)
        cat = rec["category"]
        per_cat[cat]["records"] += 1
        for code in reasons + flags:
            hits[code][cat] += 1
        qa = {"flags": flags, "tool_calls": calls, "details": details}
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
