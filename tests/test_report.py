import json

from dflash.io import write_json
from dflash.report import write_report


def test_report_aggregates_every_stage(tmp_path):
    write_json(tmp_path / "manifest.json", {"shards": [{"name": "shard-00000.jsonl.zst", "records": 3}], "prompts": 3,
                                            "heldout": 1, "categories": {"chat": 2, "tool": 1}, "dropped": {"duplicate": 2}})
    qa = []
    for i, (kept, rejected, cat) in enumerate([(2, 1, "chat"), (1, 0, "tool")]):
        qa.append(tmp_path / f"qa{i}.json")
        write_json(qa[-1], {"records": kept + rejected, "kept": kept, "rejected": rejected,
                            "checks": {"trivial": {"action": "reject", "total": rejected, "by_category": {cat: rejected} if rejected else {}}},
                            "categories": {cat: {"records": kept + rejected, "kept": kept, "rejected": rejected}}})
    tok = tmp_path / "t.json"
    write_json(tok, {"rows": [], "stats": {"rows": 3, "tokens": 300, "trainable_tokens": 120, "dropped_no_anchor": 0,
                                           "truncated": 1, "trainable_by_category": {"chat": {"rows": 2, "tokens": 80},
                                                                                     "tool": {"rows": 1, "tokens": 40}}}})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": l}) + "\n" for s, l in [(10, 6.0), (20, 4.5)]))
    ev = tmp_path / "eval.json"
    summary = {"acceptance_length": 1.5, "prompts": 1, "tokens": 9, "target_forwards": 6}
    write_json(ev, {"overall": summary, "per_category": {"chat": summary}})
    s = write_report({"run": "r1"}, tmp_path / "manifest.json", qa, [tok], ckpt, ev, tmp_path / "s.html", tmp_path / "s.json")
    assert s["validate"]["records"] == 4 and s["validate"]["kept"] == 3 and s["validate"]["reject_rate"] == 0.25
    assert s["validate"]["checks"]["trivial"]["by_category"] == {"chat": 1}
    assert s["validate"]["categories"]["chat"] == {"records": 3, "kept": 2, "rejected": 1}
    assert s["tokenized"]["trainable_by_category"]["chat"]["tokens"] == 80
    assert s["train"] == {"steps": 20, "first_loss": 6.0, "final_loss": 4.5, "curve": [[10, 6.0], [20, 4.5]]}
    page = (tmp_path / "s.html").read_text()
    assert "<polyline" in page and "1.500" in page and "6.000 &rarr; 4.500" in page and "r1" in page
    assert json.loads((tmp_path / "s.json").read_text()) == s
