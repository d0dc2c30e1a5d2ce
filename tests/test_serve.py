"""A server the pipeline starts itself (generate.server.launch): config, launcher, plan.

The launcher runs as the serve rule runs it (``python -m dflash.generate.server``) around plain Python
processes: ``http.server`` is a real HTTP server that starts in a second, and a command that exits
at once is the startup failure no inference server produces on demand. The whole lifecycle with a
real inference server under Snakemake is in ``test_serve_pipeline.py``.
"""
import json
import re
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from dflash.core.config import ConfigError, check_config
from dflash.generate.stage import use_started_server
from dflash.generate.server import LAUNCH_ENV, free_port
from tests.conftest import ROOT, demo_slice
from tests.test_pipeline import snakemake

PYTHON = shlex.quote(sys.executable)


def config(**launch) -> dict:
    return check_config({"prompts": {"sources": [{"name": "a", "path": "a.jsonl"}]},
                         "generate": {"backend": "openai", "server": {"launch": launch}}})


def test_launch_defaults_and_clear_errors():
    launch = config(command="python -m sglang.launch_server --model-path {model} --port {port}")
    assert launch["generate"]["server"]["launch"] == {
        "command": "python -m sglang.launch_server --model-path {model} --port {port}", "shards_per_server": 64, "gpus": 1,
        "host": "127.0.0.1", "port": None, "health_path": "/health", "startup_timeout_s": 1800, "env": {}}
    both = {"prompts": {"sources": [{"name": "a", "path": "a.jsonl"}]},
            "generate": {"server": {"url": "http://127.0.0.1:30000/v1", "launch": {"command": "serve {model}"}}}}
    with pytest.raises(ConfigError) as e:
        check_config(both, source="my.yaml")
    assert "my.yaml: at generate.server: url and launch are both set" in str(e.value)
    assert "my.yaml: at generate.server.launch: starts a server, which only backend 'openai' uses" in str(e.value)
    with pytest.raises(ConfigError, match=r"at generate\.server\.launch\.command: unknown placeholder \{model_path\}"):
        config(command="serve --model-path {model_path}")
    with pytest.raises(ConfigError, match=r"launch: unknown key 'prot' \(did you mean 'port'\?\)"):
        config(command="serve", prot=30000)


def launcher(tmp_path: Path, command: str, console=None, **launch) -> subprocess.Popen:
    """The serve rule's command line, from the package as installed, with the launch spec in the
    environment as the Snakefile passes it; ``console``: the launcher's stderr (default: ours)."""
    spec = {**config(command=command, **launch)["generate"]["server"]["launch"]}
    return subprocess.Popen([sys.executable, "-m", "dflash.generate.server", "--service", str(tmp_path / "servers" / "0.json"),
                             "--model", str(tmp_path / "my model"), "--served-model-name", "tiny",
                             "--log", str(tmp_path / "serve.log"), "--server-log", str(tmp_path / "serve.server.log")],
                            cwd=tmp_path, env={**os.environ, LAUNCH_ENV: json.dumps(spec)}, stderr=console)


def generate_cfg(**launch) -> dict:
    return config(command="unused", **launch)["generate"]


def gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_server_that_exits_fails_its_waiting_jobs_with_the_reason(tmp_path):
    proc = launcher(tmp_path, f"{PYTHON} -c \"print('model weights missing'); import sys; sys.exit(3)\"")
    t0 = time.time()
    with pytest.raises(RuntimeError) as e:
        use_started_server(generate_cfg(), tmp_path / "servers" / "0.json")
    assert time.time() - t0 < 30
    assert "server exited with 3 before it was healthy" in str(e.value) and "model weights missing" in str(e.value)
    assert proc.wait(timeout=30) == 1
    status = json.loads((tmp_path / "servers" / "0.json").read_text())
    assert status["status"] == "failed" and "model weights missing" in status["reason"]
    assert "server 0 failed" in (tmp_path / "serve.log").read_text()


def test_ready_server_is_shared_then_stopped_cleanly_on_sigterm(tmp_path):
    port = free_port()
    model = tmp_path / "my model"  # a space: the health check passes only if it reached the server as one argument
    model.mkdir()
    (model / "config.json").write_text("{}")
    proc = launcher(tmp_path, f"{PYTHON} -m http.server {{port}} --bind {{host}} --directory {{model}}",
                    port=port, health_path="/config.json")
    cfg = use_started_server(generate_cfg(port=port), tmp_path / "servers" / "0.json")
    assert cfg["server"]["url"] == f"http://127.0.0.1:{port}/v1" and cfg["server"]["model"] == "tiny"
    status = json.loads((tmp_path / "servers" / "0.json").read_text())
    urllib.request.urlopen(f"http://127.0.0.1:{port}/config.json", timeout=5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert gone(status["pid"]) and not listening(port)
    log = (tmp_path / "serve.log").read_text()
    assert "SIGTERM: stopping the server" in log and "server stopped" in log


def test_server_dies_with_a_killed_launcher(tmp_path):
    """Snakemake SIGKILLs a group's shell jobs when one of its generate jobs fails."""
    port = free_port()
    proc = launcher(tmp_path, f"{PYTHON} -m http.server {{port}} --bind {{host}}", port=port, health_path="/")
    use_started_server(generate_cfg(port=port), tmp_path / "servers" / "0.json")
    pid = json.loads((tmp_path / "servers" / "0.json").read_text())["pid"]
    proc.kill()
    proc.wait(timeout=10)
    assert gone(pid) and not listening(port)


def test_plan_has_one_server_per_block_of_shards_and_needs_no_cores(tmp_path, demo_sources, target_dir):
    """Two servers for four shards, and the pilot's own server in a group of its own."""
    sources = demo_slice(demo_sources, tmp_path, train=4, heldout=1)  # 4 shards of 4
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["prompts"] = {"shard_size": 4, "sources": sources}
    cfg["target"]["path"] = str(target_dir)
    cfg["generate"] = {"backend": "openai", "server": {
        "dialect": "sglang", "launch": {"command": "python -m sglang.launch_server --model-path {model}",
                                        "shards_per_server": 2, "gpus": 8}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    snakemake(tmp_path, "--cores", "1", "prompts")
    shards = [f"{i:05d}" for i in range(4)]
    # The generate jobs of a started server claim no core: a plain dry run (one core) plans the groups.
    plan = snakemake(tmp_path, "-n", *[f"results/completions/shard-{s}.jsonl.zst" for s in shards])
    jobs = [block for block in re.split(r"\n(?=\s*\[)", plan) if "rule serve:" in block or "rule generate:" in block]
    serves = sorted(re.search(r"output: (\S+) \(service\)", b).group(1) for b in jobs if "rule serve:" in b)
    assert serves == ["results/servers/0.json", "results/servers/1.json", "results/servers/pilot.json"]
    assert all("gpu=8" in b for b in jobs if "rule serve:" in b)
    generates = {re.search(r"shard=(\d{5})", b).group(1): b for b in jobs if "rule generate:" in b}
    assert sorted(generates) == shards
    for shard, block in generates.items():
        assert f"results/servers/{int(shard) // 2}.json" in block and "gpu=0" in block and "threads: 0" in block
    assert plan.count("Group job generate") == 2 and plan.count("Group job pilot") == 1, plan[-3000:]


def test_jobs_waiting_on_a_killed_launcher_fail_and_its_server_dies(tmp_path):
    proc = launcher(tmp_path, f"{PYTHON} -c \"import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                              f"time.sleep(600)\" {{model}}")
    pid_file = tmp_path / "my model"
    deadline = time.time() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline
        time.sleep(0.1)
    proc.kill()
    proc.wait(timeout=10)  # as Snakemake does: a zombie would still count as alive
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"\(pid \d+\) ended before its server was ready"):
        use_started_server(generate_cfg(), tmp_path / "servers" / "0.json")
    assert time.time() - t0 < 10
    assert gone(int(pid_file.read_text()))
