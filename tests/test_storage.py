"""Outputs in S3 through Snakemake's default storage (snakemake-storage-plugin-s3), against a real
S3 API on localhost (moto's server): a run whose machine is then thrown away, and the one-line
errors of a storage that cannot be used."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.io import read_jsonl
from tests.conftest import ROOT, small_run_config
from tests.test_generate_server import server  # noqa: F401 (fixture: transformers serve)

pytestmark = pytest.mark.slow
PREFIX = "s3://drafter/run1"


def snakemake(work: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(work),
           "--default-storage-provider", "s3", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def workdir(work: Path, demo_sources, target_dir) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    small_run_config(work, demo_sources, target_dir, max_tokens=8)
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


def test_generation_survives_the_node(s3, server, target_dir, demo_sources, tmp_path):
    """A generate job whose shard is a stored output pushes its resume file every 2 records; it is
    killed, its machine's folder deleted, and the re-run in a fresh folder fetches the pushed
    records and requests only the others: every id once, no finished prompt asked for again."""
    import json
    import time

    from dflash.generate import generate_shard, partial_path
    from dflash.io import write_jsonl_zst
    from dflash.prompts import read_source
    from tests.test_generate_server import cfg, requests_seen

    url, server_log = server
    recs = list(read_source(demo_sources[1]))[:10]
    shard = tmp_path / "shard-00000.jsonl.zst"
    write_jsonl_zst(shard, recs)
    local = Path(".snakemake/storage/s3/drafter/run1/results/completions/shard-00000.jsonl.zst")
    key = "run1/results/completions/.shard-00000.jsonl.zst.partial.jsonl"
    settings = cfg(url, concurrency=1, retries=0)
    settings["sampling"]["max_tokens"] = 64
    settings["save_every"] = {"records": 2, "seconds": 3600}
    node = tmp_path / "node-1"
    (node / local.parent).mkdir(parents=True)
    job = [sys.executable, "-c", "import sys, json; from dflash.generate import generate_shard; "
           "generate_shard(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))",
           str(shard), str(local), str(target_dir), json.dumps(settings)]
    proc = subprocess.Popen(job, cwd=node, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def pushed() -> list[str]:
        try:
            body = s3.get_object(Bucket="drafter", Key=key)["Body"].read().decode()
        except s3.exceptions.NoSuchKey:
            return []
        return [json.loads(line)["id"] for line in body.splitlines()]

    deadline = time.time() + 120
    while len(pushed()) < 4:
        assert proc.poll() is None and time.time() < deadline, "no push seen"
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    time.sleep(1.0)  # the request in flight ends and is logged
    saved = pushed()
    shutil.rmtree(node)  # instance destroyed: only the bucket remains

    fresh = tmp_path / "node-2"
    (fresh / local.parent).mkdir(parents=True)
    before = requests_seen(server_log)
    summary = generate_shard(shard, fresh / local, target_dir, settings)
    assert summary["resumed"] == len(saved) >= 4 and summary["requests"] == 10 - len(saved)
    assert requests_seen(server_log) - before == 10 - len(saved)
    assert [r["id"] for r in read_jsonl(fresh / local)] == [r["id"] for r in recs]
    assert not partial_path(fresh / local).exists() and pushed() == []  # deleted once the shard is written


def safe(work: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.cli", "safe-to-destroy", "--config", str(work / "config.yaml"),
                           "--prefix", PREFIX, "--workdir", str(work)], capture_output=True, text=True, timeout=120)


def check_safe_to_destroy(s3, work: Path) -> None:
    """After the run everything is in the bucket; a resume file only here, or a local shard whose
    object has another size or content, is named with its bytes until it is uploaded as it is."""
    done = safe(work)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("safe to destroy"), done.stdout + done.stderr
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
