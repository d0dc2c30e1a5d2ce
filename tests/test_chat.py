"""The Qwen chat format's one home: finish reasons decided by the ids, history as the template takes it."""
import pytest

from dflash.core.chat import finish_reason, render, template_message

STOP = {7, 8}


@pytest.mark.parametrize("reported,ids,completion_tokens,expected", [
    ("tool_calls", [1, 2, 3, 4], 4, "length"),  # vLLM: a call cut at the cap still says tool_calls
    ("stop", [1, 2, 3, 4], 4, "length"),
    ("tool_calls", [1, 2, 3, 7], 4, "stop"),  # the stop token came as the last allowed one
    ("length", [1, 2, 3, 8], 4, "stop"),
    ("tool_calls", [1, 2, 7], 3, "stop"),
    ("stop", [1, 2], 2, "stop"),  # under the cap without a stop token: a stop string, as reported
    ("abort", [1, 2], 2, "abort"),
    ("tool_calls", None, 4, "length"),  # no ids: a tool_calls reply that used up the cap may be cut
    ("tool_calls", None, 3, "stop"),
    (None, None, 1, "stop"),
    ("length", None, 4, "length"),
])
def test_finish_is_decided_by_the_ids_and_the_cap(reported, ids, completion_tokens, expected):
    assert finish_reason(reported, 4, STOP, ids, completion_tokens) == expected


def test_history_arguments_become_mappings_as_servers_parse_them():
    wire = {"role": "assistant", "content": "", "reasoning": "R",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}}]}
    assert template_message(wire) == {"role": "assistant", "content": "", "reasoning_content": "R",
                                      "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": [1]}}}]}
    user = {"role": "user", "content": "hi"}
    assert template_message(user) is user
    for bad, why in [('{"a": ', "arguments are not valid JSON"), ("[1, 2]", "arguments are a JSON list, not an object")]:
        call = {"function": {"name": "f", "arguments": bad}}
        with pytest.raises(ValueError, match=f"tool call 'f': {why}"):
            template_message({**wire, "tool_calls": [call]})


def test_jinja_syntax_in_content_stays_literal(target):
    tok = target[1]
    content = "Render {{ messages[0].content }} and {% for x in range(3) %}{{ x }}{% endfor %} as written."
    prompt = render([{"role": "user", "content": content}], None, tok, thinking=True)
    assert content in prompt and "012" not in prompt
