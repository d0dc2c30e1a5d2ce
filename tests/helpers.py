"""What the tests need and the pipeline never does: every schema violation of a record (the
pipeline stops at the first, compiled), a drafter written straight to a checkpoint folder, and the
command that serves a tiny model with vLLM's CPU build."""
from __future__ import annotations

from functools import cache
from pathlib import Path

from jsonschema import Draft202012Validator
from transformers import Qwen3Config

from dflash.train.drafter import DFlashDraftModel, write_drafter
from dflash.core.io import atomic_dir
from dflash.core.records import schema


@cache
def validator(kind: str) -> Draft202012Validator:
    return Draft202012Validator(schema(kind))


def record_errors(kind: str, record: dict) -> list[str]:
    """Human-readable schema violations of one record (empty when it conforms)."""
    return [f"{'.'.join(map(str, e.absolute_path)) or 'record'}: {e.message}"
            for e in validator(kind).iter_errors(record)]


def save_drafter(model: DFlashDraftModel, config: Qwen3Config, out_dir: Path) -> None:
    """Write the checkpoint under a temporary name and rename it into place when complete."""
    with atomic_dir(out_dir, "checkpoint") as tmp:
        write_drafter(model, config, tmp)


def vllm_cpu_command(python: str, model: Path, port: int, served_name: str = "tiny",
                     host: str = "127.0.0.1") -> tuple[list[str], dict]:
    """vLLM's CPU build serving a small model (reference/cpu-inference-server.md): eager mode;
    tools need a tool parser or vLLM refuses the request. The engine and its worker run in the API
    server's process (no engine-core process, the "uni" executor): one Python start instead of
    three, about 20 s to ready instead of 30 on 2 cores."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
           served_name, "--host", host, "--port", str(port), "--dtype", "float32", "--max-model-len", "4096",
           "--enforce-eager", "--distributed-executor-backend", "uni", "--enable-auto-tool-choice",
           "--tool-call-parser", "qwen3_coder"]
    return cmd, env


def on_a_small_tmpfs(script: str, *args: str, cwd: str | Path, env: dict | None = None):
    """``sh -c script args`` in a private mount namespace where ``/mnt`` is a 16 KB tmpfs, mounted
    first: a real full disk, without root. The test is skipped where no such namespace can be made."""
    import os
    import shutil
    import subprocess

    import pytest

    if not shutil.which("unshare"):
        pytest.skip("no unshare to mount a small tmpfs")
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                          f"mount -t tmpfs -o size=16k tmpfs /mnt && {script}", *args], capture_output=True,
                         text=True, cwd=cwd, env={**os.environ, **(env or {})})
    if "mount:" in run.stderr or "unshare:" in run.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip()}")
    return run
