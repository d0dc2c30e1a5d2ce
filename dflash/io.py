"""Shard I/O: zstd JSONL records and atomic writes.

Every stage writes through ``atomic_path``: the data goes to a temp file beside the target and is
renamed into place only when complete, so a killed job never leaves a file that looks finished.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

import zstandard

SHARD_RE = re.compile(r"shard-(\d{5})\.jsonl\.zst$")


def shard_name(index: int, suffix: str = ".jsonl.zst") -> str:
    return f"shard-{index:05d}{suffix}"


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path in the target's folder; rename it onto ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp folder beside ``path``; swap it into place on success."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


@contextmanager
def jsonl_zst_writer(path: str | os.PathLike, level: int = 3) -> Iterator[Callable[[bytes], int]]:
    """``write(line)`` for a zstd JSONL file that appears at ``path`` only when the block succeeds."""
    with atomic_path(path) as tmp, open(tmp, "wb") as raw:
        with zstandard.ZstdCompressor(level=level).stream_writer(raw) as out:
            yield out.write


def dumps_line(rec: dict) -> bytes:
    return json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n"


def write_jsonl_zst(path: str | os.PathLike, records: Iterable[dict], level: int = 3) -> int:
    """Write records as zstd JSONL, atomically. Returns the number of records written."""
    n = 0
    with jsonl_zst_writer(path, level) as write:
        for rec in records:
            write(dumps_line(rec))
            n += 1
    return n


def with_field(line: bytes, rec: dict, key: str, value) -> bytes:
    """The JSONL line of ``rec`` with ``key`` set to ``value``. Spliced into the original line when
    the key is new: re-encoding long texts would cost more than judging them."""
    if key in rec:
        return dumps_line({**rec, key: value})
    close = line.rfind(b"}")
    return b"".join((line[:close], b", " if rec else b"", json.dumps(key).encode(), b": ",
                     json.dumps(value, ensure_ascii=False).encode("utf-8"), b"}\n"))


def _without_arrays(line: bytes, keys: tuple[bytes, ...]) -> bytes:
    """The line with the given keys' flat arrays cut out. ``json.dumps`` escapes every quote inside
    strings, so ``, "key": [`` occurs only as a real key; its array of numbers ends at the next ``]``."""
    for key in keys:
        start = line.find(key)
        if start >= 0:
            end = line.find(b"]", start + len(key))
            if end >= 0:
                line = line[:start] + line[end + 1:]
    return line


def iter_jsonl_lines(path: str | os.PathLike, skip_arrays: tuple[str, ...] = ()) -> Iterator[tuple[bytes, dict]]:
    """(raw line, record) of a JSONL file, zstd-compressed when the name ends in ``.zst``.

    ``skip_arrays``: top-level keys holding flat arrays of numbers (token ids) that the reader does
    not need: left out of the record, unparsed (most of a completion line's parse time), and kept
    in the raw line. A line that is not a JSON object raises ``ValueError`` naming the file and line.
    """
    keys = tuple(f', "{k}": ['.encode() for k in skip_arrays)
    path = Path(path)
    with open(path, "rb") as raw:
        stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), 1 << 20) \
            if path.suffix == ".zst" else raw
        for lineno, line in enumerate(stream, 1):
            if line.isspace():  # not strip(): that would copy every long line
                continue
            try:
                try:
                    rec = json.loads(_without_arrays(line, keys) if keys else line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    rec = json.loads(line)  # a cut in the wrong place cannot lose a record, only time
                    for k in skip_arrays:
                        rec.pop(k, None)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({getattr(e, 'msg', e)})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: a JSON {type(rec).__name__} where a record object belongs")
            yield line, rec


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a JSONL file, zstd-compressed when the name ends in ``.zst``."""
    for _, rec in iter_jsonl_lines(path):
        yield rec


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return list(iter_jsonl(path))


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def local_copy(path: str | os.PathLike) -> Iterator[Path]:
    """A local path for ``path``: itself, or for ``s3://bucket/key`` a temp copy (boto3; endpoint
    and keys from the usual AWS variables, e.g. ``AWS_ENDPOINT_URL`` for MinIO or moto)."""
    if not str(path).startswith("s3://"):
        if not Path(path).exists():
            raise FileNotFoundError(f"{path}: no such file")
        yield Path(path)
        return
    try:
        import boto3
        from botocore.exceptions import ClientError
    except ImportError:
        raise ValueError(f"{path}: reading s3:// needs boto3 (pip install 'dflash-pipeline[s3]')") from None
    bucket, _, key = str(path).removeprefix("s3://").partition("/")
    with tempfile.TemporaryDirectory(prefix="dflash-s3-") as tmp:
        local = Path(tmp) / Path(key).name
        try:
            boto3.client("s3").download_file(bucket, key, str(local))
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in ("404", "NoSuchKey", "NoSuchBucket"):
                raise FileNotFoundError(f"{path}: no such object") from None
            raise ValueError(f"{path}: S3 error {code}: {e}") from None
        yield local


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as disks and clouds bill)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.1f} {unit}"
        n /= 1000


def read_json(path: str | os.PathLike):
    return json.loads(Path(path).read_text(encoding="utf-8"))
