"""The target stage, for the demo's tiny target (with ``target.path`` set in the config it does
not run: the pipeline uses that model folder).

Teaching the tiny target (dflash.target.teach) takes minutes on a CPU, so the demo ships one taught once
(``data/demo/target``; ``make demo-target`` remakes it) and ``target.build.prebuilt`` names it:
the stage copies it when its ``provenance.json`` says it was made from the same build config,
sources and teaching code (:func:`teaching_digests`) and its files are intact, and teaches one
otherwise, with a warning. Whatever it does, its output gets a ``provenance.json``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import shutil
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import torch

from dflash.core.io import atomic_dir, file_sha256, read_json, replace_problem, write_json
from dflash.core.shapes import drafter_target_problems, text_config
from dflash.core.workflow import demo_target_sources, tell
from dflash.target import teach

log = logging.getLogger(__name__)

PROVENANCE = "provenance.json"


def teaching_digests(sources: list[Path], cfg: dict) -> dict[str, str]:
    """What decides the taught target, each hashed: the build config (``prebuilt`` aside), the
    sources' bytes in their order, and the code that builds and teaches (dflash.target.teach, the chat
    template). Library versions and the machine are recorded beside them, not compared: teaching
    again is not bit-for-bit the same on another CPU anyway, as float rounding differs."""
    def sha256(chunks) -> str:
        h = hashlib.sha256()
        for chunk in chunks:
            h.update(hashlib.sha256(chunk).digest())
        return h.hexdigest()

    build = {k: v for k, v in cfg.items() if k != "prebuilt"}
    code = [Path(teach.__file__).read_bytes(), teach.chat_template().encode("utf-8")]
    return {"build config": sha256([json.dumps(build, sort_keys=True).encode()]),
            "sources": sha256(Path(p).read_bytes() for p in sources),
            "teaching code": sha256(code)}


def prebuilt_problem(folder: Path, digests: dict[str, str]) -> str | None:
    """Why the target in ``folder`` is not what teaching would make now (another build config,
    other sources, other teaching code) or not intact (a file missing or changed since it was
    made), or None when it can be used as it is."""
    try:
        provenance = read_json(folder / PROVENANCE)
        made_from, files = provenance["digests"], provenance["files"]
    except FileNotFoundError:
        return f"{folder / PROVENANCE}: no such file"
    except (ValueError, KeyError, TypeError) as e:
        return f"{folder / PROVENANCE}: not a target's provenance ({e})"
    differ = [what for what, digest in digests.items() if made_from.get(what) != digest]
    if differ:
        return f"made from another {' and '.join(differ)} than this run's"
    for name, digest in files.items():
        if not (folder / name).is_file() or file_sha256(folder / name) != digest:
            return f"{folder / name} is missing or changed since the target was made"
    return None


def build_target(sources: list[Path], out_dir: Path, cfg: dict, made_by: str = "the target stage") -> dict:
    """The tiny target (model + tokenizer + template) in ``out_dir``: a copy of ``cfg["prebuilt"]``
    when that target was made from the same build config, sources and teaching code, else built
    and taught here. ``made_by`` (the command) goes into its ``provenance.json``."""
    if problem := replace_problem(out_dir, "target"):  # now, not after the teaching
        raise FileExistsError(problem)
    digests = teaching_digests(sources, cfg)
    if cfg.get("prebuilt"):
        prebuilt = Path(cfg["prebuilt"])
        problem = prebuilt_problem(prebuilt, digests)
        if problem is None:
            return copy_prebuilt(prebuilt, out_dir)
        log.warning("target: not using the prebuilt target %s (%s): teaching one here, minutes on a CPU "
                    "(`make demo-target` remakes the shipped one)", prebuilt, problem)
    with atomic_dir(out_dir, "target") as tmp:
        summary = teach.teach_target(sources, tmp, cfg)
        write_json(tmp / PROVENANCE, {
            "made_by": made_by,
            "made_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "digests": digests,
            "files": {p.name: file_sha256(p) for p in sorted(tmp.iterdir())},
            "made_with": {"python": platform.python_version(), "torch": torch.__version__,
                          "transformers": version("transformers"), "machine": platform.machine(),
                          "torch_threads": torch.get_num_threads()},
        })
    return summary


def target_job(config: dict, out_dir: Path, teach: bool = False, made_by: str = "the target stage") -> dict:
    """The target stage as its rule and ``dflash target`` run it: the target from the demo's
    sources (taught here when ``teach``, else the prebuilt one where it may be copied), then the
    drafter section checked against its config (the run's first chance to, when the target is made
    here), so a drafter it cannot carry stops the run before any generate job."""
    build = {**config["target"]["build"], **({"prebuilt": None} if teach else {})}
    summary = build_target(demo_target_sources(config), out_dir, build, made_by)
    if problems := drafter_target_problems(config["drafter"], text_config(out_dir)):
        raise ValueError("; ".join(f"{key}: {problem}" for key, problem in problems) + f" ({Path(out_dir)}/config.json)")
    return summary


def copy_prebuilt(prebuilt: Path, out_dir: Path) -> dict:
    provenance = read_json(prebuilt / PROVENANCE)
    with atomic_dir(out_dir, "target") as tmp:
        for name in [*provenance["files"], PROVENANCE]:
            shutil.copyfile(prebuilt / name, tmp / name)
    summary = read_json(Path(out_dir) / "build_summary.json")
    tell(log, f"target: copied {prebuilt} (made by `{provenance['made_by']}` on {provenance['made_at'][:10]}, taught "
              f"{summary['history'][-1]['step'] + 1} steps to loss {summary['teach_final_loss']:.3f}): the build "
              f"config, sources and teaching code it was made from are this run's")
    return summary
