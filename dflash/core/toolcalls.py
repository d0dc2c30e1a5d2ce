"""Tool calls as Qwen models write them, parsed from raw output text as the serving engine parses them.

Qwen2.5/Qwen3 write Hermes JSON (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``);
Qwen3-Coder, Qwen3.5 and Qwen3.6 write XML (``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\n
value\\n</parameter>\\n</function>\\n</tool_call>``) whose values are strings until a schema types them.

What a call *is* follows SGLang 0.5.23's own parsers, ``Qwen25Detector`` (Hermes) and
``Qwen3CoderDetector`` (XML), case by case (``tests/test_toolcalls.py`` runs them as the oracle):
the calls a server would hand the tool are the calls a record holds, typed as the server types them.
The checks then say what is wrong with them: ``NaN``/``Infinity`` in Hermes JSON, which the
engine's json takes and hands on, is ``tool_bad_json`` (JSON has no words for them); records store
such calls with the words the model wrote (``json_safe``).
"""
from __future__ import annotations

import ast
import json
import math
import re
import warnings
from functools import lru_cache
from pathlib import Path

from jsonschema.exceptions import UnknownType
from referencing import Registry
from referencing.exceptions import Unresolvable

from dflash.core.io import MAX_JSON_DEPTH, deeper_than

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


# ---- tool schemas as data sets write them ------------------------------------------------------------

JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
# SGLang 0.5.23's aliases of non-standard type names (function_call/utils.py), which its server
# applies to every offered tool before check_schema and before its parsers type a value: what a
# served call's values become follows them, so our typing does too.
ENGINE_ALIASES = {**dict.fromkeys(("str", "text", "varchar", "char", "enum", "uuid", "date", "datetime", "time",
                                   "timestamp", "binary", "blob", "bytea", "bytes", "varbinary"), "string"),
                  "bool": "boolean", "bigint": "integer", "smallint": "integer", "tinyint": "integer",
                  "double": "number", "decimal": "number", "real": "number", "numeric": "number",
                  "arr": "array", "tuple": "array", "set": "array", "map": "object"}
ENGINE_PREFIXES = ((("int", "uint", "long", "short", "unsigned"), "integer"), (("num", "float"), "number"),
                   (("list",), "array"), (("dict",), "object"))
PREFIX_END = frozenset("0123456789[<( \t")  # "int32", "list[str]"; not "internal", "list_price"


def engine_type(raw):
    """A ``type`` value as SGLang's server rewrites it (``varchar(255)`` -> string, ``int32`` ->
    integer, ``List[int]`` -> array); a name it does not know stays as it is."""
    if not isinstance(raw, str) or raw in JSON_TYPES:
        return raw
    base = raw.split("(", 1)[0].strip().lower()
    if base in JSON_TYPES:
        return base
    if base in ENGINE_ALIASES:
        return ENGINE_ALIASES[base]
    for prefixes, kind in ENGINE_PREFIXES:
        if any(base == p or (base.startswith(p) and len(base) > len(p) and base[len(p)] in PREFIX_END)
               for p in prefixes):
            return kind
    return raw


# The places of a JSON Schema that hold subschemas (the ones SGLang's rewrite walks).
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties")


def _retyped(schema, retype):
    """A copy of ``schema`` whose every string ``type`` at a subschema place is replaced by the keys
    ``retype(name)`` returns (the schema's own keys win: an ``items`` written next to ``List[int]``)."""
    if isinstance(schema, list):
        return [_retyped(s, retype) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    kind = schema.get("type")
    if isinstance(kind, str):
        out = {**retype(kind), **{k: v for k, v in schema.items() if k != "type"}}
    elif isinstance(kind, list):
        kinds = []
        for item in kind:
            new = retype(item).get("type") if isinstance(item, str) else item
            if new is None:
                raise UnknownTypeName(f"type {item!r} in a list of types")
            kinds += [k for k in (new if isinstance(new, list) else [new]) if k not in kinds]
        out["type"] = kinds
    for key in SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {k: _retyped(v, retype) for k, v in schema[key].items()}
    for key in SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [_retyped(v, retype) for v in schema[key]]
    for key in SUBSCHEMAS:
        if key in schema:
            out[key] = _retyped(schema[key], retype)
    return out


class UnknownTypeName(ValueError):
    """A ``type`` no reading of JSON Schema, Python or xlam gives a meaning."""


# xlam marks an optional parameter in its type ("int, optional", "str, default='x'").
OPTIONAL = re.compile(r",\s*(?:optional|default\b.*)$", re.I | re.S)
GENERIC = re.compile(r"^(\w+)\s*\[(.*)\]$", re.S)


def _type_arguments(inner: str) -> list[str]:
    """``"str, List[int]"`` -> ``["str", "List[int]"]``: the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(inner):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    return [p.strip() for p in parts + [inner[start:]]]


def python_type(name: str) -> dict:
    """The JSON Schema keys of a type name as Python and xlam write it (``List[int]`` ->
    ``{"type": "array", "items": {"type": "integer"}}``, ``Optional[str]``, ``int, optional``);
    raises UnknownTypeName for one that has no clear meaning."""
    bare = OPTIONAL.sub("", name).strip()
    generic = GENERIC.match(bare)
    if generic:
        outer, args = generic.group(1).lower(), _type_arguments(generic.group(2))
        if outer == "optional" and len(args) == 1:
            return {"anyOf": [python_type(args[0]), {"type": "null"}]}
        if outer == "union":
            return {"anyOf": [python_type(a) for a in args]}
        if outer in ("list", "set", "sequence", "iterable") and len(args) == 1:
            return {"type": "array", "items": python_type(args[0])}
        if outer in ("list", "tuple", "set"):
            return {"type": "array"}
        if outer in ("dict", "mapping"):
            return {"type": "object"}
        raise UnknownTypeName(f"type {name!r}")
    if bare.lower() == "any":
        return {}
    if bare.lower() in ("none", "nonetype"):
        return {"type": "null"}
    kind = engine_type(bare)
    if kind in JSON_TYPES:
        return {"type": kind}
    raise UnknownTypeName(f"type {name!r}")


def _bare_map(parameters: dict) -> bool:
    """Whether ``parameters`` is xlam's map of parameter name -> {type, description, default} with
    no ``type: object`` / ``properties`` around it (a parameter may be named ``type``)."""
    return (bool(parameters) and "properties" not in parameters and not isinstance(parameters.get("type"), str)
            and not set(parameters) & {*SUBSCHEMAS, *SUBSCHEMA_LISTS, "$ref"}
            and all(isinstance(v, dict) and ("type" in v or "description" in v) for v in parameters.values()))


def normalised_parameters(parameters) -> tuple[dict | None, str | None]:
    """(a JSON Schema, None) for a tool's ``parameters`` as data sets write them, or (None, why its
    meaning is unclear). xlam and Python type names become JSON Schema types (``str``,
    ``List[int]``, ``Dict[str, Any]``, ``Optional[int]``, ``int, optional``); a bare map of
    parameters becomes ``{type: object, properties, required}`` (required: those whose type says
    neither optional nor a default, and that have no ``default``). ``anyOf``, ``$ref``/``$defs`` and
    properties with no type are JSON Schema already. The record keeps its tools as written."""
    if parameters is None:
        return {"type": "object"}, None
    if not isinstance(parameters, dict):
        return None, f"parameters is a {type(parameters).__name__}, not an object"
    if deeper_than(parameters):
        return None, f"nested more than {MAX_JSON_DEPTH} levels deep"
    if _bare_map(parameters):
        required = [k for k, v in parameters.items() if "default" not in v
                    and not (isinstance(v.get("type"), str) and OPTIONAL.search(v["type"]))]
        parameters = {"type": "object", "properties": parameters, **({"required": required} if required else {})}
    try:
        return _retyped(parameters, python_type), None
    except UnknownTypeName as e:
        return None, f"{e} is no JSON Schema, Python or xlam type"
    except RecursionError:
        return None, "nested too deeply"


# A $ref registry that resolves nothing outside the schema: jsonschema's default one fetches a
# remote $ref with urlopen (no timeout), so a tool schema in a prompt data set could make every
# validate job contact a host it names.
OFFLINE = Registry()
# What jsonschema raises on a schema it cannot use, met while validating a value.
UNUSABLE = (RecursionError, re.error, Unresolvable, UnknownType)


def _unusable(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "a $ref loop that never reaches a value"
    if isinstance(error, re.error):
        return f"a bad regular expression ({error})"
    if isinstance(error, UnknownType):  # under a $ref to a place check_schema does not look (no keyword)
        return f"type {error.type!r} is no JSON Schema type"
    return f"$ref {getattr(error, 'ref', error)!r} does not resolve inside the schema (none is fetched)"


@lru_cache(maxsize=256)
def _checked(schema_json: str):
    """(validator, None) for a usable tool parameters schema, else (None, why jsonschema cannot use
    it): not a valid JSON Schema (an unknown type, a bad regular expression), a ``$ref`` that does
    not resolve inside it, or a ``$ref`` loop that never reaches a value (``"$ref": "#"``: every
    validation would recurse forever)."""
    from jsonschema import Draft202012Validator, SchemaError  # heavy: offered tools' schemas only

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
    from referencing.jsonschema import DRAFT202012  # heavy: offered tools' schemas only

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
    """(validator, None) for a tool's ``parameters`` once normalised, else (None, why it cannot be used)."""
    if deeper_than(parameters):
        return None, f"nested more than {MAX_JSON_DEPTH} levels deep"
    return _normalised_checked(json.dumps(parameters, sort_keys=True))


@lru_cache(maxsize=256)
def _normalised_checked(parameters_json: str):
    """``_schema`` of one tool's parameters, once per distinct schema: a shard offers a few tools to
    thousands of records."""
    schema, problem = normalised_parameters(json.loads(parameters_json))
    if problem:
        return None, problem
    return _checked(json.dumps(schema, sort_keys=True))


def schema_problem(parameters) -> str | None:
    """Why a tool's ``parameters`` has no usable meaning even normalised, or None: the prompts stage
    keeps and flags such a prompt, validate flags a call against it ``tool_schema_unknown`` and
    leaves its arguments unchecked."""
    return _schema(parameters)[1]


# ---- typing XML values as SGLang's Qwen3CoderDetector does ----------------------------------------

def engine_properties(parameters) -> dict:
    """What SGLang types a call's XML values by (``_engine_properties``), once per distinct schema."""
    if not isinstance(parameters, dict) or deeper_than(parameters):
        return {}
    return _engine_properties(json.dumps(parameters, sort_keys=True))


@lru_cache(maxsize=256)
def _engine_properties(parameters_json: str) -> dict:
    """What SGLang types a call's XML values by: the tool's top-level ``properties`` (those of its
    ``anyOf``/``oneOf``/``allOf`` branches when the top declares none) or, without any, the
    ``parameters`` object itself (so xlam's bare map types its values), after its type aliases."""
    try:
        schema = _retyped(json.loads(parameters_json), lambda t: {"type": engine_type(t)})
    except RecursionError:
        return {}
    properties = _top_properties(schema)
    return properties if properties or "properties" in schema else schema


def _top_properties(schema) -> dict:
    if not isinstance(schema, dict):
        return {}
    if isinstance(schema.get("properties"), dict):
        return schema["properties"]
    merged: dict = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(keyword) if isinstance(schema.get(keyword), list) else []:
            for key, value in _top_properties(branch).items():
                merged.setdefault(key, value)
    return merged


def _enum_kind(value) -> str:
    for kind, test in (("null", lambda v: v is None), ("boolean", lambda v: isinstance(v, bool)),
                       ("integer", lambda v: isinstance(v, int)), ("number", lambda v: isinstance(v, float)),
                       ("string", lambda v: isinstance(v, str)), ("array", lambda v: isinstance(v, list)),
                       ("object", lambda v: isinstance(v, dict))):
        if test(value):
            return kind
    return "string"


def value_kind(schema):
    """The one type SGLang reads a property's value as (``infer_type_from_json_schema``): its
    ``type`` (the first but null of a list), else a common type of its ``anyOf``/``oneOf`` (string
    when they differ and one is a string: ``anyOf [string, integer]`` keeps ``94103`` a string),
    its ``enum``'s, ``allOf``'s, object with ``properties``, array with ``items``; None if none."""
    if not isinstance(schema, dict):
        return None
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, str):
            return kind
        if isinstance(kind, list) and kind:
            return next((k for k in kind if k != "null"), "string")
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        kinds = [k for k in map(value_kind, branches) if k]
        if kinds:
            if len(set(map(str, kinds))) == 1:
                return kinds[0]
            if len(set(map(str, kinds))) == 2 and "null" in kinds:
                return next(k for k in kinds if k != "null")
            return "string" if "string" in kinds else kinds[0]
    if isinstance(schema.get("enum"), list):
        kinds = {_enum_kind(v) for v in schema["enum"]}
        return kinds.pop() if len(kinds) == 1 else "string"
    if isinstance(schema.get("allOf"), list):
        return next((k for k in map(value_kind, schema["allOf"]) if k and k != "string"), "string")
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _literal(value: str):
    # As SGLang: invalid escapes ("\d") keep their backslash, with only a warning to hide.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.literal_eval(value)


def typed_value(value: str, name: str, properties: dict):
    """(the value SGLang hands the tool, a note when it had to guess): ``null`` is None whatever
    the type, a string type keeps the text, integers and numbers are read when they parse (else
    the text stays), a boolean is ``true`` or else false, anything else JSON, then a Python
    literal, then the text. A parameter the schema does not name stays text."""
    if value.lower() == "null":
        return None, None
    if name not in properties:
        return value, None
    kind = str(value_kind(properties[name]) or "string").strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value, None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value), None
        except Exception:
            return value, None
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except Exception:
            return value, None
        whole = "." not in value and "e" not in value.lower() and number.is_integer()
        return int(number) if whole else number, None
    if kind in ("boolean", "bool", "binary"):
        if value.lower() not in ("true", "false"):
            return False, f"{name}: {value[:40]!r} is not true or false (the engine reads false)"
        return value.lower() == "true", None
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value), None
        except Exception:
            pass
    try:
        return _literal(value), None
    except Exception:
        return value, None


# ---- finding the calls ------------------------------------------------------------------------------

def _blocks(content: str, opening: str, closing: str) -> tuple[list[str], list[str], int | None]:
    """(bodies, the text between them, where a block opened and never closed or None), as
    ``re.findall(opening (.*?) closing)`` reads a text, in one pass: a block runs to the first
    ``closing`` after it, another ``opening`` inside it included."""
    bodies, outside, pos = [], [], 0
    while (start := content.find(opening, pos)) >= 0:
        outside.append(content[pos:start])
        close = content.find(closing, start + len(opening))
        if close < 0:
            return bodies, outside, start
        bodies.append(content[start + len(opening):close])
        pos = close + len(closing)
    outside.append(content[pos:])
    return bodies, outside, None


# Call markup that means something only inside a <tool_call> block.
STRAY = re.compile(r"</tool_call>|<function=|<parameter=")
CALL_MARKUP = re.compile(r"</?tool_call>|<function=|<parameter=")
RESPONSE = re.compile(r"</?tool_response>")
# Fenced code (to its end if never closed) and inline code: where an answer quotes markup.
CODE = re.compile(r"```.*?(?:```|\Z)|`[^`\n]*`", re.S)
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
XML_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.S)
XML_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)
AUTO_JSON = re.compile(r"<tool_call>\s*[{\[]")


def _stray(pieces: list[str], code: str, problems: dict) -> None:
    """Tool-call markup outside every block (a ``<function=`` block closed by a ``</tool_call>``
    that was never opened, say): the format's code."""
    for piece in pieces:
        if hit := STRAY.search(piece):
            context = piece[max(0, hit.start() - 40):hit.end() + 40]
            problems.setdefault(code, f"{hit.group()} outside a <tool_call> block: {context!r}")
            return


def _xml_calls(content: str, offered: dict, problems: dict) -> list[dict]:
    """The calls SGLang's Qwen3CoderDetector reads (name as written, values typed its way), and in
    ``problems`` what the template never writes: ``tool_bad_xml`` (a value cut by a literal
    ``</parameter>``, a parameter given twice, a missing closing tag, more than one function in a
    block), ``tool_unclosed``, ``tool_call_unparsed`` (Hermes JSON the XML parser reads no call from)."""
    if "<tool_call>" not in content:  # the engine parses nothing
        _stray([content], "tool_bad_xml", problems)
        return []
    bodies, outside, open_at = _blocks(content, "<tool_call>", "</tool_call>")
    if open_at is not None or any("<tool_call>" in b for b in bodies):
        problems["tool_unclosed"] = "a <tool_call> without its </tool_call>"
    _stray(outside, "tool_bad_xml", problems)
    whole = not bodies and "<function=" in content  # the engine then reads the whole text
    calls = []
    for body in [content] if whole else bodies:
        functions = list(XML_FUNCTION.finditer(body))
        if not functions:
            if body.strip().startswith(("{", "[")):
                problems.setdefault("tool_call_unparsed", f"Hermes JSON in a <tool_call> block, which the model's "
                                                          f"parser (XML) reads no call from: {body.strip()[:80]!r}")
            else:
                problems.setdefault("tool_bad_xml", f"not <function=NAME> with <parameter=...> blocks: {body[:80]!r}")
            continue
        if not whole and (len(functions) > 1 or body[:functions[0].start()].strip()
                          or body[functions[-1].end():].strip()):
            problems.setdefault("tool_bad_xml", f"not one <function=NAME>...</function> in its block: {body[:80]!r}")
        for function in functions:
            text = function.group(1) or function.group(2) or ""
            if function.group(1) is None and not whole:  # an unclosed call: tool_unclosed says it
                problems.setdefault("tool_bad_xml", f"<function= without </function>: {text[:80]!r}")
            if ">" not in text:
                problems.setdefault("tool_bad_xml", f"<function= without >: {text[:80]!r}")
                continue
            name, params = text.split(">", 1)
            arguments = _xml_arguments(name, params, offered, problems)
            calls.append({"name": name, "arguments": arguments})
    return calls


def _xml_arguments(name: str, params: str, offered: dict, problems: dict) -> dict:
    properties = engine_properties((offered.get(name) or {}).get("parameters"))
    arguments, pos = {}, 0
    for param in XML_PARAMETER.finditer(params):
        if params[pos:param.start()].strip():
            problems.setdefault("tool_bad_xml", f"{name}: text outside a parameter (a literal </parameter> inside a "
                                                f"value cuts it there): {params[pos:param.start()].strip()[:80]!r}")
        pos = param.end()
        inner = param.group(1)
        if not param.group(0).endswith("</parameter>"):
            problems.setdefault("tool_bad_xml", f"{name}: <parameter= without </parameter>: {inner[:80]!r}")
        if ">" not in inner:
            problems.setdefault("tool_bad_xml", f"{name}: <parameter= without >: {inner[:80]!r}")
            continue
        key, value = inner.split(">", 1)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        if key in arguments:
            problems.setdefault("tool_bad_xml", f"{name}: parameter {key!r} given twice (the engine keeps the last)")
        arguments[key], note = typed_value(value, key, properties)
        if note:
            problems.setdefault("tool_args_schema", f"{name}: {note}")
    if params[pos:].strip():
        problems.setdefault("tool_bad_xml", f"{name}: text outside a parameter: {params[pos:].strip()[:80]!r}")
    return arguments


class _NotJSON(ValueError):
    pass


def _no_constant(word: str):
    raise _NotJSON(word)


def _hermes_calls(content: str, offered: dict, problems: dict) -> list[dict]:
    """The calls SGLang's Qwen25Detector reads: each ``<tool_call>\\n...\\n</tool_call>`` block's
    JSON object (or list of them) naming an offered tool; in ``problems`` the rest: ``tool_bad_json``
    (bad JSON, ``NaN``, a block not framed by those newlines), ``tool_unknown_name`` (a call the
    engine drops), ``tool_unclosed``, ``tool_call_unparsed`` (an XML call)."""
    bodies, outside, open_at = _blocks(content, "<tool_call>\n", "\n</tool_call>")
    for piece in outside:
        if "<tool_call>" in piece:
            problems.setdefault("tool_bad_json" if "</tool_call>" in piece.split("<tool_call>", 1)[1]
                                else "tool_unclosed", "a <tool_call> the engine reads no call from (it needs "
                                "<tool_call>, a newline, the JSON, a newline, </tool_call>): "
                                f"{piece[piece.index('<tool_call>'):][:80]!r}")
    if open_at is not None or any("<tool_call>" in b for b in bodies):
        problems["tool_unclosed"] = "a <tool_call> without its </tool_call>"
    _stray([p.replace("<tool_call>", "") for p in outside], "tool_bad_json", problems)
    calls = []
    for body in bodies:
        if "<function=" in body:
            problems.setdefault("tool_call_unparsed", f"an XML call, which the model's parser (Hermes JSON) reads "
                                                      f"no call from: {body.strip()[:80]!r}")
            continue
        try:
            try:
                obj = json.loads(body.strip(), parse_constant=_no_constant)
            except _NotJSON as e:  # Python's json (the engine's) takes it; JSON and every other reader do not
                problems.setdefault("tool_bad_json", f"{e} is no JSON number: {body.strip()[:80]!r}")
                obj = json.loads(body.strip())  # the call the engine hands on
        except json.JSONDecodeError as e:
            problems.setdefault("tool_bad_json", f"{e.msg} at {e.pos}: {body.strip()[:80]!r}")
            continue
        except RecursionError:
            problems.setdefault("tool_bad_json", f"nested too deeply for a JSON parser: {body.strip()[:80]!r}")
            continue
        for act in obj if isinstance(obj, list) else [obj]:
            if not isinstance(act, dict) or not isinstance(act.get("name"), (str, type(None))):
                problems.setdefault("tool_bad_json", f"not an object with a name: {body.strip()[:80]!r}")
                continue
            if not act.get("name") or act["name"] not in offered:  # the engine drops the call
                problems.setdefault("tool_unknown_name", f"{act.get('name')!r} is not among the offered tools "
                                                         f"({', '.join(offered)})")
                continue
            calls.append({"name": act["name"], "arguments": act.get("parameters") or act.get("arguments", {})})
    return calls


def json_safe(value):
    """``value`` as JSON can hold it: NaN and infinities (a Hermes call's, as the engine reads it)
    as the words the model wrote."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def _fenced_calls(content: str, offered: dict) -> str | None:
    """A fenced JSON block that is a call of an offered tool (``{"name", "arguments"}``) written
    instead of a ``<tool_call>``: no engine parser reads it."""
    for fence in FENCE.finditer(content):
        try:
            obj = json.loads(fence.group(1))
        except (ValueError, RecursionError):
            continue
        for act in obj if isinstance(obj, list) else [obj]:
            if isinstance(act, dict) and act.get("name") in offered and ("arguments" in act or "parameters" in act):
                return f"a fenced JSON call of {act['name']} instead of a <tool_call>: {fence.group(1).strip()[:80]!r}"
    return None


def call_problems(name: str, arguments, offered: dict[str, dict]) -> list[tuple[str, str]]:
    """(reason code, detail) of each way one parsed call fails the offered tools (name -> function):
    a name not among them, arguments that are no object, or against the tool's normalised JSON
    Schema (``tool_schema_unknown`` when it has no clear meaning: the arguments go unchecked)."""
    if not offered:
        return [("tool_without_tools", f"called {name} but no tools were offered")]
    if name not in offered:
        return [("tool_unknown_name", f"{name!r} is not among the offered tools ({', '.join(offered)})")]
    if not isinstance(arguments, dict):
        return [("tool_args_schema", f"{name}: arguments are a {type(arguments).__name__}, not an object")]
    validator, problem = _schema(offered[name].get("parameters"))
    if problem:
        return [("tool_schema_unknown", f"{name}: the offered parameters schema has no clear meaning: {problem}; "
                                        f"arguments not checked")]
    try:
        errors = list(validator.iter_errors(arguments))
    except UNUSABLE as e:  # a $ref met only inside a value the probe of _checked did not have
        return [("tool_schema_unknown", f"{name}: the offered parameters schema has no clear meaning: {_unusable(e)}; "
                                        f"arguments not checked")]
    return [("tool_missing_required" if error.validator == "required" else "tool_args_schema",
             f"{name}: {'.'.join(map(str, error.absolute_path)) or 'arguments'}: {error.message}")
            for error in errors]


def check_tool_calls(content: str, reasoning: str | None, tools: list | None,
                     fmt: str = "xml") -> tuple[list[dict], dict[str, str]]:
    """(the calls the serving engine would hand the tools, problems: reason code -> first detail)
    of one generation.

    ``fmt`` is the model's call format, which decides the engine's parser: ``xml`` (Qwen3.5/3.6,
    Qwen3-Coder: qwen3_coder), ``json`` (Hermes, Qwen2.5/Qwen3: qwen25) or ``auto`` (Hermes when the
    answer's calls are JSON, else XML). Without tools the engine parses nothing: call markup then is
    ``tool_without_tools``, unless quoted in code (an answer explaining the format).
    """
    if fmt not in ("xml", "json", "auto"):  # 'target' is the stage's to resolve (validate.validate_job)
        raise ValueError(f"tool-call format {fmt!r}: xml, json or auto (validate.validate_for_target resolves 'target' "
                         f"from the target's chat template)")
    problems: dict[str, str] = {}
    if reasoning and "<tool_call>" in reasoning:
        problems["tool_call_in_reasoning"] = "<tool_call> inside the reasoning"
    offered = {t["function"]["name"]: t["function"] for t in tools or []}
    markup_without_tools = not offered and CALL_MARKUP.search(content)
    if "tool_response>" in content or markup_without_tools:  # most answers hold neither: no second pass
        prose = CODE.sub(" ", content) if "`" in content else content
        if hit := RESPONSE.search(prose):
            problems["tool_response_invented"] = f"{hit.group()} written by the model: {prose[hit.start():][:80]!r}"
        if markup_without_tools and (hit := CALL_MARKUP.search(prose)):
            problems["tool_without_tools"] = f"{hit.group()} but no tools were offered: {prose[hit.start():][:80]!r}"
    if not offered:
        return [], problems
    if fmt == "auto":
        hermes = AUTO_JSON.search(content) or ("<tool_call>" not in content and '"name"' in content)
        fmt = "json" if hermes and "<function" not in content and "<parameter=" not in content else "xml"
    calls = []
    if "<tool_call>" in content or STRAY.search(content):
        for call in (_xml_calls if fmt == "xml" else _hermes_calls)(content, offered, problems):
            # Deeper arguments would crash what walks them next (jsonschema, the QA report's encoder).
            if deeper_than(call["arguments"]):
                problems.setdefault("tool_bad_json" if fmt == "json" else "tool_bad_xml",
                                    f"arguments of {call['name']} nest more than {MAX_JSON_DEPTH} levels deep")
                continue
            calls.append(call)
            for code, detail in call_problems(call["name"], call["arguments"], offered):
                problems.setdefault(code, detail)
    if "```" in content and (fenced := _fenced_calls(content, offered)):
        problems.setdefault("tool_call_unparsed", fenced)
    seen = set()
    for call in calls:
        key = (call["name"], json.dumps(call["arguments"], sort_keys=True, default=str))
        if key in seen:
            problems.setdefault("tool_duplicate_call", f"{call['name']} called twice with the same arguments")
        seen.add(key)
    end = content.rfind("</tool_call>")
    if calls and end >= 0 and content[end + len("</tool_call>"):].strip():
        problems["text_after_tool_call"] = f"text after the last call: {content[end + 12:].strip()[:80]!r}"
    return calls, problems


def target_tool_format(target_dir) -> str:
    """The tool-call format the target's chat template writes, which picks the engines' parser:
    ``xml`` when it renders calls as ``<function=NAME>`` (Qwen3.5/3.6, Qwen3-Coder: qwen3_coder),
    ``json`` when it renders ``<tool_call>`` otherwise (Hermes: Qwen2.5/Qwen3, qwen25), ``auto``
    (each answer as written) when it writes no tool calls at all. Read from the tokenizer files, as
    ``transformers`` does: ``chat_template.jinja``, else ``tokenizer_config.json``'s template(s)."""
    folder = Path(target_dir)
    if (path := folder / "chat_template.jinja").exists():
        template = path.read_text(encoding="utf-8")
    elif (path := folder / "tokenizer_config.json").exists():
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template") or ""
        if isinstance(template, list):  # named templates: [{name, template}]
            template = "\n".join(t.get("template") or "" for t in template if isinstance(t, dict))
    else:
        raise ValueError(f"{folder}: no chat_template.jinja or tokenizer_config.json (validate reads the target's "
                         f"tool-call format from its chat template); point target.path at the target model folder, "
                         f"or set validate.tool_format to xml or json")
    if "<function=" in template:
        return "xml"
    return "json" if "<tool_call>" in template else "auto"
