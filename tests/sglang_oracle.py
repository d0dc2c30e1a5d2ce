"""SGLang 0.5.23's own tool-call parsers, run in the venv that holds them (``make test`` makes
.venv-sglang; ``DFLASH_SGLANG_PYTHON`` names its python): reads a JSON list of ``{text, tools,
format}`` on stdin, writes the calls the server would hand back for each, ``[{name, arguments}]``,
or ``{"error": ...}`` where the parser itself raises. As the server (``serving_chat.py``): no tools,
no parsing; every tool's ``parameters`` through ``normalize_json_schema_types`` first.

Imported without ``sglang/__init__.py``, which needs torch and a GPU stack: a bare package module
stands in for it (docs: ../shared/reference/qwen-formats.md section 6)."""
import importlib.util
import json
import logging
import sys
import types

spec = importlib.util.find_spec("sglang")
package = types.ModuleType("sglang")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["sglang"] = package

from sglang.srt.entrypoints.openai.protocol import Tool  # noqa: E402
from sglang.srt.function_call.qwen3_coder_detector import Qwen3CoderDetector  # noqa: E402
from sglang.srt.function_call.qwen25_detector import Qwen25Detector  # noqa: E402
from sglang.srt.function_call.utils import normalize_json_schema_types  # noqa: E402

logging.disable(logging.CRITICAL)  # the parsers warn on every bad call


def served_calls(case: dict):
    if not case["tools"]:
        return []
    tools = [Tool(**t) for t in json.loads(json.dumps(case["tools"]))]
    for tool in tools:
        if tool.function.parameters is not None:
            normalize_json_schema_types(tool.function.parameters)
    detector = Qwen3CoderDetector() if case["format"] == "xml" else Qwen25Detector()
    try:
        result = detector.detect_and_parse(case["text"], tools)
    except Exception as e:  # noqa: BLE001 - what the server would answer with a 500
        return {"error": f"{type(e).__name__}: {e}"}
    return [{"name": c.name, "arguments": json.loads(c.parameters)} for c in result.calls]


json.dump([served_calls(case) for case in json.load(sys.stdin)], sys.stdout)
