"""Shard I/O: zstd JSONL records and atomic writes.

Every stage writes through ``atomic_path``: the data goes to a temp file beside the target and is
renamed into place only when complete, so a killed job never leaves a file that looks finished.
Every zstd frame carries a checksum and is read to its end: a cut or damaged shard is an error
naming the file, never a shorter shard.
"""
from __future__ import annotations

import codecs
import errno
import fnmatch
import hashlib
import io
import json
import math
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


class DiskFull(OSError):
    """No space left for a file being written; the message names it."""

    def __init__(self, path: Path):
        super().__init__(errno.ENOSPC, "no space left on device while writing it; free space there (or set "
                                       "output_dir to a larger disk) and re-run", str(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def _no_space(e: BaseException) -> bool:
    """Whether ``e`` is a full disk or quota, however the writer reports it (safetensors and torch
    wrap the OS error in their own, or raise their own while cleaning up after it: torch's writer
    then says "unexpected pos", the OSError in its context)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "StorageFull" in str(e):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


@contextmanager
def naming_full_disk(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise a full disk met inside the block as a ``DiskFull`` naming ``path``."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:
        if _no_space(e):
            raise DiskFull(Path(path)) from e
        raise


def umask() -> int:
    """The process's umask, read without changing it where /proc tells it."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_beside(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def _put_in_place(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` onto ``path``, with the mode a plain ``open()`` would have given it, set just
    before: ``mkstemp`` makes it private to its owner, and so do writers that replace the file
    rather than write into it (``safetensors.save_file`` renames its own 0600 temp file onto the
    path it is given)."""
    os.chmod(tmp, 0o666 & ~umask())
    try:
        os.replace(tmp, path)
    except OSError as e:  # named by the output, not by the temp file the user never asked for
        raise OSError(e.errno, f"{e.strerror}: cannot put the finished file there", str(path)) from None


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path in the target's folder; rename it onto ``path`` on success."""
    path = Path(path)
    tmp = _temp_beside(path)
    try:
        with naming_full_disk(path):
            yield tmp
            _put_in_place(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_files(*paths: str | os.PathLike) -> Iterator[list[Path]]:
    """Temp paths for outputs that belong together (a shard and its summary): the caller writes and
    closes all of them inside the block, and they are renamed into place only after it, so a
    failure (a full disk while the last one is flushed) leaves none of them, never one alone that
    looks finished. Only the writer knows which file a full disk stopped: it names it
    (``zst_lines``' ``shown``, ``naming_full_disk``)."""
    paths, temps = [Path(p) for p in paths], []
    try:
        temps.extend(_temp_beside(p) for p in paths)
        yield temps
        for tmp, path in zip(temps, paths):
            _put_in_place(tmp, path)
    finally:
        for tmp in temps:
            if tmp.exists():
                tmp.unlink()


# Written into every folder a stage replaces as a whole (the prompts, the demo target, a drafter
# checkpoint): what wrote it and what it holds. A folder is replaced only when it is empty or holds
# nothing but what its mark lists, so an --out slip or a run name like ".." never deletes a
# user's files or another stage's outputs.
OUTPUT_MARK = ".dflash-output.json"
# What others put into such a folder that is no user's: the time Snakemake gives a folder output.
_ANY_OUTPUT_HOLDS = {OUTPUT_MARK, ".snakemake_timestamp"}
# Folders of these kinds written before they carried a mark: recognised by the files they need
# and the names they may hold.
_UNMARKED = {
    "prompts": ({"manifest.json", "ids.tsv"}, ("manifest.json", "ids.tsv", "heldout.jsonl.zst", "shard-*.jsonl.zst")),
    "target": ({"config.json", "build_summary.json"},
               ("*.json", "*.jinja", "*.safetensors", "*.txt", "*.model", "*.py")),
    "checkpoint": ({"config.json", "model.safetensors", "trainer_state.json"},
                   ("config.json", "model.safetensors", "trainer_state.json", "train_log.jsonl")),
}


def replace_problem(path: str | os.PathLike, kind: str) -> str | None:
    """Why the folder ``path`` must not be replaced by a new ``kind`` output, or None when it may:
    absent, empty, or this kind's own earlier output holding nothing else."""
    path = Path(os.path.abspath(path))
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_dir():
        return f"{path} exists and is not a folder this stage wrote: choose another output path, or remove it yourself"
    entries = {p.name for p in path.iterdir()} - (_ANY_OUTPUT_HOLDS - {OUTPUT_MARK})
    if not entries:
        return None
    if OUTPUT_MARK in entries:
        try:
            mark = json.loads((path / OUTPUT_MARK).read_text(encoding="utf-8"))
            ours, allowed = mark["kind"] == kind, set(mark["entries"]) | _ANY_OUTPUT_HOLDS
        except (OSError, ValueError, KeyError, TypeError):
            ours = False
        other = sorted(entries - allowed) if ours else []
    else:
        needed, patterns = _UNMARKED.get(kind, (None, ()))
        ours = needed is not None and needed <= entries
        other = sorted(e for e in entries if not any(fnmatch.fnmatch(e, p) for p in patterns)) if ours else []
    if not ours:
        return (f"{path} holds files that are not a {kind} output of this pipeline ({_some(entries)}); nothing "
                f"was touched: choose another output path, or move them away yourself")
    if other:
        return (f"{path} is an earlier {kind} output, but also holds {_some(set(other))}, which it did not write; "
                f"nothing was touched: move them away, then re-run")
    return None


def _some(names: set[str], shown: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


@contextmanager
def atomic_dir(path: str | os.PathLike, kind: str) -> Iterator[Path]:
    """Yield a new temp folder beside ``path``; put it in place of ``path`` on success, marked as
    a ``kind`` output. An existing ``path`` is replaced only when ``replace_problem`` allows it,
    checked before the work (so a slip fails in a second, not after hours) and again at the swap."""
    path = Path(os.path.abspath(path))
    if problem := replace_problem(path, kind):
        raise FileExistsError(problem)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp's folder is private to its owner
    try:
        with naming_full_disk(path):
            yield tmp
            mask = umask()
            for p in tmp.rglob("*"):  # as open() would make them: writers that rename their own temp file leave 0600
                os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
            entries = sorted(p.name for p in tmp.iterdir())
            (tmp / OUTPUT_MARK).write_text(json.dumps({"kind": kind, "entries": entries}) + "\n", encoding="utf-8")
        if problem := replace_problem(path, kind):
            raise FileExistsError(problem)
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / path.name)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


@contextmanager
def jsonl_zst_writer(path: str | os.PathLike, level: int = 3) -> Iterator[Callable[[bytes], int]]:
    """``write(line)`` for a zstd JSONL file that appears at ``path`` only when the block succeeds."""
    with atomic_path(path) as tmp, zst_lines(tmp, level, shown=path) as write:
        yield write


@contextmanager
def zst_lines(path: Path, level: int = 3, shown: str | os.PathLike | None = None) -> Iterator[Callable[[bytes], int]]:
    """``write(line)`` into a new zstd file at ``path`` (a temp path of ``atomic_path`` or
    ``atomic_files``), complete when the block ends; a full disk is named ``shown`` (the output the
    temp file becomes), whichever of several open writers met it."""
    shown = Path(shown or path)
    # The close is named too: after a failed flush, closing the file flushes again, and that bare
    # [Errno 28] would replace the DiskFull the flush raised.
    with naming_full_disk(shown), open(path, "wb") as raw:
        out = zstandard.ZstdCompressor(level=level, write_checksum=True).stream_writer(raw, closefd=False)
        put = out.write

        def write(line: bytes) -> int:
            try:
                return put(line)
            except Exception as e:
                if _no_space(e):
                    raise DiskFull(shown) from e
                raise

        yield write
        with naming_full_disk(shown):
            out.close()
            raw.flush()


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


class _ZstdCut(Exception):
    pass


class CheckedZstdReader(io.RawIOBase):
    """The decompressed bytes of every frame of a zstd file, each frame read to its end.

    ``ZstdDecompressor.stream_reader`` reads a file cut inside a frame as a shorter file, without
    a word; this reader raises ``_ZstdCut`` instead, and ``ZstdError`` for data that is not zstd or
    fails a frame's checksum."""

    CHUNK = 1 << 20
    # Compressed bytes per read: what one read holds decompressed is this times the ratio, which
    # for a source repeating the same text in every record (tool definitions) reaches 10,000x:
    # 45 MB at 4 KB, 126 MB at 16 KB. Reads this small cost no measurable time.
    READ = 1 << 12

    def __init__(self, raw):
        self.raw = raw
        self.frame = None  # the frame being decompressed; None between frames
        self.frames = 0
        self.out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self.out:
            chunk = self.raw.read(self.READ)
            if not chunk:
                if self.frame is not None or not self.frames:
                    raise _ZstdCut()
                return 0
            self.out = memoryview(self._decompress(chunk))
        n = min(len(buf), len(self.out))
        buf[:n] = self.out[:n]
        self.out = self.out[n:]
        return n

    def _decompress(self, data: bytes) -> bytes:
        parts = []
        while data:
            if self.frame is None:
                self.frame = _DECOMPRESSOR.decompressobj(write_size=self.CHUNK)
                self.frames += 1
            parts.append(self.frame.decompress(data))
            data = b""
            if self.frame.eof:  # a next frame (concatenated files) starts in what is left
                data, self.frame = self.frame.unused_data, None
        return b"".join(parts)


_DECOMPRESSOR = zstandard.ZstdDecompressor()


# What to do about a damaged file, true whoever wrote it: a reader cannot tell a user's source
# from one of the pipeline's outputs.
REWRITE = "write or copy it again (a file the pipeline wrote: delete it and re-run the rule that writes it)"


def _stream_fault(path: Path, fault: Exception, records: int) -> ValueError:
    """One line for a zstd stream that cannot be read to its end."""
    if isinstance(fault, _ZstdCut):
        return ValueError(f"{path}: truncated zstd stream ({records} records read before the cut); the file is "
                          f"incomplete (an interrupted copy or write): {REWRITE}")
    if "Unknown frame descriptor" in str(fault) and not records:
        return ValueError(f"{path}: not a zstd file (a .zst name needs zstd-compressed JSONL; rename a plain "
                          f"JSONL file to .jsonl)")
    return ValueError(f"{path}: corrupt zstd stream ({fault}; {records} records read before the damage): {REWRITE}")


def _refuse_gzip(path: Path, raw) -> None:
    """A gzip file read as JSONL or zstd would be "not valid JSON (0x8b)" or "not a zstd file"."""
    if raw.peek(2)[:2] == b"\x1f\x8b":
        raise ValueError(f"{path}: gzip-compressed, and gzip is not supported: recompress it with zstd "
                         f"(.jsonl.zst) or decompress it to plain .jsonl")


def check_zstd(path: str | os.PathLike) -> int:
    """Read a zstd file to its end without parsing it: its number of lines, or the error every
    reader would raise. For readers that print as they go (``dflash inspect``)."""
    path, lines = Path(path), 0
    with open(path, "rb") as raw:
        _refuse_gzip(path, raw)
        reader = CheckedZstdReader(raw)
        try:
            while chunk := reader.read(1 << 20):
                lines += chunk.count(b"\n")
        except (_ZstdCut, zstandard.ZstdError) as e:
            raise _stream_fault(path, e, lines) from None
    return lines


def iter_jsonl_lines(path: str | os.PathLike, skip_arrays: tuple[str, ...] = (), max_line_bytes: int | None = None,
                     skipped: Callable[[int, str, str], None] | None = None) -> Iterator[tuple[bytes, dict]]:
    """(raw line, record) of a JSONL file: :func:`numbered_jsonl_lines` without the line numbers."""
    for _, line, rec in numbered_jsonl_lines(path, skip_arrays, max_line_bytes, skipped):
        yield line, rec


def numbered_jsonl_lines(path: str | os.PathLike, skip_arrays: tuple[str, ...] = (), max_line_bytes: int | None = None,
                         skipped: Callable[[int, str, str], None] | None = None) -> Iterator[tuple[int, bytes, dict]]:
    """(line number from 1, raw line, record) of a JSONL file, zstd-compressed when the name ends
    in ``.zst`` (blank lines are passed over, and counted).

    ``skip_arrays``: top-level keys holding flat arrays of numbers (token ids) that the reader does
    not need: left out of the record, unparsed (most of a completion line's parse time), and kept
    in the raw line. A line that is not a JSON object raises ``ValueError`` naming the file and line;
    so does a zstd file that is cut, damaged or not zstd at all, once the records before the damage
    are read (a consumer writing through ``atomic_path`` then writes nothing).

    ``max_line_bytes``: a longer line is read past in bounded pieces, never held whole (a 98 KB
    zstd source can be one 3 GB line). Such a line, and one nested too deeply for ``json`` to parse
    (``RecursionError``), is passed to ``skipped(line number, reason code, detail)`` and left out
    when the caller gives it; else it is a ``ValueError`` naming the file and line.
    """
    path = Path(path)
    records = 0
    with open(path, "rb") as raw:
        _refuse_gzip(path, raw)
        if path.suffix != ".zst":
            yield from _parse_lines(path, raw, skip_arrays, max_line_bytes, skipped)
            return
        try:
            for item in _parse_lines(path, io.BufferedReader(CheckedZstdReader(raw), 1 << 20), skip_arrays,
                                     max_line_bytes, skipped):
                yield item
                records += 1
        except (_ZstdCut, zstandard.ZstdError) as e:
            raise _stream_fault(path, e, records) from None


def _bounded_lines(stream, limit: int | None) -> Iterator[bytes | None]:
    """The stream's lines; None for a line over ``limit`` bytes (its newline not counted), which
    is read past a megabyte at a time."""
    if limit is None:
        yield from stream
        return
    while line := stream.readline(limit + 1):
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := stream.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield None
        else:
            yield line


# Nesting no JSON record of ours needs, and well inside what Python's recursion limit lets json,
# jsonschema and the recursive walks over a record (templates, text scans) go through.
MAX_JSON_DEPTH = 64


def deeper_than(value, depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether a parsed JSON value nests lists and objects more than ``depth`` levels (found
    without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level > depth:
                return True
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


def _unreadable(path: Path, lineno: int, skipped: Callable[[int, str, str], None] | None, code: str,
                detail: str) -> None:
    if skipped is None:
        raise ValueError(f"{path}:{lineno}: {detail}")
    skipped(lineno, code, detail)


def _parse_lines(path: Path, stream, skip_arrays: tuple[str, ...], max_line_bytes: int | None = None,
                 skipped: Callable[[int, str, str], None] | None = None) -> Iterator[tuple[int, bytes, dict]]:
    keys = tuple(f', "{k}": ['.encode() for k in skip_arrays)
    for lineno, line in enumerate(_bounded_lines(stream, max_line_bytes), 1):
        if line is None:
            _unreadable(path, lineno, skipped, "line_too_long", f"a line longer than {max_line_bytes:,} bytes")
            continue
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
        except RecursionError:
            _unreadable(path, lineno, skipped, "too_deep", "lists or objects nested too deeply for a JSON parser")
            continue
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: a JSON {type(rec).__name__} where a record object belongs")
        yield lineno, line, rec


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a JSONL file, zstd-compressed when the name ends in ``.zst``."""
    for _, rec in iter_jsonl_lines(path):
        yield rec


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return list(iter_jsonl(path))


def json_text(obj, path: str | os.PathLike | None = None, indent: int | None = 2) -> str:
    """A JSON document as every stage writes one (summaries, indexes, QA reports; ``indent=None``:
    one line). A number JSON cannot hold (NaN, an infinity) is an error naming where it is (in the
    file ``path``): ``json`` would write a bare ``NaN``, which strict readers refuse and others read
    as a number, so a diverged value would pass on unseen. Where a value is undefined, write None."""
    try:
        return json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False) + "\n"
    except ValueError:
        where, value = _nonfinite_at(obj) or ("a value", "not finite")
        raise ValueError(f"{path or 'a JSON document'}: not written: {where} is {value}, a number JSON cannot "
                         f"hold (an internal error: a stage let a diverged value through; report it)") from None


def _nonfinite_at(obj, where: str = "") -> tuple[str, float] | None:
    """The first non-finite float in ``obj`` and where (``final_loss``, ``windows[3].loss``)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "the document", obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        if found := _nonfinite_at(value, f"{where}[{key}]" if isinstance(key, int) else
                                  f"{where}.{key}" if where else str(key)):
            return found
    return None


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json_text(obj, path), encoding="utf-8")


def read_json(path: str | os.PathLike):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8-sig"))  # a BOM, as some editors save, is no error
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg}): {REWRITE}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text, so not a JSON file: {REWRITE}") from None


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read a megabyte at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# Prompt sources as datasets are published: JSON Lines, one JSON array (ShareGPT's dumps), or
# Parquet (most Hugging Face datasets); JSON Lines and arrays optionally zstd-compressed.
SOURCE_CONTAINERS = ("jsonl", "json_array", "parquet")
_SNIFF_BYTES = 1 << 16
# What a file that is none of them usually is, by its first bytes: named, so the fix is plain.
_NOT_A_SOURCE = ((b"PK\x03\x04", "a zip archive: unzip it"), (b"BZh", "bzip2-compressed: recompress it with zstd"),
                 (b"\xfd7zXZ", "xz-compressed: recompress it with zstd"),
                 (b"version https://git-lfs", "a Git LFS pointer, not the data: fetch it with git lfs pull"),
                 (b"<", "HTML or XML (an error page saved in place of the file?)"))


def source_container(path: str | os.PathLike) -> str:
    """Which of ``SOURCE_CONTAINERS`` a source file is, from its first bytes (after zstd when the
    name ends in ``.zst``): ``PAR1`` Parquet, ``[`` one JSON array, ``{`` (or nothing) JSON Lines.
    Anything else is a ``ValueError`` naming what the file is."""
    path = Path(path)
    with open(path, "rb") as raw:
        _refuse_gzip(path, raw)
        head = raw.peek(4)[:4]
        if head == b"PAR1":
            return "parquet"
        if path.suffix == ".parquet":
            raise ValueError(f"{path}: not a Parquet file (it does not start with PAR1): {REFETCH}")
        if path.suffix == ".zst":
            try:
                head = io.BufferedReader(CheckedZstdReader(raw), _SNIFF_BYTES).peek(_SNIFF_BYTES)
            except (_ZstdCut, zstandard.ZstdError) as e:
                raise _stream_fault(path, e, 0) from None
        else:
            head = raw.peek(_SNIFF_BYTES)
    first = head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1]
    if first in (b"[",):
        return "json_array"
    if first in (b"{", b""):
        return "jsonl"
    what = next((w for magic, w in _NOT_A_SOURCE if head.startswith(magic)), None)
    raise ValueError(f"{path}: not JSON Lines, a JSON array or Parquet: "
                     + (what or f"it starts with {head.lstrip()[:24]!r}"))


def source_records(path: str | os.PathLike, max_record_bytes: int | None = None,
                   skipped: Callable[[str, str, str], None] | None = None) -> Iterator[tuple[str, dict]]:
    """(position, record) of a prompt source file of any of ``SOURCE_CONTAINERS``, streamed:
    memory holds one record (or one Parquet batch), never the file. The position follows the
    file's name in messages: ``:12`` (a JSON Lines line), ``: element 3 (line 40)`` (of an array),
    ``: row 7`` (Parquet, from 1).

    A record longer than ``max_record_bytes`` (``line_too_long``) or nested too deeply
    (``too_deep``) is read past and passed to ``skipped(position, code, detail)``, as in
    :func:`numbered_jsonl_lines`. A file cut short (an array with no closing ``]``, a zstd stream
    cut inside a frame, a Parquet file with no footer) is a ``ValueError`` saying so."""
    path = Path(path)
    container = source_container(path)
    if container == "parquet":
        yield from _parquet_rows(path)
        return
    if container == "jsonl":
        by_line = skipped and (lambda lineno, code, detail: skipped(f":{lineno}", code, detail))
        for lineno, _, rec in numbered_jsonl_lines(path, (), max_record_bytes, by_line):
            yield f":{lineno}", rec
        return
    records = 0
    with open(path, "rb") as raw:
        if path.suffix != ".zst":
            yield from _JsonArray(path, raw, max_record_bytes, skipped).records()
            return
        try:
            for item in _JsonArray(path, io.BufferedReader(CheckedZstdReader(raw), 1 << 20), max_record_bytes,
                                   skipped).records():
                yield item
                records += 1
        except (_ZstdCut, zstandard.ZstdError) as e:
            raise _stream_fault(path, e, records) from None


_JSON = json.JSONDecoder()
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_STRUCTURE = re.compile(r'["\[\]{}]')  # what moves the depth outside strings
_STRING_END = re.compile(r'["\\]')
_SKIPPED = object()
REFETCH = "download or copy it again"  # a source is the user's file, cut or damaged on its way here


class _JsonArray:
    """The elements of one top-level JSON array, decoded one at a time from a sliding window of
    the text (``json.JSONDecoder.raw_decode``): the window holds the element being read and at
    most a read's worth more, however long the array."""

    READ = 1 << 20

    def __init__(self, path: Path, stream, limit: int | None, skipped: Callable[[str, str, str], None] | None):
        self.path, self.stream, self.limit, self.skipped = path, stream, limit, skipped
        self.text = codecs.getincrementaldecoder("utf-8-sig")()
        self.buf, self.pos, self.eof = "", 0, False
        self.line, self.counted = 1, 0  # the line of buf[counted]: newlines are counted once, as pos moves on

    def _line_at(self, pos: int) -> int:
        self.line += self.buf.count("\n", self.counted, pos)
        self.counted = pos
        return self.line

    def _more(self) -> bool:
        """Append the next read to the window, dropping what is consumed; False at the end."""
        if self.eof:
            return False
        # reads grow with the element being read: a long one is decoded a few times, not once per megabyte
        data = self.stream.read(max(self.READ, len(self.buf) - self.pos))
        try:
            text = self.text.decode(data, final=not data)
        except UnicodeDecodeError:
            raise ValueError(f"{self.path}:{self._line_at(len(self.buf))}: not UTF-8 text (JSON is UTF-8): "
                             f"re-encode it") from None
        self.eof = not data
        self._line_at(self.pos)
        self.buf, self.counted, self.pos = self.buf[self.pos:] + text, 0, 0
        return bool(data)

    def _peek(self) -> str | None:
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more():
                return None

    def records(self) -> Iterator[tuple[str, dict]]:
        if self._peek() is None:
            return  # an empty file: no records
        self.pos += 1  # the "[" source_container saw
        n = 0
        if self._peek() == "]":
            self.pos += 1
        else:
            while True:
                if self._peek() is None:
                    raise ValueError(f"{self.path}: ends after element {n} and a comma: the array is cut off (an "
                                     f"interrupted download?): {REFETCH}")
                n += 1
                line = self._line_at(self.pos)
                where = f": element {n} (line {line})"
                value = self._element(n, line)
                if value is not _SKIPPED:
                    if not isinstance(value, dict):
                        raise ValueError(f"{self.path}{where}: a JSON {type(value).__name__} where a record object "
                                         f"belongs")
                    yield where, value
                c = self._peek()
                if c == ",":
                    self.pos += 1
                    continue
                if c == "]":
                    self.pos += 1
                    break
                if c is None:
                    raise ValueError(f"{self.path}: ends after element {n} without the closing ]: the array is cut "
                                     f"off (an interrupted download?): {REFETCH}")
                raise ValueError(f"{self.path}:{self._line_at(self.pos)}: not valid JSON after element {n} "
                                 f"(expecting ',' or ']', found {c!r})")
        if self._peek() is not None:
            raise ValueError(f"{self.path}:{self._line_at(self.pos)}: more text after the array's closing ] "
                             f"(JSON Lines whose records are arrays? each record must be an object)")

    def _element(self, n: int, line: int):
        """Element n (starting on ``line``) at pos, decoded, with pos past it; ``_SKIPPED`` when it
        is too long or too deep."""
        while True:
            try:
                value, end = _JSON.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                # What more text may complete: an open string, or an error at the window's end (a
                # cut \\uXXXX escape is up to 6 characters before it; at the file's end, at the end).
                end = len(self.buf.rstrip()) if self.eof else len(self.buf) - 6
                if not (e.msg.startswith("Unterminated string") or e.pos >= end):
                    raise ValueError(f"{self.path}:{self._line_at(e.pos)}: element {n} is not valid JSON "
                                     f"({e.msg})") from None
                if self.eof:
                    raise ValueError(_cut_array(self.path, n, line)) from None
                if self.limit is not None and len(self.buf) - self.pos > self.limit:
                    return self._skip(n, line, "line_too_long", f"an element longer than {self.limit:,} bytes")
                self._more()  # at the end, once more: the error then says what it is
                continue
            except RecursionError:
                return self._skip(n, line, "too_deep", "lists or objects nested too deeply for a JSON parser")
            if self.limit is not None and end - self.pos > self.limit:
                return self._skip(n, line, "line_too_long", f"an element longer than {self.limit:,} bytes")
            self.pos = end
            return value

    def _skip(self, n: int, line: int, code: str, detail: str):
        """Read past element n at pos without decoding it (its brackets and strings only),
        holding a read's worth at a time."""
        where = f": element {n} (line {line})"
        if self.skipped is None:
            raise ValueError(f"{self.path}{where}: {detail}")
        self.skipped(where, code, detail)
        depth, in_string, i = 0, False, self.pos
        while True:
            m = (_STRING_END if in_string else _STRUCTURE).search(self.buf, i)
            escape_cut = m is not None and m.group() == "\\" and m.end() == len(self.buf)
            if m is None or escape_cut:
                self.pos = len(self.buf)
                if not self._more():
                    raise ValueError(_cut_array(self.path, n, line))
                i = 1 if escape_cut else 0  # the window now starts at the unread text (after a cut escape: its character)
                continue
            c, i = m.group(), m.end()
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = not in_string
            elif c in "[{":
                depth += 1
            else:
                depth -= 1
            if depth == 0 and not in_string:
                self.pos = i
                return _SKIPPED


def _cut_array(path: Path, n: int, line: int) -> str:
    return (f"{path}: ends inside element {n} (line {line}): the array is cut off (an interrupted download?): "
            f"{REFETCH}")


PARQUET_BATCH_ROWS = 256  # rows decoded at once: a batch of long conversations stays a few MB


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """Rows of a Parquet file as records, a batch at a time (a row group is not held whole)."""
    import pyarrow  # heavy: Parquet sources only
    import pyarrow.parquet as pq  # heavy: Parquet sources only

    row = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for rec in batch.to_pylist():
                row += 1
                yield f": row {row}", rec
    except (pyarrow.ArrowException, OSError) as e:
        cut = "magic bytes not found in footer" in str(e)  # no footer: the file stops short
        raise ValueError(f"{path}: " + (f"the Parquet file is cut off (no footer; an interrupted download?)"
                                        if cut else f"not readable as Parquet after {row} rows ({e})")
                         + f": {REFETCH}") from None
