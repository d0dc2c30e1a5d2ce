"""Tool calls as Qwen models write them, parsed from raw output text.

Qwen2.5/Qwen3 write Hermes JSON (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``);
Qwen3-Coder, Qwen3.5 and Qwen3.6 write XML (``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\n
value\\n</parameter>\\n</function>\\n</tool_call>``) whose values are strings until a schema types them.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache

# A value runs to the first </parameter> and never over the next <parameter=: a missing closing tag
# is a malformed call, not a value that swallows the next parameter.
VALUE = r"(?:(?!<parameter=).)*?"
XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
XML_PARAM = re.compile(rf"<parameter=([^>\n]+)>\n?({VALUE})\n?</parameter>", re.S)
JSON_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_tool_calls(content: str) -> list[dict]:
    """``[{name, arguments}]`` of the well-formed calls in either format, in order of appearance.

    XML parameter values stay strings here: typing them needs the tool's schema.
    """
    found = [(m.start(), {"name": m.group(1).strip(),
                          "arguments": {k.strip(): v for k, v in XML_PARAM.findall(m.group(2))}})
             for m in XML_CALL.finditer(content)]
    for m in JSON_CALL.finditer(content):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "name" in obj:
            arguments = obj.get("arguments", obj.get("parameters", {}))
            found.append((m.start(), {"name": obj["name"], "arguments": arguments}))
    return [call for _, call in sorted(found, key=lambda f: f[0])]


def text_before_calls(content: str) -> str:
    """The answer text a model wrote before its first tool call."""
    return content.split("<tool_call>", 1)[0]


def call_blocks(content: str) -> tuple[list[str], int, int, list[str]]:
    """(bodies of the closed ``<tool_call>`` blocks, how many are left open, where the last closed
    one ends, the pieces of text outside every block). A block closes before the next one opens;
    searching no further keeps a text that opens thousands of blocks (a loop) linear. An open
    block runs to the next one: its text is in no piece."""
    bodies, unclosed, end, outside = [], 0, 0, []
    pos = content.find("<tool_call>")
    outside.append(content[:pos] if pos >= 0 else content)
    while pos >= 0:
        start = pos + len("<tool_call>")
        following = content.find("<tool_call>", start)
        close = content.find("</tool_call>", start, following if following >= 0 else len(content))
        if close < 0:
            unclosed += 1
        else:
            bodies.append(content[start:close])
            end = close + len("</tool_call>")
            outside.append(content[end:following] if following >= 0 else content[end:])
        pos = following
    return bodies, unclosed, end, outside


# Call markup that means something only inside a <tool_call> block.
STRAY = re.compile(r"</tool_call>|<function=|<parameter=")


def stray_markup(pieces: list[str], fmt: str) -> tuple[str, str] | None:
    """(reason code, detail) for tool-call markup outside every well-formed block (a ``<function=``
    block closed by a ``</tool_call>`` that was never opened, say), or None. The code is the
    format's: ``tool_bad_json`` for Hermes, else ``tool_bad_xml``; with ``auto``, Hermes only when
    the stray text holds a JSON object with a name and no XML markup."""
    for piece in pieces:
        hit = STRAY.search(piece)
        if hit is None:
            continue
        xml_markup = "<function=" in piece or "<parameter=" in piece
        hermes = fmt == "json" or (fmt == "auto" and not xml_markup and '"name"' in piece and "{" in piece)
        context = piece[max(0, hit.start() - 40):hit.end() + 40]
        return ("tool_bad_json" if hermes else "tool_bad_xml",
                f"{hit.group()} outside a <tool_call> block: {context!r}")
    return None


@lru_cache(maxsize=256)
def _validator(schema_json: str):
    from jsonschema import Draft202012Validator

    return Draft202012Validator(json.loads(schema_json))
XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
XML_PARAM_ONLY = re.compile(rf"(?:\s*<parameter=[^>\n]+>\n?{VALUE}\n?</parameter>)*\s*", re.S)


def type_xml_arguments(arguments: dict[str, str], parameters: dict | None) -> dict:
    """XML parameter strings typed by the tool's JSON Schema: a non-string property is read as JSON
    (``3`` -> 3, ``true`` -> True, ``["a"]`` -> list); what does not parse stays a string, for the
    schema check to report."""
    props = (parameters or {}).get("properties") or {}
    typed = {}
    for key, value in arguments.items():
        kind = (props.get(key) or {}).get("type")
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            typed[key] = value
            continue
        try:
            typed[key] = json.loads(value)
        except json.JSONDecodeError:
            typed[key] = value
    return typed


def call_problems(name: str, arguments, offered: dict[str, dict]) -> list[tuple[str, str]]:
    """(reason code, detail) of each way one parsed call fails the offered tools (name -> function):
    none offered, a name not among them, or arguments against the tool's JSON Schema."""
    if not offered:
        return [("tool_without_tools", f"called {name} but no tools were offered")]
    if name not in offered:
        return [("tool_unknown_name", f"{name} is not among the offered tools ({', '.join(offered)})")]
    if not isinstance(arguments, dict):
        return [("tool_args_schema", f"{name}: arguments are not an object")]
    schema = offered[name].get("parameters") or {}
    return [("tool_missing_required" if error.validator == "required" else "tool_args_schema",
             f"{name}: {'.'.join(map(str, error.absolute_path)) or 'arguments'}: {error.message}")
            for error in _validator(json.dumps(schema, sort_keys=True)).iter_errors(arguments)]


def check_tool_calls(content: str, reasoning: str | None, tools: list | None,
                     fmt: str = "auto") -> tuple[list[dict], dict[str, str]]:
    """(calls with typed arguments, problems: reason code -> first detail) of one generation.

    ``fmt`` is the model's call format: ``xml`` (Qwen3.5/3.6, Qwen3-Coder), ``json`` (Hermes,
    Qwen2.5/Qwen3) or ``auto`` (each call as it is written: a block holding a JSON object is
    Hermes, any other is judged as XML, the Qwen3.5/3.6 format); a call in the other format is bad.
    """
    problems: dict[str, str] = {}
    if reasoning and "<tool_call>" in reasoning:
        problems["tool_call_in_reasoning"] = "<tool_call> inside the reasoning"
    if "<tool_call>" not in content and not STRAY.search(content):
        return [], problems
    offered = {t["function"]["name"]: t["function"] for t in tools or []}
    calls: list[dict] = []
    bodies, unclosed, end, outside = call_blocks(content)
    if unclosed:
        problems["tool_unclosed"] = f"{unclosed} <tool_call> without </tool_call>"
    stray = stray_markup(outside, fmt)
    if stray:
        problems[stray[0]] = stray[1]
    for body in bodies:
        xml = XML_FUNCTION.fullmatch(body)
        json_like = body.lstrip().startswith(("{", "["))
        if not json_like and fmt != "json":
            if not xml or not XML_PARAM_ONLY.fullmatch(xml.group(2)):
                problems.setdefault("tool_bad_xml", f"not <function=NAME> with <parameter=...> blocks: {body[:80]!r}")
                continue
            name = xml.group(1).strip()
            raw = {k.strip(): v for k, v in XML_PARAM.findall(xml.group(2))}
            arguments = type_xml_arguments(raw, (offered.get(name) or {}).get("parameters"))
        else:
            if fmt == "json" and "<function" in body:
                problems.setdefault("tool_bad_json", f"an XML call where Hermes JSON is expected: {body[:80]!r}")
                continue
            if fmt == "xml":
                problems.setdefault("tool_bad_xml", f"a JSON call where XML is expected: {body[:80]!r}")
                continue
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                problems.setdefault("tool_bad_json", f"{e.msg} at {e.pos}: {body[:80]!r}")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                problems.setdefault("tool_bad_json", f"not an object with a name: {body[:80]!r}")
                continue
            name, arguments = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            if isinstance(arguments, str):  # some models double-encode
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    problems.setdefault("tool_bad_json", f"arguments of {name} are not JSON: {arguments[:80]!r}")
                    continue
        calls.append({"name": name, "arguments": arguments})
        for code, detail in call_problems(name, arguments, offered):
            problems.setdefault(code, detail)
    if bodies and content[end:].strip():
        problems["text_after_tool_call"] = f"text after the last call: {content[end:].strip()[:80]!r}"
    return calls, problems
