"""Tool calls as Qwen models write them, parsed from raw output text.

Qwen2.5/Qwen3 write Hermes JSON (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``);
Qwen3-Coder, Qwen3.5 and Qwen3.6 write XML (``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\n
value\\n</parameter>\\n</function>\\n</tool_call>``) whose values are strings until a schema types them.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache

from referencing import Registry
from referencing.exceptions import Unresolvable

from dflash.io import MAX_JSON_DEPTH, deeper_than

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
        except (json.JSONDecodeError, RecursionError):
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


# A $ref registry that resolves nothing outside the schema: jsonschema's default one fetches a
# remote $ref with urlopen (no timeout), so a tool schema in a prompt data set could make every
# validate job contact a host it names.
OFFLINE = Registry()
# What jsonschema raises on a schema it cannot use, met while validating a value.
UNUSABLE = (RecursionError, re.error, Unresolvable)


def _unusable(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "a $ref loop that never reaches a value"
    if isinstance(error, re.error):
        return f"a bad regular expression ({error})"
    return f"$ref {getattr(error, 'ref', error)!r} does not resolve inside the schema (none is fetched)"


@lru_cache(maxsize=256)
def _checked(schema_json: str):
    """(validator, None) for a usable tool parameters schema, else (None, why jsonschema cannot use
    it): not a valid JSON Schema (an unknown type, a bad regular expression), a ``$ref`` that does
    not resolve inside it, or a ``$ref`` loop that never reaches a value (``"$ref": "#"``: every
    validation would recurse forever)."""
    from jsonschema import Draft202012Validator, SchemaError

    schema = json.loads(schema_json)
    try:
        Draft202012Validator.check_schema(schema)
        validator = Draft202012Validator(schema, registry=OFFLINE)
        for _ in validator.iter_errors({}):  # a loop or a dangling $ref at the top shows on any value
            pass
        _follow_local_refs(schema)  # and those under a property, which {} does not reach
    except SchemaError as e:
        return None, f"{e.message} (at {e.json_path})"
    except UNUSABLE as e:
        return None, _unusable(e)
    return validator, None


def _follow_local_refs(schema) -> None:
    """Resolve every ``#...`` ``$ref`` of the schema, and the ``$ref`` chain from there: raises
    ``Unresolvable`` for one that points nowhere, ``RecursionError`` for a chain that comes back
    to where it was (``{"$ref": "#/properties/a"}`` at ``/properties/a``). A schema with an ``$id``
    below its root (refs relative to it) is left to the validation itself."""
    from referencing.jsonschema import DRAFT202012

    refs, stack = [], [(schema, True)]
    while stack:
        item, root = stack.pop()
        if isinstance(item, dict):
            if "$id" in item and not root:
                return
            if isinstance(item.get("$ref"), str) and item["$ref"].startswith("#"):
                refs.append(item["$ref"])
            stack.extend((v, False) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, False) for v in item)
    if not isinstance(schema, dict):
        return
    resolver = OFFLINE.with_resource("urn:tool", DRAFT202012.create_resource(schema)).resolver("urn:tool")
    for ref in refs:
        seen: set[int] = set()
        while isinstance(ref, str) and ref.startswith("#"):
            contents = resolver.lookup(ref).contents
            if id(contents) in seen:
                raise RecursionError(ref)
            seen.add(id(contents))
            ref = contents.get("$ref") if isinstance(contents, dict) else None


def _schema(parameters):
    """(validator, None) for a tool's ``parameters`` schema jsonschema can use, else (None, why)."""
    if deeper_than(parameters):
        return None, f"nested more than {MAX_JSON_DEPTH} levels deep"
    return _checked(json.dumps(parameters, sort_keys=True))


def schema_problem(parameters) -> str | None:
    """Why jsonschema cannot use a tool's ``parameters`` schema, or None (the prompts stage drops
    such a prompt; validate rejects a call against one with ``tool_bad_schema``)."""
    return _schema(parameters)[1]


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
        except (json.JSONDecodeError, RecursionError):
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
    validator, problem = _schema(schema)
    if problem:
        return [("tool_bad_schema", f"{name}: the offered parameters schema is unusable: {problem}")]
    try:
        errors = list(validator.iter_errors(arguments))
    except UNUSABLE as e:  # a $ref met only inside a value the probe of _checked did not have
        return [("tool_bad_schema", f"{name}: the offered parameters schema is unusable: {_unusable(e)}")]
    return [("tool_missing_required" if error.validator == "required" else "tool_args_schema",
             f"{name}: {'.'.join(map(str, error.absolute_path)) or 'arguments'}: {error.message}")
            for error in errors]


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
            except RecursionError:
                problems.setdefault("tool_bad_json", f"nested too deeply for a JSON parser: {body[:80]!r}")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                problems.setdefault("tool_bad_json", f"not an object with a name: {body[:80]!r}")
                continue
            name, arguments = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            if isinstance(arguments, str):  # some models double-encode
                try:
                    arguments = json.loads(arguments)
                except (json.JSONDecodeError, RecursionError):
                    problems.setdefault("tool_bad_json", f"arguments of {name} are not JSON: {arguments[:80]!r}")
                    continue
        # Deeper arguments would crash what walks them next (jsonschema, the QA report's encoder).
        if deeper_than(arguments):
            problems.setdefault("tool_bad_json", f"arguments of {name} nest more than {MAX_JSON_DEPTH} levels deep")
            continue
        calls.append({"name": name, "arguments": arguments})
        for code, detail in call_problems(name, arguments, offered):
            problems.setdefault(code, detail)
    if bodies and content[end:].strip():
        problems["text_after_tool_call"] = f"text after the last call: {content[end:].strip()[:80]!r}"
    return calls, problems
