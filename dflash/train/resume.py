"""Resume points of a training run: weights, optimizer, random states and data position every
``save_every`` steps, so a re-run with the same settings and data continues where a failed one
stopped. (``dflash.generate.resume`` is the generate stage's, a different thing.)"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from dflash.core.io import atomic_path

LOCK = "lock"  # in the resume folder: held by the run that uses it, holding its pid


def resume_dir(out_dir: Path) -> Path:
    """Where resume points live: beside the checkpoint, never inside it (a failed job's output is
    deleted by Snakemake; this folder survives for the re-run)."""
    return out_dir.parent / f".{out_dir.name}.resume"


def run_fingerprint(cfg: dict, tokenized: list[Path], target_dir: Path) -> str:
    """What a resume point must match: the settings that shape the weights and the data (not
    where or how fast: a run that ran out of memory may resume with a smaller loss chunk)."""
    how = ("device", "save_every", "parallel", "prefetch", "loss_chunk_tokens", "fast_kernels",
           "max_nonfinite_steps")  # when to give up on non-finite steps: a skipped one changes no weight
    # a setting at what the trainer did before it existed (AdamW, no feature noise) leaves the
    # fingerprint as it was then, so a run's resume points stay good across that upgrade
    before = (("optimizer", "adamw"), ("feature_noise", 0.0))
    shaping = {k: v for k, v in cfg.items() if k not in how and (k, v) not in before}
    h = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode())
    h.update(Path(target_dir).name.encode())
    # the target's weights as this machine holds them (resume points never leave it): a target
    # rebuilt or replaced in the same folder gives other features, and must not continue a run
    for weights in sorted(Path(target_dir).glob("*.safetensors")) + sorted(Path(target_dir).glob("*.bin")):
        info = weights.stat()
        h.update(f"{weights.name} {info.st_size} {info.st_mtime_ns}".encode())
    for path in tokenized:
        h.update(Path(path).with_suffix(".json").read_bytes())
    return h.hexdigest()


@contextlib.contextmanager
def held_resume_dir(directory: Path, out_dir: Path) -> Iterator[None]:
    """The run's resume folder, made when missing and held with an exclusive lock while the block
    runs: two runs with one output would resume from, overwrite and delete each other's points.
    A folder that is a symlink or another user's is refused: the run reads the files it holds and
    deletes them when done, which must never reach a folder it points to."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ValueError(f"{directory}: a symlink or a file where training keeps {out_dir.name}'s resume points "
                         f"(a folder of its own, which it deletes when done); remove it, or choose another output")
    directory.mkdir(parents=True, exist_ok=True)
    if (owner := directory.stat().st_uid) != os.getuid():
        raise ValueError(f"{directory}: a folder of another user (uid {owner}) where training keeps {out_dir.name}'s "
                         f"resume points (which it deletes when done); remove it, or choose another output")
    lock = directory / LOCK
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            raise RuntimeError(f"another training is using {out_dir}'s resume points (pid {pid}, lock {lock}); wait "
                               f"for it to end, or give this one another output") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        try:
            yield
        finally:
            # the lock file goes with the folder (remove_resume_points) or, with no point in it, now
            if not any(directory.glob("step-*.pt")):
                remove_resume_points(directory)
    finally:
        os.close(fd)


def newest_resume_point(directory: Path, fingerprint: str, log: logging.Logger) -> dict | None:
    for path in sorted(directory.glob("step-*.pt"), reverse=True):
        try:
            # tensors and plain values only: unpickling anything else would run what the file says,
            # and the folder may be on a shared file system or in a results/ someone handed over
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            what = re.search(r"WeightsUnpickler error: (.+?)(?: Please|\n|$)", str(e))
            raise ValueError(f"{path}: refused, not loaded: a resume point holds only tensors and plain values, and "
                             f"this file holds more ({what[1].rstrip('.') if what else 'an object'}), which "
                             f"unpickling could run as code; this trainer did not write it: move it away and "
                             f"re-run") from None
        except Exception as e:  # a torn file cannot be: it is renamed into place when complete
            log.warning("%s: unreadable (%s), trying an older one", path, e)
            continue
        if not isinstance(state, dict) or state.get("fingerprint") != fingerprint:
            log.warning("%s: from other settings or data, starting from step 0", path)
            return None
        log.info("resuming from %s (step %d)", path, state["step"])
        return state
    return None


def save_resume_point(directory: Path, state: dict, keep: int = 2) -> None:
    with atomic_path(directory / f"step-{state['step']:08d}.pt") as tmp, open(tmp, "wb") as f:
        # into a file object: given a path, torch reports a full disk as "unexpected pos N vs M";
        # through Python's write it is the OSError that atomic_path names the point by
        torch.save(state, f)
    for old in sorted(directory.glob("step-*.pt"))[:-keep]:
        old.unlink()


def remove_resume_points(directory: Path) -> None:
    for point in [*directory.glob("step-*.pt"), directory / LOCK]:  # only what this module writes
        point.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # a folder holding anything else is left as it is
        directory.rmdir()
