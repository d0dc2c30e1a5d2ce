"""generate.budget: spend as node time, the guard's arithmetic and its line, and a real run that
it stops mid-way and a raised budget finishes."""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash.generate.budget import BudgetError, check_budget, spend
from dflash.core.config import load_config
from dflash.core.io import read_json, read_jsonl
from tests.conftest import ROOT, small_run_config


@pytest.fixture
def config():
    cfg = copy.deepcopy(load_config(ROOT / "config.yaml"))
    cfg["plan"]["profiles"]["b200"] = {"gpus_per_node": 4, "gpu_hour_price": 2.0, "output_tokens_per_s": None}
    return cfg


# The pilot: 10 prompts in 36 s; shard A: 20 prompts in 72 s right after; shard B overlaps A by 36 s.
PILOT = {"prompts": 10, "seconds": 36.0, "started_at": 0.0, "output_tokens": 1000}
SHARD_A = {"prompts": 20, "from_pilot": 0, "resumed": 0, "seconds": 72.0, "started_at": 36.0, "output_tokens": 2000}
SHARD_B = {"prompts": 20, "from_pilot": 5, "resumed": 0, "seconds": 54.0, "started_at": 72.0, "output_tokens": 1500}


def test_spend_is_the_wall_time_of_generation_times_the_nodes(config):
    config["generate"]["budget"].update(nodes=2, profile="b200")
    s = spend([PILOT, SHARD_A, SHARD_B], config)
    assert s["wall_hours"] == pytest.approx(126 / 3600)  # 0..126 s: the overlap counted once
    assert s["node_hours"] == pytest.approx(2 * 126 / 3600) and s["cost"] == pytest.approx(2 * 126 / 3600 * 8.0)
    assert s["prompts_generated"] == 10 + 20 + 15


def test_the_guard_forecasts_the_prompts_left_from_the_node_time_per_prompt(config):
    # spent 108 s on 30 prompts = 3.6 s each; 100 prompts: 20 done in A, 10 of the pilot's in shards
    # not yet run, so 70 left = 252 s: 360 s = 0.1 node-hours in all
    config["generate"]["budget"]["max_node_hours"] = 0.101
    done = check_budget(config, [SHARD_A], PILOT, 100)
    assert done["prompts_left"] == 70 and done["forecast_node_hours"] == pytest.approx(0.07)
    config["generate"]["budget"]["max_node_hours"] = 0.09
    with pytest.raises(BudgetError) as e:
        check_budget(config, [SHARD_A], PILOT, 100)
    assert str(e.value) == (
        "generate budget: spent 0.03 node-hours + forecast 0.07 node-hours for the 70 prompts left = 0.1 node-hours, "
        "over generate.budget.max_node_hours 0.09 node-hours: no further generate job starts (finished shards are "
        "kept); raise it and re-run to go on")
    config["generate"]["budget"].update(max_node_hours=None, max_cost=0.7, profile="b200")  # $8 a node-hour
    with pytest.raises(BudgetError, match=r"spent \$0.24 \+ forecast \$0.56 for the 70 prompts left = \$0.80, over "
                                          r"generate.budget.max_cost \$0.70"):
        check_budget(config, [SHARD_A], PILOT, 100)
    assert check_budget(config, [], None, 100)["forecast_node_hours"] is None  # nothing measured: no forecast yet
    config["generate"]["budget"]["profile"] = None
    with pytest.raises(BudgetError, match="max_cost needs a price"):
        check_budget(config, [SHARD_A], PILOT, 100)


def run(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(work),
                           "--cores", "1", *args], capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_budget_stops_the_run_mid_way_and_a_raised_one_finishes_it(tmp_path, demo_sources, target_dir):
    """The pilot and the first shard run under an hour's limit; a budget of what they spent (plus 5%)
    then starts no further generate job, naming spent, forecast and limit; finished shards stay,
    and a raised budget generates the rest without asking again for a finished prompt."""
    cfg = small_run_config(tmp_path, demo_sources, target_dir, train=3, heldout=1, shard_size=4, max_tokens=16,
                           pilot={"min_per_category": 1}, budget={"max_node_hours": 1.0})
    shards = [f"results/completions/shard-0000{i}.jsonl.zst" for i in range(3)]
    first = run(tmp_path, shards[0])
    assert first.returncode == 0, first.stderr[-3000:]
    spent = read_json(tmp_path / "results/completions/shard-00000.summary.json")["run_spend"]["node_hours"]
    cfg["generate"]["budget"] = {"max_node_hours": spent * 1.05}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    stopped = run(tmp_path, *shards)
    out = stopped.stdout + stopped.stderr
    assert stopped.returncode == 1, out[-3000:]
    line = next(ln for ln in out.splitlines() if "generate budget: spent" in ln)
    print(line)
    assert line.startswith("rule generate (shard=0000") and "over generate.budget.max_node_hours" in line
    assert "Traceback" not in out
    assert (tmp_path / shards[0]).exists() and not (tmp_path / shards[1]).exists()
    cfg["generate"]["budget"] = {"max_node_hours": 1.0}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    finished = run(tmp_path, *shards)
    assert finished.returncode == 0, finished.stderr[-3000:]
    summaries = [read_json(tmp_path / s.replace(".jsonl.zst", ".summary.json")) for s in shards]
    pilot = read_json(tmp_path / "results/pilot/generate.json")
    records = sum(len(read_jsonl(tmp_path / shard)) for shard in shards)
    assert pilot["requests"] + sum(s["requests"] for s in summaries) == records  # none asked for twice
    assert summaries[2]["run_spend"]["node_hours"] > spent
    print(json.dumps([s["run_spend"] for s in summaries]))
