"""Tool calls as Qwen models write them, parsed from raw output text.

Qwen2.5/Qwen3 write Hermes JSON (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``);
Qwen3-Coder, Qwen3.5 and Qwen3.6 write XML (``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\n
value\\n</parameter>\\n</function>\\n</tool_call>``) whose values are strings until a schema types them.
"""
from __future__ import annotations

import json
import re

XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
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
