# The run's set-up from the config, then the workflow's functions. The set-up reads and checks
# the config (ours first, naming file and key), checks the target, the output folder and the
# storage, and defines what the rules read (OUT, TARGET, LAUNCH, ...); the functions that follow
# use those: where inputs and outputs live, the prompts checkpoint's shards (known once it ran).
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path

from snakemake.utils import validate

from dflash.core.config import (ConfigError, check_config, demo_sized_problem, read_config_yaml, read_yaml,
                                schema_path)
from dflash.core.dialects import DIALECTS
from dflash.core.errors import debug_requested
from dflash.core.io import read_json
from dflash.core.run_stamp import foreign_run, stamp_run
from dflash.core.shapes import drafter_target_problems, layer_selection, text_config
from dflash.core.storage import check_s3_prefix, fetch_from_storage, stored_root
from dflash.core.workflow import demo_target_sources, shard_ids, target_dir
from dflash.eval.acceptance import DECODINGS
from dflash.generate.resume import record_settings
from dflash.core.shapes import HIDDEN_FORMAT
from dflash.plan.pilot import pilot_gpus, toggle_problem
from dflash.prompts.checks import heldout_settings, prompt_check_settings
from dflash.report.headline import headline_lines
from dflash.validate.stage import exclusion_file_problem, exclusions_by_shard, read_exclusions, validate_settings


def stop(problem):
    """A configuration problem on the console as its own lines, which name the file and the key,
    without Snakemake's traceback frames (DFLASH_DEBUG=1 shows them)."""
    if debug_requested():
        raise ConfigError(problem)
    print(problem, file=sys.stderr, flush=True)
    sys.exit(1)


def check_storage(write):
    """One line before any job, instead of a traceback from the first existence check, or an
    upload that fails after a paid-for job."""
    problem = check_s3_prefix(STORAGE_PREFIX, workflow.storage_registry.default_storage_provider.s3c, write)
    if problem:
        stop(problem)


def external(path):
    """A file from outside the pipeline (a prompt source, a model folder): read where it is, never
    looked up in the default storage that holds the outputs. With outputs in a storage its time
    says nothing (a new machine's copy is newer than the outputs made from it): ancient, so a
    changed source is re-run with --forcerun prompts."""
    return ancient(local(path)) if STORED else local(path)


# The demo's config.yaml is read only when no --configfile is given: a real run's file is its whole
# config (the schema's defaults fill the rest), so the tiny demo's sizes never flow into it. Each
# file is read by us first: Snakemake's reader names neither file nor line of a YAML error and
# keeps the last of a key given twice. (A --configfile is read by Snakemake before any of this
# runs: its YAML errors stay Snakemake's message; `dflash plan --config FILE` names file and line.
# So are a YAML template's expressions: a --configfile with __use_yte__ has already run them here,
# and its run stops before any job.)
DEMO_CONFIG = "config.yaml"
try:
    for path in workflow.overwrite_configfiles or ([DEMO_CONFIG] if os.path.exists(DEMO_CONFIG) else []):
        read_config_yaml(path)
except ConfigError as e:
    stop(str(e))
if not workflow.overwrite_configfiles:

    configfile: DEMO_CONFIG


# Our check first: it names the file and the misspelt key, and fills the defaults. Snakemake's
# validate then sees a config that already passed; its filler would trip over an object that may
# be null (generate.server.launch), and has nothing left to fill.
CONFIG_SOURCE = ", ".join(map(str, workflow.configfiles)) or "config"
try:
    check_config(config, source=CONFIG_SOURCE)
except ConfigError as e:
    stop(str(e))
validate(config, str(schema_path()), set_default=False)
if workflow.overwrite_configfiles:
    # ... and a copy of the shipped demo file pointed at a real model is refused by name
    problem = demo_sized_problem(config, read_yaml(os.path.join(workflow.basedir, DEMO_CONFIG)),
                                 CONFIG_SOURCE, DEMO_CONFIG)
    if problem:
        stop(problem)

OUT = config["output_dir"]
RUN = config["run"]
TARGET = target_dir(config)
STORED = bool(workflow.storage_settings.default_storage_provider)  # outputs in S3 (--default-storage-provider)
# the drafter's fit to the target, wherever its config.json is here (a model folder, the demo's
# once built; else the target job says it): before the first generate job, not after the last
try:
    TARGET_TEXT = text_config(TARGET) if os.path.isfile(f"{TARGET}/config.json") else {}
except ValueError:  # a damaged config.json: the first job that loads the target names it
    TARGET_TEXT = {}
if problems := drafter_target_problems(config["drafter"], TARGET_TEXT):
    stop("\n".join(f"{CONFIG_SOURCE}: at {key}: {problem} ({TARGET}/config.json)" for key, problem in problems))
TARGET_INPUT = external(TARGET) if config["target"]["path"] else TARGET
if config["target"]["path"] and not os.path.isdir(TARGET):  # else Snakemake's MissingInputException, a traceback
    stop(f"{CONFIG_SOURCE}: at target.path: {TARGET}: no such model folder on this machine: download the model "
         f"there (the jobs read its weights); to plan (snakemake -n, dflash plan), a folder with its config.json and "
         f"tokenizer files is enough")
# another config's outputs in this output_dir: a run built on them, or a plan priced from them, would be wrong
if not STORED and (problem := foreign_run(OUT, config, CONFIG_SOURCE)):
    stop(f"{CONFIG_SOURCE}: at output_dir: {problem}")
for exclusions in config["validate"]["exclude"]:
    if not os.path.isfile(exclusions):
        stop(f"{CONFIG_SOURCE}: at {exclusion_file_problem(exclusions)}")
S3 = STORED and workflow.storage_settings.default_storage_provider == "s3"
STORAGE_PREFIX = workflow.storage_settings.default_storage_prefix if STORED else None
if S3:
    try:  # before any key is listed: a '..' in output_dir would name another run's keys
        stored_root(STORAGE_PREFIX, OUT)
    except ValueError as e:
        stop(f"{CONFIG_SOURCE}: at {e}")
    check_storage(write=False)  # a dry run only lists: read-only keys may plan

STARTED = time.time()


onstart:
    if S3:
        check_storage(write=True)
    if not STORED:
        settle_backups()
        stamp_run(OUT, config, CONFIG_SOURCE)


onsuccess:
    # The run's answer on the console, when this run wrote the report (a run of one shard did not).
    summary = f"{OUT}/report/summary.json"
    if os.path.exists(summary) and os.path.getmtime(summary) >= STARTED:
        print("\n".join(headline_lines(read_json(summary), f"{OUT}/report/summary.html")), file=sys.stderr)

ONLINE = config["train"]["hidden_states"] == "online"
PILOT = config["pilot"]["enabled"]
BURST = PILOT and config["pilot"]["train_steps"] > 0  # the pilot's training burst (rules/pilot.smk)
if not STORED and (problem := toggle_problem(OUT, PILOT)):  # every shard would be generated again
    stop(problem)
PLANNED = PILOT or bool(config["plan"]["mean_output_tokens"])  # something to forecast output tokens from
LAUNCH = config["generate"]["server"]["launch"]  # null: no serve jobs, the server is the user's
# the serve rule's launcher reads it: never on a command line (ps). Set, not read: no envvars directive
os.environ.update(DFLASH_LAUNCH=json.dumps(LAUNCH))
# Snakemake would quietly cut a job's claim to the machine's GPUs (--resources gpu=N, counted by
# profiles/local) and run it on fewer than it starts processes for.
GPUS = workflow.global_resources.get("gpu").value
if GPUS is not None:
    for key, claim in [("train.gpus", config["train"]["gpus"])] + ([("generate.server.launch.gpus", LAUNCH["gpus"])]
                                                                     if LAUNCH else []):
        if claim > GPUS:
            stop(f"{key} is {claim}, but this run offers {GPUS} GPU(s) (--resources gpu, which profiles/local "
                 f"sets to the machine's count): lower {key} or run on a bigger node")
    if config["train"]["nodes"] > 1:
        stop(f"train.nodes is {config['train']['nodes']}, but profiles/local runs on this machine alone: set "
             f"train.nodes: 1, or run under a SLURM profile (profiles/slurm-*), which requests the nodes")
LOGS = f"{OUT}/logs"
BENCH = f"{OUT}/benchmarks"


# Light jobs that read a few small files, and the check of this machine's files: on a cluster they
# run where snakemake runs, not as sbatch jobs.
localrules:
    all,
    qa_summary,
    gate,
    qa_report,
    report,
    safe_to_destroy,
    pilot,
    plan,
    eval,


wildcard_constraints:
    shard=r"\d{5}",
    server=r"\d+|pilot",
    run=r"[A-Za-z0-9_-][A-Za-z0-9._-]*",





def replaced_folder(path):
    """A folder output its job replaces as a whole, only once the new one is complete
    (dflash.core.io.atomic_dir): Snakemake must not delete the old one before the job runs, or a job
    that fails (a bad new source, a crash) would cost the finished prompts, target or drafter it
    had (Snakemake restores the old one when the job fails). Not with a default storage: there
    Snakemake's backup would need a local copy a fresh node does not have."""
    return directory(path) if STORED else update(directory(path))



def settle_backups():
    """Snakemake backs up a replaced_folder output before its job (update()) and drops the backup
    when the job ends; a run killed in between leaves it, and Snakemake 9.27 then fails the next
    job of that output copying onto it. The job replaces the folder only once complete, so the
    backup is stale: dropped while the folder is there, put back in the rare case the kill came
    between the job's two renames and the folder is gone."""
    backup_of = workflow.persistence._get_backup_path  # Snakemake's own mapping: output -> backup
    checkpoints = Path(f"{OUT}/checkpoints")
    runs = [checkpoints / b.name for b in backup_of(checkpoints).iterdir()] if backup_of(checkpoints).is_dir() else []
    for folder in [Path(f"{OUT}/prompts"), Path(f"{OUT}/target"), *runs]:
        backup = backup_of(folder)
        if backup.is_dir():
            if folder.exists():
                shutil.rmtree(backup)
            else:
                logger.warning(f"{folder}: put back from Snakemake's backup (a run was killed while replacing it)")
                shutil.move(backup, folder)


def prompt_file(name):
    """A file of the prompts checkpoint; asking for it schedules the checkpoint when needed. Named
    by the rule's path, not the checkpoint's output object: with a default storage that object is
    the local copy, which the storage would take for another file."""
    checkpoints.prompts.get()
    return f"{OUT}/prompts/{name}"


def prompts_dir():
    """The prompts checkpoint's folder on this machine. With a default storage (S3) that is a local
    copy, which Snakemake removes after use and a fresh machine never had: the small files read to
    plan (the manifest, the id index) are fetched from the storage when missing."""
    out = checkpoints.prompts.get().output[0]
    if out.is_storage:
        fetch_from_storage(out, ["manifest.json", "ids.tsv"])
    return str(out)


def shards():
    return shard_ids(prompts_dir())


def per_shard(pattern):
    """Input function: ``pattern`` for every prompt shard (known once the prompts exist)."""
    return lambda wildcards: expand(pattern, shard=shards())


def after_prompts(pattern):
    """Input function: ``pattern``, named only once the prompts checkpoint is known. A job whose
    params read the checkpoint's files (its id index) then waits for it, as Snakemake requires,
    with the same input files as before."""

    def files(wildcards):
        checkpoints.prompts.get()
        return pattern.format(**wildcards)

    return files


def server_file(wildcards):
    """Input function: the service file of the started server (generate.server.launch) a shard's
    generate job uses: consecutive blocks of shards_per_server shards share one; none when the
    server is the user's."""
    if not LAUNCH:
        return []
    # Only once the prompts exist: a group formed before the checkpoint ran is reused by Snakemake
    # 9.27 with the generate jobs the checkpoint replaced still in it, and they would run twice.
    checkpoints.prompts.get()
    return f"{OUT}/servers/{int(wildcards.shard) // LAUNCH['shards_per_server']}.json"


@functools.cache
def _exclusions_by_shard(folder, files, _prompts_written):
    by_shard, unknown = exclusions_by_shard(read_exclusions(files), folder)
    if unknown:
        logger.warning(f"validate.exclude: {len(unknown)} id(s) held by no prompt shard (held out or mistyped): "
                       + ", ".join(unknown[:10]) + (" ..." if len(unknown) > 10 else ""))
    return by_shard


def excluded_in_shard(wildcards):
    """Params function: the excluded ids (with reasons) a shard holds. As a param, not an input,
    a new id re-runs only the validate job of its shard; the exclusion files themselves are no input."""
    files = tuple(config["validate"]["exclude"])
    if not files:
        return {}
    folder = prompts_dir()
    # Keyed on the prompts' write time too: a prompts job re-run in this process moves ids.
    written = os.path.getmtime(os.path.join(folder, "ids.tsv"))
    return _exclusions_by_shard(folder, files, written).get(wildcards.shard, {})


def eval_parts(run, drafter):
    """The files of one eval decoding, a part per eval job."""
    return [f"{OUT}/eval/{run}/{drafter}.{part}.json" for part in range(config["eval"]["jobs"])]
