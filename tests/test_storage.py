"""Outputs in S3 through Snakemake's default storage (snakemake-storage-plugin-s3), against a real
S3 API on localhost (moto's server): a run whose machine is then thrown away, and the one-line
errors of a storage that cannot be used."""
import json
import os
import shutil
import signal
import subprocess
import time
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, small_run_config
from tests.test_generate_server import server  # noqa: F401 (fixture: transformers serve)

pytestmark = pytest.mark.slow
PREFIX = "s3://drafter/run1"


def snakemake(work: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(work),
           "--default-storage-provider", "s3", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def workdir(work: Path, demo_sources, target_dir, **overrides) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    small_run_config(work, demo_sources, target_dir, **{"max_tokens": 8, **overrides})
    return work


def test_the_demo_in_s3_survives_the_machine(s3, tmp_path, demo_sources, target_dir):
    """Every output goes to the bucket; the working folder is then deleted ("instance destroyed")
    and a new one with the same config (sources copied anew, so newer than the outputs) plans
    nothing; the records read back with `dflash inspect s3://...`."""
    first = workdir(tmp_path / "node-1", demo_sources, target_dir)
    run = snakemake(first, "--cores", "2", "--default-storage-prefix", PREFIX)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="drafter")["Contents"]}
    for key in ["results/prompts/manifest.json", "results/completions/shard-00001.jsonl.zst",
                "results/tokenized/shard-00000.safetensors", "results/checkpoints/demo/model.safetensors",
                "results/report/summary.html", "results/logs/generate/00000.log"]:
        assert f"run1/{key}" in keys, key
    assert not list((first / "results").rglob("*.zst")) if (first / "results").exists() else True
    report = json.loads(s3.get_object(Bucket="drafter", Key="run1/results/report/summary.json")["Body"].read())
    assert report["durability"]["storage"] == PREFIX and report["durability"]["safe"], json.dumps(report["durability"])
    page = s3.get_object(Bucket="drafter", Key="run1/results/report/summary.html")["Body"].read().decode()
    assert f"every output of this run is in {PREFIX}: safe to destroy" in page
    check_safe_to_destroy(s3, first)
    shutil.rmtree(first)

    second = workdir(tmp_path / "node-2", demo_sources, target_dir)
    plan = snakemake(second, "-n", "--default-storage-prefix", PREFIX)
    assert plan.returncode == 0, (plan.stdout + plan.stderr)[-4000:]
    assert "Nothing to be done" in plan.stdout + plan.stderr
    shown = subprocess.run([sys.executable, "-m", "dflash.cli", "inspect", f"{PREFIX}/results/completions/shard-00000.jsonl.zst",
                            "--json"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert len(shown.stdout.splitlines()) == 4


def test_a_storage_that_cannot_be_used_is_one_line(s3, tmp_path, demo_sources, target_dir, monkeypatch):
    import os

    work = workdir(tmp_path / "w", demo_sources, target_dir)
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY="sEcReT-never-printed")
    cases = {
        "s3://no-such-bucket/run": (env, "s3://no-such-bucket/run: no bucket 'no-such-bucket' at this endpoint: create it or fix the URL"),
        PREFIX + "/unreachable": ({**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
                                  f"{PREFIX}/unreachable: cannot reach the S3 endpoint http://127.0.0.1:9"),
        PREFIX + "/no-keys": ({k: v for k, v in env.items() if not k.startswith("AWS_") or k == "AWS_ENDPOINT_URL"}
                              | {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
                                 "AWS_EC2_METADATA_DISABLED": "true"},
                              f"{PREFIX}/no-keys: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
    }
    for prefix, (case_env, line) in cases.items():
        run = snakemake(work, "-n", "--default-storage-prefix", prefix, env=case_env)
        out = run.stdout + run.stderr
        assert run.returncode == 1 and line in out, (prefix, out[-3000:])
        assert "sEcReT" not in out and "Traceback" not in out
        assert not (work / "results").exists()
    missing = subprocess.run([sys.executable, "-m", "dflash.cli", "inspect", f"{PREFIX}/results/nothing.jsonl.zst"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and missing.stderr.strip().splitlines() == [
        f"dflash inspect: {PREFIX}/results/nothing.jsonl.zst: no such object"]


def test_keys_that_may_only_read_can_plan_but_not_run(s3, tmp_path, demo_sources, target_dir):
    """With IAM enforced by the S3 server: keys that may list and read plan a run (a dry run
    writes nothing) but stop it before any job, naming the missing permission; keys with no
    permission stop even the plan. One line each, and no secret printed."""
    import urllib.request

    import boto3

    iam = boto3.client("iam")
    keys = {}
    for user, actions in {"reader": ["s3:ListBucket", "s3:GetObject"], "nobody": []}.items():
        iam.create_user(UserName=user)
        if actions:
            iam.put_user_policy(UserName=user, PolicyName="p", PolicyDocument=json.dumps({
                "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": [
                    "arn:aws:s3:::drafter", "arn:aws:s3:::drafter/*"]}]}))
        keys[user] = iam.create_access_key(UserName=user)["AccessKey"]
    work = workdir(tmp_path / "w", demo_sources, target_dir)

    def as_user(user: str, *args: str) -> tuple[int, str]:
        env = dict(os.environ, AWS_ACCESS_KEY_ID=keys[user]["AccessKeyId"],
                   AWS_SECRET_ACCESS_KEY=keys[user]["SecretAccessKey"])
        run = snakemake(work, *args, "--default-storage-prefix", PREFIX, env=env)
        out = run.stdout + run.stderr
        assert keys[user]["SecretAccessKey"] not in out and "Traceback" not in out, out[-3000:]
        return run.returncode, out

    def enforce(count: bytes) -> None:  # moto's switch: IAM checked after this many requests
        urllib.request.urlopen(urllib.request.Request(f"{os.environ['AWS_ENDPOINT_URL']}/moto-api/reset-auth",
                                                      data=count, headers={"Content-Type": "text/plain"})).read()

    enforce(b"0")
    try:
        code, out = as_user("reader", "-n")
        assert code == 0 and "prompts" in out, out[-3000:]
        code, out = as_user("reader", "--cores", "1")
        assert code == 1 and (f"{PREFIX}: access denied to PutObject: these credentials need s3:PutObject on bucket "
                              f"'drafter'") in out, out[-3000:]
        code, out = as_user("nobody", "-n")
        assert code == 1 and (f"{PREFIX}: access denied to ListObjectsV2: these credentials need s3:ListBucket on "
                              f"bucket 'drafter'") in out, out[-3000:]
    finally:
        enforce(b"inf")
    assert not (work / "results").exists() and "Contents" not in s3.list_objects_v2(Bucket="drafter")


def test_generation_survives_the_node(s3, server, target_dir, demo_sources, tmp_path):
    """A run with its outputs in the bucket, its generate job pushing the resume file every 2
    records, is killed with its job (SIGKILL: the node is gone) once 4 records are pushed; its
    folder is deleted. A fresh folder's dry run plans that shard's generation and nothing before
    it; its run fetches the pushed records and requests only the other prompts: every id once, no
    finished prompt asked for again, and the resume object deleted."""
    from tests.test_generate_server import requests_seen

    url, server_log = server
    # sampled hot: the briefly taught target seldom stops early, so the job outlasts the first pushes
    settings = dict(backend="openai", max_error_fraction=0.0, mirror_every={"records": 2, "seconds": 3600},
                    sampling={"temperature": 1.5, "top_p": 1.0, "top_k": 0, "max_tokens": 64, "seed": 0},
                    server={"url": url, "dialect": "openai", "concurrency": 1, "retries": 0, "timeout_s": 120})
    shard = "results/completions/shard-00000.jsonl.zst"
    key = "run1/results/completions/.shard-00000.jsonl.zst.partial.jsonl"
    first = workdir(tmp_path / "node-1", demo_sources, target_dir, train=4, shard_size=16, **settings)
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(first), "--cores", "1",
           "--default-storage-provider", "s3", "--default-storage-prefix", PREFIX, shard]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def pushed() -> list[str]:
        try:
            body = s3.get_object(Bucket="drafter", Key=key)["Body"].read().decode()
        except s3.exceptions.NoSuchKey:
            return []
        return [json.loads(line)["id"] for line in body.splitlines()]

    deadline = time.time() + 300
    while len(pushed()) < 4:
        assert job.poll() is None and time.time() < deadline, "no push seen: " + s3.get_object(
            Bucket="drafter", Key="run1/results/logs/generate/00000.log")["Body"].read().decode()[-3000:]
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGKILL)  # snakemake and its job: the node vanishes
    job.wait()
    time.sleep(1.0)  # the request in flight ends and is logged
    saved = pushed()
    left = safe(first)  # what a lost node costs: the job cut off, its unpushed records
    assert left.returncode == 1 and "incomplete (a job running, or cut off): " in left.stdout, left.stdout + left.stderr
    assert "shard-00000.jsonl.zst" in left.stdout.split("incomplete (a job running, or cut off): ")[1], left.stdout
    shutil.rmtree(first)  # instance destroyed: only the bucket remains

    second = workdir(tmp_path / "node-2", demo_sources, target_dir, train=4, shard_size=16, **settings)
    plan = snakemake(second, "-n", "--default-storage-prefix", PREFIX, shard)
    assert plan.returncode == 0, (plan.stdout + plan.stderr)[-3000:]
    assert "rule generate:" in plan.stdout and "rule prompts:" not in plan.stdout, plan.stdout[-3000:]
    before = requests_seen(server_log)
    run = snakemake(second, "--cores", "1", "--default-storage-prefix", PREFIX, shard)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    prompts = [json.loads(line)["id"] for line in subprocess.run(
        [sys.executable, "-m", "dflash.cli", "inspect", f"{PREFIX}/results/prompts/shard-00000.jsonl.zst", "--json",
         "--limit", "0"], capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()]
    done = [json.loads(line)["id"] for line in subprocess.run(
        [sys.executable, "-m", "dflash.cli", "inspect", f"{PREFIX}/{shard}", "--json", "--limit", "0"],
        capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()]
    assert len(prompts) == 16 and done == prompts  # every id once, in the shard's order
    asked = requests_seen(server_log) - before
    print(f"\n{len(saved)} records pushed before the node was killed; the re-run elsewhere asked for {asked}, "
          f"the shard holds {len(done)} ids, each once")
    assert len(saved) >= 4 and asked == 16 - len(saved)
    assert pushed() == []  # deleted once the shard is written


def safe(work: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.cli", "safe-to-destroy", "--config", str(work / "config.yaml"),
                           "--prefix", PREFIX, "--workdir", str(work)], capture_output=True, text=True, timeout=120)


def check_safe_to_destroy(s3, work: Path) -> None:
    """After the run everything is in the bucket; a resume file only here, or a local shard whose
    object has another size or content, is named with its bytes until it is uploaded as it is.
    The command and the Snakemake target give the same answer."""
    done = safe(work)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("safe to destroy"), done.stdout + done.stderr
    target = snakemake(work, "safe_to_destroy", "--cores", "1", "--default-storage-prefix", PREFIX)
    assert target.returncode == 0, (target.stdout + target.stderr)[-3000:]
    assert f"every output of {work / 'results'} is in {PREFIX}: safe to destroy" in target.stdout + target.stderr
    stored_copies = work / ".snakemake/storage/s3/drafter/run1/results/completions"
    stored_copies.mkdir(parents=True, exist_ok=True)
    resume = stored_copies / ".shard-00001.jsonl.zst.partial.jsonl"
    resume.write_text('{"id": "x"}\n' * 100)
    # e.g. a file of a run before the storage was used, copied up by hand (no job reads it: changing
    # its object here leaves the plan of the next machine alone)
    local = work / "results" / "report" / "summary.json"
    local.parent.mkdir(parents=True, exist_ok=True)
    s3.download_file("drafter", "run1/results/report/summary.json", str(local))
    s3.put_object(Bucket="drafter", Key="run1/results/report/summary.json", Body=local.read_bytes()[:-9])
    no = safe(work)
    assert no.returncode == 1, no.stdout + no.stderr
    assert (f"only here: {resume.relative_to(work)} (1.2 KB): not in the storage" in no.stdout
            and f"only here: results/report/summary.json ({local.stat().st_size / 1000:.1f} KB): stored "
                f"with another size ({local.stat().st_size - 9} bytes" in no.stdout), no.stdout
    assert "NOT safe to destroy: 2 file(s)" in no.stderr
    target = snakemake(work, "safe_to_destroy", "--cores", "1", "--default-storage-prefix", PREFIX)
    out = target.stdout + target.stderr
    assert target.returncode == 1 and "NOT safe to destroy: 2 file(s)" in out and "Traceback" not in out, out[-3000:]
    assert f"only here: {resume.relative_to(work)} (1.2 KB): not in the storage" in out
    same_size = bytearray(local.read_bytes())
    same_size[-20] ^= 0x01
    s3.put_object(Bucket="drafter", Key="run1/results/report/summary.json", Body=bytes(same_size))
    assert "stored with other content (checksum differs)" in safe(work).stdout
    s3.upload_file(str(local), "drafter", "run1/results/report/summary.json")
    s3.upload_file(str(resume), "drafter", "run1/results/completions/.shard-00001.jsonl.zst.partial.jsonl")
    again = safe(work)
    assert again.returncode == 0 and "safe to destroy" in again.stdout, again.stdout + again.stderr
    s3.delete_object(Bucket="drafter", Key="run1/results/completions/.shard-00001.jsonl.zst.partial.jsonl")
    shutil.rmtree(work / "results")
    resume.unlink()
