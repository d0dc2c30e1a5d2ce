"""Every reason code the validate stage gives a record, declared once: its default action, where it
shows in a record (the excerpt a QA example and ``dflash check`` print) and, for a tool-call code,
whether the call it faults is still an example of calling a tool.

The declarations live in the core, not beside the validate functions that find them, because
``dflash check`` (the inspect family, which imports only the core) excerpts rejected records too.
Tests hold the rest to them: validate's ``CHECKS`` (one function per code, in this order: the order
of a record's reasons and of a QA report's checks), the codes ``toolcalls.check_tool_calls`` gives,
the config schema's ``validate.checks`` defaults (the config loader's source) and docs/quality.md's
table of checks (tests/test_config.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from dflash.core.vocabulary import BAD_CHAR, NON_LATIN

ACTIONS = ("reject", "flag", "off")  # reject; flag: kept, listed in qa.flags; off: not run
# The reason of a record validate rejects unjudged: its id or its prompt's is in validate.exclude.
EXCLUDED = "excluded"
WINDOW = 400  # characters of text shown around a problem


class Anchor(NamedTuple):
    """Where in a record a problem shows: the field, and the first match an excerpt centres on
    (no pattern: the field's end)."""
    field: str
    pattern: re.Pattern | None


@dataclass(frozen=True)
class Reason:
    code: str
    default: str  # one of ACTIONS
    anchor: Anchor | None = None  # none: the excerpt is the text's end, and dflash check prints its last part
    tool: bool = False  # found by toolcalls.check_tool_calls: a QA example shows the offered tools and the calls
    breaks_call: bool = False  # the faulted call is no example of calling a tool (calls_a_tool)


START = Anchor("text", re.compile("^"))
CALL_MARKUP = Anchor("content", re.compile("<tool_call>|</tool_call>|<function=|<parameter="))

REASONS = (
    Reason("abort_or_error", "reject"),
    Reason("finish_length", "reject"),
    Reason("no_think_close", "reject"),
    Reason("empty_reasoning", "reject", START),
    Reason("empty_answer", "reject", START),
    Reason("trivial", "reject", START),
    Reason("repetition_loop", "reject"),
    # a think tag in the reasoning but a leading one, or the last </think> (the first is the split)
    Reason("stray_think", "reject", Anchor("text", re.compile(r"(?<=[\s\S])<think>|</think>(?![\s\S]*</think>)"))),
    Reason("encoding", "reject", Anchor("text", BAD_CHAR)),
    # The text checks (validate/text_checks.py): the shape of a Qwen control token (the target's own
    # are not known here), the first letter of a non-Latin script, the answer's start, the end where
    # a cut shows (an anchor, so dflash check prints that end from its start), the start.
    Reason("control_token_text", "reject", Anchor("text", re.compile(r"<\|[A-Za-z0-9_]+\|>"))),
    Reason("language_drift", "reject", Anchor("content", NON_LATIN)),
    Reason("thinking_in_answer", "reject", Anchor("content", re.compile(r"\S"))),
    Reason("stub_answer", "reject", Anchor("content", re.compile(r"\S"))),
    Reason("truncated_stop", "reject", Anchor("text", None)),
    Reason("duplicate_completion", "reject", START),
    # The tool-call codes: one parse of the answer as the serving engine's parser reads it.
    Reason("tool_unclosed", "reject", CALL_MARKUP, tool=True, breaks_call=True),
    Reason("tool_bad_json", "reject", CALL_MARKUP, tool=True, breaks_call=True),
    Reason("tool_bad_xml", "reject", CALL_MARKUP, tool=True, breaks_call=True),
    Reason("tool_unknown_name", "reject", CALL_MARKUP, tool=True, breaks_call=True),
    Reason("tool_args_schema", "reject", CALL_MARKUP, tool=True, breaks_call=True),
    Reason("tool_missing_required", "reject", CALL_MARKUP, tool=True, breaks_call=True),
    Reason("tool_without_tools", "reject", CALL_MARKUP, tool=True, breaks_call=True),
    Reason("tool_duplicate_call", "reject", CALL_MARKUP, tool=True, breaks_call=True),
    Reason("tool_call_unparsed", "reject", Anchor("content", re.compile("<tool_call>|```")), tool=True,
           breaks_call=True),
    # These say where a call sits, or that its arguments went unchecked, not whether it is one.
    Reason("tool_call_in_reasoning", "flag", Anchor("reasoning", re.compile("<tool_call>")), tool=True),
    Reason("text_after_tool_call", "flag", Anchor("content", re.compile(r"</tool_call>(?![\s\S]*</tool_call>)")),
           tool=True),
    Reason("tool_schema_unknown", "flag", Anchor("content", re.compile("<tool_call>")), tool=True),
    Reason("tool_response_invented", "reject", Anchor("content", re.compile("</?tool_response>")), tool=True),
)
TOOL_CODES = tuple(r.code for r in REASONS if r.tool)
BAD_CALL = tuple(r.code for r in REASONS if r.breaks_call)
ANCHORS = {r.code: r.anchor for r in REASONS if r.anchor}


def calls_a_tool(qa: dict) -> bool:
    """Whether a judged record holds at least one valid tool call in its answer: a parsed call,
    and none of the problems that would make it a wrong example (when those are only flagged)."""
    return bool(qa.get("tool_calls")) and not set(BAD_CALL) & set(qa.get("flags", []) + qa.get("reasons", []))


def excerpt(rec: dict, code: str) -> str:
    """About WINDOW characters of the record around where ``code`` shows, ``…`` where cut."""
    field, pattern = ANCHORS.get(code, ("text", None))
    text = rec.get(field) or ""
    hit = pattern.search(text) if pattern else None
    if hit is None:
        return ("…" if len(text) > WINDOW else "") + text[-WINDOW:]
    start = max(0, hit.start() - WINDOW // 4)
    return ("…" if start else "") + text[start:start + WINDOW] + ("…" if start + WINDOW < len(text) else "")
