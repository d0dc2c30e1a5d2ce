"""Validate stage: completion shard -> validated + rejected shards and a per-shard QA report.

Each check is a small function with a stable reason code; the config sets every code to
``reject``, ``flag`` or ``off``. Nothing is deleted silently: a rejected record goes to
``rejected/`` with ``qa.reasons``, and every check counts its hits per category.
"""
from __future__ import annotations

import json
import logging
import re
import statistics
from bisect import bisect_right
from collections import Counter, defaultdict
from itertools import accumulate, islice
from pathlib import Path
from typing import Callable, NamedTuple

from dflash.io import SHARD_RE, atomic_files, iter_jsonl, json_text, naming_full_disk, with_field, zst_lines
from dflash.records import checked_records
from dflash.toolcalls import check_tool_calls

log = logging.getLogger(__name__)

ACTIONS = ("reject", "flag", "off")
VALIDATE_READS = "validate reads the completions/ shards of the generate stage"
TAGS = re.compile(r"</?think>|</?tool_call>|</?tool_response>|<\|[a-z_]+\|>")
SUBSTANCE = re.compile(r"\w+|[^\w\s]")
STRAY_THINK = re.compile(r"</?think>")
CONTROL = r"\x00-\x08\x0b\x0c\x0e-\x1f\x7f"
# One pass finds all three: a replacement character, a lone surrogate (not encodable as UTF-8), a control.
BAD_CHAR = re.compile(f"[\ufffd\ud800-\udfff{CONTROL}]")


def substance_tokens(text: str, limit: int | None = None) -> int:
    """Words and punctuation marks outside the tags: a tokenizer-free measure of real content,
    counted up to ``limit`` (enough to tell trivial from not without scanning a long text)."""
    return sum(1 for _ in islice(SUBSTANCE.finditer(TAGS.sub(" ", text)), limit))


def _thinking(rec: dict) -> bool:
    return bool(rec.get("generation", {}).get("enable_thinking", rec.get("reasoning") is not None))


BLOCK_LINES = 8  # the longest block of lines a loop repeats
TAIL_PROBE = 32  # the tail's last this many characters must recur for it to repeat a span
# one line of 8 characters or more (stripped) making half of the last 40 non-empty lines (20 at least)
RECENT_LINES, RECENT_MIN, RECENT_CHARS = 40, 20, 8


class Loop(NamedTuple):
    detail: str  # what repeats, as repetition_loop says it
    start: int  # character offset of the loop's first repetition


def tail_window(min_chars: int) -> int:
    """How many characters at the end of a text the tail check looks at."""
    return 4 * max(min_chars, 512)


def frequent_lines(counts: Counter, least: int) -> set[str]:
    """The non-blank lines that come ``least`` times or more."""
    return {line for line, n in counts.items() if n >= least and line.strip()} \
        if max(counts.values(), default=0) >= least else set()


def line_blocks(lines: list[str], min_repeats: int, min_chars: int,
                frequent: set[str] | None = None) -> tuple[str, int] | None:
    """Identical lines or blocks of up to 8 lines repeated ``min_repeats`` times in a row over
    ``min_chars`` characters: (detail, index of the stretch's first line), or None. A stretch that
    qualifies still does with more lines after it, and inside any run of lines holding it.
    ``frequent``: frequent_lines(Counter(lines), min(min_repeats, 10)), when already known (10: see find_loop)."""
    if frequent is None:
        frequent = frequent_lines(Counter(lines), min(min_repeats, RECENT_MIN // 2))
    # A loop of blocks of up to 8 lines brings some frequent line back within 8 lines; most texts
    # have none, and skip the scans below.
    close_repeat, last_seen = False, {}
    for i in [i for i, line in enumerate(lines) if line in frequent] if frequent else ():
        close_repeat = close_repeat or i - last_seen.get(lines[i], -BLOCK_LINES - 1) <= BLOCK_LINES
        last_seen[lines[i]] = i
    if close_repeat:
        ends = list(accumulate(len(ln) + 1 for ln in lines))  # ends[j]: chars up to the end of line j
    for k in range(1, BLOCK_LINES + 1) if close_repeat else ():
        equal = 0  # how many lines in a row equal the line k before them
        for i in range(k, len(lines) + 1):
            if i < len(lines) and lines[i] == lines[i - k]:
                equal += 1
                continue
            first, last = i - equal - k, i - 1  # the stretch lines[first..last] has period k
            if (equal >= k * (min_repeats - 1) and ends[last] - (ends[first - 1] if first else 0) >= min_chars
                    and any(ln.strip() for ln in lines[first:first + k])):
                unit = "\n".join(lines[first:first + k])
                return f"{(equal + k) // k} x {unit[:60]!r} ({k} line{'s' * (k > 1)} in a row)", first
            equal = 0
    return None


def tail_span(tail: str, min_repeats: int, min_chars: int) -> tuple[str, int] | None:
    """A text's last ``tail_window`` characters that end in one span over and over (no line breaks
    needed): (detail, the span's period), or None."""
    probe = tail[-TAIL_PROBE:]
    previous = tail.rfind(probe, 0, len(tail) - 1) if len(probe) == TAIL_PROBE else -1
    if previous >= 0:
        period = len(tail) - TAIL_PROBE - previous
        run = max(period * (min_repeats - 1), min_chars - period)
        if run + period <= len(tail) and tail[-run:] == tail[-run - period:-period]:
            return f"the tail repeats {tail[-period:][:60]!r} (period {period} chars)", period
    return None


def recent_line(lines: list[str]) -> tuple[str, int] | None:
    """One line of 8 characters or more making up half of the last 40 non-empty lines (20 at
    least): (detail, index of its first line among them), or None. Looks at the end only."""
    recent = list(islice((i for i in range(len(lines) - 1, -1, -1) if lines[i].strip()), RECENT_LINES))
    common = Counter(lines[i] for i in recent if len(lines[i].strip()) >= RECENT_CHARS).most_common(1)
    if len(recent) >= RECENT_MIN and common and common[0][1] * 2 >= len(recent):
        line = common[0][0]
        return (f"{common[0][1]} of the last {len(recent)} lines are {line[:60]!r}",
                min(i for i in recent if lines[i] == line))
    return None


def find_loop(text: str, min_repeats: int, min_chars: int) -> Loop | None:
    """Where the text loops, or None: identical lines or blocks of up to 8 lines repeated
    ``min_repeats`` times in a row over ``min_chars`` characters; a tail that is one span over and
    over (no line breaks needed); or one line making up half of the last 40. Lines that are alike
    but not identical (code, tables, numbered lists, data) never count. The start of a repeating
    tail is where the span begins to repeat, however far back."""
    lines = text.split("\n")
    counts = Counter(lines)
    # 10 (half of RECENT_MIN) and not more: recent_line needs a line 10 times or more
    frequent = frequent_lines(counts, min(min_repeats, RECENT_MIN // 2))
    hit = line_blocks(lines, min_repeats, min_chars, frequent)
    if hit is None and (span := tail_span(text[-tail_window(min_chars):], min_repeats, min_chars)):
        period, start = span[1], len(text) - span[1]
        while start >= period and text[start - period:start] == text[start:start + period]:
            start -= period
        while start and text[start - 1] == text[start - 1 + period]:
            start -= 1
        return Loop(span[0], start)
    if hit is None and any(counts[line] >= RECENT_MIN // 2 for line in frequent):  # most texts have none
        hit = recent_line(lines)
    return hit and Loop(hit[0], sum(len(ln) + 1 for ln in islice(lines, hit[1])))


def repetition_loop(text: str, min_repeats: int, min_chars: int) -> str | None:
    """What repeats where the text loops (see find_loop), or None: the check of the same name."""
    loop = find_loop(text, min_repeats, min_chars)
    return loop.detail if loop else None


def encoding_problem(text: str) -> str | None:
    bad = BAD_CHAR.search(text)
    if bad is None:
        return None
    char, at = bad.group(), bad.start()
    if char == "\ufffd":
        return f"U+FFFD (a replacement character) at {at}"
    if "\ud800" <= char <= "\udfff":
        return f"not encodable as UTF-8 at {at} (a lone surrogate)"
    return f"control character U+{ord(char):04X} at {at}"


# Problems that make a parsed call unusable as a training example of calling a tool (the other
# tool codes say where a call sits, not whether it is one).
BAD_CALL = ("tool_unclosed", "tool_bad_json", "tool_bad_xml", "tool_unknown_name", "tool_args_schema",
            "tool_missing_required", "tool_without_tools")


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
    **{code: (lambda rec, ctx, code=code: ctx["tool_problems"].get(code))
       for code in (*BAD_CALL, "tool_call_in_reasoning", "text_after_tool_call")},
}


TOOL_CATEGORY = "tool"  # the category whose kept records should call tools (gates.min_tool_call_share)


def calls_a_tool(qa: dict) -> bool:
    """Whether a judged record holds at least one valid tool call in its answer: a parsed call,
    and none of the problems that would make it a wrong example (when those are only flagged)."""
    return bool(qa.get("tool_calls")) and not set(BAD_CALL) & set(qa.get("flags", []) + qa.get("reasons", []))


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


# Fixed bin edges (output tokens) so per-shard histograms add up across shards in the summary.
LENGTH_BINS = [0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
EXAMPLES_PER_REASON = 3
WINDOW = 400  # characters of text shown around a problem
ANCHORS = {  # where in the record a problem shows: (field, pattern); the end of the text if none
    "stray_think": ("content", STRAY_THINK),
    "encoding": ("text", BAD_CHAR),
    "tool_call_in_reasoning": ("reasoning", re.compile("<tool_call>")),
    "text_after_tool_call": ("content", re.compile(r"</tool_call>(?![\s\S]*</tool_call>)")),
    "trivial": ("text", re.compile("^")),
    "empty_answer": ("text", re.compile("^")),
    "empty_reasoning": ("text", re.compile("^")),
    **{code: ("content", re.compile("<tool_call>|</tool_call>|<function=|<parameter=")) for code in BAD_CALL},
}


def excerpt(rec: dict, code: str) -> str:
    """About WINDOW characters of the record around where ``code`` shows, ``…`` where cut."""
    field, pattern = ANCHORS.get(code, ("text", None))
    text = rec.get(field) or ""
    hit = pattern.search(text) if pattern else None
    if hit is None:
        return ("…" if len(text) > WINDOW else "") + text[-WINDOW:]
    start = max(0, hit.start() - WINDOW // 4)
    return ("…" if start else "") + text[start:start + WINDOW] + ("…" if start + WINDOW < len(text) else "")


def example(rec: dict, code: str, detail: str, calls: list[dict]) -> dict:
    """What a reader needs to judge one hit: where, what the check saw, the text around it and,
    for tool-call problems, the offered tools and the parsed calls."""
    ex = {"id": rec["id"], "category": rec["category"], "detail": detail, "excerpt": excerpt(rec, code)}
    if code.startswith("tool_") or code == "text_after_tool_call":
        ex["offered_tools"] = [{"name": t["function"]["name"],
                                "parameters": t["function"].get("parameters")} for t in rec.get("tools") or []]
        ex["calls"] = calls
    return ex


def length_stats(values: list[int]) -> dict:
    """Summary and fixed-bin histogram of a category's lengths."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    hist = [0] * len(LENGTH_BINS)
    for v in ordered:
        hist[bisect_right(LENGTH_BINS, v) - 1] += 1
    return {"n": len(ordered), "sum": sum(ordered), "mean": round(sum(ordered) / len(ordered), 1),
            "median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "max": ordered[-1], "histogram": hist}


GENERATION_SUFFIX = re.compile(r"-g\d+$")


# The reason of an id listed without one. Not its file and line: a comment added at the top of a
# list would change every later id's reason, and with it the validate params of their shards.
UNSTATED = "listed in validate.exclude"


def read_exclusions(paths: list[str | Path]) -> dict[str, str]:
    """Sample ids to drop, with the reason for each: a ``.jsonl`` file holds ``{"id", "reason"}``
    objects; any other file one id per line (``#`` starts a comment). A prompt id drops every
    generation of that prompt; a record id (``<prompt id>-gN``) only that generation."""
    excluded: dict[str, str] = {}
    for path in map(Path, paths):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path}:{lineno}"
            if path.suffix == ".jsonl":
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
                if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                    raise ValueError(f'{where}: expected an object with a string "id" (and an optional "reason")')
                excluded[entry["id"]] = str(entry.get("reason") or UNSTATED)
            elif (sample := line.split("#", 1)[0].strip()):
                if len(sample.split()) > 1:
                    raise ValueError(f"{where}: one sample id per line, got {sample!r}")
                excluded[sample] = UNSTATED
    return excluded


def exclusions_by_shard(excluded: dict[str, str], prompts_dir: str | Path) -> tuple[dict[str, dict], list[str]]:
    """The exclusions grouped by the prompt shard ("00003") holding each id, and the ids no shard
    holds (held-out prompts, typos). Reads the prompts' id index, not the completion shards."""
    index_path = Path(prompts_dir) / "ids.tsv"
    if index_path.exists():
        shard_of = dict(line.split("\t") for line in index_path.read_text(encoding="utf-8").splitlines())
    else:  # prompts written before the index existed
        shard_of = {rec["id"]: m.group(1) for path in sorted(Path(prompts_dir).iterdir())
                    if (m := SHARD_RE.search(path.name)) for rec in iter_jsonl(path)}
    by_shard: dict[str, dict] = defaultdict(dict)
    unknown = []
    for sample, reason in sorted(excluded.items()):
        shard = shard_of.get(sample) or shard_of.get(GENERATION_SUFFIX.sub("", sample))
        if shard is None:
            unknown.append(sample)
        else:
            by_shard[shard][sample] = reason
    return dict(by_shard), unknown


def validate_shard(completions_path: Path, validated_path: Path, rejected_path: Path, qa_path: Path,
                   cfg: dict, excluded: dict[str, str] | None = None) -> dict:
    """Judge every record of a completion shard; in == kept + rejected, always. A record whose id
    or prompt id is in ``excluded`` is rejected with reason ``excluded`` and not judged.

    Records stream through: memory holds one record plus the shard's counts and lengths."""
    unknown = set(cfg["checks"]) - set(CHECKS)
    if unknown:
        raise ValueError(f"validate.checks: unknown check(s) {sorted(unknown)}; known: {sorted(CHECKS)}")
    excluded = excluded or {}
    hits: dict[str, Counter] = defaultdict(Counter)
    per_cat: dict[str, Counter] = defaultdict(Counter)
    lengths: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    examples: dict[str, list[dict]] = defaultdict(list)
    seen: set[str] = set()  # a record twice would be trained twice
    # The three outputs appear together or not at all: rejected records alone would look like a run.
    with atomic_files(validated_path, rejected_path, qa_path) as (validated_tmp, rejected_tmp, qa_tmp):
        # zstd level 1: these shards are read once more, by tokenize; level 3 would cost a third of the stage.
        with zst_lines(validated_tmp, 1, validated_path) as keep, zst_lines(rejected_tmp, 1, rejected_path) as reject:
            # No check reads token ids: they stay unparsed, and pass through in the raw lines.
            for line, rec in checked_records(completions_path, "completion", VALIDATE_READS,
                                             skip_arrays=("prompt_token_ids", "output_token_ids")):
                if rec["id"] in seen:
                    raise ValueError(f"{completions_path}: record id {rec['id']} appears twice; every id must be "
                                     f"unique (re-run the generate rule of this shard)")
                seen.add(rec["id"])
                cat = rec["category"]
                why = excluded.get(rec["id"]) or excluded.get(rec.get("prompt_id"))
                if why:
                    reasons, flags, calls, details = ["excluded"], [], [], {"excluded": why}
                else:
                    reasons, flags, calls, details = judge(rec, cfg)
                per_cat[cat]["records"] += 1
                for code in reasons + flags:
                    hits[code][cat] += 1
                    if len(examples[code]) < EXAMPLES_PER_REASON:
                        examples[code].append(example(rec, code, details[code], calls))
                qa = {"flags": flags, "tool_calls": calls, "details": details}
                if reasons:
                    qa["reasons"] = reasons
                per_cat[cat]["rejected" if reasons else "kept"] += 1
                if not reasons and calls_a_tool(qa):
                    per_cat[cat]["kept_calling_tool"] += 1
                (reject if reasons else keep)(with_field(line, rec, "qa", qa))
                tokens = rec["usage"]["completion_tokens"]
                lengths[cat]["output_tokens"].append(tokens)
                if not reasons:
                    lengths[cat]["kept_output_tokens"].append(tokens)
                lengths[cat]["reasoning_chars"].append(len(rec.get("reasoning") or ""))
                lengths[cat]["content_chars"].append(len(rec.get("content") or ""))
        report = qa_report(completions_path, cfg, hits, per_cat, lengths, examples)
        with naming_full_disk(qa_path):
            qa_tmp.write_text(json_text(report), encoding="utf-8")
    log.info("validate %s: %d records, %d kept, %d rejected (%s)", report["shard"], report["records"], report["kept"],
             report["rejected"], ", ".join(f"{c}={n['total']}" for c, n in report["checks"].items() if n["total"])
             or "no hits")
    return report


def qa_report(completions_path: Path, cfg: dict, hits: dict, per_cat: dict, lengths: dict, examples: dict) -> dict:
    """A shard's QA report: records kept and rejected, hits per check and category, lengths, examples."""
    kept = sum(c["kept"] for c in per_cat.values())
    rejected = sum(c["rejected"] for c in per_cat.values())
    total = kept + rejected
    return {
        "shard": Path(completions_path).name,
        "records": total,
        "kept": kept,
        "rejected": rejected,
        "reject_rate": round(rejected / total, 4) if total else 0.0,
        "checks": {code: {"action": cfg["checks"].get(code, "reject"), "total": sum(hits[code].values()),
                          "by_category": dict(hits[code])} for code in [*CHECKS, "excluded"]},
        "categories": {cat: dict(c) for cat, c in sorted(per_cat.items())},
        "length_bins": LENGTH_BINS,
        "lengths": {cat: {name: length_stats(v) for name, v in sorted(kinds.items())}
                    for cat, kinds in sorted(lengths.items())},
        "examples": dict(examples),
    }
