"""Report stage: the summary of a pipeline run (``summary.json``, every stage's figures in one
file) and its page, with the provenance both pages name: the run's date, config digest and
pipeline commit. :mod:`dflash.pages` renders the pages.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from dflash.benchmarks import stage_costs
from dflash.curves import CURVES_DIR
from dflash.io import atomic_path, read_json, write_json
from dflash.pages import render_html


def config_digest(config: dict) -> str:
    """First 12 hex digits of the SHA-256 of the config as canonical JSON (keys sorted, no spaces)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def pipeline_commit(folder: str | Path) -> str:
    """The git commit checked out in ``folder`` (short hash), ``+dirty`` when tracked files differ
    from it, ``unknown`` outside a git checkout or without git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def provenance(config: dict, workflow_dir: str | Path) -> dict:
    """What the pages name so a reader knows which run and code they show. Computed by the report
    jobs themselves, not passed as rule params: a new commit alone must not re-run the report."""
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "config_digest": config_digest(config),
            "commit": pipeline_commit(workflow_dir)}


def summarize(config: dict, manifest: Path, qa_summary: Path, gates: Path, checkpoint: Path, eval_file: Path,
              durability: dict | None = None, pilot: Path | None = None, plan: Path | None = None,
              generated: list[Path] = (), benchmarks: Path | None = None, about: dict | None = None) -> dict:
    qa = read_json(qa_summary)
    train_log = [json.loads(line) for line in (Path(checkpoint) / "train_log.jsonl").read_text().splitlines() if line]
    evaluation = read_json(eval_file)
    return {
        "run": config["run"],
        "about": about,
        "demo_target": (config.get("target") or {}).get("path") is None,
        "prompts": read_json(manifest),
        "validate": {k: qa[k] for k in ("records", "kept", "rejected", "reject_rate", "checks", "categories")},
        "gates": read_json(gates)["gates"],
        "tokenized": {**qa["tokenized"], "trainable_by_category": qa["trainable_tokens"]["by_category"]},
        "train": {
            "steps": train_log[-1]["step"] if train_log else 0,
            "first_loss": train_log[0]["loss"] if train_log else None,
            "final_loss": train_log[-1]["loss"] if train_log else None,
            "curve": [[e["step"], e["loss"]] for e in train_log],
        },
        "eval": {**{k: evaluation[k] for k in ("overall", "per_category", "untrained", "thinking_off") if k in evaluation},
                 "engine": evaluation.get("settings", {}).get("engine", "transformers")},
        "curves": _curves(config),
        # what the drafter read: the target's features per layer (dflash.feature_guard checked them)
        "features": read_json(Path(checkpoint) / "trainer_state.json")["data"].get("features"),
        "serving": _serving(config, checkpoint),
        "durability": _durability(durability) if durability is not None else None,
        "pilot": read_json(pilot) if pilot else None,
        "plan": read_json(plan) if plan else None,
        "generation": _generation(config, [read_json(p) for p in generated]) if generated else None,
        "stages": stage_costs(benchmarks) if benchmarks else None,
    }


def _curves(config: dict) -> dict:
    """Where the run's live curves are (``dflash.curves``), for the page to point at."""
    tracking = config["tracking"]
    return {"tensorboard": str(Path(config["output_dir"]) / CURVES_DIR) if tracking["tensorboard"] else None,
            "wandb": tracking["wandb"]["project"], "mlflow": tracking["mlflow"]["tracking_uri"]}


def _serving(config: dict, checkpoint: Path) -> dict:
    """How to serve the trained drafter, for the page (dflash serve-command prints the same)."""
    from dflash.serving import run_serve_commands

    return run_serve_commands(config, checkpoint)


def _generation(config: dict, summaries: list[dict]) -> dict:
    """What generation took and cost over its jobs' summaries (as generate.budget counts it)."""
    from dflash.budget import spend

    from dflash.pilot import NO_LOOP_ABORTS

    return {**spend(summaries, config), "requests": sum(s["requests"] for s in summaries),
            "job_seconds": round(sum(s["seconds"] for s in summaries), 2), "budget": config["generate"]["budget"],
            "loop_aborts": {k: sum(s.get("loop_aborts", NO_LOOP_ABORTS)[k] for s in summaries) for k in NO_LOOP_ABORTS}}


DURABILITY_LINES = 20  # files at risk named on the page; the count covers all


def _durability(found: dict) -> dict:
    """What ``storage.safe_to_destroy`` found when the report was written, for the page."""
    from dflash.storage import destroy_verdict

    lines, verdict = destroy_verdict(found, "this run")
    return {"storage": found["prefix"], "safe": found["safe"], "files_at_risk": len(found["files"]),
            "bytes_at_risk": found["bytes"], "incomplete": len(found["incomplete"]), "verdict": verdict,
            "at_risk": lines[:DURABILITY_LINES],
            "checked_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def write_report(config: dict, manifest: Path, qa_summary: Path, gates: Path, checkpoint: Path, eval_file: Path,
                 html_path: Path, json_path: Path, durability: dict | None = None, pilot: Path | None = None,
                 plan: Path | None = None, generated: list[Path] = (), benchmarks: Path | None = None,
                 about: dict | None = None) -> dict:
    """The summary page and its JSON; ``durability``: what ``storage.safe_to_destroy`` found;
    ``pilot``, ``plan``: their JSON files; ``generated``: the generate jobs' summaries;
    ``benchmarks``: Snakemake's benchmark folder (time per stage); ``about``: :func:`provenance`."""
    summary = summarize(config, manifest, qa_summary, gates, checkpoint, eval_file, durability, pilot, plan, generated,
                        benchmarks, about)
    write_json(json_path, summary)
    with atomic_path(html_path) as tmp:
        tmp.write_text(render_html(summary), encoding="utf-8")
    return summary
