"""Glue shared by the Snakefile, the rule scripts and the CLI: paths, logging, threads."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from dflash.io import read_json


def target_dir(config: dict) -> str:
    """The target model folder: the configured one, or the demo target the pipeline builds."""
    return config["target"]["path"] or f"{config['output_dir']}/target"


def demo_target_sources(config: dict) -> list[str]:
    """Sources the demo target's tokenizer learns from: the local prompt conversations (adopted
    generations come from a real target, which ``target.path`` names)."""
    return [s["path"] for s in config["prompts"]["sources"]
            if s.get("format", "openai") != "chat_completions" and not s["path"].startswith("s3://")]


def shard_ids(prompts_dir: str | Path) -> list[str]:
    """Shard numbers ("00000", ...) listed in the prompts manifest."""
    manifest = read_json(Path(prompts_dir) / "manifest.json")
    return [s["name"].removeprefix("shard-").split(".")[0] for s in manifest["shards"]]


def setup_logging(log_file: str | Path | None = None, level: int = logging.INFO) -> None:
    """Log to ``log_file`` (Snakemake's per-job log) or stderr, one format everywhere."""
    handler = logging.FileHandler(log_file, mode="a") if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "urllib3", "filelock", "botocore", "boto3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # transformers prints through its own handler; propagating would print every warning twice.
    logging.getLogger("transformers").propagate = False


def log_to(log_file: str | Path) -> None:
    """Everything a job prints (logging, progress bars, a traceback) into its log file."""
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    sys.stderr = open(log_file, "a", buffering=1)
    setup_logging(log_file)


def job_context() -> str:
    """Where a job runs, for the first line of its log: the host, the SLURM job and the GPUs it sees."""
    import socket

    slurm = os.environ.get("SLURM_JOB_ID")
    return (f"host {socket.gethostname()}" + (f", SLURM job {slurm}" if slurm else "")
            + f", CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")


def notice(logger: logging.Logger, message: str) -> None:
    """A warning worth seeing although the job succeeds: in its log, and on the console when the
    log is a rule's (Snakemake shows a log only when the job fails)."""
    logger.warning(message)
    if sys.stderr is not sys.__stderr__:
        print(f"warning: {message}", file=sys.__stderr__, flush=True)


def start_job(snakemake) -> None:
    """First call of every rule script: logging into the rule's log, failures as one line on the
    console (the traceback in the log), torch threads."""
    from dflash.errors import install_job_hook

    log_to(snakemake.log[0])
    logging.getLogger("dflash.job").info("rule %s: %s", snakemake.rule, job_context())
    install_job_hook(snakemake.rule, ", ".join(f"{k}={v}" for k, v in snakemake.wildcards.items()), snakemake.log[0])
    set_threads(snakemake.threads)


def set_threads(n: int) -> None:
    """The job's threads for torch and for the Rust tokenizer's batch encode, which would take
    every core (Snakemake runs one job per core it was given). An explicit
    ``RAYON_NUM_THREADS`` in the environment wins."""
    import torch

    torch.set_num_threads(max(1, int(n)))
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, int(n))))


def layer_selection(drafter_cfg: dict) -> dict:
    """What decides the captured target layers, and nothing else: a rule param that changes
    only when the hidden-state cache really has to be rebuilt."""
    if drafter_cfg["target_layer_ids"]:
        return {"target_layer_ids": list(drafter_cfg["target_layer_ids"])}
    return {"target_layer_ids": None, "num_layers": drafter_cfg["num_layers"]}


def progress(iterable=None, **kwargs):
    """tqdm that stays readable in a log file: in a file it redraws every 15 s, not every step."""
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    kwargs.setdefault("mininterval", 1 if interactive else 15)
    kwargs.setdefault("disable", None if interactive else False)
    return tqdm(iterable, **kwargs)


def drafter_train_cfg(config: dict, target: str | Path) -> dict:
    """The trainer's settings: the ``drafter`` and ``train`` sections, with the mask token
    resolved to an id of the target's tokenizer when only its string is configured."""
    drafter = dict(config["drafter"])
    token = drafter.pop("mask_token")
    if drafter["mask_token_id"] is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
        mask_id = tokenizer.convert_tokens_to_ids(token)
        if mask_id is None or mask_id == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(mask_id) != token:
            raise ValueError(f"drafter.mask_token {token!r} is not a token of {target}; set drafter.mask_token_id")
        drafter["mask_token_id"] = mask_id
    train = {k: v for k, v in config["train"].items() if k != "gpus"}  # how many processes: the launcher's business
    return {**drafter, **train}


def prompt_check_settings(config: dict) -> dict:
    """What decides which prompts the prompts stage drops or flags (its rule's params)."""
    generate = config["generate"]
    return {"context_length": generate["context_length"], "max_tokens": generate["sampling"]["max_tokens"],
            "enable_thinking": generate["enable_thinking"], "special_tokens": config["prompts"]["special_tokens"]}


def record_settings(cfg: dict) -> dict:
    """The ``generate`` settings that shape the records (the generate rule's params, so a change
    re-runs the shards); the others say where the server runs and how hard to push it (url,
    launch, concurrency, timeouts, retries, key, error budget)."""
    server = cfg["server"]
    return {"backend": cfg["backend"], "enable_thinking": cfg["enable_thinking"], "sampling": cfg["sampling"],
            **({"dialect": server["dialect"], "model": server["model"], "extra_body": server["extra_body"]}
               if cfg["backend"] == "openai" else {})}
