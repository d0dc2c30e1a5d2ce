"""Whose outputs a results folder holds. A run is its prompt sources and its target: another
config pointing at the same ``output_dir`` (the shipped real config after the demo, both
``results``) would otherwise plan from the demo's prompts manifest and CPU pilot, and Snakemake
would build on the demo's shards. The folder's first job stamps it (``.dflash-run.json``) with
what made it; a plan or a Snakemake run of a config with another target, or none of its sources,
refuses the folder and says so.
Nothing here deletes another run's outputs: the user gives the run a folder of its own, or moves
the old one aside.
"""
from __future__ import annotations

from pathlib import Path

from dflash.core.io import read_json, write_json

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


def _names(identity: dict) -> set[str]:
    return {s["name"] for s in identity["sources"]}


def foreign_run(output_dir: str | Path, config: dict, config_source: str) -> str | None:
    """One line when ``output_dir`` holds another run's outputs, else None: another target, or no
    source in common (a source added to or dropped from a run leaves it the same run). A folder
    stamped before the stamp existed is judged by its prompts manifest's source names."""
    folder = Path(output_dir)
    mine = run_identity(config)
    stamp = folder / STAMP
    if stamp.is_file():
        theirs = read_json(stamp)
        if theirs["identity"]["target"] == mine["target"] and _names(theirs["identity"]) & _names(mine):
            return None
        made_by = f"{_describe(theirs['identity'])}, from {theirs['config']}"
    elif (manifest := folder / "prompts" / "manifest.json").is_file():
        names = sorted(read_json(manifest).get("sources", {}))
        if not names or set(names) & _names(mine):
            return None
        made_by = f"sources {', '.join(names)} ({manifest})"
    else:
        return None
    return (f"{folder}: holds another run's outputs ({made_by}), and {config_source} names {_describe(mine)}: give "
            f"this run an output_dir of its own (e.g. output_dir: {folder.name}-{config['run']}), or move {folder} "
            f"aside; nothing here deletes another run's outputs")


def stamp_run(output_dir: str | Path, config: dict, config_source: str) -> None:
    """Stamp ``output_dir`` with this run's identity (each Snakemake run that executes jobs): the
    first one, and again as the run's sources grow or shrink."""
    stamp, identity = Path(output_dir) / STAMP, run_identity(config)
    if not stamp.exists() or read_json(stamp)["identity"] != identity:
        write_json(stamp, {"identity": identity, "config": config_source})
