"""Whose outputs a results folder holds. A run is its prompt sources and its target: another
config pointing at the same ``output_dir`` (the shipped real config after the demo, both
``results``) would otherwise plan from the demo's prompts manifest and CPU pilot, and Snakemake
would build on the demo's shards. The folder's first job stamps it (``.dflash-run.json``) with
what made it; a plan or a Snakemake run of a config that differs refuses the folder and says so.
Nothing here deletes another run's outputs: the user gives the run a folder of its own, or moves
the old one aside.
"""
from __future__ import annotations

from pathlib import Path

from dflash.io import read_json, write_json

STAMP = ".dflash-run.json"
SOURCE_KEYS = ("name", "format", "category", "split")  # what a source is, wherever its file is kept


def run_identity(config: dict) -> dict:
    """The sources (by name and how they are read: a file moved is the same source) and the
    target (its folder's name: a model moved is the same model; the demo's, built from the config)."""
    path = config["target"]["path"]
    return {"sources": [{k: s[k] for k in SOURCE_KEYS if s.get(k) is not None} for s in config["prompts"]["sources"]],
            "target": Path(path.rstrip("/")).name if path else "the demo target"}


def _describe(identity: dict) -> str:
    return (f"sources {', '.join(s['name'] for s in identity['sources'])}; target {identity['target']}")


def foreign_run(output_dir: str | Path, config: dict, config_source: str) -> str | None:
    """One line when ``output_dir`` holds another run's outputs, else None. A folder stamped before
    the stamp existed is judged by its prompts manifest's source names."""
    folder = Path(output_dir)
    mine = run_identity(config)
    stamp = folder / STAMP
    if stamp.is_file():
        theirs = read_json(stamp)
        if theirs["identity"] == mine:
            return None
        made_by = f"{_describe(theirs['identity'])}, from {theirs['config']}"
    elif (manifest := folder / "prompts" / "manifest.json").is_file():
        names = sorted(read_json(manifest).get("sources", {}))
        if not names or names == sorted(s["name"] for s in mine["sources"]):
            return None
        made_by = f"sources {', '.join(names)} ({manifest})"
    else:
        return None
    return (f"{folder}: holds another run's outputs ({made_by}), and {config_source} names {_describe(mine)}: give "
            f"this run an output_dir of its own (e.g. output_dir: {folder.name}-{config['run']}), or move {folder} "
            f"aside; nothing here deletes another run's outputs")


def stamp_run(output_dir: str | Path, config: dict, config_source: str) -> None:
    """Stamp ``output_dir`` with this run's identity, once (its first job's Snakemake run)."""
    stamp = Path(output_dir) / STAMP
    if not stamp.exists():
        write_json(stamp, {"identity": run_identity(config), "config": config_source})
