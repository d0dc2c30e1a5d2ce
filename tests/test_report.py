import json

import pytest

from dflash.gates import GateError, run_gates, write_qa_summary
from dflash.io import read_json, write_json, write_jsonl_zst
from dflash.report import write_qa_page, write_report
from dflash.validate import validate_shard
from tests.test_validate import CFG, GOOD, STORY_LOOP, answer, record, xml

GATES = {"max_reject_rate": 0.5, "max_category_reject_rate": None, "max_trivial_share": 0.5,
         "min_median_trainable_tokens": 16}


@pytest.fixture
def qa_summary(tmp_path):
    """Two validated shards and their tokenized indexes, summed into the QA summary."""
    shards = [[GOOD, {**GOOD, "id": "g2"}, record("\n\n</think>\nOK.", rid="t")],
              [answer(xml(city="Paris")), {**answer(xml(city="Paris", days="soon")), "id": "bad"},
               {**STORY_LOOP, "id": "loop", "category": "tool"}]]
    qa, tok = [], []
    for i, recs in enumerate(shards):
        write_jsonl_zst(tmp_path / f"c{i}.jsonl.zst", recs)
        qa.append(tmp_path / f"qa{i}.json")
        validate_shard(tmp_path / f"c{i}.jsonl.zst", tmp_path / f"v{i}", tmp_path / f"r{i}", qa[-1], CFG)
        tok.append(tmp_path / f"t{i}.json")
        rows = [{"id": f"{i}-{j}", "category": "tool" if i else "chat", "length": 90, "trainable": 20 + 10 * j}
                for j in range(2 - i)]
        write_json(tok[-1], {"rows": rows, "stats": {
            "rows": len(rows), "tokens": 90 * len(rows), "trainable_tokens": sum(r["trainable"] for r in rows),
            "dropped_no_anchor": 0, "truncated": i, "trainable_by_category": {}}})
    write_qa_summary(qa, tok, tmp_path / "summary.json")
    return tmp_path / "summary.json"


def test_qa_summary_sums_shards_and_keeps_examples(qa_summary):
    s = read_json(qa_summary)
    assert (s["records"], s["kept"], s["rejected"]) == (6, 3, 3) and s["shards"] == 2
    assert s["categories"]["tool"] == {"records": 3, "kept": 1, "rejected": 2, "reject_rate": 2 / 3}
    assert s["checks"]["tool_args_schema"]["by_category"] == {"tool": 1}
    assert [e["id"] for e in s["examples"]["repetition_loop"]] == ["loop"]
    assert s["lengths"]["chat"]["output_tokens"]["n"] == 3 and sum(s["lengths"]["tool"]["output_tokens"]["histogram"]) == 3
    hist = lambda *counts: list(counts) + [0] * (len(s["length_bins"]) - len(counts))  # noqa: E731
    assert s["trainable_tokens"] == {"rows": 3, "total": 70, "median": 20, "by_category": {
        "chat": {"rows": 2, "total": 50, "median": 25, "histogram": hist(0, 2)},
        "tool": {"rows": 1, "total": 20, "median": 20, "histogram": hist(0, 1)}}}
    assert s["tokenized"] == {"rows": 3, "tokens": 270, "trainable_tokens": 70, "dropped_no_anchor": 0, "truncated": 1}


def test_qa_page_shows_rates_plots_and_examples(qa_summary, tmp_path):
    write_qa_page(qa_summary, tmp_path / "qa.html")
    page = (tmp_path / "qa.html").read_text()
    assert page.count("<svg") == 4 and "tool: output tokens (n=3" in page
    assert "chat: trainable tokens per row (n=2, median 25" in page
    assert "<td>tool_args_schema</td><td>reject</td><td>1</td><td>16.7%</td><td>0.0%</td><td>33.3%</td>" in page
    # the schema example shows the offered tool, the parsed call and the error
    section = page.split("<h3>tool_args_schema")[1].split("<h3>")[0]
    assert "get_weather" in section and "&quot;days&quot;: &quot;soon&quot;" in section and "offered tools" in section
    assert "&lt;tool_call&gt;\n&lt;/think&gt;" in page.split("<h3>repetition_loop")[1]


def test_failed_gate_names_itself_and_writes_nothing(qa_summary, tmp_path):
    with pytest.raises(GateError, match=r"gate min_median_trainable_tokens: median trainable tokens per row is 20 "
                                        r"\(minimum 25\)"):
        run_gates(qa_summary, tmp_path / "gates.json", {**GATES, "min_median_trainable_tokens": 25})
    assert not (tmp_path / "gates.json").exists()
    with pytest.raises(GateError, match=r"66.7% of category 'tool' rejected \(limit 60.0%\)"):
        run_gates(qa_summary, tmp_path / "gates.json", {**GATES, "max_category_reject_rate": 0.6})


def test_report_aggregates_every_stage(qa_summary, tmp_path):
    write_json(tmp_path / "manifest.json", {"shards": [{"name": "shard-00000.jsonl.zst", "records": 3}], "prompts": 3,
                                            "heldout": 1, "categories": {"chat": 2, "tool": 1}, "dropped": {"duplicate": 2}})
    run_gates(qa_summary, tmp_path / "gates.json", GATES)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": l}) + "\n" for s, l in [(10, 6.0), (20, 4.5)]))
    ev = tmp_path / "eval.json"
    summary = {"acceptance_length": 1.5, "prompts": 1, "tokens": 9, "target_forwards": 6}
    write_json(ev, {"overall": summary, "per_category": {"chat": summary},
                    "untrained": {"overall": {**summary, "acceptance_length": 1.1}, "per_category": {}}})
    s = write_report({"run": "r1"}, tmp_path / "manifest.json", qa_summary, tmp_path / "gates.json", ckpt, ev,
                     tmp_path / "s.html", tmp_path / "s.json")
    assert s["validate"]["records"] == 6 and s["validate"]["kept"] == 3 and s["validate"]["reject_rate"] == 0.5
    assert s["validate"]["checks"]["trivial"]["by_category"] == {"chat": 1}
    assert s["tokenized"]["trainable_by_category"]["chat"]["total"] == 50
    assert [g["gate"] for g in s["gates"] if g["passed"]] == ["max_reject_rate", "max_trivial_share",
                                                              "min_median_trainable_tokens"]
    assert s["train"] == {"steps": 20, "first_loss": 6.0, "final_loss": 4.5, "curve": [[10, 6.0], [20, 4.5]]}
    page = (tmp_path / "s.html").read_text()
    assert "<polyline" in page and "1.500" in page and "6.000 &rarr; 4.500" in page and "r1" in page
    assert "<td>max_reject_rate</td><td>0.5</td><td>0.5</td><td>pass</td>" in page
    assert "<td>overall</td><td>1.500</td><td>1.100</td><td>1</td><td>9</td><td>6</td><td>9</td><td>3 (33.3%)</td>" in page
    assert "acceptance length per category" in page
    assert json.loads((tmp_path / "s.json").read_text()) == s


def test_cache_gate_suggests_online_mode(qa_summary, tmp_path):
    cache = {"tokens": 1640000000, "bytes": 83968000000000, "max_bytes": 20000000000000,
             "text": "1.64e+09 tokens x 5 layers x 5120 x 2 B = 84.0 TB"}
    with pytest.raises(GateError, match=r"gate max_cache_bytes: the hidden-state cache would take 1.64e\+09 tokens .* = "
                                        r"84.0 TB \(hidden.max_cache_bytes 20.0 TB\); set train.hidden_states: online"):
        run_gates(qa_summary, tmp_path / "gates.json", GATES, cache)
    assert run_gates(qa_summary, tmp_path / "gates.json", GATES, {**cache, "max_bytes": None})
