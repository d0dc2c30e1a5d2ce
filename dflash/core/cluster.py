"""What the profiles ask of the machine or the cluster: the local GPU count, the node kinds, the site
file, and the SLURM profile every node kind shares.

A node kind (b200, rtxpro6000) is a key of plan.profiles' defaults in the schema, the one list of
kinds: its GPUs per node and prices are there. ``profiles/slurm-<kind>/config.yaml`` gives our sizes
for its nodes and calls ``slurm_profile()`` when Snakemake loads it (YTE); the names a cluster gives
its partitions, account, qos and GPU types live in one file the user edits, ``profiles/site.yaml``
(or the file ``$DFLASH_SITE`` names), read through ``site()``, so a wrong or missing name stops
before any sbatch. docs/cluster.md, "Adding a node kind", is the recipe for another kind.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from dflash.core.config import ConfigError, defaults, read_yaml

SITE_ENV = "DFLASH_SITE"
DEFAULT_SITE = "profiles/site.yaml"
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
    """The SLURM profile for nodes of ``kind``, which its profiles/slurm-<kind>/config.yaml loads: what
    every kind asks alike, the site's names (``site()``), the kind's GPUs per node, and the profile's
    ``sizes``: ``cpus_per_gpu`` (the serve, hidden, train and eval jobs'), and ``mem_mb`` and ``runtime``
    for each of GPU_STAGES."""
    s = site(kind)
    stages = all(isinstance(sizes.get(g), dict) and set(sizes[g]) == {"mem_mb", "runtime"} for g in GPU_STAGES)
    if set(sizes) != {"cpus_per_gpu", *GPU_STAGES} or not stages:
        raise ValueError(f"profiles/slurm-{kind}: sizes must give cpus_per_gpu, and mem_mb and runtime for each of "
                         f"{', '.join(GPU_STAGES)}; got {sizes}")
    qos = {"qos": s["qos"]} if s["qos"] else {}

    def gpu_job(stage: str, cpus: bool = True) -> dict:
        return {"slurm_partition": s["partition"], "gpu_model": s["gpu_model"],
                **({"cpus_per_gpu": sizes["cpus_per_gpu"]} if cpus else {}),
                "mem_mb": sizes[stage]["mem_mb"], "runtime": sizes[stage]["runtime"]}

    generate = {**gpu_job("generate", cpus=False), **qos}
    hidden = {**gpu_job("hidden"), **qos}
    return {
        "executor": "slurm",
        "jobs": 128,  # sbatch jobs queued or running at once
        "latency-wait": 60,  # shared file systems show a finished job's files late
        "restart-times": 1,  # a preempted or cancelled job runs once more (generate resumes its shard)
        # Preempted jobs go back to the queue (sbatch --requeue) where the partition's PreemptMode is
        # REQUEUE: SLURM sends SIGTERM, waits its GraceTime, and runs the job again; train writes a
        # resume point of the step it is in on that signal and the requeued job resumes there.
        "slurm-requeue": True,
        "rerun-incomplete": True,
        "scheduler": "greedy",
        "printshellcmds": True,
        "show-failed-logs": True,
        "slurm-logdir": "logs/slurm",
        # Every sbatch job's log stays there (the plugin deletes a successful job's at once, and any
        # after 10 days, unless told to keep them).
        "slurm-keep-successful-logs": True,
        # Job states from squeue, which every SLURM has: the plugin's default, sacct, needs accounting
        # (slurmdbd), and without it Snakemake never learns that a job ended. squeue lists an ended job
        # for MinJobAge seconds (`scontrol show config`; default 300, and the plugin polls at least
        # every 180 s); where it is below 120 s the plugin takes sacct instead, if installed. A failed
        # job's reason is then SLURM's state only: its log here says the rest.
        "slurm-status-command": "squeue",
        # The jobs that read a few small files run where snakemake runs (sbatch would cost more than
        # them). CPU stages go to the site's CPU partition; the GPU stages to the kind's partition.
        "default-resources": {"slurm_partition": s["cpu_partition"], "runtime": 60, "mem_mb": 8000,
                              **({"slurm_account": s["account"]} if s["account"] else {})},
        "set-threads": {
            "prompts": 16,  # the tokenizer screens every prompt (batch encode over these cores)
            "tokenize": 8,
            "pilot_tokenize": 8,
        },
        "set-resources": {
            "prompts": {"mem_mb": 64000, "runtime": 360},
            "target": {"mem_mb": 16000, "runtime": 120},
            "validate": {"mem_mb": 4000, "runtime": 30},
            "tokenize": {"mem_mb": 16000, "runtime": 60},
            # the pilot's sample: reads the prompt shards' ids, then its records
            "pilot_prompts": {"mem_mb": 16000, "runtime": 60},
            "pilot_validate": {"mem_mb": 4000, "runtime": 30},
            "pilot_tokenize": {"mem_mb": 16000, "runtime": 60},
            # generate.server.launch: a server and the generate jobs of its shards are one sbatch job on
            # one node. Snakemake sums a group's memory and takes its longest runtime; text resources
            # (partition, GPU type, qos) must be equal in all of its jobs. The server claims the node
            # (its GPUs come from generate.server.launch.gpus: the node's); each generate job is a client.
            "serve": {**gpu_job("serve"), "nodes": 1, **qos},
            "generate": generate,
            "pilot_generate": generate,
            "hidden": hidden,
            # the pilot's hidden states and its training burst (pilot.train_steps): one GPU each, as a hidden job
            "pilot_hidden": hidden,
            "pilot_train": hidden,
            # train.nodes nodes (the rule's nodes resource), each to itself: train.gpus of each node's GPUs
            # train. Every GPU of each (gres counts per node, the plugin's gpu the whole job, which SLURM
            # may spread unevenly).
            "train": {
                "slurm_partition": s["partition"],
                "gres": f"gpu:{s['gpu_model']}:{node_kinds()[kind]['gpus_per_node']}",
                "gpu": 0,
                "cpus_per_gpu": sizes["cpus_per_gpu"],
                "mem_mb": sizes["train"]["mem_mb"],
                "runtime": sizes["train"]["runtime"],
                # SIGTERM 10 minutes before the time limit (SLURM's own comes KillWait, often 30 s, before
                # the kill): time for the step in flight and the resume point; the retried job resumes from
                # it. A requeued job appends to its SLURM log, which then tells both runs (where it
                # stopped, resumed).
                "slurm_extra": "'--exclusive --signal=TERM@600 --open-mode=append'",
                **qos,
            },
            # the eval's decodings (trained, untrained drafter; eval.jobs parts each), one GPU each;
            # joining them is a local job
            "eval_decode": {**gpu_job("eval_decode"), **qos},
        },
    }


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
