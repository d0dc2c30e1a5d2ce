"""Outputs in a Snakemake default storage (``--default-storage-provider s3``): what the workflow
must read itself, outside a job, from where the outputs live."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from dflash.io import s3_problem

log = logging.getLogger(__name__)


def fetch_from_storage(folder, names: list[str]) -> None:
    """Put ``names`` of a stored folder output (a Snakemake IOFile whose str() is its local copy)
    into that local copy unless they are there: one object each on S3, the whole folder with any
    other storage plugin."""
    local = Path(str(folder))
    missing = [n for n in names if not (local / n).exists()]
    if not missing:
        return
    obj = folder.storage_object
    if not hasattr(obj, "s3obj"):
        obj.retrieve_object()
        return
    local.mkdir(parents=True, exist_ok=True)
    for name in missing:
        obj.s3obj(name).download_file(str(local / name))


def check_s3_prefix(prefix: str, s3_resource) -> str | None:
    """Why the default storage ``prefix`` (s3://bucket/path) cannot be used with the storage
    plugin's own client (its endpoint and keys), as one line; None when its bucket answers."""
    bucket = prefix.removeprefix("s3://").split("/")[0]
    client = s3_resource.meta.client
    try:
        client.head_bucket(Bucket=bucket)
    except Exception as e:
        return s3_problem(prefix, e, endpoint=client.meta.endpoint_url)
    return None


def storage_url(local: str | Path) -> str | None:
    """The s3:// URL of a file in Snakemake's local copy of an S3 storage
    (``.snakemake/storage/s3/<bucket>/<key>``, where a job's stored outputs are written), or None."""
    parts = Path(os.path.abspath(local)).parts
    for i in range(len(parts) - 4):
        if parts[i:i + 3] == (".snakemake", "storage", "s3"):
            return "s3://" + "/".join(parts[i + 3:])
    return None


def s3_client():
    """boto3's S3 client with the storage plugin's settings when given as SNAKEMAKE_STORAGE_S3_*
    variables, else the usual AWS chain (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, a profile, a role)."""
    import boto3

    env = {k: os.environ.get(f"SNAKEMAKE_STORAGE_S3_{k.upper()}") for k in ("endpoint_url", "access_key",
                                                                         "secret_key", "region", "token")}
    return boto3.client("s3", endpoint_url=env["endpoint_url"], region_name=env["region"],
                        aws_access_key_id=env["access_key"], aws_secret_access_key=env["secret_key"],
                        aws_session_token=env["token"])


class PartialMirror:
    """A copy in the storage of a generate job's resume file (the partial JSONL), when its shard is
    a stored output: pushed every ``records`` finished records or ``seconds``, whichever first, so
    a node that vanishes loses at most that much paid-for generation; fetched by the re-run on
    another machine; deleted once the shard is written. Nothing to do for a local shard."""

    def __init__(self, partial: Path, records: int, seconds: float):
        self.partial, self.records, self.seconds = Path(partial), records, seconds
        self.url = storage_url(partial)
        self.unpushed, self.pushed_at = 0, time.time()
        if self.url:
            self.client = s3_client()
            self.bucket, _, self.key = self.url.removeprefix("s3://").partition("/")

    def fetch(self) -> int:
        """Bring the stored resume file here unless one is here already; its size in bytes (0: none)."""
        if not self.url or self.partial.exists():
            return 0
        from botocore.exceptions import ClientError

        try:
            self.client.download_file(self.bucket, self.key, str(self.partial))
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey"):
                return 0
            raise ValueError(s3_problem(self.url, e)) from None
        except Exception as e:
            problem = s3_problem(self.url, e)
            if problem is None:
                raise
            raise ValueError(problem) from None
        size = self.partial.stat().st_size
        log.info("%s: fetched the resume file from %s (%d bytes)", self.partial.name, self.url, size)
        return size

    def added(self, n: int) -> None:
        self.unpushed += n
        if self.url and (self.unpushed >= self.records or time.time() - self.pushed_at >= self.seconds):
            self.push()

    def push(self) -> None:
        """Upload the resume file; a failure is logged, and the next push tries again."""
        if not self.url or not self.unpushed or not self.partial.exists():
            return
        try:
            self.client.upload_file(str(self.partial), self.bucket, self.key)
        except Exception as e:
            log.warning("%s: could not push the resume file: %s", self.partial.name, s3_problem(self.url, e) or e)
            return
        self.unpushed, self.pushed_at = 0, time.time()

    def discard(self) -> None:
        if self.url:
            self.client.delete_object(Bucket=self.bucket, Key=self.key)
