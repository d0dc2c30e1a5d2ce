"""Secrets of a run (an API key in a server's command, HF_TOKEN in generate.server.launch.env, a
password in a url) stay out of what the pipeline logs, prints, writes or puts on a command line:
logs and service files are outputs a run uploads, and a command line is visible to every user of
the node in ps. A server's own log is its own business: it is shown to prove the secrets reached it.
"""
import json
import shlex
import subprocess
import sys

import pytest
import yaml

from dflash.core.config import ConfigError, check_config
from tests.test_pipeline import snakemake
from tests.test_profiles import real_workdir
from tests.test_serve import PYTHON, launcher

# A server that prints its arguments and environment, as engines do at start, then fails; its log
# is longer than the 3,000 characters a failure's reason quotes, so the cut may fall in a secret.
SERVER = ("import os, sys; print('args', sys.argv[1:], 'env', os.environ['HF_TOKEN'], os.environ['DB_URL']); "
          "print((os.environ['HF_TOKEN'] + ' ') * 400); sys.exit(1)")
COMMAND = (f"{PYTHON} -c {shlex.quote(SERVER)} --port {{port}} --api-key sk-secret --hf-token=hf-flag-secret "
           f"--max-num-batched-tokens 8192")
# HF_HUB_OFFLINE's "1" is too short to be anyone's key: blanked, it would hide the exit status
ENV = {"HF_TOKEN": "hf-secret", "DB_URL": "postgres://u:db-secret@db/x", "HF_HUB_OFFLINE": "1"}
SECRETS = ("sk-secret", "hf-flag-secret", "hf-secret", "db-secret")


def hidden(text: str, where: str) -> None:
    """No secret in ``text``, not even the end of one."""
    assert "secret" not in text, f"{where} shows a secret:\n{text[-3000:]}"


def test_launcher_log_service_file_and_console_line_show_no_secret(tmp_path):
    proc = launcher(tmp_path, COMMAND, console=subprocess.PIPE, env=ENV)
    console = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 1
    server_log = (tmp_path / "serve.server.log").read_text()
    assert all(s in server_log for s in SECRETS), server_log
    log = (tmp_path / "serve.log").read_text()
    reason = json.loads((tmp_path / "servers" / "0.json").read_text())["reason"]
    for text, where in [(log, "the launcher's log"), (reason, "the service file"), (console, "the console")]:
        hidden(text, where)
    # what a user needs is still there: which flags the server got, its exit status, its last words
    assert "--api-key '***' '--hf-token=***' --max-num-batched-tokens 8192" in log
    assert reason.startswith("server exited with 1 before it was healthy") and "env *** ***" in reason
    assert "rule serve (server=0): server exited with 1 before it was healthy" in console


def test_serve_rule_passes_the_launch_env_by_environment_not_command_line(tmp_path):
    """A real Snakemake run of a shard's group (its server fails at once), shell commands printed
    (-p, as the SLURM profiles do): the launcher gets generate.server.launch with no secret on its
    command line (ps), and no secret reaches the console."""
    real = real_workdir(tmp_path, shards=1, launch={"command": COMMAND, "env": ENV})
    cfg = yaml.safe_load(real.read_text())
    cfg["pilot"]["enabled"] = False
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = snakemake(tmp_path, "--cores", "1", "-p", f"{cfg['output_dir']}/completions/shard-00000.jsonl.zst",
                    check=False)
    shell = [line for line in out.splitlines() if "-m dflash.generate.server" in line]
    assert shell and all("--launch" not in line for line in shell), out[-3000:]
    hidden(out, "snakemake's console")
    assert "rule serve (server=0): server exited with 1 before it was healthy" in out, out[-3000:]
    logs = tmp_path / "results" / "logs"
    hidden((logs / "serve" / "0.log").read_text(), "the launcher's log")
    assert "hf-secret" in (logs / "serve" / "0.server.log").read_text()  # launch.env reached the server
    assert "server exited with 1 before it was healthy" in (logs / "generate" / "00000.log").read_text()


def test_url_with_user_and_password_is_refused_without_showing_them(tmp_path):
    cfg = {"prompts": {"sources": [{"name": "a", "path": "a.jsonl"}]},
           "generate": {"backend": "openai", "server": {"url": "http://bob:sk-secret@127.0.0.1:18071/v1"}}}
    with pytest.raises(ConfigError) as e:
        check_config(cfg, source="my.yaml")
    problem = "my.yaml: at generate.server.url: holds a user name or password"
    assert problem in str(e.value) and "generate.server.api_key_env" in str(e.value)
    hidden(str(e.value), "the config check")
    with pytest.raises(ConfigError, match="holds a query or fragment"):  # a key there would leak the same way
        check_config({**cfg, "generate": {"backend": "openai", "server": {"url": "http://127.0.0.1:18071/v1?key=sk-s"}}})
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(cfg))
    cli = subprocess.run([sys.executable, "-m", "dflash.cli", "plan", "--config", str(tmp_path / "my.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and f"{tmp_path}/{problem}" in cli.stderr, cli.stderr
    hidden(cli.stdout + cli.stderr, "the dflash CLI")
