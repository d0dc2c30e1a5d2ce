"""``dflash check tools``: its numbers against the shard files of a real (small) run, and its verdict."""
import copy
import json
import shutil
from collections import Counter

import pytest
import yaml

from dflash.inspect.check import Tally, is_refusal, verdict
from dflash.core.loops import loop_patterns
from dflash.cli import main
from dflash.generate.stage import generate_shard
from dflash.core.io import read_json, read_jsonl, write_jsonl_zst
from dflash.prompts.stage import read_source
from dflash.core.toolcalls import check_tool_calls
from dflash.core.reasons import BAD_CALL
from dflash.validate.stage import validate_for_target, validate_shard
from tests.conftest import ROOT
from tests.test_validate import CFG, GOOD, STORY_LOOP, answer, xml

GATES = {"max_category_reject_rate": 0.5, "min_tool_call_share": 0.3}
GEN = {"backend": "transformers", "enable_thinking": True, "max_error_fraction": 0.0,
       "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 64, "seed": 0}}


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_sources, demo_config, target_dir):
    """A finished run's output folder, made by the stages' own functions on the demo's data with the
    demo target and the demo's validate settings: tool prompts (replayed conversations among them)
    and chat prompts in two shards."""
    out = tmp_path_factory.mktemp("check") / "results"
    source = {s["name"]: s for s in demo_sources}
    tool = list(read_source(source["demo-tool"]))
    replayed = [p for p in tool if p["meta"].get("replay")][:3]
    prompts = (replayed + [p for p in tool if not p["meta"].get("replay")][:5]
               + list(read_source(source["demo-chat"]))[:2])
    cfg = copy.deepcopy(demo_config["validate"])
    for stage in ("prompts", "completions", "validated", "rejected", "qa"):
        (out / stage).mkdir(parents=True)
    for n, part in enumerate((prompts[::2], prompts[1::2])):
        name = f"shard-{n:05d}"
        write_jsonl_zst(out / "prompts" / f"{name}.jsonl.zst", part)
        generate_shard(out / "prompts" / f"{name}.jsonl.zst", out / "completions" / f"{name}.jsonl.zst", target_dir,
                       GEN, out / "completions" / f"{name}.summary.json")
        validate_for_target(out / "completions" / f"{name}.jsonl.zst", out / "validated" / f"{name}.jsonl.zst",
                     out / "rejected" / f"{name}.jsonl.zst", out / "qa" / f"{name}.json", cfg, None, target_dir)
    # what a running generate job leaves beside the shards: never read
    (out / "completions" / ".shard-00002.jsonl.zst.partial.jsonl").write_text("{not a record\n")
    return out


def check(capsys, *args) -> tuple[int, str, str]:
    rc = main(["check", "tools", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def records(run, stage):
    return [r for path in sorted((run / stage).glob("shard-*.jsonl.zst")) for r in read_jsonl(path)
            if r["category"] == "tool"]


def test_numbers_match_the_shard_files(run, capsys):
    rc, out, err = check(capsys, run, "--json", "--examples", "2")
    got = json.loads(out)
    completions, kept, rejected = records(run, "completions"), records(run, "validated"), records(run, "rejected")
    assert rc == (3 if got["verdict"] == "not usable" else 0) and not err
    assert (got["records"], got["kept"], got["rejected"]) == (len(completions), len(kept), len(rejected))
    assert got["records"] == 8 + sum(r.get("replay", {}).get("step", 0) > 0 for r in completions)  # + later steps
    assert got["rejected_by_reason"] == dict(Counter(c for r in rejected for c in r["qa"]["reasons"]))
    # a call, judged again from the answer's text: parsed, and no problem that makes it a wrong example
    calling = sum(bool(calls) and not set(problems) & set(BAD_CALL)
                  for calls, problems in (check_tool_calls(r["content"], r["reasoning"], r["tools"]) for r in kept))
    assert got["kept_classes"]["calls"] == calling
    assert sum(got["kept_classes"].values()) == len(kept)
    assert got["schema"]["calls"] == sum(len(r["qa"]["tool_calls"]) for r in kept + rejected)
    assert sum(t["called"] for t in got["tools"].values()) == got["schema"]["calls"]
    offered = Counter(t["function"]["name"] for r in kept + rejected for t in r["tools"])
    assert {n: t["offered"] for n, t in got["tools"].items() if t["offered"]} == dict(offered)
    stops = Counter(r["replay"]["stop"] for r in completions if r.get("replay", {}).get("stop"))
    assert got["replay"] == {"conversations": 3, "records": sum("replay" in r for r in completions),
                             "stops": dict(stops)}
    summaries = sum((Counter(read_json(p)["replay_stops"]) for p in (run / "completions").glob("*.summary.json")),
                    Counter())
    assert summaries == stops  # only the tool prompts replay
    assert all(len(found) <= 2 for found in got["examples"].values())
    assert got["line"].startswith(got["verdict"] + ": ") and got["thresholds"] == GATES


def test_terminal_report_leads_with_the_verdict(run, capsys):
    got = json.loads(check(capsys, run, "--json")[1])
    rc, out, _ = check(capsys, run)
    assert out.splitlines()[0] == got["line"] and rc == (3 if got["verdict"] == "not usable" else 0)
    assert f"records     {got['records']} generated, {got['kept']} kept, {got['rejected']} rejected" in out
    assert "kept records:" in out and "argument schemas:" in out and "replayed conversations: 3" in out
    _, out, _ = check(capsys, run, "--category", "chat", "--examples", "0")
    assert "replayed conversations" not in out and "examples:" not in out and "call a tool" not in out.splitlines()[0]


def test_an_unfinished_run_says_what_is_missing(run, tmp_path, capsys):
    partial = tmp_path / "results"
    shutil.copytree(run, partial)
    (partial / "validated" / "shard-00001.jsonl.zst").unlink()
    rc, out, err = check(capsys, partial)
    assert rc == 1 and not out
    assert err.strip() == (f"dflash check: {partial}/validated: 1 of 2 shards (missing shard-00001.jsonl.zst): the run "
                           f"is unfinished; let snakemake finish (or run it again), then check again")
    shutil.rmtree(partial / "completions")
    rc, _, err = check(capsys, partial)
    assert rc == 1 and f"{partial}/completions: no shards: the run has not generated anything yet" in err
    rc, _, err = check(capsys, tmp_path / "nowhere")
    assert rc == 1 and "no such folder; give the run's output_dir" in err


def test_an_s3_run_reads_the_same(run, s3, capsys):
    for path in run.rglob("*"):
        if path.is_file():
            s3.upload_file(str(path), "drafter", f"run/results/{path.relative_to(run).as_posix()}")
    local = json.loads(check(capsys, run, "--json")[1])
    rc, out, _ = check(capsys, "s3://drafter/run/results", "--json")
    assert rc == (3 if local["verdict"] == "not usable" else 0)  # stderr: the moto server's log
    # the same, but for where the next step looks
    assert json.loads(out.replace("s3://drafter/run/results", str(run))) == local


def test_gates_come_from_the_config(run, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    demo = yaml.safe_load((ROOT / "config.yaml").read_text())
    config.write_text(yaml.safe_dump({**demo, "gates": {"max_category_reject_rate": 1.0, "min_tool_call_share": None}}))
    got = json.loads(check(capsys, run, "--json", "--config", config)[1])
    assert got["thresholds"] == {"max_category_reject_rate": 1.0, "min_tool_call_share": None}
    assert not any("gates." in why for why in got["failed"])


# The verdict on hand-made records judged by the validate stage.
CALL = {**answer(xml(city="Paris", days="2")), "id": "call"}
PROSE = {**answer("Paris is mild in spring; pack a light jacket and an umbrella for the evenings."), "id": "prose"}
REFUSAL = {**answer("I can't look up live weather for that date, and none of the tools covers it."), "id": "refusal"}
LOOP = {**STORY_LOOP, "category": "tool", "tools": CALL["tools"], "id": "loop"}


def tally(tmp_path, recs, gates=GATES, cfg=CFG) -> dict:
    write_jsonl_zst(tmp_path / "c.jsonl.zst", recs)
    validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst", tmp_path / "qa.json",
                   cfg)
    t = Tally("tool", 3)
    for rec in recs:
        if rec["category"] == "tool":
            t.completion(rec)
    for stage, kept in (("v", True), ("r", False)):
        for rec in read_jsonl(tmp_path / f"{stage}.jsonl.zst"):
            if rec["category"] == "tool":
                t.judged(rec, kept)
    result = t.result()
    return {**result, **verdict(result, gates)}


def test_verdict_usable_with_caveats_and_not_usable(tmp_path):
    r = tally(tmp_path, [CALL, PROSE, REFUSAL, GOOD])
    assert r["kept_classes"] == {"calls": 1, "prose": 1, "refusal": 1, "bad_call": 0}
    assert r["line"] == "usable: you will train on 3 tool records: 1 call a tool (33.3%), 1 answer in prose, 1 refuse"
    assert r["target"] == ("the target, on all 3 tool records: 0.0% rejected; 1 of 1 calls to offered tools pass "
                           "their schema (100.0%)") and r["next"] is None
    assert r["schema"] == {"calls": 1, "to_offered_tools": 1, "passed": 1, "pass_rate": 1.0, "failures": {},
                           "kept": {"to_offered_tools": 1, "failed": 0, "not_offered": 0}}
    assert r["tools"]["get_weather"] == {"offered": 3, "called": 1, "called_in_kept": 1, "called_not_offered": 0}
    # a loop in a rejected record is the target's business, not a caveat on what you train on
    r = tally(tmp_path, [CALL, PROSE, REFUSAL, LOOP])
    assert r["verdict"] == "usable" and r["target"].endswith("; tag loops in 1 records")
    assert r["loops"]["patterns"] == {"<tool_call> </think>": {"records": 1, "kept": 0, "longest": 400}}
    assert r["examples"]["loop <tool_call> </think>"][0]["excerpt"].startswith("<tool_call>↵</think>↵<tool_call>")
    r = tally(tmp_path, [CALL, PROSE, REFUSAL, LOOP], {**GATES, "min_tool_call_share": 0.5})
    assert r["line"] == ("not usable: you will train on 3 tool records: 1 call a tool (33.3%), 1 answer in prose, 1 "
                         "refuse; 33.3% call a tool, under gates.min_tool_call_share 50.0%; next: dflash inspect "
                         "results/validated --category tool: what the kept records do instead")
    bad = {**answer(xml("get_stock", symbol="NVDA")), "id": "bad"}
    r = tally(tmp_path, [PROSE, bad, {**bad, "id": "bad2"}])
    assert r["line"] == ("not usable: you will train on 1 tool records: 0 call a tool (0.0%), 1 answer in prose, 0 "
                         "refuse; 0.0% call a tool, under gates.min_tool_call_share 30.0%; 66.7% of 3 rejected, over "
                         "gates.max_category_reject_rate 50.0% (tool_unknown_name 2); next: dflash inspect "
                         "results/validated --category tool: what the kept records do instead")
    assert r["never_offered"] == ["get_stock"] and r["schema"]["to_offered_tools"] == 0


def test_loop_patterns_and_refusals():
    loop = "Checking.\n</think>\n\n" + "<tool_call>\n</think>\n" * 40
    assert loop_patterns(loop) == {("<tool_call>", "</think>"): 40}
    three_calls = "".join(xml(city=city) + "\n" for city in ("Paris", "Rome", "Oslo"))
    assert loop_patterns(f"Three cities.\n</think>\n\n{three_calls}") == {}
    assert loop_patterns(f"Same city.\n</think>\n\n{xml(city='Paris')}\n" * 3) == {}  # arguments stand between
    assert loop_patterns("a <|im_end|><|im_end|> b <|im_end|><|im_end|><|im_end|>") == {("<|im_end|>",): 3}
    assert is_refusal("I’m unable to book flights; try the airline's site.")
    assert is_refusal("Sorry, I cannot do that.")
    assert not is_refusal("The forecast for Paris is 18°C and sunny.")


def test_the_report_shows_escape_sequences_of_records_escaped(tmp_path):
    from dflash.inspect.check import render
    from tests.test_inspect import HOSTILE

    prose = {**answer(f"It is sunny in Paris today, no call needed. {HOSTILE}"), "id": "esc"}
    text = render({**tally(tmp_path, [prose]), "output_dir": "results", "shards": 1, "thresholds": GATES})
    assert "\\x1b]52;c;cm0gLXJmIH4=\\x07" in text and not {"\x1b", "\x07", "\r", "\x9b", "\u202e"} & set(text)


def test_the_caveats_are_on_what_you_train_on_with_the_next_step(tmp_path):
    """Before, the headline's "80% of calls pass" counted rejected records' calls too. Now a schema
    failure the validate stage rejected is the target's (the second line); one it only flagged is
    in the training data, a caveat, with the command that shows it."""
    bad = {**answer(xml(city="Paris", days="zero")), "id": "bad"}
    rejected = tally(tmp_path, [CALL, PROSE, bad])
    assert rejected["verdict"] == "usable" and rejected["caveats"] == []
    assert rejected["target"] == ("the target, on all 3 tool records: 33.3% rejected (tool_args_schema 1); 1 of 2 "
                                  "calls to offered tools pass their schema (50.0%)")
    flagged = tally(tmp_path, [CALL, PROSE, bad], cfg={**CFG, "checks": {**CFG["checks"], "tool_args_schema": "flag"}})
    assert flagged["line"] == ("usable with caveats: you will train on 3 tool records: 1 call a tool (33.3%), 1 "
                               "answer in prose, 0 refuse, 1 hold a broken call; 1 of their 2 calls to offered tools "
                               "fail the tool's schema (its check set to flag); next: dflash inspect results/validated "
                               "--category tool --flag tool_args_schema")
