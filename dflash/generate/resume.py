"""Resuming a generate shard: finished records accumulate in a partial file beside the output
(never mistaken for it), one job at a time holds the shard, and a re-run keeps only records made
with the same settings and model (their digest)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import time
from collections import defaultdict
from pathlib import Path

from dflash.core.io import atomic_path, iter_jsonl, naming_full_disk
from dflash.core.records import checked_records
from dflash.core.workflow import notice

log = logging.getLogger(__name__)


def record_settings(cfg: dict) -> dict:
    """The ``generate`` settings that shape the records (the generate rule's params, so a change
    re-runs the shards); the others say where the server runs and how hard to push it (url,
    launch, concurrency, timeouts, retries, key, error budget)."""
    server = cfg.get("server") or {}  # (a section as the package's callers pass it: what they set)
    return {"backend": cfg["backend"], "enable_thinking": cfg.get("enable_thinking"), "sampling": cfg.get("sampling"),
            **({k: server.get(k) for k in ("dialect", "model", "extra_body")} if cfg["backend"] == "openai" else {})}


def settings_digest(cfg: dict, target_dir: str | Path) -> str:
    """What decides a shard's records, as one short digest each record carries: the settings that
    shape them (``record_settings``) and the model that writes them. A resumed shard keeps
    only records of the same digest, so a re-run with another model or sampling never mixes the two."""
    model = ((cfg.get("server") or {}).get("model") or str(target_dir)) if cfg["backend"] == "openai" \
        else os.path.abspath(target_dir)
    blob = json.dumps({"records": record_settings(cfg), "model": model}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def partial_path(out_path: str | Path) -> Path:
    """Where finished records of an unfinished shard accumulate: beside the output, never
    mistaken for it, and not a Snakemake output (so a failed job does not delete it)."""
    out_path = Path(out_path)
    return out_path.with_name(f".{out_path.name}.partial.jsonl")


@contextlib.contextmanager
def shard_lock(out_path: Path, poll_s: float = 5.0):
    """Hold the shard's lock file while writing it. A job left running by a killed snakemake (its
    SLURM job lives on) and its re-run would both append to the partial file: the re-run waits
    here until the first one ends. Needs flock on the shared file system (NFSv4; Lustre mounted
    with -o flock); where it has none, the job goes on with a warning."""
    lock = Path(out_path).with_name(f".{Path(out_path).name}.lock")
    with naming_full_disk(lock):  # the open alone: a full disk met while the lock is held is the writer's to name
        f = open(lock, "a")
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("%s: another job is writing this shard (an earlier run's job still running?); "
                        "waiting for it to end", out_path)
            while True:
                time.sleep(poll_s)
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    continue
            log.info("%s: the other job ended; going on from what it left", out_path)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            log.warning("%s: no file locks on this file system (%s): run one job per shard at a time", lock, e)
        yield


def keep_finished_output(out_path: Path, partial: Path) -> None:
    """A shard file already there (an earlier job finished it after Snakemake had cleared the
    outputs for this one, or a CLI run onto an existing output): its good records join the
    partial file, where ``load_partial`` keeps those of this run's settings, so none is generated
    twice and none of other settings is kept."""
    if not out_path.exists():
        return
    # read whole before anything is written: a file that is no completion shard (an --out slip onto
    # a user's file) is refused as it stands, never taken apart
    kept = "".join(json.dumps(r, ensure_ascii=False) + "\n" for _, r in checked_records(
        out_path, "completion", f"{out_path} is there already and is not a completion shard this stage wrote: give "
                                f"--out a path of its own") if r["finish_reason"] != "error")
    with naming_full_disk(partial), open(partial, "a", encoding="utf-8") as sink:
        sink.write(kept)
    out_path.unlink()


def finished(records: list[dict]) -> bool:
    """A prompt's records are complete: its single generation, or a replay whose last record stops."""
    return bool(records) and ("replay" not in records[-1] or records[-1]["replay"]["stop"] is not None)


def load_partial(path: Path, wanted: set[str], settings: str) -> dict[str, list[dict]]:
    """Finished prompts of an interrupted run (prompt id -> records), rewritten clean: a line torn
    by a kill is dropped (appending after it would corrupt the next record), as are a replay cut
    short by it, ids not in this shard, a second copy of a record (an earlier job killed between
    writing its shard and removing this file) and records generated with other settings or
    another model (``settings``: ``settings_digest``), said in the log and on the console."""
    found: dict[str, list[dict]] = {}
    seen: set[str] = set()
    other = set()
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict) or rec.get("prompt_id") not in wanted or rec.get("id") in seen:
                continue  # a record kept twice counts once
            if (rec.get("generation") or {}).get("settings") != settings:
                other.add(rec["prompt_id"])
                continue
            seen.add(rec["id"])
            found.setdefault(rec["prompt_id"], []).append(rec)
    if other:
        notice(log, f"{path}: {len(other)} finished prompt(s) were generated with other generate settings or "
                    f"another model than this run's; they are dropped and generated again")
    done = {pid: recs for pid, recs in found.items() if finished(recs)}
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for recs in done.values() for r in recs),
                       encoding="utf-8")
    return done


def pilot_records(path: Path | None, ids: set[str]) -> dict[str, list[dict]]:
    """The pilot's finished records of the prompts ``ids`` (a generate job's shard), by prompt id:
    the job writes them as they are instead of asking for them again."""
    found: dict[str, list[dict]] = defaultdict(list)
    if path:
        for rec in iter_jsonl(path):
            if rec["prompt_id"] in ids and rec["finish_reason"] != "error":
                found[rec["prompt_id"]].append(rec)
    return dict(found)


def seed_from_pilot(partial: Path, pilot: Path | None, ids: set[str]) -> set[str]:
    """Add the pilot's finished records of these prompts to the resume file (load_partial drops a
    record already there); the prompt ids taken from the pilot."""
    found = {pid: recs for pid, recs in pilot_records(pilot, ids).items() if finished(recs)}
    if found:
        with naming_full_disk(partial), open(partial, "a", encoding="utf-8") as sink:
            sink.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for recs in found.values() for r in recs))
    return set(found)
