"""The gates that catch a data set that looks fine overall: one category mostly rejected, and tool
records that were kept but call no tool (the story's "check the tool-calling examples")."""
import pytest

from dflash.core.config import check_config
from dflash.validate.gates import GateError, run_gates, write_qa_summary
from dflash.core.io import write_json, write_jsonl_zst
from dflash.validate.stage import validate_shard
from dflash.core.reasons import calls_a_tool
from tests.test_report import GATES
from tests.test_validate import CFG, GOOD, answer, xml

PROSE = answer("I would look the weather up, but here is what I know: Paris is mild in spring.")


def summary_of(tmp_path, records, cfg=CFG):
    write_jsonl_zst(tmp_path / "c.jsonl.zst", records)
    validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst", tmp_path / "qa.json",
                   cfg)
    write_json(tmp_path / "t.json", {"rows": [{"id": "x", "category": "chat", "length": 90, "trainable": 40}],
                                     "stats": {"rows": 1}})
    write_qa_summary([tmp_path / "qa.json"], [tmp_path / "t.json"], tmp_path / "qa" / "summary.json")
    return tmp_path / "qa" / "summary.json"


def ids(prefix, rec, n):
    return [{**rec, "id": f"{prefix}{i}"} for i in range(n)]


def default_gates() -> dict:
    return check_config({"prompts": {"sources": [{"name": "s", "path": "s.jsonl"}]}})["gates"]


def test_defaults_turn_both_gates_on():
    gates = default_gates()
    assert gates["max_category_reject_rate"] == 0.5 and gates["min_tool_call_share"] == 0.3


def test_tool_records_that_call_nothing_fail_the_gate_with_the_count(tmp_path):
    summary = summary_of(tmp_path, ids("g", GOOD, 4) + ids("p", PROSE, 3) + ids("c", answer(xml(city="Paris")), 1))
    gates = {**GATES, "min_tool_call_share": 0.3}
    with pytest.raises(GateError, match=r"gate min_tool_call_share: 1 of 4 kept 'tool' records call a tool "
                                        r"\(25.0%, minimum 30.0%\)\n  `dflash check tools "):
        run_gates(summary, tmp_path / "gates.json", gates)
    assert not (tmp_path / "gates.json").exists()
    verdicts = run_gates(summary, tmp_path / "gates.json", {**gates, "min_tool_call_share": 0.25})
    assert [v["value"] for v in verdicts if v["gate"] == "min_tool_call_share"] == [0.25]


def test_a_flagged_bad_call_is_no_call(tmp_path):
    """With the schema check only flagging, a call whose arguments break the schema is kept but
    does not count as calling a tool."""
    bad = answer(xml(city="Paris", days="soon"))
    cfg = {**CFG, "checks": {**CFG["checks"], "tool_args_schema": "flag"}}
    summary = summary_of(tmp_path, ids("b", bad, 2) + ids("c", answer(xml(city="Paris")), 2), cfg)
    (verdict,) = [v for v in run_gates(summary, tmp_path / "gates.json", {**GATES, "min_tool_call_share": 0.5})
                  if v["gate"] == "min_tool_call_share"]
    assert verdict["value"] == 0.5 and "2 of 4 kept" in verdict["message"]
    assert not calls_a_tool({"tool_calls": [{"name": "get_weather"}], "flags": ["tool_args_schema"]})


def test_no_tool_records_no_tool_gate(tmp_path):
    summary = summary_of(tmp_path, ids("g", GOOD, 3))
    verdicts = run_gates(summary, tmp_path / "gates.json", {**GATES, "min_tool_call_share": 0.3})
    assert "min_tool_call_share" not in [v["gate"] for v in verdicts]


def test_a_lost_category_fails_by_default_while_the_overall_rate_passes(tmp_path):
    looping = answer(xml(city="Paris") + " and then some", tools=())  # a call with no tools offered
    summary = summary_of(tmp_path, ids("g", GOOD, 9) + ids("t", looping, 3) + ids("c", answer(xml(city="Paris")), 1))
    gates = {**default_gates(), "min_median_trainable_tokens": None}
    with pytest.raises(GateError, match=r"gate max_category_reject_rate: 75.0% of category 'tool' rejected "
                                        r"\(limit 50.0%\)"):
        run_gates(summary, tmp_path / "gates.json", gates)
