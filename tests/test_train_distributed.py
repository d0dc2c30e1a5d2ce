"""Data-parallel training under torchrun on CPU (gloo): DDP and FSDP, and a resume after SIGKILL."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from dflash.train.drafter import load_drafter
from tests.test_train import TRAIN_CFG, shards, tiny_target_dir  # noqa: F401 (fixtures)


def torchrun(shards, target, out, cfg, wait=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dflash.train.stage",
           "--cfg", json.dumps(cfg), "--tokenized", str(shards[0]), "--hidden", str(shards[1]),
           "--target", str(target), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout + run.stderr


def weights(path):
    return load_file(path / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_ddp_and_fsdp_train_the_drafter_one_process_trains_on_the_global_batch(tiny_target_dir, shards,  # noqa: F811
                                                                                tmp_path, optimizer):
    """The loss's denominator is the global batch's supervised slots on every rank, so two ranks
    of 4 rows make the update one process makes on those 8 rows, however the rows' supervised
    slots fall on the ranks (the rows here differ in length, so the ranks' counts differ), and
    each row gets the feature noise it gets in one process. With AdamW to float rounding; Muon
    orthogonalizes each update in bfloat16 (torch's Newton-Schulz), which turns the ranks'
    differently summed gradients into differences of a few percent of the weights' movement,
    never more (a rank orthogonalizing its own shard would be all of it)."""
    cfg = {**TRAIN_CFG, "steps": 20, "log_every": 5, "optimizer": optimizer, "feature_noise": 1.0}
    for parallel in ("ddp", "fsdp"):
        out = torchrun(shards, tiny_target_dir, tmp_path / parallel, {**cfg, "parallel": parallel})
        assert "2 process(es)" in out
        state = json.loads((tmp_path / parallel / "trainer_state.json").read_text())
        assert state["processes"] == 2 and state["final_loss"] < state["first_loss"]
        load_drafter(tmp_path / parallel)  # a complete checkpoint in the reference layout
    for name, run in (("one", {}), ("init", {"steps": 1, "lr": 1e-30})):  # init: the weights before training
        one = subprocess.run([sys.executable, "-m", "dflash.train.stage", "--cfg",
                              json.dumps({**cfg, "batch_size": 2 * cfg["batch_size"], **run}),
                              "--tokenized", str(shards[0]), "--hidden", str(shards[1]),
                              "--target", str(tiny_target_dir), "--out", str(tmp_path / name)],
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
        assert one.returncode == 0, one.stderr[-3000:]
    ddp, fsdp, single, init = (weights(tmp_path / d) for d in ("ddp", "fsdp", "one", "init"))
    assert ddp.keys() == fsdp.keys() == single.keys()
    moved = max((single[k] - init[k]).abs().max().item() for k in single)
    tolerance = 1e-4 if optimizer == "adamw" else 0.1 * moved  # AdamW: float rounding (2e-5 seen)
    for other in (ddp, fsdp):
        assert max((other[k] - single[k]).abs().max().item() for k in single) < tolerance
    logs = [[json.loads(line)["loss"] for line in (tmp_path / d / "train_log.jsonl").read_text().splitlines()]
            for d in ("ddp", "one")]
    assert logs[0] == pytest.approx(logs[1], rel=1e-5 if optimizer == "adamw" else 1e-4)


@pytest.mark.slow
def test_killed_ddp_run_resumes_to_the_same_weights(tiny_target_dir, shards, tmp_path):  # noqa: F811
    cfg = {**TRAIN_CFG, "steps": 200, "log_every": 50, "save_every": 50}
    torchrun(shards, tiny_target_dir, tmp_path / "whole", cfg)
    resume = tmp_path / ".killed.resume"
    run = torchrun(shards, tiny_target_dir, tmp_path / "killed", cfg, wait=False)
    deadline = time.time() + 300
    while not list(resume.glob("step-*.pt")) and run.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    # torchrun starts its workers in sessions of their own: kill each (a preempted node loses all)
    os.killpg(run.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-KILL", "-f", str(tmp_path / "killed")])
    run.wait()
    while subprocess.run(["pgrep", "-f", str(tmp_path / "killed")], capture_output=True).returncode == 0:
        time.sleep(0.1)
    assert list(resume.glob("step-*.pt")) and not (tmp_path / "killed").exists()
    out = torchrun(shards, tiny_target_dir, tmp_path / "killed", cfg)
    assert "resuming from" in out and not resume.exists(), out
    whole, resumed = weights(tmp_path / "whole"), weights(tmp_path / "killed")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.slow
def test_a_stop_signal_to_one_rank_stops_every_rank_after_the_same_step(tiny_target_dir, shards,  # noqa: F811
                                                                         tmp_path):
    """SIGTERM reaches rank 1 alone (a signal is per process): the ranks agree in the step's
    all-reduce, all stop after that step, rank 0 writes its resume point, and the re-run resumes to
    the weights of a run never stopped."""
    cfg = {**TRAIN_CFG, "steps": 300, "log_every": 1, "save_every": 0}
    torchrun(shards, tiny_target_dir, tmp_path / "whole", cfg)
    run = torchrun(shards, tiny_target_dir, tmp_path / "stopped", cfg, wait=False)
    deadline = time.time() + 300
    logs = lambda: list(tmp_path.glob(".stopped.*.tmp/train_log.jsonl"))  # noqa: E731
    while not logs() or len(logs()[0].read_text().splitlines()) < 2:
        assert run.poll() is None and time.time() < deadline
        time.sleep(0.05)
    pids = subprocess.run(["pgrep", "-f", f"dflash.train.stage .*{tmp_path / 'stopped'}"], capture_output=True,
                          text=True).stdout.split()
    ranks = {int(dict(v.split("=", 1) for v in open(f"/proc/{pid}/environ").read().split("\0") if "=" in v)
                  .get("RANK", -1)): int(pid) for pid in pids}
    os.kill(ranks[1], signal.SIGTERM)
    assert run.wait(timeout=120) != 0
    (point,) = (tmp_path / ".stopped.resume").glob("step-*.pt")
    assert 2 <= int(point.stem.split("-")[1]) < cfg["steps"] and not (tmp_path / "stopped").exists()
    out = torchrun(shards, tiny_target_dir, tmp_path / "stopped", cfg)
    assert f"(step {int(point.stem.split('-')[1])})" in out, out[-3000:]
    whole, resumed = weights(tmp_path / "whole"), weights(tmp_path / "stopped")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_nodes_train_as_one_process_on_the_global_batch(tiny_target_dir, shards, tmp_path, parallel):  # noqa: F811
    """Two "nodes" on this machine: two torchrun agents with the launch flags train.nodes: 2 gives
    each node (train_processes, under SLURM one per node through srun), meeting at a c10d
    rendezvous; one process each. Their weights are one process's on the global batch, to the DDP
    test's tolerance (AdamW: float rounding), replicated or sharded."""
    import socket

    from dflash.train.launch import torchrun_args

    cfg = {**TRAIN_CFG, "steps": 20, "log_every": 5, "optimizer": "adamw", "parallel": parallel}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["-m", "dflash.train.stage", "--cfg", json.dumps(cfg), "--tokenized", str(shards[0]), "--hidden", str(shards[1]),
            "--target", str(tiny_target_dir), "--out", str(tmp_path / "nodes")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                               *torchrun_args(1, 2, f"127.0.0.1:{port}", "two-nodes"), *args],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert json.loads((tmp_path / "nodes" / "trainer_state.json").read_text())["processes"] == 2
    one = subprocess.run([sys.executable, "-m", "dflash.train.stage", "--cfg",
                          json.dumps({**cfg, "batch_size": 2 * cfg["batch_size"]}), *args[4:-1], str(tmp_path / "one")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two, single = weights(tmp_path / "nodes"), weights(tmp_path / "one")
    diff = max((two[k] - single[k]).abs().max().item() for k in single)
    print(f"{parallel}: two nodes against one process on the global batch: weights differ by {diff:.2g} at most")
    assert diff < 1e-4


def test_several_nodes_need_a_slurm_allocation_of_them(tiny_target_dir, shards, tmp_path, monkeypatch):  # noqa: F811
    from dflash.train.launch import train_processes

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(RuntimeError, match=r"train\.nodes is 2: the train job must run in a SLURM allocation of 2 "
                                           r"nodes \(this one has none\)"):
        train_processes(1, [shards[0]], [shards[1]], tiny_target_dir, tmp_path / "out", TRAIN_CFG, None, 2)
