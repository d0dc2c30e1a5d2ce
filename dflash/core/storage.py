"""Outputs in a Snakemake default storage (``--default-storage-provider s3``): what the workflow
must read itself, outside a job, from where the outputs live."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import tempfile
import time
from base64 import urlsafe_b64decode
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from dflash.core.curves import CURVES_DIR
from dflash.core.io import naming_full_disk, read_json
from dflash.core.units import human_bytes
from dflash.core.workflow import job_console, to_console

log = logging.getLogger(__name__)


@contextmanager
def local_copy(path: str | os.PathLike) -> Iterator[Path]:
    """A local path for ``path``: itself, or for ``s3://bucket/key`` a temp copy (``s3_client``'s
    endpoint and keys)."""
    if not str(path).startswith("s3://"):
        if not Path(path).exists():
            raise FileNotFoundError(f"{path}: no such file")
        yield Path(path)
        return
    bucket, key = split_s3(path)
    with tempfile.TemporaryDirectory(prefix="dflash-s3-") as tmp:
        local = Path(tmp) / Path(key).name
        try:
            s3_client().download_file(bucket, key, str(local))
        except Exception as e:
            problem = s3_problem(str(path), e)
            if problem is None:
                raise
            raise (FileNotFoundError if "no such object" in problem else ValueError)(problem) from None
        try:
            yield local
        except (ValueError, OSError) as e:
            # The readers name the file they were given: here a temp copy, gone when this returns.
            if str(local) not in str(e):
                raise
            raise ValueError(str(e).replace(str(local), str(path))) from e


def split_s3(url: str) -> tuple[str, str]:
    """``s3://bucket/some/key/`` -> ``("bucket", "some/key")`` (no trailing slash)."""
    bucket, _, key = str(url).removeprefix("s3://").rstrip("/").partition("/")
    return bucket, key


def stored_root(prefix: str, output_dir: str) -> tuple[str, str]:
    """``(bucket, key)`` under which a run with the default storage ``prefix`` keeps ``output_dir``,
    as Snakemake and its S3 plugin make it (the path normalised, the key normalised again). A key
    outside the prefix is refused: ``output_dir: ../x`` would write into, and be checked against,
    another run's keys."""
    bucket, base = split_s3(prefix)
    root = posixpath.normpath(posixpath.join(base, os.path.normpath(output_dir).lstrip("/")) if base
                              else os.path.normpath(output_dir).lstrip("/"))
    if root == ".." or root.startswith("../") or (base and not (root + "/").startswith(base + "/")) or root == ".":
        raise ValueError(f"output_dir: {output_dir!r} puts the outputs outside the storage prefix {prefix} "
                         f"(its keys would be s3://{bucket}/{root}/..., another run's): give a folder below the "
                         f"working directory without '..', such as results")
    return bucket, root


def s3_missing(error: BaseException) -> bool:
    """Whether ``error`` says the object is not there (as opposed to a failure to ask)."""
    from botocore.exceptions import ClientError  # heavy: S3 runs only

    return isinstance(error, ClientError) and str(error.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey")


# The IAM permission each S3 call the pipeline makes needs (an access-denied line names it).
S3_PERMISSION = {"ListObjectsV2": "s3:ListBucket", "HeadBucket": "s3:ListBucket", "HeadObject": "s3:GetObject",
                 "GetObject": "s3:GetObject", "PutObject": "s3:PutObject", "CreateMultipartUpload": "s3:PutObject",
                 "UploadPart": "s3:PutObject", "CompleteMultipartUpload": "s3:PutObject",
                 "DeleteObject": "s3:DeleteObject"}


def s3_problem(url: str, error: BaseException, endpoint: str | None = None) -> str | None:
    """One line for an S3 failure: the URL, what went wrong and what to do; never the keys. None
    when ``error`` is no S3 failure."""
    from botocore.exceptions import (ClientError, EndpointConnectionError, NoCredentialsError,  # heavy: S3 runs only
                                     PartialCredentialsError)

    bucket = split_s3(url)[0]
    if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
        return (f"{url}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE); "
                f"for Snakemake's storage also SNAKEMAKE_STORAGE_S3_ACCESS_KEY and SNAKEMAKE_STORAGE_S3_SECRET_KEY")
    if isinstance(error, EndpointConnectionError):
        where = endpoint or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
        return (f"{url}: cannot reach the S3 endpoint {where}: check the address (AWS_ENDPOINT_URL, "
                f"SNAKEMAKE_STORAGE_S3_ENDPOINT_URL) and that the server is up")
    if not isinstance(error, ClientError):
        return None
    code = str(error.response.get("Error", {}).get("Code"))
    if code in ("NoSuchBucket",) or (code == "404" and error.operation_name == "HeadBucket"):
        return f"{url}: no bucket {bucket!r} at this endpoint: create it or fix the URL"
    if s3_missing(error):
        return f"{url}: no such object"
    if code in ("403", "AccessDenied", "AllAccessDisabled"):
        needed = S3_PERMISSION.get(error.operation_name)
        return (f"{url}: access denied{f' to {error.operation_name}' if needed else ''}: these credentials need "
                f"{needed or 's3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject'} on bucket {bucket!r}"
                + (" (the pipeline needs s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject)" if needed else ""))
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"):
        return f"{url}: the S3 endpoint rejected these credentials ({code}): check the access key, secret key and token"
    return f"{url}: S3 error {code}: {error.response.get('Error', {}).get('Message', '')}"


def list_objects(url: str, client=None) -> list[dict]:
    """Every object whose key starts with what follows the bucket in ``url`` (``s3://bucket/a/b``
    lists ``a/b/...`` and ``a/bc``; end it in ``/`` for a folder), as S3 lists them (``Key``,
    ``Size``, ``ETag``), page after page; an S3 failure is a ValueError naming the URL."""
    bucket, _, prefix = str(url).removeprefix("s3://").partition("/")
    try:
        pages = (client or s3_client()).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o for page in pages for o in page.get("Contents", [])]
    except Exception as e:
        raise ValueError(s3_problem(url, e) or f"{url}: {type(e).__name__}: {e}") from None


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


def check_s3_prefix(prefix: str, s3_resource, write: bool = False) -> str | None:
    """Why the default storage ``prefix`` (s3://bucket/path) cannot be used with the storage
    plugin's own client (its endpoint and keys), as one line; None when it can. Listing is what
    every plan needs; ``write`` (a run, not a dry run) also puts and deletes a small object, so
    credentials that may only read fail now, not at the upload after a paid-for job."""
    bucket, base = split_s3(prefix)
    client = s3_resource.meta.client
    probe = f"{base}/.dflash-write-check" if base else ".dflash-write-check"
    try:
        client.list_objects_v2(Bucket=bucket, Prefix=base, MaxKeys=1)
        if write:
            client.put_object(Bucket=bucket, Key=probe, Body=b"")
            client.delete_object(Bucket=bucket, Key=probe)
    except Exception as e:
        return s3_problem(prefix, e, endpoint=client.meta.endpoint_url) or f"{prefix}: {type(e).__name__}: {e}"
    return None


def folder_files(folder: str, wanted: Callable[[str], object]) -> list[str] | None:
    """The files right in a local or ``s3://`` folder whose names ``wanted`` takes, sorted; None when
    the folder is not there (an S3 folder: no object under it)."""
    if not str(folder).startswith("s3://"):
        if not Path(folder).is_dir():
            return None
        return sorted(str(p) for p in Path(folder).iterdir() if p.is_file() and wanted(p.name))
    folder = str(folder).rstrip("/")
    key = split_s3(folder)[1] + "/"
    names = [o["Key"][len(key):] for o in list_objects(folder + "/")]
    if not names:
        return None
    return sorted(f"{folder}/{name}" for name in names if "/" not in name and wanted(name))


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
    import boto3  # heavy: S3 runs only

    env = {k: os.environ.get(f"SNAKEMAKE_STORAGE_S3_{k.upper()}") for k in ("endpoint_url", "access_key",
                                                                         "secret_key", "region", "token")}
    return boto3.client("s3", endpoint_url=env["endpoint_url"], region_name=env["region"],
                        aws_access_key_id=env["access_key"], aws_secret_access_key=env["secret_key"],
                        aws_session_token=env["token"])


def read_json_here_or_stored(path: Path) -> dict | None:
    """The JSON file ``path``: here, or fetched from the storage when ``path`` is in Snakemake's
    local copy of a stored folder; None when it is in neither."""
    path = Path(path)
    if path.exists():
        return read_json(path)
    url = storage_url(path)
    if not url:
        return None
    bucket, key = split_s3(url)
    try:
        return json.loads(s3_client().get_object(Bucket=bucket, Key=key)["Body"].read())
    except Exception as e:
        if s3_missing(e):
            return None
        raise ValueError(s3_problem(url, e) or f"{url}: {type(e).__name__}: {e}") from None


def stored_json(folder: Path, prefix: str, suffix: str) -> list[dict] | None:
    """Every JSON object named ``<prefix>*<suffix>`` in the storage beside Snakemake's local copy
    ``folder`` (fetched 16 at a time); None when ``folder`` is not a stored one."""
    url = storage_url(Path(folder) / prefix)
    if not url:
        return None
    client = s3_client()
    bucket = split_s3(url)[0]
    keys = [o["Key"] for o in list_objects(url, client) if o["Key"].endswith(suffix)]
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda k: json.loads(client.get_object(Bucket=bucket, Key=k)["Body"].read()), keys))


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
            self.bucket, self.key = split_s3(self.url)

    def fetch(self) -> int:
        """Bring the stored resume file here unless one is here already; its size in bytes (0: none)."""
        if not self.url or self.partial.exists():
            return 0
        try:
            with naming_full_disk(self.partial):
                self.client.download_file(self.bucket, self.key, str(self.partial))
        except Exception as e:
            if s3_missing(e):
                return 0
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


def s3_etag(path: Path, part_bytes: int) -> str:
    """The ETag S3 gives ``path`` uploaded in parts of ``part_bytes`` (boto3's default: 8 MiB):
    the MD5 of a single-part upload, else the MD5 of the parts' MD5s with ``-<parts>``."""
    digests = []
    with open(path, "rb") as f:
        while chunk := f.read(part_bytes):
            digests.append(hashlib.md5(chunk).digest())
    if len(digests) <= 1:
        return digests[0].hex() if digests else hashlib.md5(b"").hexdigest()
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


def _at_risk(local: Path, stored: dict | None, part_bytes: int) -> str | None:
    """Why the local file is not safe in the storage (None when it is)."""
    if stored is None:
        return "not in the storage"
    if stored["Size"] != local.stat().st_size:
        return f"stored with another size ({stored['Size']} bytes, here {local.stat().st_size})"
    if s3_etag(local, part_bytes) != stored["ETag"].strip('"'):
        return "stored with other content (checksum differs)"
    return None


def _incomplete(marks: Path) -> list[str]:
    """Outputs Snakemake marked incomplete (a job running, or cut off): its markers are the output
    paths in URL-safe base64, split into parts of a file name's length."""
    found = []
    for mark in sorted(marks.rglob("*")) if marks.is_dir() else []:
        if mark.is_file() and mark.name != "migration_underway":
            encoded = "".join(part.lstrip("@") for part in mark.relative_to(marks).parts)
            try:
                found.append(urlsafe_b64decode(encoded).decode())
            except ValueError:
                found.append(str(mark))
    return found


# The log of the safe_to_destroy rule: what the check printed, which no run needs back.
CHECK_LOG = "logs/safe_to_destroy.log"


def safe_to_destroy(workdir: Path, output_dir: str, prefix: str | None, skip=(),
                    part_bytes: int = 8 * 1024 * 1024) -> dict:
    """What would be lost if this machine vanished now, for a run whose outputs go to ``prefix``
    (None: a run without storage, whose every output is only here): every file of ``output_dir``
    here (outputs of a local run, and Snakemake's local copies of stored ones) that the storage
    lacks or holds with another size or checksum, resume files of generate jobs included, and the
    outputs a snakemake run marked incomplete (a job running, or cut off). ``skip``: files of the
    job asking (its own log and outputs, written and uploaded after it looks).
    Returns ``{"prefix", "files": [(path, bytes, why)], "incomplete": [paths], "bytes": n, "safe": bool}``."""
    workdir = Path(workdir)
    # a stored output's incomplete marker names its s3:// URL, its file the local copy
    skipped = {os.path.abspath(p) for p in skip} | {storage_url(p) for p in skip} - {None}
    stored: dict[str, dict] = {}
    places = [(workdir / output_dir, output_dir)]
    if prefix:
        bucket, key_root = stored_root(prefix, output_dir)
        base = split_s3(prefix)[1]
        stored = {o["Key"]: o for o in list_objects(f"s3://{bucket}/{base}")}
        places = [(workdir / output_dir, key_root),
                  (workdir / ".snakemake" / "storage" / "s3" / bucket / key_root, key_root)]
    files = []
    for root, key_root in places:
        if not root.is_dir():
            continue
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            relative = path.relative_to(root).as_posix()
            if (path.name.endswith(".lock") or path.name == ".snakemake_timestamp" or os.path.abspath(path) in skipped
                    or relative == CHECK_LOG or relative.startswith(f"{CURVES_DIR}/")):
                # empty markers, never outputs; the asking job's files; what this check logged; the
                # live curves (a view of train_log.jsonl and the eval JSON, which the storage holds)
                continue
            key = f"{key_root}/{relative}"
            why = _at_risk(path, stored.get(key), part_bytes) if prefix else "no storage: this run writes only here"
            if why:
                # an output_dir outside the workdir (output_dir: /scratch/results) is named as it is
                files.append((str(path.relative_to(workdir) if path.is_relative_to(workdir) else path),
                              path.stat().st_size, why))
    incomplete = [p for p in _incomplete(workdir / ".snakemake" / "incomplete")
                  if p not in skipped and os.path.abspath(workdir / p) not in skipped]
    total = sum(size for _, size, _ in files)
    return {"prefix": prefix, "files": files, "incomplete": incomplete, "bytes": total,
            "safe": not files and not incomplete}


def destroy_verdict(found: dict, where: str) -> tuple[list[str], str]:
    """What ``safe_to_destroy`` found, as lines to print (one per file or job at risk), and the
    verdict: "... safe to destroy" or "NOT safe to destroy: ..." with the fix."""
    lines = [f"only here: {path} ({human_bytes(size)}): {why}" for path, size, why in found["files"]]
    lines += [f"incomplete (a job running, or cut off): {path}" for path in found["incomplete"]]
    if found["safe"]:
        held = f"every output of {where} is in {found['prefix']}" if found["prefix"] else f"{where} holds nothing"
        return lines, f"{held}: safe to destroy"
    fix = (f"let the run finish (or re-run snakemake with --default-storage-prefix {found['prefix']}), then check again"
           if found["prefix"] else "run with --default-storage-provider s3 --default-storage-prefix s3://... "
           "(docs/storage.md: running on rented machines), or copy results/ off this machine")
    return lines, (f"NOT safe to destroy: {len(found['files'])} file(s), {human_bytes(found['bytes'])}, only on this "
                   f"machine; {len(found['incomplete'])} incomplete job output(s). {fix[0].upper()}{fix[1:]}")


def safe_to_destroy_job(config: dict, workdir: Path, prefix: str | None) -> None:
    """``snakemake safe_to_destroy`` and ``dflash safe-to-destroy``: every file of the run that only
    this machine holds, then the verdict; exit 1 when it is not safe."""
    found = safe_to_destroy(workdir, config["output_dir"], prefix)
    lines, verdict = destroy_verdict(found, str(Path(workdir).resolve() / config["output_dir"]))
    if job_console():  # a rule's job: the answer is its whole point, on the console as well as in its log
        to_console("\n".join(lines + [verdict]))
        if not found["safe"]:
            raise SystemExit(1)
    else:
        print("\n".join(lines + ([verdict] if found["safe"] else [])))
        if not found["safe"]:
            raise SystemExit(verdict)
