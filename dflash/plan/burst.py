"""The pilot's training burst: ``pilot.train_steps`` steps of the run's own drafter and train
settings on the pilot's tokenized rows (its hidden states, or the target online as the run will),
on the machine the pilot runs on. What it keeps is a step rate (``pilot/train_burst.json``) for
``dflash plan``: the drafter it trains is made in a temporary folder and thrown away, so nothing
it writes can pass for the run's checkpoint."""
from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path

import psutil  # snakemake's own dependency

from dflash.core.io import write_json
from dflash.train.batches import NothingToTrain
from dflash.train.stage import resolve_cfg, train, trainer_settings

log = logging.getLogger(__name__)


def pilot_train_job(config: dict, tokenized: Path, hidden: Path | None, target_dir: Path, out_path: Path) -> dict:
    """The pilot_train rule's job: the run's own trainer settings for ``pilot.train_steps`` steps,
    timed on this machine, the node kind ``plan.pilot_profile`` names (``local``: none)."""
    return train_burst(tokenized, hidden or None, target_dir, out_path, trainer_settings(config, target_dir),
                       config["plan"]["pilot_profile"] or "local", config["pilot"]["train_steps"])


def train_burst(tokenized: Path, hidden: Path | None, target_dir: Path, out_path: Path, cfg: dict, kind: str,
                steps: int) -> dict:
    """Train ``steps`` steps with the trainer's ``cfg`` and time them: seconds per step from the
    log windows after the first (which holds the first steps' warm-up: allocations, kernel
    choices), and the set-up as the rest of the wall time since this process started (the
    interpreter and its imports, loading the target and the rows, the warm-up), as a train job
    spends it. ``kind``: the node kind of plan.profiles this machine is (``local``: none)."""
    every = max(1, steps // 5)
    started = psutil.Process().create_time()
    with tempfile.TemporaryDirectory(prefix=".train-burst-", dir=Path(out_path).parent) as tmp:
        try:
            summary = train([tokenized], [hidden] if hidden else None, target_dir, Path(tmp) / "drafter",
                            {**cfg, "steps": steps, "log_every": every, "save_every": 0}, log)
        except NothingToTrain as e:  # every pilot record rejected: the pilot's summary says why, the plan goes on
            log.warning("training burst on %s: none: %s", kind, e)
            result = {"kind": kind, "steps": 0, "skipped": str(e)}
            write_json(out_path, result)
            return result
        windows = [json.loads(line) for line in (Path(tmp) / "drafter" / "train_log.jsonl").read_text().splitlines()]
    wall = time.time() - started
    timed = windows[1:] or windows
    first = windows[0]["step"] if len(windows) > 1 else 0
    per_step = sum(w["seconds"] for w in timed) / (timed[-1]["step"] - first)
    result = {"kind": kind, "steps": steps, "seconds_per_step": per_step,
              "setup_seconds": max(0.0, wall - steps * per_step), "seconds": wall,
              "timed_steps": timed[-1]["step"] - first, "hidden_states": resolve_cfg(cfg)["hidden_states"],
              "rows": summary["rows"], "tokens": summary["tokens"]}
    write_json(out_path, result)
    log.info("training burst on %s: %d steps, %.3g s per step (from the last %d), %.3g s set-up", kind, steps,
             per_step, result["timed_steps"], result["setup_seconds"])
    return result
