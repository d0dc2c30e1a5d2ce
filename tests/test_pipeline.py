"""The real Snakemake pipeline, end to end, on a small slice of the demo data (a few minutes)."""
import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dflash.cli import main
from dflash.core.io import read_json, read_jsonl, write_jsonl_zst
from tests.helpers import record_errors
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def snakemake(workdir: Path, *args: str, check: bool = True) -> str:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(workdir),
           "--configfile", str(workdir / "config.yaml"), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    if check and run.returncode != 0:
        logs = "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in (workdir / "results" / "logs").rglob("*.log"))
        raise AssertionError(f"snakemake {' '.join(args)} failed ({run.returncode}):\n{out[-5000:]}\n{logs}")
    return out


def planned_jobs(dry_run_output: str) -> set[tuple[str, str | None]]:
    """(rule, shard or None) of every job in a ``snakemake -n`` listing."""
    jobs = set()
    for block in re.split(r"\n(?=\[|rule |localrule )", dry_run_output):
        rule = re.search(r"^(?:local)?rule (\w+):", block, re.M)
        if rule:
            shard = re.search(r"wildcards:.*shard=(\d{5})", block)
            jobs.add((rule.group(1), shard.group(1) if shard else None))
    return jobs


def test_whole_chain_runs_and_writes_every_stage(pipeline):
    work, out = pipeline
    res = work / "results"
    manifest = read_json(res / "prompts" / "manifest.json")
    assert manifest["prompts"] == 32 and manifest["heldout"] == 8
    assert [s["records"] for s in manifest["shards"]] == [12, 12, 8]
    for shard in ("00000", "00001", "00002"):
        for kind, stage in [("prompt", "prompts"), ("completion", "completions"), ("completion", "validated"),
                            ("completion", "rejected")]:
            for rec in read_jsonl(res / stage / f"shard-{shard}.jsonl.zst"):
                assert record_errors(kind, rec) == [], (stage, shard, rec["id"])
        comps = read_jsonl(res / "completions" / f"shard-{shard}.jsonl.zst")
        assert all(c["output_token_ids"] and c["prompt_token_ids"] for c in comps)
        qa = read_json(res / "qa" / f"shard-{shard}.json")
        assert qa["records"] == len(comps) == qa["kept"] + qa["rejected"]
        index = read_json(res / "tokenized" / f"shard-{shard}.json")
        assert index["stats"]["rows"] == len(index["rows"]) > 0
        assert (res / "hidden" / f"shard-{shard}.safetensors").stat().st_size > 0
    ckpt = res / "checkpoints" / "demo"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [1, 3]
    assert (ckpt / "model.safetensors").exists()
    ev = read_json(res / "eval" / "demo.json")
    assert set(ev["per_category"]) == {"chat", "code", "reasoning", "tool"}
    assert ev["overall"]["acceptance_length"] >= 1.0
    # thinking off beside thinking on, and the figures per draft position, each named with its method
    assert set(ev["thinking_off"]["per_category"]) == set(ev["per_category"]) and set(ev["methods"]) >= {
        "acceptance_length", "acceptance_length_per_step", "acceptance_rate_per_position", "accepted_length_histogram"}
    for figures in (ev["overall"], ev["thinking_off"]["overall"]):
        assert sum(figures["accepted_length_histogram"]) == figures["drafts"] > 0
        assert len(figures["acceptance_rate_per_position"]) == len(figures["accepted_length_histogram"]) - 1
    summary = read_json(res / "report" / "summary.json")
    assert summary["validate"]["records"] == 32 and summary["tokenized"]["rows"] > 0
    assert "Acceptance length" in (res / "report" / "summary.html").read_text()
    # the run ends with its answer on the console: the report's headline and where the page is
    tail = out[out.index("run demo ("):]
    assert re.search(r"^kept: \d+ of 32 completions kept", tail, re.M) and "acceptance length: " in tail
    assert "report: results/report/summary.html" in tail
    # and `dflash check run` prints it again, from any terminal, later
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["check", "run", str(res)]) == 0
    headline = printed.getvalue().replace(str(res), "results").splitlines()
    assert headline[-1] == "report: results/report/summary.html" and "\n".join(headline) in tail
    assert "Output length per category" in (res / "report" / "qa.html").read_text()
    for rule in ("prompts", "target", "train/demo", "eval/demo", "eval/demo.trained.0", "eval/demo.trained.1",
                 "eval/demo.untrained.0", "eval/demo.untrained.1", "eval/demo.thinking_off.0",
                 "eval/demo.thinking_off.1", "report", "gate", "qa_summary", "qa_report"):
        assert (res / "logs" / f"{rule}.log").exists(), rule


def test_the_pilot_ran_first_and_no_prompt_is_generated_twice(pipeline):
    """The pilot (4 prompts of each category) ran before the full generation, which took its
    records as they were; its findings reached the console, the plan and the report."""
    work, out = pipeline
    res = work / "results"
    pilot = read_json(res / "pilot" / "summary.json")
    assert pilot["prompts"] == 16 and {c: v["sampled"] for c, v in pilot["categories"].items()} == {
        "chat": 4, "code": 4, "reasoning": 4, "tool": 4}
    assert "pilot: 16 prompts" in out and "plan: 32 prompts" in out  # on the console
    shards = [read_json(p) for p in sorted((res / "completions").glob("shard-*.summary.json"))]
    generated = read_json(res / "pilot" / "generate.json")
    records = [r for p in (res / "completions").glob("shard-*.jsonl.zst") for r in read_jsonl(p)]
    assert sum(s["from_pilot"] for s in shards) == 16
    assert generated["requests"] + sum(s["requests"] for s in shards) == len(records)  # each asked for once
    assert read_json(res / "plan.json")["output_tokens_from"] == "pilot"
    assert "Pilot and plan" in (res / "report" / "summary.html").read_text()
    # the training burst on the pilot's rows: its step rate prices the training; no drafter of it is left
    assert pilot["train_burst"]["kind"] == "local" and pilot["train_burst"]["steps"] == 30
    assert "training burst on local: 30 steps" in out and "(measured by the pilot)" in out
    assert sorted(p.name for p in (res / "pilot").iterdir() if p.name.startswith((".train", "train"))) == [
        "train_burst.json"]
    assert "measured by the pilot" in (res / "report" / "summary.html").read_text()


def test_turning_the_pilot_off_after_generation_is_refused(pipeline):
    """Every generate job read the pilot's files: another pilot would re-run them all."""
    work, _ = pipeline
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["pilot"]["enabled"] = False
    other = work / "no-pilot.yaml"
    other.write_text(yaml.safe_dump(config))
    out = snakemake(work, "-n", "--configfile", str(other), check=False)
    assert ("pilot.enabled is false, but this run's pilot was made and 3 generate job(s) finished after it: the "
            "change would re-run every one of them. Set pilot.enabled back to true") in out, out[-2000:]


def test_second_run_has_nothing_to_do(pipeline):
    work, _ = pipeline
    assert "Nothing to be done" in snakemake(work, "--cores", "2")


def test_a_run_without_storage_is_not_safe_to_destroy(pipeline):
    """Every output is only on this machine: the report says so, and so does the check target."""
    work, _ = pipeline
    durability = read_json(work / "results" / "report" / "summary.json")["durability"]
    assert durability["storage"] is None and not durability["safe"] and durability["files_at_risk"] > 50
    assert "Machine: outputs on this machine only. NOT safe to destroy" in (work / "results" / "report" / "summary.html").read_text()
    out = snakemake(work, "--cores", "1", "safe_to_destroy", check=False)
    assert "only here: results/completions/shard-00000.jsonl.zst" in out and "no storage: this run writes only here" in out
    assert "NOT safe to destroy:" in out and "Run with --default-storage-provider s3" in out


def test_snakemake_report_embeds_the_summary(pipeline):
    work, _ = pipeline
    snakemake(work, "--report", str(work / "report.html"))
    page = (work / "report.html").read_text()
    assert "summary.html" in page and "qa.html" in page and len(page) > 100_000


def test_trivial_completions_stop_at_the_gate_before_any_gpu_job(pipeline, tmp_path):
    """The story's data set: 87% of completions are ``OK.``. They are written over a finished run's
    completions (standing in for a model that answers so), with the default gates."""
    from transformers import AutoTokenizer

    work = tmp_path / "run"
    shutil.copytree(pipeline[0], work, symlinks=True)
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["gates"] = {}
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    tok = AutoTokenizer.from_pretrained(work / "results" / "target")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    n = trivial = 0
    for shard in sorted((work / "results" / "completions").glob("shard-*.jsonl.zst")):
        records = read_jsonl(shard)
        for rec in records:
            n += 1
            if trivial < 0.87 * n:
                trivial += 1
                text = "\n\n</think>\nOK."
                rec.update(text=text, reasoning="\n\n", content="\nOK.", finish_reason="stop",
                           output_token_ids=tok.encode(text, add_special_tokens=False) + [end])
        write_jsonl_zst(shard, records)
    gpu_outputs = sorted((work / "results" / "hidden").glob("*.safetensors")) + [work / "results" / "checkpoints"]
    before = {p: p.stat().st_mtime_ns for p in gpu_outputs}
    out = snakemake(work, "--cores", "2", check=False)
    assert "Error in rule gate" in out and "results/logs/gate.log" in out
    assert re.search(r"gate max_trivial_share: \d+\.\d% of records are trivial", out)  # on the terminal too
    log = (work / "results" / "logs" / "gate.log").read_text()
    hit = re.search(rf"gate max_trivial_share: (\d+\.\d)% of records are trivial, (\d+) of {n} \(limit 50\.0%\)", log)
    assert hit and int(hit.group(2)) >= trivial and float(hit.group(1)) >= 87.0  # the model's own may be trivial too
    assert "quality gate failed, no hidden-state or training job will run" in log
    assert {p: p.stat().st_mtime_ns for p in gpu_outputs} == before  # nothing extracted or trained again
    assert not (work / "results" / "qa" / "gates.json").exists()
    # the QA page needs no gate: it shows why this one failed
    snakemake(work, "--cores", "1", "results/report/qa.html")
    page = (work / "results" / "report" / "qa.html").read_text()
    assert "<h3>trivial" in page and "OK." in page.split("<h3>trivial")[1]
    assert not re.search(r"^\s*(local)?rule (hidden|train):", out[out.index("Error in rule gate"):], re.M)


def test_only_settings_that_shape_the_records_rerun_generation(pipeline):
    work, _ = pipeline
    config = yaml.safe_load((work / "config.yaml").read_text())
    other = work / "other.yaml"
    config["generate"]["server"] = {"concurrency": 3, "timeout_s": 5, "retries": 9}
    config["generate"]["max_error_fraction"] = 0.5
    config["generate"]["batch_size"] = 4  # rows decoded together: float rounding at most, not the records' settings
    other.write_text(yaml.safe_dump(config))
    assert "Nothing to be done" in snakemake(work, "-n", "--configfile", str(other))
    config["generate"]["sampling"]["temperature"] = 0.5
    other.write_text(yaml.safe_dump(config))
    jobs = planned_jobs(snakemake(work, "-n", "--configfile", str(other)))
    assert {s for rule, s in jobs if rule == "generate"} == {"00000", "00001", "00002"}


def test_online_hidden_states_plan_no_cache(pipeline):
    work, _ = pipeline
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["train"]["hidden_states"] = "online"
    other = work / "online.yaml"
    other.write_text(yaml.safe_dump(config))
    jobs = planned_jobs(snakemake(work, "-n", "--forceall", "--configfile", str(other)))
    assert ("train", None) in jobs and not [j for j in jobs if j[0] == "hidden"]


def test_excluded_ids_rerun_only_the_shards_holding_them(pipeline, tmp_path):
    work, _ = pipeline
    shard_of = dict(line.split("\t") for line in (work / "results/prompts/ids.tsv").read_text().splitlines())
    first = [i for i, s in shard_of.items() if s == "00000"][:2]
    third = [i for i, s in shard_of.items() if s == "00002"][0]
    (work / "drop.txt").write_text(f"# found by hand\n{first[0]}\n{first[1]}  # loops\nnot-a-sample-id\n")
    (work / "drop.jsonl").write_text(json.dumps({"id": third, "reason": "leaked eval prompt"}) + "\n")
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["validate"]["exclude"] = [str(work / "drop.txt"), str(work / "drop.jsonl")]
    other = work / "exclude.yaml"
    other.write_text(yaml.safe_dump(config))
    out = snakemake(work, "-n", "--configfile", str(other))
    assert "1 id(s) held by no prompt shard" in out and "not-a-sample-id" in out
    jobs = planned_jobs(out)
    assert {(rule, s) for rule, s in jobs if s is not None} == {
        (r, s) for r in ("validate", "tokenize", "hidden") for s in ("00000", "00002")}
    assert {rule for rule, s in jobs if s is None} == {"qa_summary", "gate", "qa_report", "train", "eval_decode", "eval",
                                                       "report", "all"}

    # For real, in a copy: the listed records land in rejected/ with their reasons, nothing is lost.
    copy = tmp_path / "copy"
    shutil.copytree(work, copy, symlinks=True)
    other = copy / "exclude.yaml"
    other.write_text(yaml.safe_dump(config))
    snakemake(copy, "--cores", "2", "--configfile", str(other), "--until", "validate")
    rejected = {r["id"]: r["qa"] for r in read_jsonl(copy / "results/rejected/shard-00000.jsonl.zst")}
    assert {i: rejected[i]["details"]["excluded"] for i in first} == {i: "listed in validate.exclude" for i in first}
    assert read_jsonl(copy / "results/rejected/shard-00002.jsonl.zst")[0]["qa"]["details"] == {
        "excluded": "leaked eval prompt"}
    qa = read_json(copy / "results/qa/shard-00000.json")
    assert qa["checks"]["excluded"]["total"] == 2 and qa["kept"] + qa["rejected"] == qa["records"]
    assert not {s for rule, s in planned_jobs(snakemake(copy, "-n", "--configfile", str(other)))
                if rule == "validate"}
    # a comment added at the top moves every id down a line: no shard's params change, nothing re-runs
    drop = copy / "drop.txt"
    drop.write_text("# reviewed again on Monday\n" + (work / "drop.txt").read_text())
    config["validate"]["exclude"] = [str(drop), str(copy / "drop.jsonl")]
    other.write_text(yaml.safe_dump(config))
    shutil.copy(work / "drop.jsonl", copy / "drop.jsonl")
    assert not {s for rule, s in planned_jobs(snakemake(copy, "-n", "--configfile", str(other)))
                if rule == "validate"}


def test_one_shard_target_with_exclusions(pipeline, tmp_path):
    """A single shard as the target, with exclusions configured: its validate job's params wait for
    the prompts' id index (an input), and only that shard is planned."""
    work, _ = pipeline
    shard_of = dict(line.split("\t") for line in (work / "results/prompts/ids.tsv").read_text().splitlines())
    (work / "drop-one.txt").write_text(next(i for i, s in shard_of.items() if s == "00002") + "\n")
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["validate"]["exclude"] = [str(work / "drop-one.txt")]
    other = work / "exclude-one.yaml"
    other.write_text(yaml.safe_dump(config))
    jobs = planned_jobs(snakemake(work, "-n", "results/qa/shard-00002.json", "--configfile", str(other)))
    assert jobs == {("validate", "00002")}
    fresh = tmp_path / "fresh"  # nothing built yet: the prompts checkpoint comes first
    fresh.mkdir()
    (fresh / "config.yaml").write_text(yaml.safe_dump(config))
    out = snakemake(fresh, "-n", "results/qa/shard-00002.json")
    assert "checkpoint prompts:" in out and {rule for rule, _ in planned_jobs(out)} == {"target", "validate"}


def test_changing_one_prompt_shard_reruns_only_that_shard(pipeline):
    work, _ = pipeline
    shard = work / "results" / "prompts" / "shard-00001.jsonl.zst"
    records = read_jsonl(shard)
    write_jsonl_zst(shard, records[:-1])  # e.g. a prompt removed by hand
    jobs = planned_jobs(snakemake(work, "-n"))
    per_shard = {(rule, s) for rule, s in jobs if s is not None}
    assert per_shard == {(r, "00001") for r in ("generate", "validate", "tokenize", "hidden")}
    # the gate sees the changed QA; the other shards keep their hidden states (the gate is ancient() there)
    assert {rule for rule, s in jobs if s is None} == {"qa_summary", "gate", "qa_report", "train", "eval_decode", "eval",
                                                       "report", "all"}


def test_killed_training_resumes_to_the_same_weights(pipeline, tmp_path):
    """SIGKILL to the whole run (a preempted node) after a resume point; the re-run of the rule
    continues from it and ends with the weights of a run that was never interrupted."""
    import os
    import signal
    import time

    from safetensors.torch import load_file

    runs = {}
    for name in ("whole", "killed"):
        work = tmp_path / name
        shutil.copytree(pipeline[0], work, symlinks=True)
        config = yaml.safe_load((work / "config.yaml").read_text())
        config["train"].update(steps=60, save_every=20, log_every=10)
        (work / "config.yaml").write_text(yaml.safe_dump(config))
        runs[name] = work
    snakemake(runs["whole"], "--cores", "2", "results/checkpoints/demo")

    work = runs["killed"]
    resume = work / "results" / "checkpoints" / ".demo.resume"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(work),
           "--configfile", str(work / "config.yaml"), "--cores", "2", "results/checkpoints/demo"]
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not list(resume.glob("step-*.pt")) and time.time() < deadline and run.poll() is None:
        time.sleep(0.02)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    points = sorted(p.name for p in resume.glob("step-*.pt"))
    before = pipeline[0] / "results" / "checkpoints" / "demo" / "model.safetensors"
    # the drafter of the earlier run stays in place until the new one is complete
    assert points and (work / "results" / "checkpoints" / "demo" / "model.safetensors").read_bytes() == \
        before.read_bytes(), points
    snakemake(work, "--unlock")  # the killed run's lock
    out = snakemake(work, "--cores", "2", "--rerun-incomplete", "results/checkpoints/demo")
    log = (work / "results" / "logs" / "train" / "demo.log").read_text()
    assert f"resuming from results/checkpoints/.demo.resume/{points[-1]}" in log, out
    assert not resume.exists()  # finished: nothing left to resume
    state = json.loads((work / "results" / "checkpoints" / "demo" / "trainer_state.json").read_text())
    assert state["resumed_from_step"] == int(points[-1][5:13]) > 0
    whole = load_file(runs["whole"] / "results" / "checkpoints" / "demo" / "model.safetensors")
    resumed = load_file(work / "results" / "checkpoints" / "demo" / "model.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    lines = lambda w: (w / "results/checkpoints/demo/train_log.jsonl").read_text().splitlines()  # noqa: E731
    assert [json.loads(x)["loss"] for x in lines(work)] == [json.loads(x)["loss"] for x in lines(runs["whole"])]


def test_a_failing_job_says_why_in_one_line_on_the_console(pipeline, tmp_path):
    """A completion shard cut short (an interrupted copy): the validate job fails, and the reason,
    naming the file and what to do, is on the console, not only in the rule's log."""
    work = tmp_path / "run"
    shutil.copytree(pipeline[0], work, symlinks=True)
    shard = work / "results" / "completions" / "shard-00000.jsonl.zst"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = snakemake(work, "--cores", "1", "results/qa/shard-00000.json", check=False)
    line = re.search(r"^rule validate \(shard=00000\): (\S+): truncated zstd stream \((\d+) records read before the "
                     r"cut\); .* \[log: (\S+)\]$", out, re.M)
    assert line, out
    assert line.group(1) == "results/completions/shard-00000.jsonl.zst" and line.group(3) == "results/logs/validate/00000.log"
    assert "Traceback" not in out
    log = (work / line.group(3)).read_text()
    assert "Traceback" in log and "truncated zstd stream" in log  # the whole story stays in the log
    assert not (work / "results" / "qa" / "shard-00000.json").exists()
