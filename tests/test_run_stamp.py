"""Another run's outputs in the same output_dir: the plan leaves them unread and Snakemake stops,
each saying so (issue: the real config's plan priced the demo's prompts and its CPU pilot)."""
import json
import subprocess
import sys

import yaml

from dflash.core.io import write_json
from dflash.core.run_stamp import STAMP, foreign_run, run_identity, stamp_run
from tests.conftest import ROOT
from tests.test_prompts import mixed_openai_source

DEMO = yaml.safe_load((ROOT / "config.yaml").read_text())


def mine(tmp_path) -> dict:
    """A real-run config of one's own: its own source and model folder, the demo's output_dir."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["prompts"]["sources"] = [mixed_openai_source(tmp_path)]
    cfg["target"]["path"] = str(ROOT / "data/demo/target")
    cfg["run"] = "mine"
    return cfg


def test_a_folder_of_another_run_is_named_and_this_runs_own_is_not(tmp_path):
    out = tmp_path / "results"
    stamp_run(out, DEMO, "config.yaml")
    assert foreign_run(out, DEMO, "config.yaml") is None
    moved = {**DEMO, "prompts": {**DEMO["prompts"], "sources": [{**s, "path": f"/elsewhere/{s['path']}"}
                                                                 for s in DEMO["prompts"]["sources"]]}}
    assert foreign_run(out, moved, "moved.yaml") is None  # the same sources, kept elsewhere
    assert foreign_run(out, mine(tmp_path), "mine.yaml") == (
        f"{out}: holds another run's outputs (sources demo-chat, demo-code, demo-reasoning, demo-tool; target the demo "
        f"target, from config.yaml), and mine.yaml names sources mixed; target target: give this run an output_dir of "
        f"its own (e.g. output_dir: results-mine), or move {out} aside; nothing here deletes another run's outputs")
    # a source added to the run (or one dropped) leaves it the same run, and the stamp follows it
    grown = {**DEMO, "prompts": {**DEMO["prompts"], "sources": [*DEMO["prompts"]["sources"],
                                                                mixed_openai_source(tmp_path)]}}
    assert foreign_run(out, grown, "grown.yaml") is None
    stamp_run(out, grown, "grown.yaml")
    assert json.loads((out / STAMP).read_text())["identity"] == run_identity(grown)
    assert foreign_run(out, DEMO, "config.yaml") is None
    other_target = {**DEMO, "target": {**DEMO["target"], "path": "/models/Qwen3.6-27B"}}
    assert "target Qwen3.6-27B: give this run" in foreign_run(out, other_target, "q.yaml")
    # a folder of a version before the stamp: its prompts manifest's sources
    legacy = tmp_path / "legacy"
    write_json(legacy / "prompts" / "manifest.json", {"sources": {"demo-chat": {}, "demo-tool": {}}})
    assert "(sources demo-chat, demo-tool (" in foreign_run(legacy, mine(tmp_path), "mine.yaml")


def plan(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "dflash.cli", "plan", "--config", "mine.yaml", *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_the_plan_leaves_another_runs_manifest_and_pilot_unread(tmp_path):
    """The demo's results/ (its manifest: 208 prompts; its pilot: a CPU rate): a plan of another
    config counts its own sources and takes no pilot figure, and says why."""
    write_json(tmp_path / "results" / "prompts" / "manifest.json",
               {"prompts": 208, "categories": {"chat": 208}, "shards": [{}], "heldout": 44,
                "sources": {"demo-chat": {}}})
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(mine(tmp_path)))
    run = plan(tmp_path, "--output-tokens", "1e6", "--json", "p.json")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("plan: 87 prompts (from the sources, counted; held out: prompts.heldout_share 0.02)")
    assert lines[1] == (f"  warning: not read: results: holds another run's outputs (sources demo-chat "
                        f"(results/prompts/manifest.json)), and mine.yaml names sources mixed; target "
                        f"target: give this run an output_dir of its own (e.g. output_dir: results-mine), or move "
                        f"results aside; nothing here deletes another run's outputs")
    assert json.loads((tmp_path / "p.json").read_text())["foreign_outputs"].startswith("results: holds another run's")


def test_snakemake_stops_before_building_on_another_runs_outputs(tmp_path):
    stamp_run(tmp_path / "results", DEMO, "config.yaml")
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(mine(tmp_path)))
    run = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path), "-n",
                          "--configfile", str(tmp_path / "mine.yaml")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert (f"{tmp_path / 'mine.yaml'}: at output_dir: results: holds another run's outputs (sources demo-chat, "
            f"demo-code, demo-reasoning, demo-tool; target the demo target, from config.yaml)") in run.stderr
