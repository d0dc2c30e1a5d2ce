# dflash-pipeline: prompts -> completions -> validated -> tokenized -> hidden -> checkpoints -> eval.
# Each stage is a rule over files (rules/*.smk), so Snakemake re-runs only what is stale.
import json
import os
import sys
import time

from snakemake.utils import min_version, validate

from dflash.acceptance import DECODINGS
from dflash.config import (ConfigError, check_config, demo_sized_problem, read_config_yaml, read_yaml,
                           schema_path)
from dflash.dialects import DIALECTS
from dflash.pilot import toggle_problem
from dflash.hidden_cache import HIDDEN_FORMAT, drafter_target_problems, layer_selection, text_config
from dflash.prompt_checks import heldout_settings, prompt_check_settings
from dflash.resume import record_settings
from dflash.run_stamp import foreign_run, stamp_run
from dflash.workflow import demo_target_sources, shard_ids, target_dir

min_version("9.0")


include: "rules/common.smk"


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
        from dflash.io import read_json
        from dflash.headline import headline_lines

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


include: "rules/prompts.smk"
include: "rules/target.smk"
include: "rules/generate.smk"
include: "rules/validate.smk"
include: "rules/tokenize.smk"
include: "rules/hidden.smk"
include: "rules/pilot.smk"  # after hidden: its burst reads the pilot's hidden states (use rule hidden)
include: "rules/train.smk"
include: "rules/eval.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        f"{OUT}/report/summary.html",
        f"{OUT}/report/qa.html",
