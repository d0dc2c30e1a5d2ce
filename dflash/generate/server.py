"""Start, health-check and stop an inference server process (vLLM, SGLang, ``transformers serve``).

The whole process group is stopped, since engines fork workers that outlive a killed parent.
``python -m dflash.generate.server`` is the serve rule: it runs ``generate.server.launch``'s server for one
group of generate jobs and tells them through a service file when it is ready, or why it failed.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dflash.core.config import render_command
from dflash.core.errors import failure_line, install_job_hook
from dflash.core.io import naming_full_disk, read_json, write_json
from dflash.core.workflow import job_context, job_label, log_to

log = logging.getLogger("dflash.generate.server")  # not __main__ under python -m
# The serve rule's generate.server.launch as JSON, set by rules/common.smk: a command line is shown to
# every user of the node by ps (and printed by printshellcmds), and launch.env may hold HF_TOKEN.
LAUNCH_ENV = "DFLASH_LAUNCH"
SECRET_NAMES = ("key", "token", "secret", "password", "passwd")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None  # loaded here: the forked child only calls it
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGTERM when the parent dies, even by SIGKILL: for a server, its launcher (Snakemake kills
    a group's shell jobs when a generate job fails); for the launcher, Snakemake. So no server
    outlives the run that started it."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _secret_name(name: str) -> bool:
    """A flag or variable named like a secret: --api-key, --hf-token, HF_TOKEN; not --max-num-batched-tokens
    or --tokenizer."""
    return any(part.lower().endswith(SECRET_NAMES) for part in re.split(r"[-_]+", name))


def secrets(argv: list[str], env: dict) -> list[str]:
    """What a launch must never show in our logs, longest first: the values of its flags named like
    a secret (``--api-key sk-...``, ``--api-key=sk-...``) and of ``launch.env``. Any variable may hold
    one, so every env value counts, but for short ones under other names: blanking "1"
    (HF_HUB_OFFLINE) everywhere would garble exit statuses and ports, and no key is that short."""
    found = {value for name, value in env.items() if _secret_name(name) or len(value) >= 8}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            value = argv[i + 1]  # else a flag without a value (vLLM's bare --hf-token: the cached token)
        if flag.startswith("-") and _secret_name(flag):
            found.add(value)
    return sorted(filter(None, found), key=len, reverse=True)


def redact(text: str, hidden: list[str]) -> str:
    for secret in hidden:
        text = text.replace(secret, "***")
    return text


class ServerProcess:
    def __init__(self, command: list[str], health_url: str, log_file: Path, env: dict | None = None,
                 ready_timeout_s: float = 300):
        self.command, self.health_url, self.log_file = command, health_url, Path(log_file)
        self.env = {**os.environ, **(env or {})}
        self.hidden = secrets(command, env or {})
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        with naming_full_disk(self.log_file):
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_file, "a")
        with log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True,
                                         preexec_fn=_die_with_parent if _LIBC else None)
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

    def _signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the server's process group; False when nothing of it is left."""
        self.proc.poll()  # reap an exited leader: a zombie would keep the group alive
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
        """Stop every process of the server's group (workers too, even when the leader is gone):
        ``sig`` first, SIGKILL to whatever is left after ``timeout_s``."""
        if self.proc is None or not self._signal_group(sig):
            return
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if not self._signal_group(0):
                return
            time.sleep(0.1)
        self._signal_group(signal.SIGKILL)
        self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log, for a failure's reason: its secrets blanked before the cut,
        which could leave the end of one."""
        return redact(self.log_file.read_text(errors="replace"), self.hidden)[-chars:] if self.log_file.exists() else ""

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class StopRequested(Exception):
    pass


def _stop_requested(signum, frame):
    raise StopRequested(signal.Signals(signum).name)


def _on_stop_signals(handler) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def serve(service: Path, model: str, launch: dict, index: int, server_log: Path, served_model_name: str) -> int:
    """Run server ``index`` of ``generate.server.launch`` until SIGTERM or SIGINT; returns the exit status.

    ``service`` says ``{"status": "starting", "launcher_pid"}`` at once (Snakemake fails a
    consumer whose service file is missing after ``--latency-wait``), then ``{"status": "ready",
    "url", "pid", "launcher_pid", "model"}`` once the health check answers, or ``{"status":
    "failed", "reason"}`` (with the server's last log lines) when the server exits or stays
    unhealthy: the generate jobs that share it wait for one or the other. SIGTERM is how
    Snakemake ends a service job once its consumers finished; it stops the server's whole process
    group (SIGKILL after a grace period) and exits 0.
    """
    launcher = {"launcher_pid": os.getpid()}
    write_json(service, {"status": "starting", **launcher})
    # Servers of one run on one node must not share a port.
    port = launch["port"] + index if launch["port"] is not None else free_port()
    # A server bound to every interface is reached on loopback: its generate jobs share its node.
    host = "127.0.0.1" if launch["host"] in ("0.0.0.0", "::") else launch["host"]
    argv = render_command(launch["command"], model=model, host=launch["host"], port=port,
                          served_model_name=served_model_name)
    server = ServerProcess(argv, f"http://{host}:{port}{launch['health_path']}", server_log, launch["env"],
                           launch["startup_timeout_s"])
    _on_stop_signals(_stop_requested)
    try:  # this log and the failure reason (service file, console) are outputs a run may upload
        log.info("starting server %d: %s", index, shlex.join(redact(arg, server.hidden) for arg in argv))
        server.start()
        write_json(service, {"status": "ready", "url": f"http://{host}:{port}/v1", "pid": server.proc.pid,
                             **launcher, "model": served_model_name})
        log.info("server pid %d ready at http://%s:%d (log: %s)", server.proc.pid, host, port, server_log)
        reason = f"server exited with {server.proc.wait()} while serving; last log lines:\n{server.log_tail()}"
    except StopRequested as stop:
        _on_stop_signals(signal.SIG_IGN)  # a second signal must not cut the shutdown short
        log.info("%s: stopping the server", stop)
        server.stop()
        log.info("server stopped")
        return 0
    except RuntimeError as e:  # exited or not healthy in time: ServerProcess says which
        reason = str(e)
    except OSError as e:
        reason = f"cannot run {argv[0]}: {e}"
    _on_stop_signals(signal.SIG_IGN)
    log.error("server %d failed: %s", index, reason)
    write_json(service, {"status": "failed", **launcher, "reason": reason})
    server.stop()  # workers of a crashed server may still hold the GPUs
    return 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_for_service(path: str | Path, timeout_s: float, poll_s: float = 0.5) -> dict:
    """The service file of a server the pipeline started, once it says ready; its failure reason
    as an error when it says failed or its launcher died (a SIGKILL leaves no word). Written
    atomically, so a file that exists is whole; the launcher runs on this node (same group job)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            info = read_json(path)
        except FileNotFoundError:
            info = {"status": "missing"}
        if info["status"] == "ready":
            return info
        if info["status"] == "failed":
            raise RuntimeError(f"the server of {path} failed: {info['reason']}")
        if info["status"] == "starting" and not _alive(info["launcher_pid"]):
            raise RuntimeError(f"the serve job of {path} (pid {info['launcher_pid']}) ended before its server "
                               f"was ready; see its log")
        time.sleep(poll_s)
    raise TimeoutError(f"{path}: no server ready after {timeout_s:.0f} s; see the serve job's log")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.generate.server", description=(
        "The serve rule: run a generate.server.launch server for a group of generate jobs until SIGTERM."))
    p.add_argument("--service", type=Path, required=True, help="service file to write (ready or failed)")
    p.add_argument("--model", required=True, help="model folder, the command's {model}")
    p.add_argument("--served-model-name", required=True, help="the command's {served_model_name}")
    p.add_argument("--launch", default=os.environ.get(LAUNCH_ENV),
                   help=f"generate.server.launch as JSON (default: ${LAUNCH_ENV}, as the serve rule passes it: "
                        f"an argument is visible to every user in ps)")
    p.add_argument("--index", type=int, default=0, help="which server of the run this is (its port: launch.port + index)")
    p.add_argument("--log", type=Path, required=True, help="this launcher's log")
    p.add_argument("--server-log", type=Path, required=True, help="the server's stdout and stderr")
    a = p.parse_args(argv)
    try:  # argparse's own message would echo the value, secrets and all
        launch = json.loads(a.launch)
    except (TypeError, ValueError):
        p.error(f"needs generate.server.launch as a JSON object in --launch or ${LAUNCH_ENV} (the Snakefile "
                f"sets ${LAUNCH_ENV} for the serve rule)")
    if _LIBC:
        _die_with_parent()
    log_to(a.log)
    log.info("serve: %s", job_context())
    job = job_label("serve", {"server": a.service.stem})  # the rule's wildcard names its service file
    install_job_hook(job, a.log)
    code = serve(a.service, a.model, launch, a.index, a.server_log, a.served_model_name)
    if code:  # the generate jobs waiting for it fail with the same reason
        print(failure_line(job, read_json(a.service)["reason"], a.log), file=sys.__stderr__, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
