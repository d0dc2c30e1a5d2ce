# dflash-pipeline: prompts -> completions -> validated -> tokenized -> hidden -> checkpoints -> eval.
# Each stage is a rule over files (rules/*.smk), so Snakemake re-runs only what is stale.
from snakemake.utils import min_version, validate

from dflash.config import check_config, schema_path
from dflash.workflow import layer_selection, shard_ids, target_dir

min_version("9.0")


configfile: "config.yaml"


# Our check first: it names the file and the misspelt key. Snakemake's validate then sees a
# config that already passed and fills nothing new.
check_config(config, source=", ".join(map(str, workflow.configfiles)) or "config")
validate(config, str(schema_path()))

OUT = config["output_dir"]
RUN = config["run"]
TARGET = target_dir(config)
LOGS = f"{OUT}/logs"
BENCH = f"{OUT}/benchmarks"


wildcard_constraints:
    shard=r"\d{5}",
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
