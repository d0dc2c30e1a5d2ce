"""Tool calls read as the serving engine reads them, and tool schemas as data sets write them.

The labelled cases below (good and bad twins of every shape seen in real Qwen3.6 data, each schema
dialect, typing edge cases) say which tool codes each must get; ``test_our_parse_is_sglangs`` runs
SGLang 0.5.23's own parsers (``tests/sglang_oracle.py``) on all of them and asks for the same calls,
name and typed arguments, case by case."""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from dflash.core.toolcalls import check_tool_calls, json_safe, normalised_parameters, schema_problem
from dflash.validate.stage import judge
from tests.test_validate import CFG, answer


def tool(name, parameters):
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


WEATHER = tool("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array", "items": {"type": "integer"}}, "ratio": {"type": "number"}}, "required": ["city"]})
WRITE = tool("write_file", {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                            "required": ["path", "content"]})
# Schema dialects as real tool sets write them.
DIALECTS = {
    "pydantic": {"type": "object", "properties": {"zip": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                                  "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
    "mixed": {"type": "object", "properties": {"zip": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                                               "n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
    "untyped": {"type": "object", "properties": {"zip": {"description": "a postcode"}, "n": {}}},
    "xlam": {"zip": {"type": "str", "description": "a postcode"}, "n": {"type": "int, optional", "default": 1}},
    "xlam_wrapped": {"type": "dict", "properties": {"zip": {"type": "str"}, "n": {"type": "List[int]"}},
                     "required": ["zip"]},
    "ref": {"type": "object", "properties": {"zip": {"$ref": "#/$defs/Zip"}, "n": {"$ref": "#/$defs/N"}},
            "$defs": {"Zip": {"type": "string"}, "N": {"type": "integer"}}},
    "enum": {"type": "object", "properties": {"zip": {"enum": ["75001", "94103"]}, "n": {"enum": [1, 2, 3]}}},
    "typelist": {"type": "object", "properties": {"zip": {"type": ["string", "null"]}, "n": {"type": ["integer", "null"]}}},
    "db": {"type": "object", "properties": {"zip": {"type": "varchar(10)"}, "n": {"type": "int32"}}},
    "python": {"type": "object", "properties": {"zip": {"type": "Optional[str]"}, "n": {"type": "float, optional"}}},
}


def xml_call(name, params, close_params=True):
    end = "\n</parameter>\n" if close_params else "\n"
    body = "".join(f"<parameter={k}>\n{v}{end}" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def hermes(name, arguments, raw=None):
    return f"<tool_call>\n{raw or json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


XML_FILE = '<config>\n  <param name="x">1</param>\n</config>'
XML_FILE_CUT = '<config>\n  <parameter name="x">1</parameter>\n</config>'  # a literal </parameter> inside the value

# (id, content, tools, format, the tool codes it must get)
SHAPES = [
    ("xml-good", xml_call("get_weather", {"city": "Paris", "days": 3}), [WEATHER], "xml", set()),
    ("xml-parallel", xml_call("get_weather", {"city": "Paris"}) + "\n" + xml_call("get_weather", {"city": "Lyon"}),
     [WEATHER], "xml", set()),
    ("xml-duplicate", xml_call("get_weather", {"city": "Paris"}) + "\n" + xml_call("get_weather", {"city": "Paris"}),
     [WEATHER], "xml", {"tool_duplicate_call"}),
    ("xml-value-with-xml", xml_call("write_file", {"path": "a.xml", "content": XML_FILE}), [WRITE], "xml", set()),
    ("xml-value-cut", xml_call("write_file", {"path": "a.xml", "content": XML_FILE_CUT}), [WRITE], "xml",
     {"tool_bad_xml"}),
    ("xml-name-space", xml_call("get_weather ", {"city": "Paris"}), [WEATHER], "xml", {"tool_unknown_name"}),
    ("xml-param-twice", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=city>"
     "\nLyon\n</parameter>\n</function>\n</tool_call>", [WEATHER], "xml", {"tool_bad_xml"}),
    ("xml-two-params", xml_call("get_weather", {"city": "Lyon", "days": 2}), [WEATHER], "xml", set()),
    ("xml-hermes-from-qwen36", hermes("get_weather", {"city": "Paris"}), [WEATHER], "xml", {"tool_call_unparsed"}),
    ("xml-fenced-call", 'I will call it:\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
     [WEATHER], "xml", {"tool_call_unparsed"}),
    ("xml-fenced-config", 'Use this package.json:\n```json\n{"name": "my-app", "version": "1.0.0"}\n```', [WEATHER],
     "xml", set()),
    ("xml-response-invented", xml_call("get_weather", {"city": "Paris"}) + "\n<tool_response>\n{\"temp\": 21}\n"
     "</tool_response>\nIt is 21 degrees.", [WEATHER], "xml", {"tool_response_invented"}),
    ("no-tools-quoted", "A call looks like this:\n```\n<tool_call>\n<function=NAME>\n<parameter=ARG>\nvalue\n"
     "</parameter>\n</function>\n</tool_call>\n```\nand the result comes back in `<tool_response>`.", None, "xml",
     set()),
    ("no-tools-call", xml_call("get_weather", {"city": "Paris"}), None, "xml", {"tool_without_tools"}),
    ("xml-unclosed", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n", [WEATHER], "xml",
     {"tool_unclosed"}),
    ("xml-no-closing-parameter", xml_call("get_weather", {"city": "Paris", "days": 2}, close_params=False), [WEATHER],
     "xml", {"tool_bad_xml"}),
    ("xml-unicode", xml_call("get_weather", {"city": "Zürich 東京 🌧"}), [WEATHER], "xml", set()),
    ("xml-bad-int", xml_call("get_weather", {"city": "Paris", "days": "three"}), [WEATHER], "xml",
     {"tool_args_schema"}),
    ("xml-bad-bool", xml_call("get_weather", {"city": "Paris", "metric": "yes"}), [WEATHER], "xml",
     {"tool_args_schema"}),
    ("xml-null", xml_call("get_weather", {"city": "null"}), [WEATHER], "xml", {"tool_args_schema"}),
    ("xml-missing-required", xml_call("get_weather", {"days": 2}), [WEATHER], "xml", {"tool_missing_required"}),
    ("xml-prose-then-call", "Let me check.\n\n" + xml_call("get_weather", {"city": "Paris"}), [WEATHER], "xml",
     set()),
    ("json-good", hermes("get_weather", {"city": "Paris", "days": 2}), [WEATHER], "json", set()),
    ("json-parallel", hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("get_weather", {"city": "Lyon"}),
     [WEATHER], "json", set()),
    ("json-duplicate", hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("get_weather", {"city": "Paris"}),
     [WEATHER], "json", {"tool_duplicate_call"}),
    ("json-nan", hermes("", None, '{"name": "get_weather", "arguments": {"city": "Paris", "ratio": NaN}}'), [WEATHER],
     "json", {"tool_bad_json"}),
    ("json-number", hermes("get_weather", {"city": "Paris", "ratio": 0.5}), [WEATHER], "json", set()),
    ("json-name-space", hermes("get_weather ", {"city": "Paris"}), [WEATHER], "json", {"tool_unknown_name"}),
    ("json-xml-from-qwen3", xml_call("get_weather", {"city": "Paris"}), [WEATHER], "json", {"tool_call_unparsed"}),
    ("json-no-newline", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', [WEATHER],
     "json", {"tool_bad_json"}),
    ("json-broken", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', [WEATHER],
     "json", {"tool_bad_json"}),
    ("json-parameters-key", hermes("", None, '{"name": "get_weather", "parameters": {"city": "Paris"}}'), [WEATHER],
     "json", set()),
    ("json-double-encoded", hermes("", None, json.dumps({"name": "get_weather", "arguments": '{"city": "Paris"}'})),
     [WEATHER], "json", {"tool_args_schema"}),
    ("json-nested", hermes("get_weather", {"city": "Paris", "hours": [9, 12]}), [WEATHER], "json", set()),
    ("json-unicode", hermes("get_weather", {"city": "Zürich 東京 🌧"}), [WEATHER], "json", set()),
    ("json-response-invented", hermes("get_weather", {"city": "Paris"}) + "\n<tool_response>\n21\n</tool_response>",
     [WEATHER], "json", {"tool_response_invented"}),
    ("json-unclosed", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', [WEATHER], "json",
     {"tool_unclosed"}),
]

# Typing: every schema dialect with values that look like other types; SGLang decides what each becomes.
VALUES = ["94103", "007", "12", "3.5", "1e3", "true", "yes", "null", "[1, 2]", "{'a': 1}", '{"a": [1, {"b": null}]}',
          "Zürich", "-4"]
TYPING = [(f"typing-{dialect}-{n}", xml_call("lookup", {"zip": value, "n": value}), [tool("lookup", schema)], "xml",
           None) for dialect, schema in DIALECTS.items() for n, value in enumerate(VALUES)]
CASES = SHAPES + TYPING
TOOL_CODES = {"tool_unclosed", "tool_bad_json", "tool_bad_xml", "tool_unknown_name", "tool_args_schema",
              "tool_missing_required", "tool_without_tools", "tool_duplicate_call", "tool_call_unparsed",
              "tool_response_invented", "tool_schema_unknown"}


@pytest.mark.parametrize("cid,content,tools,fmt,codes", SHAPES, ids=[c[0] for c in SHAPES])
def test_each_shape_gets_its_codes_and_its_twin_none(cid, content, tools, fmt, codes):
    problems = check_tool_calls(content, None, tools, fmt)[1]
    assert set(problems) & TOOL_CODES == codes, problems


def test_the_shapes_have_good_and_bad_twins():
    assert len(SHAPES) >= 30 and sum(not c[4] for c in SHAPES) >= 10


def test_our_parse_is_sglangs():
    """SGLang 0.5.23's Qwen3CoderDetector / Qwen25Detector, the engine's own parsers, on every case:
    the same calls, name and typed arguments, or none where it finds none."""
    python = os.environ.get("DFLASH_SGLANG_PYTHON")
    if not python:
        if os.environ.get("CI") == "true":  # CI runs `make test`, which sets it: a skip there would hide the oracle
            pytest.fail("DFLASH_SGLANG_PYTHON is unset under CI; run the tests through `make test`")
        pytest.skip("DFLASH_SGLANG_PYTHON is unset: `make test` sets it (.venv-sglang, SGLang's parsers without torch)")
    oracle = Path(__file__).with_name("sglang_oracle.py")
    payload = json.dumps([{"text": c[1], "tools": c[2], "format": c[3]} for c in CASES], ensure_ascii=False)
    out = subprocess.run([python, oracle], input=payload, capture_output=True, text=True, timeout=120, check=True)
    theirs = json.loads(out.stdout)
    differ = [(cid, ours, served) for (cid, content, tools, fmt, _), served in zip(CASES, theirs)
              if json.dumps(ours := check_tool_calls(content, None, tools, fmt)[0], sort_keys=True)
              != json.dumps(served, sort_keys=True)]
    assert not differ and len(CASES) >= 100, f"{len(differ)} of {len(CASES)} differ from SGLang: {differ[:5]}"


# ---- schemas as data sets write them -----------------------------------------------------------------

@pytest.mark.parametrize("parameters,schema", [
    ({"city": {"type": "str", "description": "the city"}, "days": {"type": "int, optional", "default": 1},
      "ids": {"type": "List[int]"}, "opts": {"type": "Dict[str, Any]"}, "ratio": {"type": "float"},
      "on": {"type": "bool"}, "label": {"type": "str, default='x'"}},
     {"type": "object", "required": ["city", "ids", "opts", "ratio", "on"], "properties": {
         "city": {"type": "string", "description": "the city"}, "days": {"type": "integer", "default": 1},
         "ids": {"type": "array", "items": {"type": "integer"}}, "opts": {"type": "object"}, "ratio": {"type": "number"},
         "on": {"type": "boolean"}, "label": {"type": "string"}}}),
    ({"type": "object", "properties": {"q": {"type": "Optional[str]"}, "u": {"type": "Union[int, str]"}}},
     {"type": "object", "properties": {"q": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                       "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}),
    ({"type": "object", "properties": {"zip": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "x": {}}},
     {"type": "object", "properties": {"zip": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "x": {}}}),
    (None, {"type": "object"}),
])
def test_schemas_are_normalised_where_their_meaning_is_clear(parameters, schema):
    assert normalised_parameters(parameters) == (schema, None)
    assert schema_problem(parameters) is None


def test_an_xlam_type_behind_a_ref_no_longer_crashes_validate():
    """An OpenAPI-style $ref into a place no JSON Schema keyword names (check_schema never looks
    there) met jsonschema's UnknownType mid-validation: the whole shard was lost."""
    parameters = {"type": "object", "properties": {"city": {"$ref": "#/components/schemas/City"}},
                  "components": {"schemas": {"City": {"type": "town"}}}}
    reasons, flags, _, details = judge(answer(xml_call("get_weather", {"city": "Paris"}), tools=[tool("get_weather",
                                                                                                    parameters)]),
                                       {**CFG, "checks": {**CFG["checks"], "tool_schema_unknown": "flag"}})
    assert reasons == [] and flags == ["tool_schema_unknown"]
    assert "type 'town' is no JSON Schema type" in details["tool_schema_unknown"]


def test_an_xlam_tool_checks_its_calls():
    xlam = tool("get_weather", DIALECTS["xlam"])
    good = check_tool_calls(xml_call("get_weather", {"zip": "94103", "n": 2}), None, [xlam], "xml")
    assert good == ([{"name": "get_weather", "arguments": {"zip": "94103", "n": 2}}], {})
    assert set(check_tool_calls(xml_call("get_weather", {"n": 2}), None, [xlam], "xml")[1]) == {"tool_missing_required"}


def test_an_unresolved_target_format_is_an_error_not_a_guess():
    """'target' names the target's chat template; only the stage's job (validate_for_target) can read it.
    Parsed as anything else, XML calls would all be tool_call_unparsed."""
    with pytest.raises(ValueError, match="validate.validate_for_target resolves 'target'"):
        check_tool_calls(xml_call("get_weather", {"city": "Paris"}), None, [WEATHER], "target")


def test_nan_is_read_as_the_engine_reads_it_and_rejected():
    """The engine's json hands the tool NaN; the record is tool_bad_json, and stores the call as
    JSON can hold it (the QA JSON and the shards are strict JSON)."""
    calls, problems = check_tool_calls(SHAPES[[c[0] for c in SHAPES].index("json-nan")][1], None, [WEATHER], "json")
    assert math.isnan(calls[0]["arguments"]["ratio"]) and "NaN is no JSON number" in problems["tool_bad_json"]
    assert json_safe(calls) == [{"name": "get_weather", "arguments": {"city": "Paris", "ratio": "NaN"}}]
    assert json_safe([float("inf"), -float("inf"), 1.5, {"a": [float("nan")]}]) == ["Infinity", "-Infinity", 1.5,
                                                                                   {"a": ["NaN"]}]


# -- the default format: the one the target's chat template writes ---------------------------------

DEMO_TARGET = Path(__file__).resolve().parents[1] / "data" / "demo" / "target"
HERMES_TEMPLATE = ('{%- for tool_call in message.tool_calls %}<tool_call>\n{"name": "{{ tool_call.function.name }}", '
                   '"arguments": {{ tool_call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}')


@pytest.mark.parametrize("files, expected", [
    ({"chat_template.jinja": "<tool_call>\n<function={{ name }}>\n"}, "xml"),  # Qwen3.5/3.6, Qwen3-Coder
    ({"chat_template.jinja": HERMES_TEMPLATE}, "json"),  # Qwen2.5/Qwen3
    ({"tokenizer_config.json": json.dumps({"chat_template": HERMES_TEMPLATE})}, "json"),
    ({"tokenizer_config.json": json.dumps({"chat_template": [{"name": "default", "template": "{{ m }}"},
                                                             {"name": "tool_use", "template": HERMES_TEMPLATE}]})},
     "json"),
    ({"tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"})}, "auto"),  # writes no calls
])
def test_the_target_template_names_the_tool_call_format(tmp_path, files, expected):
    from dflash.core.toolcalls import target_tool_format

    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert target_tool_format(tmp_path) == expected


def test_validate_reads_the_format_from_the_target_by_default(tmp_path):
    """validate.tool_format: target (the default): the demo target's template writes XML calls, so
    a Hermes call from it is one its engine's parser (qwen3_coder) does not read."""
    from dflash.core.config import defaults
    from dflash.core.io import read_jsonl, write_jsonl_zst
    from dflash.core.toolcalls import target_tool_format
    from dflash.validate.stage import validate_for_target

    assert target_tool_format(DEMO_TARGET) == "xml"
    hermes = answer('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    write_jsonl_zst(tmp_path / "c.jsonl.zst", [hermes])
    cfg = defaults("validate")
    assert cfg["tool_format"] == "target"
    validate_for_target(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst", tmp_path / "qa.json",
                 cfg, None, DEMO_TARGET)
    assert read_jsonl(tmp_path / "r.jsonl.zst")[0]["qa"]["reasons"] == ["tool_call_unparsed"]
    with pytest.raises(ValueError, match="no chat_template.jinja or tokenizer_config.json"):
        target_tool_format(tmp_path)
