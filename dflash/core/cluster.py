"""What the profiles ask of the machine or the cluster: the local GPU count, the node kinds, the site
file, and the SLURM profile every node kind shares.

A node kind (b200, rtxpro6000) is a key of plan.profiles' defaults in the schema, the one list of
kinds: its GPUs per node and prices are there. ``profiles/slurm-<kind>/config.yaml`` gives our sizes
for its nodes and calls ``slurm_profile()`` when Snakemake loads it (YTE), which fills in
``profiles/slurm.yaml``: what every kind asks alike, so the cluster choices stay in the profiles.
The names a cluster gives its partitions, account, qos and GPU types live in one file the user
edits, ``profiles/site.yaml`` (or the file ``$DFLASH_SITE`` names), read through ``site()``, so a
wrong or missing name stops before any sbatch. docs/cluster.md, "Adding a node kind", is the recipe
for another kind.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from yte import process_yaml

from dflash.core.config import ConfigError, defaults, read_yaml

SITE_ENV = "DFLASH_SITE"
DEFAULT_SITE = "profiles/site.yaml"
# What every node kind's SLURM profile holds alike (the pipeline's, whichever folder snakemake runs in).
SHARED_PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "slurm.yaml"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # what sbatch and the SLURM plugin accept unquoted
_SHARED = {"account": False, "qos": False, "cpu_partition": True}  # key: required
_NODE = {"partition": True, "gpu_model": True}
# The GPU jobs whose memory and runtime a kind's profile sizes for its nodes (the pilot's GPU jobs: as
# generate and hidden).
GPU_STAGES = ("serve", "generate", "hidden", "train", "eval_decode")


class SiteError(ValueError):
    pass


def site_path() -> Path:
    return Path(os.environ.get(SITE_ENV) or DEFAULT_SITE)


def _name(path: Path, key: str, value, required: bool) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or not _NAME.match(value):
        raise SiteError(f"{path}: {key} must be a SLURM name (letters, digits, _ . -), not {value!r}")
    return value


def node_kinds() -> dict[str, dict]:
    """Every node kind with its figures (``gpus_per_node``, prices, rates): plan.profiles' defaults."""
    return defaults("plan")["profiles"]


def site(kind: str) -> dict:
    """The site's names for a node kind: ``account``, ``qos`` (None when unset), ``cpu_partition``,
    ``partition`` and ``gpu_model`` (the ``Type=`` of the site's gres.conf)."""
    path = site_path()
    if not path.is_file():
        raise SiteError(f"{path}: no site file (run snakemake from the pipeline's folder, or set {SITE_ENV} "
                        "to your copy of profiles/site.yaml)")
    kinds = list(node_kinds())
    allowed = ", ".join([*_SHARED, *kinds])
    try:
        data = read_yaml(path)
    except ConfigError as e:
        raise SiteError(f"{e} ({allowed})") from None
    unknown = sorted(set(data) - set(_SHARED) - set(kinds))
    if unknown:
        raise SiteError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {allowed}")
    if kind not in kinds:
        raise SiteError(f"unknown node kind {kind!r}: the kinds are plan.profiles' defaults in the schema, "
                        f"{', '.join(kinds)} (docs/cluster.md: adding a node kind)")
    node = data.get(kind)
    if not isinstance(node, dict):
        raise SiteError(f"{path}: {kind} must be a mapping with {', '.join(_NODE)}")
    bad = sorted(set(node) - set(_NODE))
    if bad:
        raise SiteError(f"{path}: {kind}: unknown key(s) {', '.join(bad)}; allowed: {', '.join(_NODE)}")
    out = {key: _name(path, key, data.get(key), req) for key, req in _SHARED.items()}
    out.update({key: _name(path, f"{kind}.{key}", node.get(key), req) for key, req in _NODE.items()})
    return out


def slurm_profile(kind: str, sizes: dict) -> dict:
    """The SLURM profile for nodes of ``kind``, which its profiles/slurm-<kind>/config.yaml loads:
    profiles/slurm.yaml, what every kind asks alike, filled in with the site's names (``site()``), the
    kind's GPUs per node, and the profile's ``sizes``: ``cpus_per_gpu`` (the serve, hidden, train and
    eval jobs'), and ``mem_mb`` and ``runtime`` for each of GPU_STAGES."""
    stages = all(isinstance(sizes.get(g), dict) and set(sizes[g]) == {"mem_mb", "runtime"} for g in GPU_STAGES)
    if set(sizes) != {"cpus_per_gpu", *GPU_STAGES} or not stages:
        raise ValueError(f"profiles/slurm-{kind}: sizes must give cpus_per_gpu, and mem_mb and runtime for each of "
                         f"{', '.join(GPU_STAGES)}; got {sizes}")
    return process_yaml(SHARED_PROFILE.read_text(encoding="utf-8"), variables={
        "kind": kind, "s": site(kind), "sizes": sizes, "gpus_per_node": node_kinds()[kind]["gpus_per_node"]})


def local_gpus() -> int:
    """GPUs this machine offers the local profile's ``gpu`` resource: ``CUDA_VISIBLE_DEVICES`` when
    set, else the NVIDIA driver's device list; at least 1, so that on a CPU machine the GPU stages
    still run one at a time."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    else:
        driver = Path("/proc/driver/nvidia/gpus")
        n = len(list(driver.iterdir())) if driver.is_dir() else 0
    return max(1, n)
