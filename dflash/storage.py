"""Outputs in a Snakemake default storage (``--default-storage-provider s3``): what the workflow
must read itself, outside a job, from where the outputs live."""
from __future__ import annotations

from pathlib import Path


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
    from dflash.io import s3_problem

    bucket = prefix.removeprefix("s3://").split("/")[0]
    client = s3_resource.meta.client
    try:
        client.head_bucket(Bucket=bucket)
    except Exception as e:
        return s3_problem(prefix, e, endpoint=client.meta.endpoint_url)
    return None
