"""The pipeline through the shipped SLURM profiles, on a real SLURM (tests/slurm_cluster.py): a
single node posing as one 8x B200 and one 4x RTX PRO 6000 node, with tests/slurm-ci on top for
what the test machine lacks (accounting). Jobs, sbatch lines, GPU allocations, a cancelled job and
a killed snakemake are all real."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from dflash.core.config import load_config
from dflash.core.io import read_jsonl
from dflash.train.stage import drafter_train_cfg, train
from tests import slurm_cluster
from tests.conftest import ROOT, demo_slice, small_run_config

pytestmark = pytest.mark.slow
SITE = ROOT / "profiles" / "site.yaml"


@pytest.fixture(scope="module")
def slurm():
    try:
        slurm_cluster.start()
    except slurm_cluster.SlurmUnavailable as e:
        pytest.fail(f"no SLURM for the SLURM tests: {e}")
    yield
    # The cluster stays up: with scontrol installed and no controller, the SLURM plugin's help text
    # (scontrol show config, 9 s to time out) would slow every later snakemake start.
    subprocess.run(["scancel", "--user", "root"], capture_output=True)


def command(work: Path, profile: str, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "tests" / "slurm_snakemake.py"), "-s", str(ROOT / "Snakefile"), "-d", str(work),
            "--profile", str(ROOT / "profiles" / profile), "--profile", str(ROOT / "tests" / "slurm-ci"),
            "--jobs", "3", "--latency-wait", "5", *args, "--configfile", str(work / "config.yaml")]


def env(site: Path = SITE) -> dict:
    return {**os.environ, "DFLASH_SITE": str(site)}


def run(work: Path, profile: str, *args: str, site: Path = SITE) -> str:
    r = subprocess.run(command(work, profile, *args), capture_output=True, text=True, timeout=900, env=env(site))
    out = r.stdout + r.stderr
    if r.returncode:
        logs = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in (work / "results" / "logs").rglob("*.log"))
        raise AssertionError(f"snakemake {' '.join(args)} failed ({r.returncode}):\n{out[-6000:]}\n{logs}")
    return out


def sbatch_calls(out: str) -> dict[str, list[str]]:
    """The plugin's --verbose "sbatch call:" lines by rule (a group job: by its rules, e.g.
    generate_generate_serve)."""
    calls: dict[str, list[str]] = {}
    for line in out.splitlines():
        if "sbatch call:" in line:
            rule = re.search(r"--comment '?rule_(\w+?)(?:_wildcards_\S+?)?'? ", line).group(1)
            calls.setdefault(rule, []).append(line)
    return calls


def visible_gpus(log: Path) -> list[str]:
    found = re.search(r"CUDA_VISIBLE_DEVICES=(\S*)", log.read_text())
    assert found, f"{log}: no job context line"
    return [d for d in found.group(1).split(",") if d]


def test_demo_through_the_b200_profile(slurm, tmp_path, demo_sources, target_dir):
    """In-process generation (one GPU per shard job), hidden states, training and eval as sbatch jobs."""
    small_run_config(tmp_path, demo_sources, target_dir)
    out = run(tmp_path, "slurm-b200", "--verbose")
    res = tmp_path / "results"
    assert (res / "report" / "summary.html").exists() and (res / "eval" / "demo.json").exists()
    calls = sbatch_calls(out)
    assert set(calls) == {"prompts", "generate", "validate", "tokenize", "hidden", "train", "eval_decode"}, set(calls)
    assert len(calls["generate"]) == len(calls["hidden"]) == len(calls["eval_decode"]) == 2
    for rule, mem, runtime in [("generate", 2000, 1440), ("hidden", 200000, 240), ("eval_decode", 200000, 120)]:
        for call in calls[rule]:
            assert " -p b200 " in call and "--gpus=b200:1" in call and f"--mem {mem} " in call, call
            assert f" -t {runtime} " in call and "--cpus-per-gpu=12" in call or rule == "generate", call
    train = calls["train"][0]
    # the node whole, every GPU of it (gres: per node); train.gpus of them train
    assert "--gres=gpu:b200:8" in train and "--gpus" not in train and "--nodes=1" in train, train
    assert "--exclusive" in train and " -t 2880 " in train, train
    # a preempted job is requeued; a time limit near, train hears of it 10 minutes ahead
    assert " --requeue " in train and "--signal=TERM@600" in train and "--open-mode=append" in train, train
    for rule in ("prompts", "validate", "tokenize"):
        assert all(" -p cpu " in c and "--gpus" not in c for c in calls[rule]), calls[rule]
    assert "--cpus-per-task=16" in calls["prompts"][0] and "--mem 64000" in calls["prompts"][0]
    assert all("--cpus-per-task=8" in c and "--mem 16000" in c for c in calls["tokenize"]), calls["tokenize"]
    # the light jobs ran where snakemake runs
    assert re.search(r"localrule gate:", out) and re.search(r"localrule report:", out)
    for log in [res / "logs" / "hidden" / "00000.log", res / "logs" / "generate" / "00001.log"]:
        assert len(visible_gpus(log)) == 1, log
    assert "SLURM job" in (res / "logs" / "train" / "demo.log").read_text()


def test_started_server_holds_a_whole_rtx_node(slurm, tmp_path, demo_sources, target_dir):
    """generate.server.launch: the server and the generate jobs of its shards are one sbatch job
    holding the node's 4 GPUs; every job of the group sees them. The chain after generation runs
    through SLURM in the B200 test; the RTX profile's GPU jobs after it are planned in
    tests/test_profiles.py (a whole run here took two minutes of CI)."""
    cli = Path(sys.executable).with_name("transformers")
    small_run_config(tmp_path, demo_sources, target_dir, backend="openai", max_error_fraction=0.0, server={
        "dialect": "openai", "concurrency": 2, "retries": 0, "timeout_s": 120,
        "launch": {"command": f"{cli} serve --host {{host}} --port {{port}} {{model}}", "gpus": 4,
                   "shards_per_server": 64, "startup_timeout_s": 300}})
    out = run(tmp_path, "slurm-rtxpro6000", "--verbose", *(f"results/completions/shard-{s}.jsonl.zst"
                                                          for s in ("00000", "00001")))
    calls = sbatch_calls(out)
    group = [c for rule, lines in calls.items() if "serve" in rule for c in lines]
    assert len(group) == 1, group  # one server for both shards: one node
    # the server's 300 GB and 2 GB per client; the longest runtime; the node's 4 GPUs
    assert " -p rtxpro6000 " in group[0] and "--gpus=rtx_pro_6000:4" in group[0], group[0]
    assert "--mem 304000 " in group[0] and " -t 2880 " in group[0] and "--cpus-per-gpu=8" in group[0], group[0]
    res = tmp_path / "results"
    seen = [visible_gpus(res / "logs" / "generate" / f"{s}.log") for s in ("00000", "00001")]
    assert len(seen[0]) == 4 and seen[0] == seen[1] == visible_gpus(res / "logs" / "serve" / "0.log")
    for shard in ("00000", "00001"):
        prompts = read_jsonl(res / "prompts" / f"shard-{shard}.jsonl.zst")
        assert [c["id"] for c in read_jsonl(res / "completions" / f"shard-{shard}.jsonl.zst")] == [p["id"] for p in prompts]
    assert "SIGTERM: stopping the server" in (res / "logs" / "serve" / "0.log").read_text()


@pytest.fixture
def long_shard(tmp_path, demo_sources, target_dir):
    """A workdir whose shard 00000 takes tens of seconds to generate on CPU: 40 prompts of 96 tokens,
    sampled hot enough that the briefly taught target seldom stops early, one at a time (batched,
    they would all be written within seconds, before a test could stop the job)."""
    cfg = small_run_config(tmp_path, demo_sources, target_dir)
    cfg["prompts"] = {"shard_size": 40, "sources": demo_slice(demo_sources, tmp_path, train=10, heldout=1)}
    cfg["generate"]["sampling"].update(max_tokens=96, temperature=1.5, top_k=0, top_p=1.0)
    cfg["generate"]["batch_size"] = 1
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    run(tmp_path, "slurm-b200", "prompts")
    return tmp_path


SHARD = "results/completions/shard-00000.jsonl.zst"


def wait_for_partial(work: Path, proc: subprocess.Popen, lines: int = 2, timeout_s: float = 300) -> None:
    partial = work / "results" / "completions" / ".shard-00000.jsonl.zst.partial.jsonl"
    deadline = time.time() + timeout_s
    while not (partial.exists() and len(partial.read_text().splitlines()) >= lines):
        assert proc.poll() is None, f"snakemake ended early: {proc.communicate()[0][-3000:]}"
        assert time.time() < deadline, "the generate job never got going"
        time.sleep(0.5)


def generate_jobs() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %k"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if "rule_generate" in line]


def every_id_once(work: Path) -> None:
    prompts = [p["id"] for p in read_jsonl(work / "results" / "prompts" / "shard-00000.jsonl.zst")]
    ids = [c["id"] for c in read_jsonl(work / SHARD)]
    assert Counter(ids) == Counter(prompts) and len(prompts) == 40


def test_a_cancelled_generate_job_is_rerun_and_resumes(slurm, long_shard):
    work = long_shard
    proc = subprocess.Popen(command(work, "slurm-b200", SHARD), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env())
    wait_for_partial(work, proc)
    jobs = generate_jobs()
    assert len(jobs) == 1
    subprocess.run(["scancel", jobs[0]], check=True)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"Error in rule generate", out), out[-3000:]  # the cancelled attempt failed, then ran again
    every_id_once(work)
    log = (work / "results" / "logs" / "generate" / "00000.log").read_text()
    assert re.search(r"resuming, \d+ of 40 prompts already finished", log)


def test_a_killed_snakemake_resumes_without_duplicates(slurm, long_shard):
    """SIGKILL leaves the SLURM job running; the re-run's job waits for it on the shard's lock and
    keeps what it wrote."""
    work = long_shard
    proc = subprocess.Popen(command(work, "slurm-b200", SHARD), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env())
    wait_for_partial(work, proc)
    orphan = generate_jobs()
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert len(orphan) == 1 and generate_jobs() == orphan  # still running, with nobody watching it
    subprocess.run(command(work, "slurm-b200", "--unlock"), capture_output=True, env=env(), check=True)
    run(work, "slurm-b200", SHARD)
    every_id_once(work)
    log = (work / "results" / "logs" / "generate" / "00000.log").read_text()
    assert "another job is writing this shard" in log and "resuming, 40 of 40 prompts already finished" in log
    deadline = time.time() + 30  # a finished job leaves squeue within seconds
    while generate_jobs():
        assert time.time() < deadline, generate_jobs()
        time.sleep(1)


def test_a_preempted_train_job_is_requeued_and_resumes_to_the_same_weights(slurm, tmp_path, demo_sources,
                                                                           target_dir):
    """``scontrol requeue`` on the running train job does what a preemption with PreemptMode=REQUEUE
    does: SIGTERM to the job, then the job back in the queue and run again. No periodic resume
    points (save_every 0): the one it resumes from is the step the signal found."""

    cfg = small_run_config(tmp_path, demo_sources, target_dir, train_steps=600)
    cfg["train"].update(log_every=1, save_every=0)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    checkpoint = tmp_path / "results" / "checkpoints" / "demo"
    proc = subprocess.Popen(command(tmp_path, "slurm-b200", str(checkpoint.relative_to(tmp_path))),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
    deadline = time.time() + 600  # the stages before it run first, through SLURM too
    logs = lambda: list(checkpoint.parent.glob(".demo.*.tmp/train_log.jsonl"))  # noqa: E731
    while not logs() or len(logs()[0].read_text().splitlines()) < 2:
        assert proc.poll() is None, f"snakemake ended early: {proc.communicate()[0][-3000:]}"
        assert time.time() < deadline, "the train job never got going"
        time.sleep(0.2)
    out = subprocess.run(["squeue", "-h", "-o", "%i %k"], capture_output=True, text=True).stdout
    (job,) = [line.split()[0] for line in out.splitlines() if "rule_train" in line]
    subprocess.run(["scontrol", "requeue", job], check=True)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-4000:]
    # the rule's log is the requeued run's; the SLURM log (--open-mode=append) has both runs
    (slurm_log,) = (tmp_path / "logs" / "slurm" / "rule_train" / "demo").glob(f"{job}.log")
    both = slurm_log.read_text()
    stopped = re.search(r"SIGTERM: training stopped after step (\d+); its resume point is in", both)
    assert stopped and 2 <= int(stopped.group(1)) < 600, both[-3000:]
    log = (tmp_path / "results" / "logs" / "train" / "demo.log").read_text()
    assert f"(step {stopped.group(1)})" in log and "resuming from" in log, log[:3000]

    config = load_config(tmp_path / "config.yaml")
    shards = sorted((tmp_path / "results" / "tokenized").glob("shard-*.safetensors"))
    train(shards, [tmp_path / "results" / "hidden" / p.name for p in shards], target_dir, tmp_path / "whole",
          {**drafter_train_cfg(config, target_dir), "fast_kernels": config["target"]["fast_kernels"]})
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(checkpoint / "model.safetensors")
    assert all(a[k].equal(b[k]) for k in a)


def test_train_over_two_nodes_is_one_sbatch_job_of_two_whole_nodes(slurm, tmp_path, demo_sources, target_dir):
    """train.nodes: 2 through the B200 profile, on the cluster's two-node partition (a site file
    naming it for b200): one sbatch job holding both nodes whole; srun starts a torchrun on each
    (one process, train.gpus: 1); they meet at the first node. The weights are one process's on the
    global batch, to the DDP test's tolerance."""
    cfg = small_run_config(tmp_path, demo_sources, target_dir, train_steps=6)
    cfg["train"].update(nodes=2, log_every=1)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    site = yaml.safe_load(SITE.read_text())
    site["b200"]["partition"] = "pair"
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    out = run(tmp_path, "slurm-b200", "--verbose", "results/checkpoints/demo", site=tmp_path / "site.yaml")
    (train_call,) = sbatch_calls(out)["train"]
    print(train_call)
    assert " -p pair " in train_call and "--nodes=2" in train_call and "--gres=gpu:b200:8" in train_call, train_call
    assert "--gpus" not in train_call and "--exclusive" in train_call, train_call
    log = (tmp_path / "results" / "logs" / "train" / "demo.log").read_text()
    assert re.search(r"2 nodes \(pair\[1-2\]\), rendezvous [\w.-]+:29500", log), log[-3000:]
    # one rank on each node (the rendezvous hands out the ranks: rank 0 may be either)
    ranks = dict(m.group(1, 2) for m in re.finditer(r"rank (\d) of 2 on node (pair\d)", log))
    assert sorted(ranks) == ["0", "1"] and sorted(ranks.values()) == ["pair1", "pair2"], log[-3000:]
    checkpoint = tmp_path / "results" / "checkpoints" / "demo"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["processes"] == 2

    config = load_config(tmp_path / "config.yaml")
    shards = sorted((tmp_path / "results" / "tokenized").glob("shard-*.safetensors"))
    one = {**drafter_train_cfg(config, target_dir), "fast_kernels": config["target"]["fast_kernels"]}
    train(shards, [tmp_path / "results" / "hidden" / p.name for p in shards], target_dir, tmp_path / "one",
          {**one, "batch_size": 2 * one["batch_size"]})
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(checkpoint / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
