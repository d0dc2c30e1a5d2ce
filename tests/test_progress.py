"""The console under Snakemake: a long stage's progress lines (the bar stays in the rule's log),
and a failed job's one line, from a rule script, the serve rule and a multi-process training."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import ROOT
from tests.test_serve import PYTHON, config
from tests.test_train import TRAIN_CFG, shards, tiny_target_dir  # noqa: F401 (fixtures)

FAST = {**os.environ, "DFLASH_PROGRESS_SECONDS": "0.2"}

STAGE = """\
import time

from dflash.core.workflow import progress, start_job

start_job(snakemake)
bar = progress(range(12), desc="teach target", unit="step")
for step in bar:
    time.sleep(0.1)
    bar.set_postfix(loss=f"{3 - step / 10:.3f}", refresh=False)
if snakemake.wildcards.shard == "cut":
    raise ValueError("shard-cut.jsonl.zst: truncated zstd stream; copy it again")
open(snakemake.output[0], "w").write("done")
"""


def test_a_stage_under_snakemake_tells_its_progress_on_the_console(tmp_path):
    (tmp_path / "stage.py").write_text(STAGE)
    (tmp_path / "Snakefile").write_text(textwrap.dedent(f"""\
        rule stage:
            output: "out/{{shard}}.txt"
            log: "logs/{{shard}}.log"
            script: "{tmp_path / 'stage.py'}"
        """))
    run = subprocess.run([sys.executable, "-m", "snakemake", "-d", str(tmp_path), "--cores", "1", "--keep-going",
                          "out/00003.txt", "out/cut.txt"], cwd=tmp_path, capture_output=True, text=True, env=FAST,
                         timeout=300)
    console = run.stdout + run.stderr
    ours = re.findall(r"^\[stage \(shard=00003\)\] teach target (.*)$", console, re.M)
    assert ours and ours[0] == "0/12 steps (0%), started", console
    rate = r"[\d.]+ (steps/s|s/step)"
    periodic = [line for line in ours[1:-1] if re.fullmatch(rf"\d+/12 steps \(\d+%\), {rate}, ETA [\dhms]+, "
                                                             r"loss \d\.\d{3}", line)]
    assert periodic, console
    assert re.fullmatch(rf"12/12 steps \(100%\) done in [\dhms]+, {rate}, loss 1\.900", ours[-1]), console
    # the log keeps tqdm's bar and nothing of the console's story
    log = (tmp_path / "logs" / "00003.log").read_text()
    assert "teach target: 100%|" in log and "12/12" in log and "[stage" not in log
    # the failed job: one line, its reason and its log; the traceback only in the log
    assert re.search(r"^rule stage \(shard=cut\): shard-cut\.jsonl\.zst: truncated zstd stream; copy it again "
                     r"\[log: logs/cut\.log\]$", console, re.M), console
    assert "Traceback" not in console and "Traceback" in (tmp_path / "logs" / "cut.log").read_text()
    assert run.returncode != 0 and (tmp_path / "out" / "00003.txt").exists()


def in_a_job(code: str, log: Path, seconds: str = "0.2") -> subprocess.CompletedProcess:
    """``code`` after start_job, in a process whose stderr is the console, as Snakemake runs a
    rule script (the object stands in for the one Snakemake hands the script)."""
    prelude = ("from types import SimpleNamespace\nfrom dflash.core.workflow import start_job\n"
               f"start_job(SimpleNamespace(rule='train', wildcards={{}}, log=[{str(log)!r}], threads=1))\n")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, "DFLASH_PROGRESS_SECONDS": seconds}, cwd=ROOT, timeout=600)


def test_progress_lines_can_be_turned_off_and_stay_out_of_the_cli(tmp_path):
    code = "from dflash.core.workflow import progress\nfor _ in progress(range(3), desc='spec decode'): pass\n"
    off = in_a_job(code, tmp_path / "off.log", seconds="0")
    assert off.returncode == 0 and off.stderr == "", off.stderr
    assert "spec decode: 100%|" in (tmp_path / "off.log").read_text()
    cli = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=FAST, timeout=60)
    assert "spec decode: 100%|" in cli.stderr and "[" not in cli.stderr.replace("[00:", "")  # tqdm's bar only
    bad = in_a_job(code, tmp_path / "bad.log", seconds="soon")
    assert "rule train: DFLASH_PROGRESS_SECONDS='soon': give the seconds between progress lines" in bad.stderr


def test_multi_process_training_tells_rank_0s_progress_and_the_failed_rank(tiny_target_dir, shards,  # noqa: F811
                                                                          tmp_path):
    """Two torchrun processes train, then rank 0 cannot write its first resume point (a folder is in
    the way of its file): rank 0's progress alone on the console, then one line naming the rank
    and why."""
    out = tmp_path / "drafter"
    (tmp_path / ".drafter.resume" / "step-00000010.pt").mkdir(parents=True)
    cfg = {**TRAIN_CFG, "steps": 20, "log_every": 5, "save_every": 10}
    run = in_a_job(f"""
        from dflash.train.launch import train_processes
        train_processes(2, [{str(shards[0])!r}], [{str(shards[1])!r}], {str(tiny_target_dir)!r}, {str(out)!r},
                        {cfg!r})
        """, tmp_path / "train.log")
    log = (tmp_path / "train.log").read_text()
    assert run.returncode == 1, run.stderr + log[-3000:]
    lines = run.stderr.splitlines()
    assert lines.count("[train] train drafter 0/20 steps (0%), started") == 1, run.stderr
    failed = [line for line in lines if line.startswith("rule train:")]
    assert len(failed) == 1 and re.fullmatch(
        rf"rule train: training in 2 processes failed: rank 0: "
        rf"{re.escape(str(tmp_path / '.drafter.resume' / 'step-00000010.pt'))}: Is a directory: cannot put the "
        rf"finished file there \(1 more lines in the log\) \[log: {re.escape(str(tmp_path / 'train.log'))}\]",
        failed[0]), run.stderr
    assert "Traceback" not in run.stderr and "IsADirectoryError" in log and not out.exists()


def test_a_failed_server_says_why_on_the_console(tmp_path):
    """The serve rule's launcher: a server that exits at once."""
    launch = config(command=f"{PYTHON} -c \"print('model weights missing'); import sys; sys.exit(3)\"")
    run = subprocess.run([sys.executable, "-m", "dflash.generate.server", "--service", str(tmp_path / "servers" / "0.json"),
                          "--model", str(tmp_path), "--served-model-name", "tiny",
                          "--launch", json.dumps(launch["generate"]["server"]["launch"]),
                          "--log", str(tmp_path / "serve.log"), "--server-log", str(tmp_path / "serve.server.log")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert re.fullmatch(r"rule serve \(server=0\): server exited with 3 before it was healthy.*\(\d+ more lines in "
                        rf"the log\) \[log: {re.escape(str(tmp_path / 'serve.log'))}\]\n", run.stderr), run.stderr


def test_a_job_stopped_by_sigterm_leaves_no_temp_files(tmp_path):
    """Snakemake cancelling a job, or SLURM's time limit, sends SIGTERM: the job's unfinished
    outputs (temp files beside the real ones) are removed, not left behind for ever."""
    import signal

    log = tmp_path / "job.log"
    code = textwrap.dedent(f"""\
        from types import SimpleNamespace
        import time
        from dflash.core.io import atomic_dir, atomic_path
        from dflash.core.workflow import start_job
        start_job(SimpleNamespace(rule='hidden', wildcards={{}}, log=[{str(log)!r}], threads=1))
        with atomic_path({str(tmp_path / 'shard.safetensors')!r}) as tmp, atomic_dir({str(tmp_path / 'ckpt')!r}, 'checkpoint') as folder:
            tmp.write_text('half'); (folder / 'model.safetensors').write_text('half')
            print('writing', flush=True)
            time.sleep(120)
        """)
    job = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert job.stdout.readline() == "writing\n"
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM, job.stderr.read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.log"]
    assert "SIGTERM: the job stopped; its unfinished outputs are removed" in log.read_text()
