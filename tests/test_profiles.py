"""Profiles and configs for real runs, planned by real Snakemake dry runs: the SLURM profiles with
the site file, the local profile's GPU count, the shipped real-run config, and the guard that
keeps the demo's sizes out of a real run; and the SLURM executor settings docs/cluster.md promises."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
import yte

from dflash.core.cluster import SiteError, local_gpus, node_kinds, site
from dflash.core.config import DEMO_SIZED, _at, demo_sized_problem, load_config
from tests.conftest import ROOT

REAL = ROOT / "config" / "qwen3.6-27b.yaml"


def dry_run(work: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(work), "-n", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def fake_model(path: Path, layers: int = 64) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "num_hidden_layers": layers}))
    return path


def real_workdir(work: Path, shards: int = 3, **server) -> Path:
    """The shipped real-run config with local stand-ins (a 64-layer model folder, empty sources) and
    a prompts checkpoint already written (a dry run reads only its manifest)."""
    cfg = yaml.safe_load(REAL.read_text())
    cfg["output_dir"] = str(work / "results")
    cfg["target"]["path"] = str(fake_model(work / "model"))
    for src in cfg["prompts"]["sources"]:
        src["path"] = str(work / Path(src["path"]).name)
        Path(src["path"]).touch()
    if server:
        cfg["generate"]["server"].update(server)
    (work / "real.yaml").write_text(yaml.safe_dump(cfg))
    prompts = work / "results" / "prompts"
    prompts.mkdir(parents=True)
    names = [f"shard-{i:05d}.jsonl.zst" for i in range(shards)] + ["heldout.jsonl.zst"]
    for name in names:
        (prompts / name).touch()
    (prompts / "manifest.json").write_text(json.dumps({"shards": [{"name": n, "records": 500} for n in names[:-1]]}))
    return work / "real.yaml"


def test_the_real_run_config_is_complete_and_sized_for_qwen36_27b():
    cfg = load_config(REAL)
    demo = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert [k for k in DEMO_SIZED if _at(cfg, k) == _at(demo, k)] == []
    assert cfg["drafter"]["num_layers"] == 5 and cfg["drafter"]["target_layer_ids"] is None
    assert cfg["drafter"]["block_size"] == 16 and cfg["drafter"]["mask_token_id"] == 248070
    assert cfg["train"]["num_anchors"] == 512 and cfg["generate"]["sampling"]["max_tokens"] == 4096
    launch = cfg["generate"]["server"]["launch"]
    assert "--dp 8" in launch["command"] and launch["gpus"] == cfg["train"]["gpus"] == 8
    assert cfg["prompts"]["shard_size"] == 500 and cfg["train"]["hidden_states"] == "online"


def test_a_configfile_inherits_nothing_from_the_demo(tmp_path):
    """With --configfile, the demo's config.yaml is not read: a real config that leaves the drafter
    and training keys out gets the schema's sizes, so the guard against the demo's sizes (which a
    merge with the demo would trip) stays quiet and the plan is made."""
    (tmp_path / "config.yaml").write_text((ROOT / "config.yaml").read_text())  # the demo, where snakemake runs
    real = yaml.safe_load(real_workdir(tmp_path).read_text())
    for section in ("drafter", "train", "eval"):
        real.pop(section)
    real["generate"]["server"]["launch"] = None
    real["generate"]["server"]["url"] = "http://127.0.0.1:30000/v1"
    (tmp_path / "lean.yaml").write_text(yaml.safe_dump(real))
    run = dry_run(tmp_path, "--configfile", str(tmp_path / "lean.yaml"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "generate" in run.stdout and "demo" not in run.stdout.split("Job stats")[0].split("Config file")[-1]


def test_a_copy_of_the_demo_pointed_at_a_real_model_is_refused(tmp_path):
    demo = yaml.safe_load((ROOT / "config.yaml").read_text())
    demo["target"]["path"] = str(fake_model(tmp_path / "Qwen3.6-27B"))
    demo["prompts"]["sources"] = [{**s, "path": str(ROOT / s["path"])} for s in demo["prompts"]["sources"]]
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(demo))
    run = dry_run(tmp_path, "--configfile", str(tmp_path / "mine.yaml"))
    assert run.returncode == 1
    out = run.stdout + run.stderr
    assert "is a 64-layer model, but drafter.target_layer_ids [1, 3], train.num_anchors 16, train.lr 0.005" in out
    assert "config/qwen3.6-27b.yaml" in out and str(tmp_path / "mine.yaml") in out
    assert not (tmp_path / "results").exists()


def test_the_demo_guard_spares_tiny_targets_and_single_coincidences(tmp_path):
    demo = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg = load_config(ROOT / "config.yaml")
    cfg["target"]["path"] = str(fake_model(tmp_path / "tiny", layers=4))  # a test target as small as the demo's
    assert demo_sized_problem(cfg, demo, "x.yaml", "config.yaml") is None
    cfg = load_config(REAL)
    cfg["target"]["path"] = str(fake_model(tmp_path / "big"))
    cfg["train"]["lr"] = demo["train"]["lr"]  # one value chosen on purpose
    assert demo_sized_problem(cfg, demo, "x.yaml", "config.yaml") is None
    cfg["eval"]["max_new_tokens"] = demo["eval"]["max_new_tokens"]
    assert "train.lr 0.005, eval.max_new_tokens 128" in demo_sized_problem(cfg, demo, "x.yaml", "config.yaml")
    cfg["target"]["path"] = str(tmp_path / "not-here")  # only on the GPU nodes: nothing to compare
    assert demo_sized_problem(cfg, demo, "x.yaml", "config.yaml") is None


def test_local_gpu_count(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert local_gpus() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_gpus() == 1  # none visible: the GPU stages still run, one at a time, on CPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert local_gpus() == max(1, len(list(Path("/proc/driver/nvidia/gpus").glob("*"))))


def test_a_job_claiming_more_gpus_than_the_machine_is_refused(tmp_path):
    """Snakemake would cut train's claim to the machine's count and start train.gpus processes anyway."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text().replace("data/demo", str(ROOT / "data/demo")))
    for gpus, rc in [(4, 1), (2, 0)]:
        cfg["train"]["gpus"] = gpus
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
        run = dry_run(tmp_path, "--profile", str(ROOT / "profiles" / "local"), env={"CUDA_VISIBLE_DEVICES": "0,1"})
        assert run.returncode == rc, run.stdout[-2000:]
    assert "train.gpus is 2" not in run.stdout
    run = dry_run(tmp_path, "--profile", str(ROOT / "profiles" / "local"), env={"CUDA_VISIBLE_DEVICES": "0"})
    assert run.returncode == 1 and "train.gpus is 2, but this run offers 1 GPU(s)" in run.stdout + run.stderr
    cfg["train"].update(gpus=1, nodes=2)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    run = dry_run(tmp_path, "--profile", str(ROOT / "profiles" / "local"), env={"CUDA_VISIBLE_DEVICES": "0"})
    assert run.returncode == 1 and "train.nodes is 2, but profiles/local runs on this machine alone" in run.stderr


def site_file(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load((ROOT / "profiles" / "site.yaml").read_text())
    data.update(changes)
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_site_file_names_reach_every_job_of_the_b200_plan(tmp_path):
    """One file holds the cluster's names; the profile puts them on the jobs: GPU stages on the GPU
    partition with the gres type, CPU stages on the CPU partition, account on all, qos on GPU jobs.
    A started server and the generate jobs of its shards plan as one group each, with no --cores."""
    site = site_file(tmp_path, account="proj-17", qos="high", cpu_partition="short",
                     b200={"partition": "gpu-b200", "gpu_model": "nvidia_b200"})
    real = real_workdir(tmp_path, shards=5)
    cfg = yaml.safe_load(real.read_text())
    cfg["generate"]["server"]["launch"]["shards_per_server"] = 2
    real.write_text(yaml.safe_dump(cfg))
    run = dry_run(tmp_path, "--profile", str(ROOT / "profiles" / "slurm-b200"), "--configfile", str(real),
                  env={"DFLASH_SITE": str(site)})
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert out.count("Group job generate") == 3  # shards 0-1, 2-3, 4
    blocks = {b.split(":")[0].split()[-1]: b for b in out.split("rule ")[1:]}
    serve, generate, validate = blocks["serve"], blocks["generate"], blocks["validate"]
    for block in (serve, generate):
        assert "slurm_partition=gpu-b200" in block and "gpu_model=nvidia_b200" in block and "qos=high" in block
        assert "slurm_account=proj-17" in block
    assert "gpu=8" in serve and "nodes=1" in serve and "mem_mb=1500000" in serve and "cpus_per_gpu=12" in serve
    assert "gpu=0" in generate and "threads: 0" in generate and "mem_mb=2000" in generate
    assert "slurm_partition=short" in validate and "slurm_account=proj-17" in validate and "qos" not in validate
    assert "gpu_model" not in validate


def test_the_rtx_plan_puts_each_gpu_stage_on_the_rtx_partition(tmp_path):
    """The RTX PRO 6000 profile's GPU jobs after generation, as planned (tests/test_slurm.py runs
    its server group for real, and the B200 profile's whole chain): one GPU each for the hidden
    states, the eval's decodings and the pilot's hidden states and training burst, a whole node for
    training; the cached-features plan, so that the hidden jobs are in it."""
    real = real_workdir(tmp_path)
    cfg = yaml.safe_load(real.read_text())
    cfg["train"]["hidden_states"] = "offline"
    cfg["train"].update(gpus=4, nodes=2)
    cfg["hidden"]["max_cache_bytes"] = None
    real.write_text(yaml.safe_dump(cfg))
    run = dry_run(tmp_path, "--profile", str(ROOT / "profiles" / "slurm-rtxpro6000"), "--configfile", str(real),
                  env={"DFLASH_SITE": str(site_file(tmp_path))})
    assert run.returncode == 0, run.stderr[-3000:]
    blocks = {}
    for block in run.stdout.split("rule ")[1:]:
        blocks.setdefault(block.split(":")[0].split()[-1], []).append(block)
    # the eval: trained, untrained and thinking off (eval.thinking_off), one job each
    assert [len(blocks[r]) for r in ("hidden", "eval_decode", "train", "pilot_hidden", "pilot_train")] == [3, 3, 1, 1, 1]
    for rule, mem, runtime in [("hidden", 100000, 480), ("eval_decode", 100000, 120), ("train", 400000, 4320),
                               ("pilot_hidden", 100000, 480), ("pilot_train", 100000, 480)]:
        for block in blocks[rule]:
            assert "slurm_partition=rtxpro6000" in block, block
            assert f"mem_mb={mem}," in block and f"runtime={runtime}," in block and "cpus_per_gpu=8" in block, block
            assert ("gpu=1," in block and "gpu_model=rtx_pro_6000" in block) != (rule == "train"), block
    # train.nodes nodes whole, every GPU of each (gres counts per node; the plugin's gpu, the whole job, is off)
    train = blocks["train"][0]
    assert "nodes=2" in train and "gres=gpu:rtx_pro_6000:4" in train and "gpu=0" in train, train
    assert "slurm_extra=--exclusive" in train


def test_a_wrong_site_file_stops_before_any_job(tmp_path):
    bad = site_file(tmp_path, acount="proj")
    with pytest.raises(SiteError, match="unknown key.*acount"):
        os.environ["DFLASH_SITE"] = str(bad)
        try:
            site("b200")
        finally:
            del os.environ["DFLASH_SITE"]
    (tmp_path / "config.yaml").write_text((ROOT / "config.yaml").read_text())
    run = dry_run(tmp_path, "--profile", str(ROOT / "profiles" / "slurm-rtxpro6000"), env={"DFLASH_SITE": str(bad)})
    assert run.returncode != 0 and "unknown key(s) acount" in run.stdout + run.stderr
    quoted = site_file(tmp_path, rtxpro6000={"partition": "'rtx'", "gpu_model": "rtx_pro_6000"})
    run = dry_run(tmp_path, "--profile", str(ROOT / "profiles" / "slurm-rtxpro6000"), env={"DFLASH_SITE": str(quoted)})
    assert run.returncode != 0 and "rtxpro6000.partition must be a SLURM name" in run.stdout + run.stderr
    missing = dry_run(tmp_path, "--profile", str(ROOT / "profiles" / "slurm-b200"),
                      env={"DFLASH_SITE": str(tmp_path / "nope.yaml")})
    assert missing.returncode != 0 and "nope.yaml: no site file" in missing.stdout + missing.stderr


def test_a_missing_model_folder_or_exclusion_file_is_one_line_at_the_plan(tmp_path):
    """Before: Snakemake's MissingInputException for the model folder, a FileNotFoundError
    traceback for an exclusion file. Now one line each, naming the key and what to do."""
    real = real_workdir(tmp_path)
    cfg = yaml.safe_load(real.read_text())
    cfg["target"]["path"] = str(tmp_path / "models" / "Qwen3.6-27B")
    real.write_text(yaml.safe_dump(cfg))
    run = dry_run(tmp_path, "--configfile", str(real))
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert (f"at target.path: {tmp_path}/models/Qwen3.6-27B: no such model folder on this machine: download the "
            f"model there (the jobs read its weights); to plan (snakemake -n, dflash plan), a folder with its "
            f"config.json and tokenizer files is enough") in run.stderr
    cfg["target"]["path"] = str(fake_model(tmp_path / "model"))
    cfg["validate"]["exclude"] = ["lists/leaked.txt"]
    real.write_text(yaml.safe_dump(cfg))
    run = dry_run(tmp_path, "--configfile", str(real))
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert ("at validate.exclude: lists/leaked.txt: no such file (paths are relative to the folder snakemake runs "
            "in): fix the path, or take it out of the list") in run.stderr


@pytest.mark.parametrize("kind", list(node_kinds()))
def test_slurm_profiles_keep_every_job_log_and_need_no_accounting(kind, monkeypatch):
    """docs/cluster.md promises each sbatch job's log in logs/slurm/ (the plugin deletes a
    successful job's unless told), and job states that a cluster without sacct's accounting gives."""
    monkeypatch.setenv("DFLASH_SITE", str(ROOT / "profiles" / "site.yaml"))
    with open(ROOT / "profiles" / f"slurm-{kind}" / "config.yaml") as f:
        shipped = yte.process_yaml(f, require_use_yte=True)
    assert shipped["slurm-logdir"] == "logs/slurm" and shipped["slurm-keep-successful-logs"] is True
    assert shipped["slurm-status-command"] == "squeue"
    # the test cluster's overlay only adds keys: it replaces none of what the tests should check
    ci = yaml.safe_load((ROOT / "tests" / "slurm-ci" / "config.yaml").read_text())
    assert not set(ci) & set(shipped), set(ci) & set(shipped)
    # the profile of its folder's kind: the kind's partition, and every GPU of its nodes for train
    names, train = site(kind), shipped["set-resources"]["train"]
    assert train["gres"] == f"gpu:{names['gpu_model']}:{node_kinds()[kind]['gpus_per_node']}"
    assert {r["slurm_partition"] for r in shipped["set-resources"].values() if "gpu_model" in r} == {names["partition"]}


def test_each_node_kind_has_its_profile_and_its_site_entry(monkeypatch):
    """plan.profiles' defaults are the node kinds: a profile folder or a site entry of any other
    kind, or a kind without either, is a kind half added (docs/cluster.md, adding a node kind)."""
    kinds = list(node_kinds())
    folders = {p.name.removeprefix("slurm-") for p in (ROOT / "profiles").glob("slurm-*")}
    named = set(yaml.safe_load((ROOT / "profiles" / "site.yaml").read_text())) - {"account", "qos", "cpu_partition"}
    assert set(kinds) == folders == named and {"b200", "rtxpro6000"} <= folders
    monkeypatch.setenv("DFLASH_SITE", str(ROOT / "profiles" / "site.yaml"))
    with pytest.raises(SiteError, match=f"unknown node kind 'no-such-kind'.*{', '.join(kinds)} .*adding a node kind"):
        site("no-such-kind")


RECIPE = ("dflash/schemas/config.schema.yaml", "profiles/site.yaml", "profiles/slurm-h200/config.yaml")


def test_adding_a_node_kind_is_the_recipe_of_three_files(tmp_path):
    """docs/cluster.md's recipe, its blocks as written, applied to a copy of the pipeline: the new
    kind's profile plans a run from the pipeline's folder (the shipped site file's path, no
    DFLASH_SITE), and `dflash plan` forecasts it from its plan.profiles default."""
    doc = (ROOT / "docs" / "cluster.md").read_text()
    section = doc.split("\n## Adding a node kind\n")[1].split("\n## ")[0]
    blocks = {re.match(r"# ([\w./-]+)", b).group(1): b for b in re.findall(r"```yaml\n(.*?)```", section, re.S)}
    assert sorted(blocks) == sorted(RECIPE)
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    for name in ("Snakefile", "config.yaml", "rules", "dflash", "profiles", "report", "scripts", "envs"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, pipeline / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, pipeline / name)
    schema_path, site_path, profile_path = (pipeline / f for f in RECIPE)
    schema = yaml.safe_load(schema_path.read_text())
    schema["properties"]["plan"]["properties"]["profiles"]["default"].update(yaml.safe_load(blocks[RECIPE[0]]))
    schema_path.write_text(yaml.safe_dump(schema, sort_keys=False))
    site_path.write_text(site_path.read_text() + blocks[RECIPE[1]])
    profile_path.parent.mkdir()
    profile_path.write_text(blocks[RECIPE[2]])

    real = real_workdir(tmp_path / "work")
    env = {**{k: v for k, v in os.environ.items() if k != "DFLASH_SITE"}, "PYTHONPATH": str(pipeline)}
    run = subprocess.run([sys.executable, "-m", "snakemake", "-s", "Snakefile", "-d", str(tmp_path / "work"), "-n",
                          "--profile", "profiles/slurm-h200", "--configfile", str(real)],
                         capture_output=True, text=True, timeout=300, cwd=pipeline, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    jobs = {b.split(":")[0].split()[-1]: b for b in run.stdout.split("rule ")[1:]}
    assert "slurm_partition=h200" in jobs["serve"] and "gpu_model=h200" in jobs["serve"], jobs["serve"]
    assert "gres=gpu:h200:8" in jobs["train"] and "runtime=4320," in jobs["train"], jobs["train"]
    assert "slurm_partition=cpu" in jobs["validate"]

    cfg = yaml.safe_load(REAL.read_text())
    del cfg["plan"]["profiles"]  # the schema's defaults: every kind
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(cfg))
    plan = subprocess.run([sys.executable, "-m", "dflash.cli", "plan", "--config", str(tmp_path / "plan.yaml"),
                           "--target", str(ROOT / "data/demo/target"), "--prompts", "1000",
                           "--output-tokens", "1e6"], capture_output=True, text=True, timeout=300, cwd=pipeline,
                          env=env)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "h200: training on 8 GPUs a node" in plan.stdout and "989 TFLOPS bf16" in plan.stdout, plan.stdout
