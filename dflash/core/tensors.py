"""safetensors files (tokenized rows, hidden-state shards, checkpoints): read with errors that
name the file, written with a header whose bytes are the same on every run."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Iterable, Iterator

from safetensors import SafetensorError, safe_open

from dflash.core.io import REWRITE


@contextmanager
def open_safetensors(path: str | os.PathLike, needs: Iterable[str] = (), what: str = "") -> Iterator:
    """``safe_open`` of one of the pipeline's safetensors files (a shard, a checkpoint's or a model's
    weights): one that is cut or damaged, or lacks the tensors ``needs`` (so is not ``what``), is a
    ``ValueError`` naming it (safetensors' own errors name no file)."""
    try:
        f = safe_open(str(path), framework="pt")
    except SafetensorError as e:
        detail = str(e).removeprefix("Error while deserializing header: ")
        raise ValueError(f"{path}: not a whole safetensors file ({detail}): cut short or damaged (an interrupted "
                         f"copy or write): {REWRITE}") from None
    except OSError as e:
        if str(path) in str(e):
            raise
        raise type(e)(f"{path}: {e}") from None  # a folder: "No such device (os error 19)"
    with f:
        missing = [name for name in needs if name not in f.keys()]
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)} tensor{'s' * (len(missing) > 1)}: not {what}")
        yield f


def load_safetensors(path: str | os.PathLike, needs: Iterable[str] = (), what: str = "") -> dict:
    """Every tensor of a safetensors file, read as :func:`open_safetensors` opens it."""
    with open_safetensors(path, needs, what) as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """``safetensors``' ``save_file``, its metadata then put in sorted key order: safetensors writes
    that map in hash order, another in each process, so the same tensors made different bytes run to
    run. The header is rewritten in place (its length kept, padded with spaces as the format
    allows), never the tensors."""
    from safetensors.torch import save_file  # torch: the readers of these files need none

    save_file(tensors, str(path), metadata=metadata)
    if len(metadata) < 2:
        return
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(text) <= size:  # it always is: the same keys and values, compact as safetensors writes them
            f.seek(8)
            f.write(text.ljust(size))
