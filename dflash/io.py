"""Shard I/O: zstd JSONL records and atomic writes.

Every stage writes through ``atomic_path``: the data goes to a temp file beside the target and is
renamed into place only when complete, so a killed job never leaves a file that looks finished.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

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


def write_jsonl_zst(path: str | os.PathLike, records: Iterable[dict], level: int = 3) -> int:
    """Write records as zstd JSONL, atomically. Returns the number of records written."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as raw:
        with zstandard.ZstdCompressor(level=level).stream_writer(raw) as out:
            for rec in records:
                out.write(json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n")
                n += 1
    return n


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a JSONL file, zstd-compressed when the name ends in ``.zst``.

    A line that is not JSON raises ``ValueError`` naming the file and line number.
    """
    path = Path(path)
    if path.suffix == ".zst":
        import io

        raw = open(path, "rb")
        stream = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
    else:
        raw = None
        stream = open(path, encoding="utf-8")
    try:
        for lineno, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    finally:
        stream.close()
        if raw is not None:
            raw.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return list(iter_jsonl(path))


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def read_json(path: str | os.PathLike):
    return json.loads(Path(path).read_text(encoding="utf-8"))
