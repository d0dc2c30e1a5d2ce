"""The words every stage, check and report shares about records: the data categories and splits,
the tool-call reason codes and what makes a kept record a tool-calling one, the model's markup, and
how a problem is shown (an excerpt around where it is, the length histogram's bins).

The validation checks themselves and their reason codes' actions live with the validate stage and
the config schema (``validate.checks``); the loop scan in ``loops``. This module imports nothing of
the package, so a report or a CLI command reads it without a stage."""
from __future__ import annotations

import re
import statistics
from bisect import bisect_right

# The record schemas' and the config schema's category enums say the same (tests/test_config.py).
CATEGORIES = ("chat", "code", "reasoning", "tool", "other")
SPLITS = ("train", "heldout")
TOOL_CATEGORY = "tool"  # the category whose kept records should call tools (gates.min_tool_call_share)
# The reason of a record validate rejects unjudged: its id or its prompt's is in validate.exclude.
EXCLUDED = "excluded"

# Problems that make a parsed call unusable as a training example of calling a tool (the other
# tool codes say where a call sits, or that its arguments went unchecked, not whether it is one).
BAD_CALL = ("tool_unclosed", "tool_bad_json", "tool_bad_xml", "tool_unknown_name", "tool_args_schema",
            "tool_missing_required", "tool_without_tools", "tool_duplicate_call", "tool_call_unparsed")
# The other tool-call codes (dflash/toolcalls.py), which validate's CHECKS hold with BAD_CALL's.
TOOL_NOTES = ("tool_call_in_reasoning", "text_after_tool_call", "tool_schema_unknown", "tool_response_invented")


def calls_a_tool(qa: dict) -> bool:
    """Whether a judged record holds at least one valid tool call in its answer: a parsed call,
    and none of the problems that would make it a wrong example (when those are only flagged)."""
    return bool(qa.get("tool_calls")) and not set(BAD_CALL) & set(qa.get("flags", []) + qa.get("reasons", []))


TAGS = re.compile(r"</?think>|</?tool_call>|</?tool_response>|<\|[a-z_]+\|>")
STRAY_THINK = re.compile(r"</?think>")
CONTROL = r"\x00-\x08\x0b\x0c\x0e-\x1f\x7f"
# One pass finds all three: a replacement character, a lone surrogate (not encodable as UTF-8), a control.
BAD_CHAR = re.compile(f"[\ufffd\ud800-\udfff{CONTROL}]")

# Letters of the scripts language_drift tells apart. Latin is none of them: code, names and terms
# are Latin in any language, and an English answer to a Chinese prompt is common and often wanted;
# nor Greek, the letters of formulas.
SCRIPTS = {"Han": "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff", "Kana": "\u3040-\u30ff", "Hangul": "\uac00-\ud7af",
           "Cyrillic": "\u0400-\u04ff", "Arabic": "\u0600-\u06ff", "Hebrew": "\u0590-\u05ff",
           "Devanagari": "\u0900-\u097f", "Thai": "\u0e00-\u0e7f"}
NON_LATIN = re.compile(f"[{''.join(SCRIPTS.values())}]")

# What a terminal acts on instead of showing: the C0 controls but tab and newline (ESC starts the
# sequences that set the window title, write the clipboard (OSC 52) or hide text; CR overwrites a
# line), DEL, the C1 controls (0x9b is a one-character CSI to some terminals) and the bidirectional
# overrides and isolates (text shown in another order than it is read).
TERMINAL_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str, json_escapes: bool = False) -> str:
    """``text`` (record text, a message quoting it) with every character a terminal would act on
    shown as its escape, ``\\x1b``; with ``json_escapes`` as a JSON escape, ``\\u001b``, so a JSON
    document stays one, with the same values. Every printer of record text goes through it."""
    def escape(m: re.Match) -> str:
        code = ord(m.group())
        return f"\\u{code:04x}" if json_escapes or code > 0xFF else f"\\x{code:02x}"

    return TERMINAL_UNSAFE.sub(escape, text)


# Fixed bin edges (output tokens) so per-shard histograms add up across shards in the summary.
LENGTH_BINS = [0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
EXAMPLES_PER_REASON = 3
WINDOW = 400  # characters of text shown around a problem
ANCHORS = {  # where in the record a problem shows: (field, pattern); the end of the text if none
    # a think tag in the reasoning but a leading one, or the last </think> (the first is the split)
    "stray_think": ("text", re.compile(r"(?<=[\s\S])<think>|</think>(?![\s\S]*</think>)")),
    # the text checks: the shape of a Qwen control token (the target's own are not known here), the
    # first letter of a non-Latin script, the answer's start, the end where a cut shows, the start
    "control_token_text": ("text", re.compile(r"<\|[A-Za-z0-9_]+\|>")),
    "language_drift": ("content", NON_LATIN),
    "thinking_in_answer": ("content", re.compile(r"\S")),
    "stub_answer": ("content", re.compile(r"\S")),
    "truncated_stop": ("text", None),
    "duplicate_completion": ("text", re.compile("^")),
    "encoding": ("text", BAD_CHAR),
    "tool_call_in_reasoning": ("reasoning", re.compile("<tool_call>")),
    "text_after_tool_call": ("content", re.compile(r"</tool_call>(?![\s\S]*</tool_call>)")),
    "trivial": ("text", re.compile("^")),
    "empty_answer": ("text", re.compile("^")),
    "empty_reasoning": ("text", re.compile("^")),
    **{code: ("content", re.compile("<tool_call>|</tool_call>|<function=|<parameter=")) for code in BAD_CALL},
    "tool_call_unparsed": ("content", re.compile("<tool_call>|```")),
    "tool_schema_unknown": ("content", re.compile("<tool_call>")),
    "tool_response_invented": ("content", re.compile("</?tool_response>")),
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
