"""What the profiles ask of the machine or the cluster: the local GPU count, and the site file.

The SLURM profiles (profiles/slurm-b200, profiles/slurm-rtxpro6000) hold our per-rule resources;
the names a cluster gives its partitions, account, qos and GPU types live in one file the user
edits, ``profiles/site.yaml`` (or the file ``$DFLASH_SITE`` names). The profiles read it through
``site()`` when Snakemake loads them (YTE), so a wrong or missing name stops before any sbatch.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from dflash.config import ConfigError, read_yaml

SITE_ENV = "DFLASH_SITE"
DEFAULT_SITE = "profiles/site.yaml"
NODE_KINDS = ("b200", "rtxpro6000")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # what sbatch and the SLURM plugin accept unquoted
_TOP = {"account": False, "qos": False, "cpu_partition": True, **{k: True for k in NODE_KINDS}}
_NODE = {"partition": True, "gpu_model": True}


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


def site(kind: str) -> dict:
    """The site's names for a node kind: ``account``, ``qos`` (None when unset), ``cpu_partition``,
    ``partition`` and ``gpu_model`` (the ``Type=`` of the site's gres.conf)."""
    path = site_path()
    if not path.is_file():
        raise SiteError(f"{path}: no site file (run snakemake from the pipeline's folder, or set {SITE_ENV} "
                        "to your copy of profiles/site.yaml)")
    try:
        data = read_yaml(path)
    except ConfigError as e:
        raise SiteError(f"{e} ({', '.join(_TOP)})") from None
    unknown = sorted(set(data) - set(_TOP))
    if unknown:
        raise SiteError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_TOP)}")
    if kind not in NODE_KINDS:
        raise SiteError(f"unknown node kind {kind!r}; the site file knows {', '.join(NODE_KINDS)}")
    node = data.get(kind)
    if not isinstance(node, dict):
        raise SiteError(f"{path}: {kind} must be a mapping with {', '.join(_NODE)}")
    bad = sorted(set(node) - set(_NODE))
    if bad:
        raise SiteError(f"{path}: {kind}: unknown key(s) {', '.join(bad)}; allowed: {', '.join(_NODE)}")
    out = {key: _name(path, key, data.get(key), req) for key, req in _TOP.items() if key not in NODE_KINDS}
    out.update({key: _name(path, f"{kind}.{key}", node.get(key), req) for key, req in _NODE.items()})
    return out


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
