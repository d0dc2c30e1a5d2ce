# dflash-pipeline: prompts -> completions -> validated -> tokenized -> hidden -> checkpoints -> eval.
# Each stage is a rule over files (rules/*.smk), so Snakemake re-runs only what is stale.
import json
import sys

from snakemake.utils import min_version, validate

from dflash.config import check_config, schema_path
from dflash.workflow import (demo_target_sources, layer_selection, prompt_check_settings, record_settings, shard_ids,
                             target_dir)

min_version("9.0")


configfile: "config.yaml"


# Our check first: it names the file and the misspelt key, and fills the defaults. Snakemake's
# validate then sees a config that already passed; its filler would trip over an object that may
# be null (generate.server.launch), and has nothing left to fill.
check_config(config, source=", ".join(map(str, workflow.configfiles)) or "config")
validate(config, str(schema_path()), set_default=False)

OUT = config["output_dir"]
RUN = config["run"]
TARGET = target_dir(config)
ONLINE = config["train"]["hidden_states"] == "online"
LAUNCH = config["generate"]["server"]["launch"]  # null: no serve jobs, the server is the user's
LOGS = f"{OUT}/logs"
BENCH = f"{OUT}/benchmarks"


wildcard_constraints:
    shard=r"\d{5}",
    server=r"\d+",
    run=r"[A-Za-z0-9._-]+",


include: "rules/common.smk"
include: "rules/prompts.smk"
include: "rules/target.smk"
include: "rules/generate.smk"
include: "rules/validate.smk"
include: "rules/tokenize.smk"
include: "rules/hidden.smk"
include: "rules/train.smk"
include: "rules/eval.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        f"{OUT}/report/summary.html",
        f"{OUT}/report/qa.html",
