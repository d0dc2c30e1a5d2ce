"""Report stage: the summary of a pipeline run (``summary.json``, every stage's figures in one
file) and its page, with the provenance both pages name: the run's date, config digest and
pipeline commit. :mod:`dflash.report.pages` renders the pages.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from dflash.core.curves import CURVES_DIR
from dflash.core.io import atomic_path, read_json, write_json
from dflash.core.storage import destroy_verdict, local_copy, safe_to_destroy
from dflash.core.vocabulary import terminal_safe
from dflash.generate.budget import spend
from dflash.plan.pilot import NO_LOOP_ABORTS
from dflash.report.benchmarks import stage_costs
from dflash.report.headline import headline_lines
from dflash.report.pages import render_html, write_qa_page
from dflash.serve.commands import run_serve_commands


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
        # what the drafter read: the target's features per layer (dflash.hidden.feature_guard checked them)
        "features": read_json(Path(checkpoint) / "trainer_state.json")["data"].get("features"),
        "serving": _serving(config, checkpoint),
        "durability": _durability(durability) if durability is not None else None,
        "pilot": read_json(pilot) if pilot else None,
        "plan": read_json(plan) if plan else None,
        "generation": _generation(config, [read_json(p) for p in generated]) if generated else None,
        "stages": stage_costs(benchmarks) if benchmarks else None,
    }


def _curves(config: dict) -> dict:
    """Where the run's live curves are (``dflash.core.curves``), for the page to point at."""
    tracking = config["tracking"]
    return {"tensorboard": str(Path(config["output_dir"]) / CURVES_DIR) if tracking["tensorboard"] else None,
            "wandb": tracking["wandb"]["project"], "mlflow": tracking["mlflow"]["tracking_uri"]}


def _serving(config: dict, checkpoint: Path) -> dict:
    """How to serve the trained drafter, for the page (dflash serve-command prints the same)."""
    return run_serve_commands(config, checkpoint)


def _generation(config: dict, summaries: list[dict]) -> dict:
    """What generation took and cost over its jobs' summaries (as generate.budget counts it)."""
    return {**spend(summaries, config), "requests": sum(s["requests"] for s in summaries),
            "job_seconds": round(sum(s["seconds"] for s in summaries), 2), "budget": config["generate"]["budget"],
            "loop_aborts": {k: sum(s.get("loop_aborts", NO_LOOP_ABORTS)[k] for s in summaries) for k in NO_LOOP_ABORTS}}


DURABILITY_LINES = 20  # files at risk named on the page; the count covers all


def _durability(found: dict) -> dict:
    """What ``storage.safe_to_destroy`` found when the report was written, for the page."""
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


# The pipeline's folder, whose commit the pages name.
PIPELINE_DIR = Path(__file__).resolve().parents[2]


def report_job(config: dict, manifest: Path, qa_summary: Path, gates: Path, checkpoint: Path, eval_file: Path,
               html_path: Path, json_path: Path, *, pilot: Path | None = None, plan: Path | None = None,
               generated: list[Path] = (), benchmarks: Path | None = None,
               storage: tuple[str | None, list[str]] | None = None) -> dict:
    """The report rule's job and ``dflash report``: the summary page and its JSON. ``storage``: the
    run's storage prefix (None: none) and the job's own files, written and uploaded after it looks,
    to say whether the run's outputs are all in the storage; None: not asked."""
    durability = None
    if storage is not None:
        prefix, own = storage
        durability = safe_to_destroy(".", config["output_dir"], prefix, skip=own)
    return write_report(config, manifest, qa_summary, gates, checkpoint, eval_file, html_path, json_path, durability,
                        pilot=pilot, plan=plan, generated=generated, benchmarks=benchmarks,
                        about=provenance(config, PIPELINE_DIR))


def qa_page_job(config: dict, qa_summary: Path, html_path: Path) -> None:
    """The qa_report rule's job: the QA page, naming the run, its config and the pipeline's commit."""
    write_qa_page(qa_summary, html_path, provenance(config, PIPELINE_DIR), config["run"])


def check_run_command(output_dir: str) -> None:
    """``dflash check run``: the headline a finished run printed, from its report's summary.json."""
    summary, page = (f"{str(output_dir).rstrip('/')}/report/{name}" for name in ("summary.json", "summary.html"))
    try:
        with local_copy(summary) as local:
            found = read_json(local)
    except FileNotFoundError:
        raise FileNotFoundError(f"{summary}: no report yet: the run has not finished (snakemake writes it last), or "
                                f"{output_dir} is not a run's output_dir") from None
    print(terminal_safe("\n".join(headline_lines(found, page))))
