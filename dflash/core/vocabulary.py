"""The words every stage, check and report shares about records: the data categories and splits,
the model's markup, the scripts told apart, how record text is printed safely, the length
histogram's bins.

The reason codes (their default actions, where each shows in a record) are declared in ``reasons``;
the loop scan is ``loops``. This module imports nothing of the package, so a report or a CLI command
reads it without a stage."""
from __future__ import annotations

import re
import statistics
from bisect import bisect_right

# The record schemas' and the config schema's category enums say the same (tests/test_config.py).
CATEGORIES = ("chat", "code", "reasoning", "tool", "other")
SPLITS = ("train", "heldout")
TOOL_CATEGORY = "tool"  # the category whose kept records should call tools (gates.min_tool_call_share)

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
