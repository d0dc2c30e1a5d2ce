"""Resume points of a training run: weights, optimizer, random states and data position every
``save_every`` steps, so a re-run with the same settings and data continues where a failed one
stopped. (``dflash.resume`` is the generate stage's, a different thing.)"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path

import torch

from dflash.io import atomic_path


def resume_dir(out_dir: Path) -> Path:
    """Where resume points live: beside the checkpoint, never inside it (a failed job's output is
    deleted by Snakemake; this folder survives for the re-run)."""
    return out_dir.parent / f".{out_dir.name}.resume"


def run_fingerprint(cfg: dict, tokenized: list[Path], target_dir: Path) -> str:
    """What a resume point must match: the settings that shape the weights and the data (not
    where or how fast: a run that ran out of memory may resume with a smaller loss chunk)."""
    how = ("device", "save_every", "parallel", "prefetch", "loss_chunk_tokens", "fast_kernels")
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


def newest_resume_point(directory: Path, fingerprint: str, log: logging.Logger) -> dict | None:
    for path in sorted(directory.glob("step-*.pt"), reverse=True):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)  # written by us, below
        except Exception as e:  # a torn file cannot be: it is renamed into place when complete
            log.warning("%s: unreadable (%s), trying an older one", path, e)
            continue
        if state["fingerprint"] != fingerprint:
            log.warning("%s: from other settings or data, starting from step 0", path)
            return None
        log.info("resuming from %s (step %d)", path, state["step"])
        return state
    return None


def save_resume_point(directory: Path, state: dict, keep: int = 2) -> None:
    with atomic_path(directory / f"step-{state['step']:08d}.pt") as tmp:
        torch.save(state, tmp)
    for old in sorted(directory.glob("step-*.pt"))[:-keep]:
        old.unlink()


def remove_resume_points(directory: Path) -> None:
    for point in directory.glob("step-*.pt"):  # only what save_resume_point wrote
        point.unlink()
    with contextlib.suppress(OSError):  # a folder holding anything else is left as it is
        directory.rmdir()
