import pytest

from dflash.io import read_json, read_jsonl, write_jsonl_zst
from dflash.toolcalls import parse_tool_calls
from dflash.validate import CHECKS, judge, substance_tokens, validate_shard

CFG = {"trivial_min_tokens": 16, "checks": {code: "reject" for code in CHECKS}}
REASONING = "The user asks for the capital of France, which is Paris; I answer in one sentence with the city."


def record(text, finish="stop", thinking=True, category="chat", error=None, rid="r"):
    if thinking and "</think>" in text:
        reasoning, content = text.split("</think>", 1)
    else:
        reasoning, content = (text, "") if thinking else (None, text)
    return {"id": rid, "category": category, "text": text, "reasoning": reasoning, "content": content,
            "finish_reason": finish, "error": error, "usage": {"completion_tokens": 10},
            "generation": {"enable_thinking": thinking}}


GOOD = record(f"{REASONING}\n</think>\n\nThe capital of France is Paris.")


@pytest.mark.parametrize("rec,code", [
    (record(f"{REASONING} and on and on", finish="length"), "finish_length"),
    (record("", finish="error", error="boom"), "abort_or_error"),
    (record("", finish="abort"), "abort_or_error"),
    (record(f"{REASONING} and never closes"), "no_think_close"),
    (record("\n</think>\n\nThe capital of France is Paris, a city on the Seine with many museums."), "empty_reasoning"),
    (record(f"{REASONING}\n</think>\n\n"), "empty_answer"),
    (record("\n\n</think>\nOK."), "trivial"),
])
def test_each_check_catches_its_problem(rec, code):
    reasons, flags, _ = judge(rec, CFG)
    assert code in reasons and not flags


def test_good_records_pass_every_check():
    assert judge(GOOD, CFG) == ([], [], [])
    tool_only = record(f"{REASONING}\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                       "</parameter>\n</function>\n</tool_call>", category="tool")
    reasons, _, calls = judge(tool_only, CFG)
    assert reasons == [] and calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    no_thinking = record("The capital of France is Paris, the largest city of the country by far.", thinking=False)
    assert judge(no_thinking, CFG)[0] == []


def test_flag_and_off_actions():
    trivial = record("\n\n</think>\nOK.")
    cfg = {**CFG, "checks": {**CFG["checks"], "trivial": "flag", "empty_reasoning": "off"}}
    reasons, flags, _ = judge(trivial, cfg)
    assert reasons == [] and flags == ["trivial"]


def test_parse_tool_calls_both_formats():
    xml = ("<tool_call>\n<function=search>\n<parameter=q>\nmulti\nline\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
           "</function>\n</tool_call>\n<tool_call>\n<function=other>\n</function>\n</tool_call>")
    assert parse_tool_calls(xml) == [{"name": "search", "arguments": {"q": "multi\nline", "n": "3"}},
                                     {"name": "other", "arguments": {}}]
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse_tool_calls(hermes) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert parse_tool_calls("<tool_call>\n{broken\n</tool_call>") == []


def test_substance_ignores_tags():
    assert substance_tokens("<think>\n\n</think>\nOK.<|im_end|>") == 2


def test_shard_counts_add_up(tmp_path):
    recs = [GOOD, record("\n\n</think>\nOK.", rid="t", category="code"),
            record(REASONING, finish="length", rid="l", category="code")]
    write_jsonl_zst(tmp_path / "c.jsonl.zst", recs)
    rep = validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                         tmp_path / "qa.json", CFG)
    kept, rejected = read_jsonl(tmp_path / "v.jsonl.zst"), read_jsonl(tmp_path / "r.jsonl.zst")
    assert rep["records"] == 3 == len(kept) + len(rejected)
    assert [r["id"] for r in kept] == ["r"] and kept[0]["qa"] == {"flags": [], "tool_calls": []}
    by_id = {r["id"]: r["qa"]["reasons"] for r in rejected}
    assert by_id == {"t": ["empty_reasoning", "trivial"], "l": ["finish_length", "no_think_close", "empty_answer"]}
    assert rep["checks"]["trivial"] == {"action": "reject", "total": 1, "by_category": {"code": 1}}
    assert rep["categories"] == {"chat": {"records": 1, "kept": 1}, "code": {"records": 2, "rejected": 2}}
    assert read_json(tmp_path / "qa.json") == rep


def test_unknown_check_in_config_is_an_error(tmp_path):
    write_jsonl_zst(tmp_path / "c.jsonl.zst", [GOOD])
    with pytest.raises(ValueError, match="unknown check"):
        validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v", tmp_path / "r", tmp_path / "q",
                       {**CFG, "checks": {"trival": "reject"}})
